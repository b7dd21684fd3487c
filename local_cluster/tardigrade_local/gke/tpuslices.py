"""TPU slice node pools: the nodes of one slice, and which nodes go and come back with a node.

GKE ("TPUs in GKE", cloud.google.com/tpu/docs/tpus-in-gke): a multi-host TPU slice node pool
holds the interconnected TPU VMs of one slice and is an atomic unit: if GKE cannot deploy one
node of the slice it deploys none, and when one node needs repair it shuts down every TPU VM of
the slice, evicting all its pods; pods schedule again once all VMs of the slice are up. Nodes
carry `cloud.google.com/gke-tpu-accelerator`, `cloud.google.com/gke-tpu-topology`, the pool
name in `cloud.google.com/gke-nodepool`, allocatable `google.com/tpu` (chips per host) and the
taint `google.com/tpu=present:NoSchedule`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping

from tardigrade_local.gke.nodes import DEFAULT_NODE_CAPACITY, NodeConfig

TPU_ACCELERATOR_LABEL = "cloud.google.com/gke-tpu-accelerator"
TPU_TOPOLOGY_LABEL = "cloud.google.com/gke-tpu-topology"
TPU_RESOURCE = "google.com/tpu"
TPU_TAINT = {"key": TPU_RESOURCE, "value": "present", "effect": "NoSchedule"}
SPOT_LABEL = "cloud.google.com/gke-spot"


@dataclasses.dataclass(frozen=True)
class SliceShape:
    accelerator: str = "tpu-v5-lite-podslice"
    topology: str = "2x4"
    chips_per_host: int = 4

    @classmethod
    def parse(cls, text: str) -> SliceShape:
        """`ACCELERATOR:TOPOLOGY:CHIPS_PER_HOST`, e.g. `tpu-v5-lite-podslice:2x4:4`."""
        parts = text.split(":")
        if len(parts) != 3 or not parts[2].isdigit() or int(parts[2]) < 1:
            raise ValueError(f"TPU slice shape {text!r}: expected ACCELERATOR:TOPOLOGY:CHIPS, "
                             "e.g. tpu-v5-lite-podslice:2x4:4")
        shape = cls(parts[0], parts[1], int(parts[2]))
        if shape.chips() % shape.chips_per_host:
            raise ValueError(f"TPU slice shape {text!r}: {shape.chips()} chips of topology "
                             f"{shape.topology} are not whole hosts of {shape.chips_per_host}")
        return shape

    def chips(self) -> int:
        try:
            return math.prod(int(d) for d in self.topology.split("x"))
        except ValueError:
            raise ValueError(f"TPU topology {self.topology!r}: expected AxB or AxBxC") from None

    def hosts(self) -> int:
        return self.chips() // self.chips_per_host


def slice_nodes(pool: str, shape: SliceShape, spot: bool = True,
                host_capacity: Mapping[str, str] = DEFAULT_NODE_CAPACITY) -> list[NodeConfig]:
    """The hosts of one slice node pool, named `<pool>-<host>`, each with `host_capacity`
    (cpu, memory, pods: a real node's must fit the machine, `nodeshape.py`) and its chips."""
    labels = {TPU_ACCELERATOR_LABEL: shape.accelerator, TPU_TOPOLOGY_LABEL: shape.topology}
    if spot:
        labels[SPOT_LABEL] = "true"
    capacity = {**host_capacity, TPU_RESOURCE: str(shape.chips_per_host)}
    return [NodeConfig(f"{pool}-{host}", labels=labels, taints=(TPU_TAINT,),
                       capacity=capacity, pool=pool) for host in range(shape.hosts())]


def is_multi_host_slice(config: NodeConfig) -> bool:
    topology = config.labels.get(TPU_TOPOLOGY_LABEL)
    per_host = config.capacity.get(TPU_RESOURCE)
    if topology is None or per_host is None or not per_host.isdigit():
        return False
    return SliceShape("", topology, int(per_host)).hosts() > 1


def slice_of(config: NodeConfig, nodes: Iterable[NodeConfig]) -> list[NodeConfig]:
    """The nodes that are reclaimed and recreated together with `config`: every host of its
    multi-host slice pool (itself included), or just itself."""
    if not is_multi_host_slice(config):
        return [config]
    return sorted((n for n in nodes if n.pool == config.pool), key=lambda n: n.name)
