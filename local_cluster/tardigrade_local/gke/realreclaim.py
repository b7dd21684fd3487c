"""GKE's part for real nodes: a spot reclaim or a lost VM of a `realnode.RealNode`.

The cluster process's control endpoint (`Disruptor.preempt_node`, `halt_node`) reclaims the
benches' simulated nodes itself (`simulator.SimulatedHost`); a real node is started by another
process (a test, `tardigrade local up`'s `serve`), which holds its processes. The endpoint finds
it by its record (`realnode.RECORDS_DIR`: its name and the egress routes of the cluster it
joined) and acts on the machine as the cloud does:
- a spot reclaim shuts the VM down (`RealNode.shutdown`: logind, the real kubelet's graceful
  node shutdown, the power-off), then the VM is gone and GKE's cloud node lifecycle controller
  deletes its Node object (`gke/cloud.py`). The node pool does not recreate it here: the
  process that started it would have to;
- a lost VM (`RealNode.halt`): everything killed at once; the Node object stays;
- scheduled host maintenance (`maintain`): the label at once, then at the start GKE's
  maintenance handler's taint and pod deletions with their own grace
  (`hostmaintenance.py`), then the VM's shutdown as for a reclaim, then its Node goes.
Each acts on a host of a multi-host TPU slice's whole slice (`slice_hosts`), as
`RealNodeCluster` does: Compute Engine stops, recovers and maintains a slice's instances
together (local_cluster/README.md, "TPU slices").
What the dead machine leaves on ours is removed at once; its starter's `stop()` then finds
nothing left to do.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path
from typing import Any

from tardigrade_local.gke import hostmaintenance, tpuslices
from tardigrade_local.gke.cloud import GkeCloud
from tardigrade_local.gke.nodes import NODE_POOL_LABEL, NodeConfig
from tardigrade_local.realnode import RECORDS_DIR, RealNode


def recorded_node(name: str, egress_routes: Path | None) -> RealNode | None:
    """The running real node `name` of the cluster whose egress routes are `egress_routes`
    (real nodes join a cluster started with `node_egress`), or None."""
    if egress_routes is None or not RECORDS_DIR.is_dir():
        return None
    for record in sorted(RECORDS_DIR.glob("*.json")):
        with contextlib.suppress(OSError, ValueError, KeyError):
            data = json.loads(record.read_text())
            if data["name"] == name and data.get("egress_routes") == str(egress_routes):
                return RealNode(name, Path(data["directory"]), "", Path(),
                                index=data["index"], egress_routes=egress_routes)
    return None


def slice_hosts(nodes: list[dict[str, Any]], name: str) -> list[str]:
    """The Nodes that go and come back with Node `name`, from the Node objects `nodes` (as
    the cloud knows its VMs: by pool, accelerator topology and chips): every host of its
    multi-host TPU slice pool, itself included, or just `name`."""
    def config(node: dict[str, Any]) -> NodeConfig:
        labels = node["metadata"].get("labels") or {}
        capacity = (node.get("status") or {}).get("capacity") or {}
        return NodeConfig(node["metadata"]["name"], labels=labels,
                          capacity={k: v for k, v in capacity.items()
                                    if k == tpuslices.TPU_RESOURCE},
                          pool=labels.get(NODE_POOL_LABEL, ""))

    configs = [config(node) for node in nodes]
    mine = next((c for c in configs if c.name == name), None)
    if mine is None:
        return [name]
    return [c.name for c in tpuslices.slice_of(mine, configs)]


async def reclaim(cloud: GkeCloud, node: RealNode) -> None:
    """Spot reclaim: the VM shuts down (the kubelet's graceful node shutdown), then its Node
    object goes."""
    await asyncio.to_thread(node.shutdown)
    await cloud.delete_node(node.name)


async def lose(node: RealNode, slice_mates: list[RealNode] | None = None) -> None:
    """The VM stops without a shutdown; its Node object stays (the node lifecycle controller
    turns it Unknown). `slice_mates`: the other hosts of its multi-host TPU slice, which
    stop with it through a shutdown (logind, the kubelet's graceful node shutdown), their
    Node objects staying too."""
    await asyncio.gather(asyncio.to_thread(node.halt),
                         *(asyncio.to_thread(mate.shutdown) for mate in slice_mates or []))


async def maintain(cloud: GkeCloud, node: RealNode, start: float) -> list[str]:
    """GKE's host maintenance of a real node announced for `start` (`hostmaintenance.announce`
    labelled it): at the start the handler taints the node and deletes its pods with their
    own grace, then the VM shuts down through logind (the kubelet's graceful node shutdown
    finds what is left) and its Node object goes. Returns the pods the handler deleted."""
    await hostmaintenance.wait_for_start(start)
    await hostmaintenance.begin(cloud, node.name)
    deleted = await hostmaintenance.drain(cloud, node.name)
    await reclaim(cloud, node)
    return deleted
