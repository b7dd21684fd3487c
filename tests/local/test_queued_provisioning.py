"""GKE's queued provisioning in the local cluster, the pure parts: which nodes a
ProvisioningRequest books (all of its pods or none), and queued-provisioning pools kept out
of the ordinary autoscaler. End to end, with Kueue: tests/e2e/test_kueue_provisioning.py."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from tardigrade_local import kueue
from tardigrade_local.cluster import ClusterConfig
from tardigrade_local.gke.autoscaler import NodeAutoscaler, NodePool
from tardigrade_local.gke.nodes import NODE_POOL_LABEL, NodeConfig
from tardigrade_local.gke.provisioning import Booking, QueuedProvisioner, plan_booking

# Nodes of 2 cpus (the rest of the default capacity).
SMALL = NodeConfig.from_dict({"name": "template", "capacity": {"cpu": "2"}})
DWS = NodePool("dws-pool", max_size=3, template=SMALL, provision_seconds=5,
               queued_provisioning=True)


def template_pod(i: int, cpu: str = "1", **spec: Any) -> dict[str, Any]:
    return {"metadata": {"name": f"p{i}", "namespace": "default", "uid": f"ppt-{i}"},
            "spec": {"containers": [{"name": "main", "resources": {"requests": {"cpu": cpu}}}],
                     "nodeSelector": {NODE_POOL_LABEL: "dws-pool"}, **spec}}


def test_a_request_books_the_nodes_all_its_pods_need():
    booking = plan_booking([template_pod(i) for i in range(3)], [DWS], {})
    assert booking.refusal is None and booking.grow == {"dws-pool": 2}


def test_a_request_the_pool_cannot_hold_whole_books_nothing_and_says_why():
    # 4 pods of 2 cpus need 4 nodes; the pool has 3 at most: none is booked.
    booking = plan_booking([template_pod(i, cpu="2") for i in range(4)], [DWS], {})
    assert booking.grow == {}
    assert booking.refusal == "pod didn't trigger scale-up: 1 max node group size reached"
    # Nodes the pool already has count against its max size.
    assert plan_booking([template_pod(0, cpu="2")], [DWS], {"dws-pool": 3}).grow == {}


def test_a_pod_asking_for_another_pool_is_not_booked_here():
    pod = template_pod(0)
    pod["spec"]["nodeSelector"] = {NODE_POOL_LABEL: "elsewhere"}
    booking = plan_booking([pod], [DWS], {})
    assert booking.grow == {} and booking.refusal is not None


def test_the_pool_flag_round_trips_and_keeps_the_pool_from_the_autoscaler():
    config = ClusterConfig(state_dir=Path("x"), node_pools=[DWS, NodePool("plain", 2, SMALL)])
    again = ClusterConfig.from_json(config.to_json())
    assert again.node_pools == config.node_pools
    assert [p.queued_provisioning for p in again.node_pools] == [True, False]
    assert NodePool.from_dict({"name": "p", "maxSize": 1}).queued_provisioning is False
    # The cluster autoscaler never grows it for an unschedulable pod.
    host: Any = SimpleNamespace(cloud=SimpleNamespace(client=None))
    assert [p.name for p in NodeAutoscaler(host, again.node_pools).pools] == ["plain"]


def test_the_provisioning_request_crd_comes_from_the_autoscaler_module_kueue_pins():
    crd = kueue.provisioning_request_crd()
    assert crd["metadata"]["name"] == "provisioningrequests.autoscaling.x-k8s.io"
    served = {v["name"] for v in crd["spec"]["versions"] if v["served"]}
    assert "v1" in served and crd["spec"]["scope"] == "Namespaced"


class PoolHost:
    """A `ProvisioningHost` whose nodes are names in pools (no VM behind them)."""

    def __init__(self, nodes: dict[str, str]) -> None:
        self.cloud = SimpleNamespace(client=None)
        self.nodes = dict(nodes)  # name -> pool
        self.removed: list[str] = []

    def pool_sizes(self) -> dict[str, int]:
        return dict(Counter(self.nodes.values()))

    def upcoming_nodes(self) -> list[NodeConfig]:
        return []

    def has_node(self, name: str) -> bool:
        return name in self.nodes or name in self.removed

    async def add_node(self, config: NodeConfig) -> None:
        self.nodes[config.name] = config.pool

    async def remove_node(self, name: str) -> None:
        if self.nodes.pop(name, None) is not None:
            self.removed.append(name)


def test_booked_nodes_count_in_their_pool_from_the_booking_on_whatever_the_host():
    host = PoolHost({"dws-pool-1": "dws-pool", "other-1": "other"})
    provisioner = QueuedProvisioner(host, [DWS])
    names = provisioner._book("uid-1", Booking({"dws-pool": 2}, None))
    # A name the host has taken is never booked again.
    assert sorted(names) == ["dws-pool-2", "dws-pool-3"]
    assert provisioner._sizes()["dws-pool"] == 3
    # A booked node the host created is counted once.
    asyncio.run(host.add_node(DWS.node_config("dws-pool-2")))
    assert provisioner._sizes()["dws-pool"] == 3
    # The pool is full: a second request waits, saying why.
    refused = plan_booking([template_pod(0)], [DWS], provisioner._sizes())
    assert refused.refusal == "pod didn't trigger scale-up: 1 max node group size reached"
    asyncio.run(host.remove_node("dws-pool-1"))
    assert provisioner._sizes()["dws-pool"] == 2
    assert provisioner._new_name(DWS) not in {"dws-pool-1", "dws-pool-2", "dws-pool-3"}
