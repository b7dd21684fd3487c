"""The `kubernetes` Service for pods of real nodes: kube-apiserver at 10.0.0.1:443.

A pod reaches the API server as on GKE, through the `default/kubernetes` Service
(`KUBERNETES_SERVICE_HOST`/`_PORT`, what in-cluster clients use: the trainer's rank 0 sends
its TokenReview there, `tardigrade_sdk/peerauth.py`). kube-apiserver listens on the host's
loopback only, and the control plane runs with `--endpoint-reconciler-type=none` (its own
address, 127.0.0.1, is no valid endpoint), so the Service has no endpoints of its own.
`ClusterAPI` gives it one in the cluster network (`nodenet.py`): a `netnsproxy` listening on
`nodenet.API_ADDRESS:API_PORT` inside the cluster's namespace, relaying to kube-apiserver,
and an EndpointSlice of `default/kubernetes` naming that address (a Service without selector
has the endpoints its owner writes: Kubernetes docs, "Services without selectors"); the
kube-proxies DNAT 10.0.0.1:443 there. kube-apiserver's serving certificate names 10.0.0.1 and
`kubernetes.default.svc` (`pki.serving_names`), so clients verify it as on any cluster.
"""

from __future__ import annotations

import contextlib
import subprocess
import urllib.parse
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

import kubernetes

from tardigrade_local import netnsproxy
from tardigrade_local.nodenet import API_ADDRESS, ClusterNetwork

API_PORT = 6443
SLICE = "kubernetes-cluster-network"


class ClusterAPI:
    """`with ClusterAPI(network, cluster.info, tmp / "api"): ...` (pods reach 10.0.0.1:443)"""

    def __init__(self, network: ClusterNetwork, info: Mapping[str, Any], directory: Path
                 ) -> None:
        self.network = network
        self.directory = directory.absolute()
        self.api_url = str(info["direct_api_url"])
        self.admin_kubeconfig = str(info["kubeconfig"])
        self._proxy: subprocess.Popen[str] | None = None

    def __enter__(self) -> ClusterAPI:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def start(self) -> ClusterAPI:
        self.directory.mkdir(parents=True, exist_ok=True)
        api = urllib.parse.urlsplit(self.api_url)
        self._proxy = netnsproxy.spawn(self.network.netns_path, f"{API_ADDRESS}:{API_PORT}",
                                       f"{api.hostname}:{api.port}",
                                       self.directory / "netnsproxy.log")
        try:
            self._publish()
        except BaseException:
            self.stop()
            raise
        return self

    def _publish(self) -> None:
        with kubernetes.config.new_client_from_config(self.admin_kubeconfig) as client:
            service = kubernetes.client.CoreV1Api(client).read_namespaced_service(
                "kubernetes", "default")
            kubernetes.client.DiscoveryV1Api(client).create_namespaced_endpoint_slice(
                "default", {
                    "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                    "metadata": {
                        "name": SLICE,
                        "labels": {"kubernetes.io/service-name": "kubernetes",
                                   "endpointslice.kubernetes.io/managed-by":
                                       "clusterapi.tardigrade.local"},
                        "ownerReferences": [{"apiVersion": "v1", "kind": "Service",
                                             "name": "kubernetes",
                                             "uid": service.metadata.uid}]},
                    "addressType": "IPv4",
                    "endpoints": [{"addresses": [API_ADDRESS],
                                   "conditions": {"ready": True}}],
                    # The Service's port is named `https` (kube-apiserver's bootstrap).
                    "ports": [{"name": "https", "port": API_PORT, "protocol": "TCP"}]})

    def stop(self) -> None:
        """Remove the EndpointSlice, stop the proxy. Idempotent."""
        with (contextlib.suppress(Exception),
              kubernetes.config.new_client_from_config(self.admin_kubeconfig) as client):
            kubernetes.client.DiscoveryV1Api(client).delete_namespaced_endpoint_slice(
                SLICE, "default")
        netnsproxy.stop(self._proxy)
        self._proxy = None
