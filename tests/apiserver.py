"""One real kube-apiserver shared by the tests of a pytest worker (the `shared_api` fixture in
conftest.py): schema and CEL checks through `dryRun=All`, status writes, the CLI. Each test
that writes works in a namespace of its own (`SharedApi.new_namespace`)."""

from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path
from typing import Any

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from tardigrade_local.cluster import LocalCluster

GROUP, VERSION, PLURAL = "tardigrade.dev", "v1alpha1", "trainingjobs"


@dataclasses.dataclass(frozen=True)
class Cause:
    """One `details.causes` entry of a 422: the field kube-apiserver names, and why."""

    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


def causes_of(err: ApiException) -> list[Cause]:
    """What the API server said is wrong; a refusal without causes (413, 400) is one cause
    with the status message and no field."""
    try:
        body = json.loads(err.body or "{}")
    except ValueError:
        return [Cause("", str(err.body))]
    causes = (body.get("details") or {}).get("causes") or []
    if not causes:
        return [Cause("", str(body.get("message") or err.reason))]
    return [Cause(str(c.get("field") or ""), str(c.get("message") or "")) for c in causes]


class SharedApi:
    def __init__(self, cluster: LocalCluster) -> None:
        self.cluster = cluster
        self.kubeconfig = cluster.kubeconfig
        self.api = config.new_client_from_config(config_file=str(self.kubeconfig))
        self.core = client.CoreV1Api(self.api)
        self.custom = client.CustomObjectsApi(self.api)
        self._names = itertools.count(1)

    def new_namespace(self, prefix: str = "t") -> str:
        name = f"{prefix}-{next(self._names)}"
        self.core.create_namespace({"metadata": {"name": name}})
        return name

    def validate(self, job: dict[str, Any], old: dict[str, Any] | None = None,
                 namespace: str | None = None) -> list[Cause]:
        """kube-apiserver's verdict on creating `job` (on replacing `old` with it, when
        given), without storing anything: [] if it would be accepted. Unknown fields are
        errors, as for kubectl (`--validate=strict`, its default since 1.27, sends
        fieldValidation=Strict; without it the server drops them silently)."""
        namespace = namespace or self.new_namespace("validate")
        body = {**job, "metadata": {**job.get("metadata", {}), "namespace": namespace}}
        try:
            if old is None:
                self.custom.create_namespaced_custom_object(
                    GROUP, VERSION, namespace, PLURAL, body, dry_run="All",
                    field_validation="Strict")
            else:
                stored = self.custom.create_namespaced_custom_object(
                    GROUP, VERSION, namespace, PLURAL,
                    {**old, "metadata": {**old.get("metadata", {}), "namespace": namespace}})
                body["metadata"]["resourceVersion"] = stored["metadata"]["resourceVersion"]
                self.custom.replace_namespaced_custom_object(
                    GROUP, VERSION, namespace, PLURAL, body["metadata"]["name"], body,
                    dry_run="All", field_validation="Strict")
        except ApiException as err:
            return causes_of(err)
        return []


def start_shared(root: Path) -> LocalCluster:
    return LocalCluster(root, nodes=[], with_gcs=False).start()
