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
import os
import subprocess
import sys
import urllib.parse
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

import kubernetes

from tardigrade_local.lifetime import die_with_parent
from tardigrade_local.nodenet import API_ADDRESS, ClusterNetwork

API_PORT = 6443
SLICE = "kubernetes-cluster-network"
STOP_TIMEOUT_SECONDS = 10.0


class ClusterAPIError(RuntimeError):
    pass


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
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")])}
        with open(self.directory / "netnsproxy.log", "a") as log:
            self._proxy = subprocess.Popen(
                [sys.executable, "-m", "tardigrade_local.netnsproxy",
                 str(self.network.netns_path), f"{API_ADDRESS}:{API_PORT}",
                 f"{api.hostname}:{api.port}"],
                stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL, env=env,
                text=True, preexec_fn=die_with_parent)
        try:
            assert self._proxy.stdout is not None
            if self._proxy.stdout.readline().strip() != "listening":
                raise ClusterAPIError(f"the API proxy did not start: "
                                      f"{(self.directory / 'netnsproxy.log').read_text()}")
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
        if self._proxy is not None and self._proxy.poll() is None:
            self._proxy.terminate()
            try:
                self._proxy.wait(STOP_TIMEOUT_SECONDS)
            except subprocess.TimeoutExpired:
                self._proxy.kill()
                self._proxy.wait(5)
        if self._proxy is not None and self._proxy.stdout is not None:
            self._proxy.stdout.close()
        self._proxy = None
