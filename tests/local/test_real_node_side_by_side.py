"""Two local clusters of real nodes side by side on one machine, with the same address plan
(node 1's address and pod range, the Service range, the cluster DNS address): each pod reaches
its own cluster's Service and DNS, never the other's; stopping one leaves the other running
and leaves nothing of itself behind.

Each cluster: its control plane, its network, its DNS, the `kubernetes` Service's endpoint and
one real node."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kube_helpers import Kube, condition, wait_for
from tardigrade_local import nodeimage, nodenet
from tardigrade_local.cluster import LocalCluster
from tardigrade_local.clusterapi import ClusterAPI
from tardigrade_local.clusterdns import ClusterDNS
from tardigrade_local.nodenet import ClusterNetwork
from tardigrade_local.realnode import RealNode, sweep_orphans

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux") or os.geteuid() != 0,
                       reason="real nodes need Linux and root (namespaces, mounts, cgroups)"),
]

NODE = "side-node-1"
PORT = 8476
POD_TIMEOUT_SECONDS = 180.0
# A client retries while kube-proxy programs a new Service (about a second).
RETRY = "for i in $(seq 60); do {attempt} && exit 0; sleep 2; done; exit 1"
GET = "printf 'GET / HTTP/1.0\\r\\n\\r\\n' | nc -w 5 {host} {port} | grep answer"


class Side:
    """One cluster: its control plane, network, DNS, API endpoint and node (once started)."""

    cluster: LocalCluster
    network: ClusterNetwork
    node: RealNode
    kube: Kube

    def __init__(self, name: str, root: Path) -> None:
        self.name = name
        self.root = root
        self.stack = contextlib.ExitStack()

    def start(self) -> Side:
        stack = self.stack
        self.cluster = stack.enter_context(LocalCluster(
            self.root / "state", nodes=[], with_gcs=False, node_egress=True,
            endpoint_controllers=True))
        self.network = stack.enter_context(ClusterNetwork(self.root / "net"))
        stack.enter_context(ClusterDNS(self.network, self.cluster.info, self.root / "dns"))
        stack.enter_context(ClusterAPI(self.network, self.cluster.info, self.root / "api"))
        # Index 1 on both sides: the same node address and pod range.
        self.node = stack.enter_context(RealNode.for_cluster(
            self.cluster.info, NODE, self.root / "n", index=1, network=self.network))
        self.kube = Kube(str(self.cluster.kubeconfig))
        return self

    def stop(self) -> None:
        self.stack.close()


@pytest.fixture(scope="module")
def sides(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Side, Side]]:
    sweep_orphans()
    nodenet.sweep_orphans()
    one = Side("one", tmp_path_factory.mktemp("sa"))
    two = Side("two", tmp_path_factory.mktemp("sb"))
    try:
        one.start()
        two.start()
        yield one, two
    finally:
        two.stop()
        one.stop()


def _server(side: Side) -> dict[str, Any]:
    """busybox httpd answering `answer from <side>`, behind the Service `web`."""
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "web", "labels": {"app": "web"}},
            "spec": {"terminationGracePeriodSeconds": 1, "containers": [{
                "name": "main", "image": nodeimage.BUSYBOX_IMAGE, "imagePullPolicy": "Never",
                "command": ["sh", "-c", f"mkdir /www && echo answer from {side.name} "
                            f"> /www/index.html && exec httpd -f -p {PORT} -h /www"],
                "readinessProbe": {"tcpSocket": {"port": PORT}, "periodSeconds": 1}}]}}


def _ask(side: Side, name: str, host: str) -> str:
    """A pod of this side's node GETs `host`; its log once it succeeded."""
    kube = side.kube
    kube.create_pod({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": {
        "restartPolicy": "Never",
        "containers": [{"name": "main", "image": nodeimage.BUSYBOX_IMAGE,
                        "imagePullPolicy": "Never", "command": ["sh", "-c", RETRY.format(
                            attempt=GET.format(host=host, port=80))]}]}})
    pod = kube.wait_phase(name, ("Succeeded", "Failed"), timeout=POD_TIMEOUT_SECONDS)
    log = kube.core.read_namespaced_pod_log(name, "default")
    assert pod["status"]["phase"] == "Succeeded", log
    return log


def _serve(side: Side) -> str:
    """The server pod and its Service; the Service's ClusterIP."""
    kube = side.kube
    kube.create_pod(_server(side))

    def ready() -> dict[str, Any] | None:
        pod = kube.pod("web")
        found = pod and condition(pod, "Ready")
        return pod if found and found["status"] == "True" else None
    wait_for(ready, POD_TIMEOUT_SECONDS, what=f"{side.name}'s web pod Ready")
    service = kube.core.create_namespaced_service("default", {
        "apiVersion": "v1", "kind": "Service", "metadata": {"name": "web"},
        "spec": {"selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": PORT}]}})
    return str(service.spec.cluster_ip)


def test_two_clusters_with_one_address_plan_each_answer_their_own_pods(sides):
    one, two = sides
    assert one.node.addresses == two.node.addresses
    assert one.network.id != two.network.id
    ips = [_serve(side) for side in sides]
    for side in sides:
        # By name (each cluster's DNS) and by ClusterIP (each node's kube-proxy).
        assert _ask(side, "by-name", "web.default.svc.cluster.local").strip().endswith(
            f"answer from {side.name}")
    # The same ClusterIP may well be given on both sides; either way, each answers its own.
    for side, ip in zip(sides, ips, strict=True):
        assert _ask(side, "by-ip", ip).strip().endswith(f"answer from {side.name}")


def test_stopping_one_cluster_leaves_the_other_running_and_nothing_of_itself(sides):
    one, two = sides
    one.stop()
    left = {**one.node.leftovers(), **{f"network {k}": v
                                       for k, v in one.network.leftovers().items()}}
    assert {kind: items for kind, items in left.items() if items} == {}
    assert _ask(two, "after", "web.default.svc.cluster.local").strip().endswith(
        "answer from two")
