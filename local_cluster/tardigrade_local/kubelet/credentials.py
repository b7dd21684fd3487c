"""API credentials for pods, standing in for the service-account token mount.

A real kubelet asks the API server for a token bound to the pod (TokenRequest,
`POST /api/v1/namespaces/{ns}/serviceaccounts/{name}/token` with a `boundObjectRef` to the
pod and `expirationSeconds: 3607`; `pkg/kubelet/token/token_manager.go`), mounts it with
`ca.crt` and `namespace` at /var/run/secrets/kubernetes.io/serviceaccount, and sets
KUBERNETES_SERVICE_HOST/PORT; in-cluster clients then talk to https://HOST:PORT with that
token. This kubelet gets the token the same way; pods reach the API server's TLS port with
it, where the server authenticates it as `system:serviceaccount:<ns>:<name>` and authorizes
it with RBAC (kubectl and client-go send bearer tokens over TLS only).

The mount cannot be reproduced: pod processes share one filesystem, so there is no per-pod
file at the fixed path /var/run/secrets/kubernetes.io/serviceaccount that in-cluster
configuration (`load_incluster_config()`, kopf's in-cluster login) reads. What both the
official `kubernetes` client and kopf do next is read KUBECONFIG (kopf tries in-cluster
first, then the kubeconfig; so does the operator's `load_client_config`). So the kubelet
writes `token`, `namespace` and `ca.crt` into the pod's directory plus a kubeconfig naming
the API server's TLS port and CA, the service account as user, the token, and the pod's
namespace as default, and sets KUBECONFIG to it. KUBERNETES_SERVICE_HOST stays unset: code
that sees it assumes a working in-cluster config (JAX's Kubernetes cluster detection, for
one, would then fail in trainers).

Pods opt out as upstream: `automountServiceAccountToken: false` on the pod, or on the
ServiceAccount when the pod does not say.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tardigrade_local.apiserver import write_kubeconfig

SERVICE_ACCOUNT_DIR = "serviceaccount"
CONTEXT = "tardigrade-local"
# What the kubelet asks for (`WarnOnlyBoundTokenExpirationSeconds`); the server extends it.
TOKEN_EXPIRATION_SECONDS = 3607


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


def token_request(pod: Mapping[str, Any]) -> dict[str, Any]:
    """The TokenRequest a kubelet sends for a pod's projected service-account token."""
    meta = pod["metadata"]
    return {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
            "spec": {"expirationSeconds": TOKEN_EXPIRATION_SECONDS,
                     "boundObjectRef": {"kind": "Pod", "apiVersion": "v1",
                                        "name": meta["name"], "uid": meta.get("uid", "")}}}


def write_pod_credentials(pod_dir: Path, api_url: str, pod: Mapping[str, Any], token: str,
                          ca_pem: str | None = None) -> Path:
    """Write the pod's token files and kubeconfig; returns the kubeconfig's path."""
    namespace = pod["metadata"].get("namespace") or "default"
    account = service_account_name(pod["spec"])
    directory = pod_dir / SERVICE_ACCOUNT_DIR
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "token").write_text(token)
    (directory / "namespace").write_text(namespace)
    if ca_pem is not None:
        (directory / "ca.crt").write_text(ca_pem)
    return write_kubeconfig(directory / "kubeconfig", api_url, context=CONTEXT,
                            namespace=namespace,
                            user=f"system:serviceaccount:{namespace}:{account}", token=token,
                            ca_pem=ca_pem)
