"""API credentials for pods, standing in for the service-account token mount.

A real kubelet mounts `token`, `ca.crt` and `namespace` at
/var/run/secrets/kubernetes.io/serviceaccount and sets KUBERNETES_SERVICE_HOST/PORT; in-cluster
clients then talk to https://HOST:PORT with that token. That cannot be reproduced here: pod
processes share one filesystem (no per-pod mount at that fixed path), and the local API server
speaks plain HTTP, while `load_incluster_config()` always builds an https URL and wants a CA
file. What both the official `kubernetes` client and kopf do next is read KUBECONFIG (kopf
tries in-cluster first, then the kubeconfig; so does the operator's `load_client_config`). So
the kubelet writes the same three files into the pod's directory plus a kubeconfig naming the
local API server, the service account as user and the pod's namespace as default, and sets
KUBECONFIG to it. KUBERNETES_SERVICE_HOST stays unset: code that sees it assumes a working
in-cluster config (JAX's Kubernetes cluster detection, for one, would then fail in trainers).

Pods opt out as upstream: `automountServiceAccountToken: false` on the pod, or on the
ServiceAccount when the pod does not say. The API server checks no token (no authentication or
RBAC), so the chart's RBAC is not exercised here.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tardigrade_local.apiserver import write_kubeconfig

SERVICE_ACCOUNT_DIR = "serviceaccount"
CONTEXT = "tardigrade-local"


def mounts_token(pod_spec: Mapping[str, Any], service_account: Mapping[str, Any] | None) -> bool:
    """Upstream's rule: the pod's setting wins, then the ServiceAccount's, default yes."""
    if pod_spec.get("automountServiceAccountToken") is not None:
        return bool(pod_spec["automountServiceAccountToken"])
    if service_account is not None and \
            service_account.get("automountServiceAccountToken") is not None:
        return bool(service_account["automountServiceAccountToken"])
    return True


def service_account_name(pod_spec: Mapping[str, Any]) -> str:
    return str(pod_spec.get("serviceAccountName") or pod_spec.get("serviceAccount") or "default")


def write_pod_credentials(pod_dir: Path, api_url: str, pod: Mapping[str, Any]) -> Path:
    """Write the pod's token files and kubeconfig; returns the kubeconfig's path."""
    meta = pod["metadata"]
    namespace = meta.get("namespace") or "default"
    account = service_account_name(pod["spec"])
    directory = pod_dir / SERVICE_ACCOUNT_DIR
    directory.mkdir(parents=True, exist_ok=True)
    # Opaque: the local API server accepts any token; this one at least says whose it is.
    token = f"local.{namespace}.{account}.{meta.get('uid', '')}"
    (directory / "token").write_text(token)
    (directory / "namespace").write_text(namespace)
    return write_kubeconfig(directory / "kubeconfig", api_url, context=CONTEXT,
                            namespace=namespace,
                            user=f"system:serviceaccount:{namespace}:{account}", token=token)
