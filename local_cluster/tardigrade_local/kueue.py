"""Kueue's manager in the local cluster (`tardigrade local up --kueue`, `ClusterConfig.kueue`).

Kueue is built from its pinned module (`builds/kueue`, v0.19.2; `builds/kueue-v0.17`, the
oldest version Tardigrade supports, when $TARDIGRADE_KUEUE_MODULE=kueue-v0.17:
`gobuild.kueue_module`) and runs as a child process of the cluster's supervisor, like the
control plane's components. What a
release install (`kubectl apply` of Kueue's manifests) puts in a cluster comes from the
module's own files in the Go module cache, never from copies of ours:
- the CRDs, `config/components/crd/bases/`, with the conversion webhooks its kustomization
  turns on (`config/components/crd/kustomization.yaml`, `patches/webhook_in_*.yaml`);
- the webhooks, `config/components/webhook/manifests.yaml`, with the namespace selectors of
  `config/components/webhook/kustomization.yaml`;
- the manager's ClusterRole, `config/components/rbac/role.yaml` (`kueue-manager-role`, as
  `config/default`'s `namePrefix: kueue-` names it), bound to the manager's identity.
Every webhook's `clientConfig.service` becomes a URL on 127.0.0.1 with the cluster CA as its
`caBundle`, which is what Kueue's own integration tests do with envtest
(`test/integration/framework/framework.go`, `WebhookInstallOptions`).

The manager's configuration (`config/components/manager/controller_manager_config.yaml` is
the upstream example) lists TrainingJob as an external framework
(`integrations.externalFrameworks`), so Kueue knows our kind as the owner of its Workloads.
The ProvisioningRequest CRD (autoscaling.x-k8s.io/v1) comes from the cluster autoscaler's API
module at the version Kueue's own go.mod pins (`k8s.io/autoscaler/cluster-autoscaler/apis`,
`config/crd/`): on GKE the cluster autoscaler installs it; with it present before the manager
starts, Kueue sets up its ProvisioningRequest admission check controller
(`cmd/kueue/main.go`, `provisioning.ServerSupportsProvisioningRequest`; no feature gate).
Everything else is Kueue's default, `waitForPodsReady` included (on, 30 min, from v0.19;
off before), unless the cluster sets it (`WaitForPodsReady`: a test shortens the timeout).
Cross-checked notes: `local_cluster/README.md`, "Kueue".
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import dataclasses
import logging
import re
import subprocess
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from tardigrade_local import crdwait, gobuild, pki
from tardigrade_local.identities import RBAC, Identity
from tardigrade_local.ports import free_port

log = logging.getLogger(__name__)

MODULE_PATH = "sigs.k8s.io/kueue"
NAMESPACE = "kueue-system"
# The name kustomize gives the manager's role (`config/default/kustomization.yaml`,
# `namePrefix: kueue-`), so a user who reads Kueue's docs finds it under that name.
MANAGER_ROLE = "kueue-manager-role"
IDENTITY = Identity("kueue", "local:kueue-controller-manager")
# `integrations.externalFrameworks` entry: Kind.version.group
# (`pkg/controller/jobframework/integrationmanager.go`).
TRAININGJOB_FRAMEWORK = "TrainingJob.v1alpha1.tardigrade.dev"
# What Kueue needs of our kind to recognise a Workload's owner as a managed job: read access.
# On a real cluster whoever installs Kueue grants it (docs/kueue.md, "Set-up on GKE").
TRAININGJOB_READER_ROLE = "kueue-tardigrade-trainingjob-reader"
# Kueue's `cmd/kueue/main.go` (v0.17.x) reads the metrics server's certificate from this
# fixed path whenever its internal certificate management is off, and exits without it.
METRICS_CERT_DIR = Path("/etc/kueue/metrics/certs")
READY_TIMEOUT_SECONDS = 120.0
AUTOSCALER_APIS = "k8s.io/autoscaler/cluster-autoscaler/apis"
PROVISIONING_REQUEST_CRD_FILE = "autoscaling.x-k8s.io_provisioningrequests.yaml"


class KueueError(RuntimeError):
    pass


def module_source() -> Path:
    """The directory of the pinned Kueue module in the Go module cache (downloaded if
    missing; `go build` of the module has fetched it already)."""
    cwd = gobuild.kueue_module().directory
    command = ["go", "list", "-m", "-f", "{{.Dir}}", MODULE_PATH]
    done = subprocess.run(command, cwd=cwd, env=gobuild.go_env(), capture_output=True,
                          text=True)
    directory = done.stdout.strip()
    if done.returncode != 0 or not directory:
        subprocess.run(["go", "mod", "download", MODULE_PATH], cwd=cwd, env=gobuild.go_env(),
                       check=True, capture_output=True)
        directory = subprocess.run(command, cwd=cwd, env=gobuild.go_env(), check=True,
                                   capture_output=True, text=True).stdout.strip()
    path = Path(directory)
    if not (path / "config" / "components").is_dir():
        raise KueueError(f"{MODULE_PATH} module at {path} has no config/components")
    return path


def provisioning_request_crd() -> dict[str, Any]:
    """The ProvisioningRequest CRD of the autoscaler API module Kueue's build pins."""
    cwd = gobuild.kueue_module().directory
    done = subprocess.run(["go", "list", "-m", "-f", "{{.Dir}}", AUTOSCALER_APIS], cwd=cwd,
                          env=gobuild.go_env(), capture_output=True, text=True)
    path = Path(done.stdout.strip()) / "config" / "crd" / PROVISIONING_REQUEST_CRD_FILE
    if done.returncode != 0 or not path.is_file():
        raise KueueError(f"no ProvisioningRequest CRD at {path} (module {AUTOSCALER_APIS} "
                         f"of Kueue's build): {done.stderr.strip()}")
    return _documents(path)[0]


def _documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def _client_config(webhook_url: str, path: str, ca_pem: bytes) -> dict[str, Any]:
    return {"url": f"{webhook_url}{path}", "caBundle": base64.b64encode(ca_pem).decode()}


def crds(source: Path, webhook_url: str, ca_pem: bytes) -> list[dict[str, Any]]:
    """Kueue's CRDs, with the conversion webhooks its kustomization enables, by URL."""
    crd_dir = source / "config" / "components" / "crd"
    kustomization = yaml.safe_load((crd_dir / "kustomization.yaml").read_text())
    conversions: dict[str, dict[str, Any]] = {}
    for entry in kustomization.get("patches") or []:
        patch = yaml.safe_load((crd_dir / entry["path"]).read_text())
        conversions[patch["metadata"]["name"]] = patch["spec"]["conversion"]
    out = []
    for resource in kustomization["resources"]:
        for doc in _documents(crd_dir / resource):
            name = doc["metadata"]["name"]
            if name in conversions:
                conversion = copy.deepcopy(conversions[name])
                service = conversion["webhook"]["clientConfig"]["service"]
                conversion["webhook"]["clientConfig"] = _client_config(
                    webhook_url, service["path"], ca_pem)
                doc["spec"]["conversion"] = conversion
            out.append(doc)
    return out


def _merge_webhook_patches(configs: list[dict[str, Any]], patches: Iterable[Any]) -> None:
    """Apply the kustomization's strategic-merge patches: webhooks merge by `name`."""
    by_kind = {c["kind"]: c for c in configs}
    for patch in patches:
        doc = yaml.safe_load(patch["patch"]) if isinstance(patch, dict) else None
        if not doc or doc.get("kind") not in by_kind:
            continue
        hooks = {h["name"]: h for h in by_kind[doc["kind"]]["webhooks"]}
        for change in doc.get("webhooks") or []:
            if change["name"] in hooks:
                hooks[change["name"]].update({k: v for k, v in change.items() if k != "name"})


def _webhook_in(configs: list[dict[str, Any]], select: Mapping[str, Any], field_path: str
                ) -> tuple[dict[str, Any], str] | None:
    """(webhook, field) that a kustomize replacement's `webhooks.[name=N].field` names in
    the configuration `select` ({kind, name}) picks; None if there is none."""
    found = re.fullmatch(r"webhooks\.\[name=([^\]]+)\]\.(\w+)", field_path)
    if found is None:
        raise KueueError(f"unsupported kustomize field path {field_path!r} in Kueue's webhook "
                         "kustomization")
    for config in configs:
        if (config["kind"], config["metadata"]["name"]) == (select["kind"], select["name"]):
            hook = next((h for h in config["webhooks"] if h["name"] == found.group(1)), None)
            return None if hook is None else (hook, found.group(2))
    return None


def _apply_replacements(configs: list[dict[str, Any]], replacements: Iterable[Any]) -> None:
    """The kustomization's `replacements` (Kueue v0.19 copies the pod webhook's
    namespaceSelector to every job webhook this way; v0.17 patched each one)."""
    for replacement in replacements:
        source = _webhook_in(configs, replacement["source"], replacement["source"]["fieldPath"])
        if source is None or source[1] not in source[0]:
            continue
        value = source[0][source[1]]
        for target in replacement.get("targets") or []:
            for path in target.get("fieldPaths") or []:
                found = _webhook_in(configs, target["select"], path)
                if found is not None:
                    found[0][found[1]] = copy.deepcopy(value)


def webhook_configurations(source: Path, webhook_url: str, ca_pem: bytes
                           ) -> list[dict[str, Any]]:
    """Kueue's mutating and validating webhook configurations, named as a release names them
    (`kueue-` prefix), each webhook called by URL."""
    webhook_dir = source / "config" / "components" / "webhook"
    configs = _documents(webhook_dir / "manifests.yaml")
    kustomization = yaml.safe_load((webhook_dir / "kustomization.yaml").read_text())
    _merge_webhook_patches(configs, kustomization.get("patches") or [])
    _apply_replacements(configs, kustomization.get("replacements") or [])
    for config in configs:
        config["metadata"]["name"] = "kueue-" + config["metadata"]["name"]
        for hook in config["webhooks"]:
            service = hook["clientConfig"]["service"]
            hook["clientConfig"] = _client_config(webhook_url, service["path"], ca_pem)
    return configs


def rbac_objects(source: Path, user: str) -> list[tuple[str, dict[str, Any]]]:
    """(URL path under /apis/rbac.authorization.k8s.io/v1, object): the manager's ClusterRole
    (`role.yaml`) and its Role on Secrets in its namespace (`manager_secrets_role.yaml`, which
    its cache watches at start) from the module, our kind's read access, each bound to
    `user` (a release binds them to its ServiceAccount, `role_binding.yaml`)."""
    rbac_dir = source / "config" / "components" / "rbac"
    role = _documents(rbac_dir / "role.yaml")[0]
    role["metadata"] = {"name": MANAGER_ROLE}
    secrets = _documents(rbac_dir / "manager_secrets_role.yaml")[0]
    secrets["metadata"] = {"name": "kueue-" + secrets["metadata"]["name"],
                           "namespace": NAMESPACE}
    reader = {"apiVersion": RBAC, "kind": "ClusterRole",
              "metadata": {"name": TRAININGJOB_READER_ROLE},
              "rules": [{"apiGroups": ["tardigrade.dev"], "resources": ["trainingjobs"],
                         "verbs": ["get", "list", "watch"]}]}
    subject = [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}]
    objects: list[tuple[str, dict[str, Any]]] = []
    for cluster_role in (role, reader):
        name = cluster_role["metadata"]["name"]
        objects += [("clusterroles", cluster_role), ("clusterrolebindings", {
            "apiVersion": RBAC, "kind": "ClusterRoleBinding", "metadata": {"name": name},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                        "name": name}, "subjects": subject})]
    name = secrets["metadata"]["name"]
    objects += [(f"namespaces/{NAMESPACE}/roles", secrets),
                (f"namespaces/{NAMESPACE}/rolebindings", {
                    "apiVersion": RBAC, "kind": "RoleBinding",
                    "metadata": {"name": name, "namespace": NAMESPACE},
                    "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                "name": name}, "subjects": subject})]
    return objects


@dataclasses.dataclass(frozen=True)
class WaitForPodsReady:
    """Kueue's `waitForPodsReady` setting (config.kueue.x-k8s.io/v1beta2,
    `apis/config/v1beta2/configuration_types.go`; the same fields in v0.17 and v0.19). Set
    at all, it is on; Kueue defaults what is left out (`defaults.go`): recoveryTimeout to
    the timeout, blockAdmission false, requeuing from the eviction's time with a back-off of
    60 s doubling up to 3600 s, no limit on requeues."""

    timeout_seconds: float
    recovery_timeout_seconds: float | None = None
    block_admission: bool | None = None
    backoff_base_seconds: int | None = None
    backoff_max_seconds: int | None = None
    backoff_limit_count: int | None = None

    def __post_init__(self) -> None:
        if self.timeout_seconds <= 0:
            raise ValueError(f"waitForPodsReady timeout_seconds must be > 0 (Kueue reads 0 as "
                             f"its 30 min default), got {self.timeout_seconds}")

    def to_config(self) -> dict[str, Any]:
        requeuing = {k: v for k, v in (("backoffBaseSeconds", self.backoff_base_seconds),
                                       ("backoffMaxSeconds", self.backoff_max_seconds),
                                       ("backoffLimitCount", self.backoff_limit_count))
                     if v is not None}
        config: dict[str, Any] = {"timeout": _duration(self.timeout_seconds)}
        if self.recovery_timeout_seconds is not None:
            config["recoveryTimeout"] = _duration(self.recovery_timeout_seconds)
        if self.block_admission is not None:
            config["blockAdmission"] = self.block_admission
        if requeuing:
            config["requeuingStrategy"] = requeuing
        return config

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> WaitForPodsReady | None:
        return None if data is None else cls(**data)


def _duration(seconds: float) -> str:
    """A metav1.Duration (Go's time.ParseDuration)."""
    return f"{seconds:g}s"


def manager_config(webhook_port: int, health_port: int, cert_dir: Path,
                   frameworks: Iterable[str] = ("batch/job",),
                   wait_for_pods_ready: WaitForPodsReady | None = None) -> dict[str, Any]:
    """Kueue's `Configuration` (config.kueue.x-k8s.io/v1beta2) for a process on loopback;
    `wait_for_pods_ready` None leaves Kueue's default."""
    config = {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2", "kind": "Configuration",
        "namespace": NAMESPACE,
        "health": {"healthProbeBindAddress": f"127.0.0.1:{health_port}"},
        # "0" turns controller-runtime's metrics server off (two clusters, one machine).
        "metrics": {"bindAddress": "0"},
        "webhook": {"host": "127.0.0.1", "port": webhook_port, "certDir": str(cert_dir)},
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": False},
        "clientConnection": {"qps": 50, "burst": 100},
        "integrations": {"frameworks": list(frameworks),
                         "externalFrameworks": [TRAININGJOB_FRAMEWORK]},
        # The visibility server is an aggregated API server of its own (an APIService we
        # do not install); off, as the notes on running Kueue out of cluster advise.
        "featureGates": {"VisibilityOnDemand": False},
    }
    if wait_for_pods_ready is not None:
        config["waitForPodsReady"] = wait_for_pods_ready.to_config()
    return config


def ensure_metrics_certificate(ca: pki.Authority, directory: Path = METRICS_CERT_DIR) -> None:
    """Kueue exits unless its fixed metrics certificate path holds a pair (see
    METRICS_CERT_DIR); its metrics server is off here, so any valid pair does. Needs write
    access there (root on our CI machines); one pair serves every cluster of the machine."""
    if (directory / "tls.crt").is_file() and (directory / "tls.key").is_file():
        return
    try:
        directory.mkdir(parents=True, exist_ok=True)
        pair = ca.issue("kueue-metrics", client=False, server=True,
                        ip_addresses=("127.0.0.1",))
        (directory / "tls.crt").write_bytes(pair.cert_pem)
        (directory / "tls.key").write_bytes(pair.key_pem)
        (directory / "tls.key").chmod(0o600)
    except OSError as err:
        raise KueueError(
            f"Kueue v0.17 needs a certificate at {directory}/tls.{{crt,key}} even with its "
            f"metrics server off (cmd/kueue/main.go), and this user cannot write there: "
            f"{err}. Create it once as root, or run the cluster without --kueue.") from err


async def _create(session: aiohttp.ClientSession, url: str, body: Mapping[str, Any],
                  replace: bool = True) -> None:
    async with session.post(url, json=body) as resp:
        if resp.status < 400:
            return
        if resp.status != 409:
            raise KueueError(f"cannot create {body['kind']} {body['metadata']['name']}: "
                             f"{await resp.text()}")
    if not replace:
        return
    item = f"{url}/{body['metadata']['name']}"
    async with session.get(item) as current:
        version = (await current.json())["metadata"]["resourceVersion"]
    updated = {**body, "metadata": {**body["metadata"], "resourceVersion": version}}
    async with session.put(item, json=updated) as resp:
        if resp.status >= 400:
            raise KueueError(f"cannot replace {body['kind']} {body['metadata']['name']}: "
                             f"{await resp.text()}")


async def install(session: aiohttp.ClientSession, api_url: str, source: Path,
                  webhook_url: str, ca_pem: bytes) -> None:
    """Kueue's namespace, RBAC, CRDs (waited for until Established) and webhooks."""
    await _create(session, f"{api_url}/api/v1/namespaces",
                  {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}},
                  replace=False)
    for plural, body in rbac_objects(source, IDENTITY.common_name):
        await _create(session, f"{api_url}/apis/{RBAC}/{plural}", body)
    crd_base = f"{api_url}/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
    documents = [*crds(source, webhook_url, ca_pem),
                 await asyncio.to_thread(provisioning_request_crd)]
    for doc in documents:
        await _create(session, crd_base, doc)
    try:
        await crdwait.wait_established(session, crd_base,
                                       [doc["metadata"]["name"] for doc in documents],
                                       READY_TIMEOUT_SECONDS)
    except crdwait.NotEstablished as err:
        raise KueueError(str(err)) from None
    admission = f"{api_url}/apis/admissionregistration.k8s.io/v1"
    for config in webhook_configurations(source, webhook_url, ca_pem):
        plural = ("mutatingwebhookconfigurations"
                  if config["kind"] == "MutatingWebhookConfiguration"
                  else "validatingwebhookconfigurations")
        await _create(session, f"{admission}/{plural}", config)


class KueuePorts:
    def __init__(self) -> None:
        self.webhook = free_port()
        self.health = free_port()

    @property
    def webhook_url(self) -> str:
        return f"https://127.0.0.1:{self.webhook}"

    @property
    def ready_url(self) -> str:
        return f"http://127.0.0.1:{self.health}/readyz"


async def wait_ready(ready_url: str, exited: Any, failure: Any) -> None:
    """Until the manager's readiness probe answers 200 (its webhook server is serving)."""
    deadline = time.monotonic() + READY_TIMEOUT_SECONDS
    timeout = aiohttp.ClientTimeout(total=2)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        while True:
            if exited():
                raise KueueError(failure())
            with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError):
                async with session.get(ready_url) as resp:
                    if resp.status == 200:
                        return
            if time.monotonic() > deadline:
                raise KueueError(f"Kueue not ready after {READY_TIMEOUT_SECONDS:.0f} s; "
                                 + failure())
            await asyncio.sleep(0.2)
