"""The GCS emulator for pods of real nodes: the Service `kube-system/fake-gcs`.

The emulator (`gcs.GcsEmulator`, fake-gcs-server) listens on the host's loopback, which no
pod of a real node can reach: each node, and each pod, has a network namespace of its own
(`realnode.py`). `ClusterGCS` does for it what `clusterapi.py` does for kube-apiserver: a
`netnsproxy` listening on `nodenet.GCS_ADDRESS:PORT` inside the cluster network's namespace,
relaying to the emulator, behind a Service without selector (`fake-gcs`, ClusterIP, port
PORT) whose EndpointSlice we write (Kubernetes docs, "Services without selectors"); the
kube-proxies DNAT the Service's address there, and CoreDNS names it
`fake-gcs.kube-system.svc.cluster.local`.

A pod's GCS clients find it through `pod_env()`: `gcs.client_env` of the Service's URL
(TensorStore's `TENSORSTORE_GCS_HTTP_URL`, a test token, google-auth kept off the metadata
server). A real kubelet adds nothing to a pod, so a job passes them itself, as `spec.env` of its
TrainingJob: what a job on GKE does to point TensorStore at another endpoint. The operator never
opens a bucket (a checkpoint's step and path come from rank 0's progress), so it needs none.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import kubernetes

from tardigrade_local import gcs
from tardigrade_local.nodenet import GCS_ADDRESS, ClusterNetwork
from tardigrade_local.relayed import RelayedService, endpoint_slice

NAMESPACE = "kube-system"
SERVICE = "fake-gcs"
# fake-gcs-server's own default port.
PORT = 4443
HOST = f"{SERVICE}.{NAMESPACE}.svc.cluster.local"


def pod_url() -> str:
    """The emulator's URL as pods of real nodes reach it."""
    return f"http://{HOST}:{PORT}"


def pod_env() -> dict[str, str]:
    """The emulator's client environment for a pod of a real node."""
    return gcs.client_env(pod_url())


def env_vars(env: Mapping[str, str]) -> list[dict[str, str]]:
    """`env` as a container's (or a TrainingJob's `spec.env`) list of name/value pairs."""
    return [{"name": name, "value": value} for name, value in sorted(env.items())]


class ClusterGCS(RelayedService):
    """`with ClusterGCS(network, cluster.info, tmp / "gcs"): ...` (pods reach `pod_url()`)"""

    def __init__(self, network: ClusterNetwork, info: Mapping[str, Any], directory: Path
                 ) -> None:
        if not info.get("gcs_url"):
            raise ValueError("the cluster runs no GCS emulator (LocalCluster with_gcs=False)")
        super().__init__(network, str(info["gcs_url"]), GCS_ADDRESS, PORT,
                         str(info["kubeconfig"]), directory)

    def _publish(self, client: Any) -> None:
        ports = [{"name": "http", "port": PORT, "protocol": "TCP"}]
        service = kubernetes.client.CoreV1Api(client).create_namespaced_service(NAMESPACE, {
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"name": SERVICE, "labels": {"app.kubernetes.io/name": SERVICE}},
            "spec": {"ports": [{**p, "targetPort": PORT} for p in ports]}})
        kubernetes.client.DiscoveryV1Api(client).create_namespaced_endpoint_slice(
            NAMESPACE, endpoint_slice(f"{SERVICE}-cluster-network", service, GCS_ADDRESS,
                                      ports, "clustergcs.tardigrade.local"))

    def _unpublish(self, client: Any) -> None:
        # Deleted outright rather than left to the garbage collector: the control plane may
        # be stopped next.
        with contextlib.suppress(Exception):
            kubernetes.client.DiscoveryV1Api(client).delete_namespaced_endpoint_slice(
                f"{SERVICE}-cluster-network", NAMESPACE)
        kubernetes.client.CoreV1Api(client).delete_namespaced_service(SERVICE, NAMESPACE)
