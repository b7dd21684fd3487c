"""API credentials for pods, from the service-account volume the API server adds.

kube-apiserver's ServiceAccount admission plugin gives every pod whose ServiceAccount and
spec do not opt out (`automountServiceAccountToken: false`) a projected volume
`kube-api-access-<random>` (a bound token, the cluster CA from the `kube-root-ca.crt`
ConfigMap, the namespace) mounted in every container at
/var/run/secrets/kubernetes.io/serviceaccount (`plugin/pkg/admission/serviceaccount/
admission.go`, `DefaultAPITokenMountPath`). The kubelet fills it like any projected volume
(projected.py), and kube-apiserver authenticates the token as
`system:serviceaccount:<ns>:<name>` and authorizes it with RBAC.

The mount cannot be reproduced: pod processes share one filesystem, so there is no per-pod
file at that fixed path, which in-cluster configuration (`load_incluster_config()`, kopf's
in-cluster login) reads. What both the official `kubernetes` client and kopf do next is read
KUBECONFIG (kopf tries in-cluster first, then the kubeconfig; so does the operator's
`load_client_config`). So the kubelet writes a kubeconfig beside the volume's files, naming
the API server, the CA and the token of that volume, and sets KUBECONFIG to it.
KUBERNETES_SERVICE_HOST stays unset: code that sees it assumes a working in-cluster config
(JAX's Kubernetes cluster detection, for one, would then fail in trainers).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tardigrade_local.kubeconfig import write_kubeconfig

SERVICE_ACCOUNT_MOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"
CONTEXT = "tardigrade-local"


def service_account_name(pod_spec: Mapping[str, Any]) -> str:
    return str(pod_spec.get("serviceAccountName") or pod_spec.get("serviceAccount") or "default")


def service_account_volume(pod_spec: Mapping[str, Any]) -> str | None:
    """The volume the API server mounted at the service-account path, if any."""
    for container in [*(pod_spec.get("initContainers") or []),
                      *(pod_spec.get("containers") or [])]:
        for mount in container.get("volumeMounts") or []:
            if mount.get("mountPath", "").rstrip("/") == SERVICE_ACCOUNT_MOUNT:
                return str(mount["name"])
    return None


def write_pod_kubeconfig(volume: Path, api_url: str, pod: Mapping[str, Any],
                         ca_pem: str | None) -> Path:
    """A kubeconfig beside the service-account volume's files (`token`, `namespace`)."""
    namespace = pod["metadata"].get("namespace") or "default"
    account = service_account_name(pod["spec"])
    return write_kubeconfig(volume.parent / f"{volume.name}.kubeconfig", api_url,
                            context=CONTEXT, namespace=namespace,
                            user=f"system:serviceaccount:{namespace}:{account}",
                            token=(volume / "token").read_text(), ca_pem=ca_pem)
