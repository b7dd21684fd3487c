"""A node as GKE's node pool makes it: name, labels, taints, allocatable resources, pool.

The template of an autoscaled pool (`autoscaler.NodePool`), a TPU slice's hosts
(`tpuslices.py`) and every node the local cluster starts are described by one `NodeConfig`.
`node_object` is the Node such a node registers as, Ready: what the cluster autoscaler
simulates pods onto for a node not there yet (its template node,
cluster-autoscaler `TemplateNodeInfo`)."""

from __future__ import annotations

import dataclasses
import platform
from collections.abc import Mapping
from typing import Any

DEFAULT_NODE_CAPACITY = {"cpu": "8", "memory": "32Gi", "pods": "110", "ephemeral-storage": "100Gi"}
# GKE's default node pool name, and the label GKE puts on every node with its pool's name.
DEFAULT_POOL = "default-pool"
NODE_POOL_LABEL = "cloud.google.com/gke-nodepool"


@dataclasses.dataclass(frozen=True)
class NodeConfig:
    """One local node: its name, labels, taints, allocatable resources and node pool (a GKE
    node pool is a managed instance group: it recreates a reclaimed VM under the same name)."""

    name: str
    labels: Mapping[str, str] = dataclasses.field(default_factory=dict)
    taints: tuple[Mapping[str, str], ...] = ()
    capacity: Mapping[str, str] = dataclasses.field(
        default_factory=lambda: dict(DEFAULT_NODE_CAPACITY)
    )
    pool: str = DEFAULT_POOL
    # Pods run without processes (`simulated.py`), as on a kwok-managed node.
    simulated: bool = False
    # What this node's kubelet reports and honours: nodes of one cluster can run different
    # kubelet releases (version skew), so features are per node. None: the default release.
    kubelet_version: str | None = None
    feature_gates: Mapping[str, bool] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> NodeConfig:
        return cls(
            name=str(data["name"]),
            labels={str(k): str(v) for k, v in (data.get("labels") or {}).items()},
            taints=tuple(dict(t) for t in data.get("taints") or ()),
            capacity={**DEFAULT_NODE_CAPACITY,
                      **{str(k): str(v) for k, v in (data.get("capacity") or {}).items()}},
            pool=str(data.get("pool") or DEFAULT_POOL),
            simulated=bool(data.get("simulated", False)),
            kubelet_version=(str(data["kubeletVersion"]) if data.get("kubeletVersion")
                             else None),
            feature_gates={str(k): bool(v) for k, v in (data.get("featureGates") or {}).items()},
        )

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "labels": dict(self.labels),
                "taints": [dict(t) for t in self.taints], "capacity": dict(self.capacity),
                "pool": self.pool, "simulated": self.simulated,
                "kubeletVersion": self.kubelet_version, "featureGates": dict(self.feature_gates)}


def arch() -> str:
    """The machine's architecture as Kubernetes names it."""
    machine = platform.machine().lower()
    return {"x86_64": "amd64", "aarch64": "arm64"}.get(machine, machine)


def node_labels(config: NodeConfig) -> dict[str, str]:
    """The labels of a node of `config`: those the kubelet sets on its own Node
    (pkg/kubelet/kubelet_node_status.go, `initialNode`), its pool's and the config's."""
    return {
        "kubernetes.io/hostname": config.name,
        "kubernetes.io/os": "linux",
        "kubernetes.io/arch": arch(),
        "beta.kubernetes.io/os": "linux",
        "beta.kubernetes.io/arch": arch(),
        NODE_POOL_LABEL: config.pool,
        **config.labels,
    }


def node_object(config: NodeConfig) -> dict[str, Any]:
    """The Node a node of `config` registers as, once Ready: its labels, taints, and capacity
    and allocatable as the config's (the figures a pool's template states)."""
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": config.name, "labels": node_labels(config)},
        "spec": {"taints": [dict(t) for t in config.taints]} if config.taints else {},
        "status": {
            "capacity": dict(config.capacity),
            "allocatable": dict(config.capacity),
            "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                            "message": "kubelet is posting ready status"}],
        },
    }
