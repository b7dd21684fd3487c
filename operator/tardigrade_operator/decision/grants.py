"""What of its namespace a TrainingJob's pods may use: the admin's allow lists.

The operator creates pods with its own rights, so whoever may create a TrainingJob could
otherwise hand its pods any ServiceAccount or Secret of the namespace, mount any inline volume
the Pod Security level leaves open (baseline allows nfs, iscsi, cephfs...: storage outside
every checkpoint rule), or take a priority class that preempts other teams. Each list below
is a chart value under `admission.` (an operator setting); anything not on it is refused
before a pod is created, naming the TrainingJob field and the value that would allow it.

- serviceAccounts: the pods' ServiceAccount (unset means the namespace's `default`).
- secrets: Secrets the pods may read, by any route the TrainingJob API has: a `secret`
  volume, a projected volume's `secret` source, a volume source's own Secret reference
  (csi nodePublishSecretRef, cephfs/iscsi/rbd/flexVolume/scaleIO/storageos secretRef,
  azureFile secretName) and env `valueFrom.secretKeyRef`. The API has no envFrom and no
  imagePullSecrets, so no other route exists.
- volumeTypes: core/v1 volume sources allowed inline (`secret` is not one: a Secret volume is
  allowed by naming the Secret in `secrets`).
- csiDrivers: drivers a `csi` volume may name.
- priorityClasses: besides none at all; system-*-critical stay with allowSystemScheduling.

The operator's own additions to the pod (its token and restart volumes, the job's keys from
its own Secret) are exempt by name only (`OPERATOR_VOLUMES`, `OPERATOR_SECRET_ENV`), never
by kind, so a user volume of the same kind is still checked.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterator, Mapping
from typing import Any

from kubernetes.client import models as k8s

from tardigrade_operator.api.parse import FieldError
from tardigrade_operator.api.types import TrainingJobSpec
from tardigrade_operator.rendering.manifests import (
    IN_PLACE_VOLUME,
    KEY_ENV_NAMES,
    MEMORY_TIER_VOLUME,
    RENDEZVOUS_TOKEN_VOLUME,
)

# Every core/v1 volume source, as the kubernetes client names it on the wire.
VOLUME_TYPES = tuple(sorted(v for v in k8s.V1Volume.attribute_map.values() if v != "name"))
# Scratch and the pod's own data, claims the namespace already holds (their StorageClass and
# quota are the admin's), and CSI limited by driver below. Not the network filesystems
# (nfs, iscsi, cephfs, glusterfs, rbd...): they reach storage no checkpoint rule covers.
DEFAULT_VOLUME_TYPES = ("configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
                        "persistentVolumeClaim", "projected")
# Cloud Storage FUSE mounts a bucket with the pod's own Workload Identity, so it reads and
# writes only what the ServiceAccount's IAM grants; a driver that takes a server or a
# credential in volumeAttributes (NFS CSI, SMB CSI, the Secrets Store driver) would not.
GCS_FUSE_DRIVER = "gcsfuse.csi.storage.gke.io"
DEFAULT_CSI_DRIVERS = (GCS_FUSE_DRIVER,)
DEFAULT_SERVICE_ACCOUNT = "default"
# For pods the node or cluster cannot run without: admission.allowSystemScheduling's, not a list.
SYSTEM_PRIORITY_CLASSES = ("system-node-critical", "system-cluster-critical")
# Projected sources that carry only the pod's own identity or public data; `secret` sources
# follow the secrets list, and a source kind not listed here is refused.
HARMLESS_PROJECTIONS = frozenset({"configMap", "downwardAPI", "serviceAccountToken",
                                  "clusterTrustBundle", "podCertificate"})
# The operator's own pod additions (rendering/manifests.py), exempt by name.
OPERATOR_VOLUMES = frozenset({RENDEZVOUS_TOKEN_VOLUME, IN_PLACE_VOLUME, MEMORY_TIER_VOLUME})
OPERATOR_SECRET_ENV = KEY_ENV_NAMES
# Keys by which a volume source names a Secret of the namespace.
_SECRET_REF_KEYS = ("secretRef", "nodePublishSecretRef")
_SECRET_NAME_KEYS = ("secretName",)
_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")

# Operator setting (environment variable) -> chart value, for each list.
SETTINGS = {
    "service_accounts": ("TARDIGRADE_ALLOWED_SERVICE_ACCOUNTS", "admission.serviceAccounts"),
    "secrets": ("TARDIGRADE_ALLOWED_SECRETS", "admission.secrets"),
    "volume_types": ("TARDIGRADE_ALLOWED_VOLUME_TYPES", "admission.volumeTypes"),
    "csi_drivers": ("TARDIGRADE_ALLOWED_CSI_DRIVERS", "admission.csiDrivers"),
    "priority_classes": ("TARDIGRADE_ALLOWED_PRIORITY_CLASSES", "admission.priorityClasses"),
}


@dataclasses.dataclass(frozen=True)
class Grants:
    """The admin's allow lists (chart values admission.serviceAccounts, ...)."""

    service_accounts: tuple[str, ...] = (DEFAULT_SERVICE_ACCOUNT,)
    secrets: tuple[str, ...] = ()
    volume_types: tuple[str, ...] = DEFAULT_VOLUME_TYPES
    csi_drivers: tuple[str, ...] = DEFAULT_CSI_DRIVERS
    priority_classes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        env, value = SETTINGS["volume_types"]
        for kind in self.volume_types:
            if kind == "secret":
                raise ValueError(f"{env}: list the Secrets a pod may mount in admission.secrets "
                                 f"instead of the volume type secret ({value})")
            if kind not in VOLUME_TYPES:
                raise ValueError(f"{env}: {kind!r} is not a core/v1 volume type; expected "
                                 f"some of {', '.join(VOLUME_TYPES)} ({value})")

    @classmethod
    def from_settings(cls, settings: Mapping[str, str | None]) -> Grants:
        """From the operator's environment: each list a JSON array of strings (the chart
        renders them with toJson); an unset variable keeps the default."""
        lists: dict[str, tuple[str, ...]] = {}
        for attribute, (env, value) in SETTINGS.items():
            raw = settings.get(env)
            if raw in (None, ""):
                continue
            try:
                parsed = json.loads(raw)
            except ValueError:
                parsed = None
            if not (isinstance(parsed, list) and all(isinstance(p, str) for p in parsed)):
                raise ValueError(f"{env}={raw!r}: expected a JSON list of names, e.g. "
                                 f'["default", "trainer"] (chart value {value})')
            if attribute != "volume_types" and (bad := [p for p in parsed if not _NAME.match(p)]):
                raise ValueError(f"{env}: {', '.join(map(repr, bad))} is not a Kubernetes "
                                 f"object name (chart value {value})")
            lists[attribute] = tuple(parsed)
        return cls(**lists)


def review(spec: TrainingJobSpec, pod: dict[str, Any], grants: Grants) -> list[FieldError]:
    """Everything in `spec` (and `pod`, rendered from it) that `grants` does not allow."""
    errors = _service_account_errors(spec, grants) + _priority_errors(spec, grants)
    user_volumes = {v.name for v in spec.pod_template.volumes}
    for i, volume in enumerate(spec.pod_template.volumes):
        errors += _volume_errors(f"spec.podTemplate.volumes[{i}]",
                                 volume.model_dump(by_alias=True, exclude_none=True), grants)
    for i, env in enumerate(spec.env):
        ref = env.value_from.secret_key_ref if env.value_from else None
        if ref is not None and ref.name not in grants.secrets:
            errors.append(_secret_error(f"spec.env[{i}].valueFrom.secretKeyRef.name", ref.name,
                                        grants))
    # The operator's own additions: checked like the user's unless exempt by name, so a
    # renderer change that adds a grant fails here, not silently.
    for volume in pod["spec"].get("volumes", []):
        if volume["name"] not in user_volumes and volume["name"] not in OPERATOR_VOLUMES:
            errors += _volume_errors(f"spec (the operator's volume {volume['name']})", volume,
                                     grants)
    user_env = {e.name for e in spec.env}
    for container in pod["spec"]["containers"]:
        for env in container.get("env", []):
            ref = (env.get("valueFrom") or {}).get("secretKeyRef")
            exempt = env["name"] in user_env or env["name"] in OPERATOR_SECRET_ENV
            if ref and not exempt and ref.get("name") not in grants.secrets:
                errors.append(_secret_error(f"spec (the operator's variable {env['name']})",
                                            str(ref.get("name")), grants))
    return errors


def _service_account_errors(spec: TrainingJobSpec, grants: Grants) -> list[FieldError]:
    account = spec.pod_template.service_account_name or DEFAULT_SERVICE_ACCOUNT
    if account in grants.service_accounts:
        return []
    allowed = ", ".join(grants.service_accounts) or "none"
    unset = "" if spec.pod_template.service_account_name else " (unset: the namespace's default)"
    return [FieldError("spec.podTemplate.serviceAccountName",
                       f"service account {account}{unset} is not allowed by the cluster admin "
                       f"(admission.serviceAccounts: {allowed}): its pods would act with that "
                       f"account's rights; use one of {allowed}, or ask the cluster admin to "
                       f"add {account}")]


def _priority_errors(spec: TrainingJobSpec, grants: Grants) -> list[FieldError]:
    priority = spec.pod_template.priority_class_name
    # System classes are the allowSystemScheduling rule's (admission.py).
    if priority in (None, *grants.priority_classes, *SYSTEM_PRIORITY_CLASSES):
        return []
    allowed = ", ".join(grants.priority_classes) or "none"
    return [FieldError("spec.podTemplate.priorityClassName",
                       f"priority class {priority} is not allowed by the cluster admin "
                       f"(admission.priorityClasses: {allowed}): a gang at a higher priority "
                       f"preempts other teams' pods; remove it, or ask the cluster admin to "
                       f"add {priority}")]


def _volume_errors(field: str, volume: dict[str, Any], grants: Grants) -> list[FieldError]:
    errors: list[FieldError] = []
    for kind, source in volume.items():
        if kind == "name":
            continue
        where = f"{field}.{kind}"
        if kind != "secret" and kind not in grants.volume_types:
            allowed = ", ".join(grants.volume_types) or "none"
            errors.append(FieldError(where, f"volume type {kind} is not allowed by the cluster "
                                     f"admin (admission.volumeTypes: {allowed}); use a "
                                     f"persistentVolumeClaim, or ask the cluster admin to add "
                                     f"{kind}"))
        elif kind == "csi" and source.get("driver") not in grants.csi_drivers:
            allowed = ", ".join(grants.csi_drivers) or "none"
            errors.append(FieldError(f"{where}.driver", f"CSI driver {source.get('driver')} is "
                                     f"not allowed by the cluster admin (admission.csiDrivers: "
                                     f"{allowed}); use a persistentVolumeClaim, or ask the "
                                     f"cluster admin to add it"))
        if kind == "projected":
            for i, projection in enumerate(source.get("sources") or []):
                for projected in projection:
                    if projected != "secret" and projected not in HARMLESS_PROJECTIONS:
                        errors.append(FieldError(
                            f"{where}.sources[{i}].{projected}",
                            f"projected source {projected} is not allowed by the operator; "
                            "remove it, or ask the cluster admin for a newer operator that "
                            "knows it"))
        for ref_field, name in _secret_refs(where, source):
            if name not in grants.secrets:
                errors.append(_secret_error(ref_field, name, grants))
    return errors


def _secret_refs(field: str, source: Any) -> Iterator[tuple[str, str]]:
    """(field, Secret name) of every Secret a volume source names, at any depth."""
    if isinstance(source, list):
        for i, item in enumerate(source):
            yield from _secret_refs(f"{field}[{i}]", item)
        return
    if not isinstance(source, dict):
        return
    for key, value in source.items():
        if key in _SECRET_NAME_KEYS and isinstance(value, str):
            yield f"{field}.{key}", value
        elif key in _SECRET_REF_KEYS and isinstance(value, dict):
            yield f"{field}.{key}.name", str(value.get("name") or "")
        elif key == "secret" and field.endswith("]") and isinstance(value, dict):
            # A projected source: {"secret": {"name": ...}}.
            yield f"{field}.secret.name", str(value.get("name") or "")
        else:
            yield from _secret_refs(f"{field}.{key}", value)


def _secret_error(field: str, name: str, grants: Grants) -> FieldError:
    allowed = ", ".join(grants.secrets) or "none"
    return FieldError(field, f"Secret {name or '(unnamed)'} is not allowed by the cluster admin "
                      f"(admission.secrets: {allowed}): the pods could read it; remove the "
                      f"reference, or ask the cluster admin to add {name or 'it'}")
