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

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import kubernetes

from tardigrade_local.nodenet import API_ADDRESS, ClusterNetwork
from tardigrade_local.relayed import RelayedService, endpoint_slice

API_PORT = 6443
SLICE = "kubernetes-cluster-network"


class ClusterAPI(RelayedService):
    """`with ClusterAPI(network, cluster.info, tmp / "api"): ...` (pods reach 10.0.0.1:443)"""

    def __init__(self, network: ClusterNetwork, info: Mapping[str, Any], directory: Path,
                 through_proxy: bool = False) -> None:
        """`through_proxy`: relay to the control plane's API proxy (`apiproxy.py`) instead of
        kube-apiserver itself, so that `LocalCluster.cut_watches` cuts pods' connections too
        (the chart's operator in the fault trials); the kubelets keep their own way."""
        target = info["api_url"] if through_proxy else info["direct_api_url"]
        super().__init__(network, str(target), API_ADDRESS, API_PORT,
                         str(info["kubeconfig"]), directory)

    def _publish(self, client: Any) -> None:
        service = kubernetes.client.CoreV1Api(client).read_namespaced_service(
            "kubernetes", "default")
        # The Service's port is named `https` (kube-apiserver's bootstrap).
        ports = [{"name": "https", "port": API_PORT, "protocol": "TCP"}]
        kubernetes.client.DiscoveryV1Api(client).create_namespaced_endpoint_slice(
            "default", endpoint_slice(SLICE, service, API_ADDRESS, ports,
                                      "clusterapi.tardigrade.local"))

    def _unpublish(self, client: Any) -> None:
        kubernetes.client.DiscoveryV1Api(client).delete_namespaced_endpoint_slice(
            SLICE, "default")
