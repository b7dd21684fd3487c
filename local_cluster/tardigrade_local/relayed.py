"""A host service given to the pods of real nodes: a relay in the cluster network, and the
EndpointSlice of a Service naming it.

What listens on the host's loopback (kube-apiserver, the GCS emulator) no pod of a real node
can reach: each node, and each pod, has a network namespace of its own (`realnode.py`). A
`netnsproxy` listening on an address of the cluster network's namespace (`nodenet.py`) relays
to it, and an EndpointSlice we write puts that address behind a Service without selector
(Kubernetes docs, "Services without selectors"): the kube-proxies DNAT the Service's address
there, and CoreDNS names it. `clusterapi.py` and `clustergcs.py` are the two.
"""

from __future__ import annotations

import abc
import contextlib
import subprocess
import urllib.parse
from pathlib import Path
from types import TracebackType
from typing import Any

import kubernetes

from tardigrade_local import netnsproxy
from tardigrade_local.nodenet import ClusterNetwork


class RelayedService(abc.ABC):
    """`with Sub(network, ...): ...`: the relay from `address:port` in the cluster network to
    `target_url`, published by `_publish` (a subclass's), removed by `_unpublish`."""

    def __init__(self, network: ClusterNetwork, target_url: str, address: str, port: int,
                 admin_kubeconfig: str, directory: Path) -> None:
        self.network = network
        self.target_url = target_url
        self.address, self.port = address, port
        self.admin_kubeconfig = admin_kubeconfig
        self.directory = directory.absolute()
        self._proxy: subprocess.Popen[str] | None = None

    def __enter__(self) -> RelayedService:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def start(self) -> RelayedService:
        self.directory.mkdir(parents=True, exist_ok=True)
        target = urllib.parse.urlsplit(self.target_url)
        self._proxy = netnsproxy.spawn(self.network.netns_path, f"{self.address}:{self.port}",
                                       f"{target.hostname}:{target.port}",
                                       self.directory / "netnsproxy.log")
        try:
            with kubernetes.config.new_client_from_config(self.admin_kubeconfig) as client:
                self._publish(client)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Unpublish, stop the relay. Idempotent."""
        with (contextlib.suppress(Exception),
              kubernetes.config.new_client_from_config(self.admin_kubeconfig) as client):
            self._unpublish(client)
        netnsproxy.stop(self._proxy)
        self._proxy = None

    @abc.abstractmethod
    def _publish(self, client: Any) -> None:
        """Put the relay's address behind the Service (an API client of the admin's)."""

    @abc.abstractmethod
    def _unpublish(self, client: Any) -> None:
        """Take it away again."""


def endpoint_slice(name: str, service: Any, address: str, ports: list[dict[str, Any]],
                   managed_by: str) -> dict[str, Any]:
    """The EndpointSlice of `service` (a V1Service, its owner) naming `address`."""
    return {
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {
            "name": name,
            "labels": {"kubernetes.io/service-name": service.metadata.name,
                       "endpointslice.kubernetes.io/managed-by": managed_by},
            "ownerReferences": [{"apiVersion": "v1", "kind": "Service",
                                 "name": service.metadata.name,
                                 "uid": service.metadata.uid}]},
        "addressType": "IPv4",
        "endpoints": [{"addresses": [address], "conditions": {"ready": True}}],
        "ports": ports}
