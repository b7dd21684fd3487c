"""Settings of the local kubelet and of the nodes it runs."""

from __future__ import annotations

import dataclasses
import ssl
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import tardigrade_local
from tardigrade_local.disruptions import REGULAR_POD_SHUTDOWN_GRACE_SECONDS
from tardigrade_local.kubelet.images import ImageMap
from tardigrade_local.paths import StateLayout

PODSITE_DIR = Path(__file__).resolve().parent / "podsite"
DEFAULT_NODE_CAPACITY = {"cpu": "8", "memory": "32Gi", "pods": "110", "ephemeral-storage": "100Gi"}
# GKE's default node pool name, and the label GKE puts on every node with its pool's name.
DEFAULT_POOL = "default-pool"
NODE_POOL_LABEL = "cloud.google.com/gke-nodepool"
# The mark of a simulated node (`simulated.py`), in the style of kwok's `kwok.x-k8s.io/node:
# fake`, and the runtime its Node reports.
SIMULATED_ANNOTATION = "local.tardigrade.dev/simulated"
SIMULATED_RUNTIME_VERSION = "simulated://0.1"


def project_python_path() -> list[str]:
    """Source folders of this checkout, so pods import our packages without an install."""
    repo = Path(tardigrade_local.__file__).resolve().parents[2]
    return [str(repo / d) for d in ("local_cluster", "operator", "trainer_image")]


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


class ClusterAccess(Protocol):
    """How the node agents authenticate: the control plane's CA issues each identity."""

    def ssl_context(self, identity: str) -> ssl.SSLContext: ...

    def node_context(self, node: str) -> ssl.SSLContext: ...

    def kubelet_serving_context(self, node: str, ip: str) -> ssl.SSLContext: ...


# A kubelet's Lease (kubelet config `nodeLeaseDurationSeconds`, 40 s), renewed every quarter
# of it (`nodeLeaseRenewIntervalFraction`, 0.25: pkg/kubelet/kubelet.go).
NODE_LEASE_SECONDS = 40.0
LEASE_RENEW_FRACTION = 0.25


@dataclasses.dataclass(frozen=True)
class KubeletSettings:
    layout: StateLayout
    # kube-apiserver's URL (TLS) and the CA that signed its certificate: the node agents and
    # pods reach it there.
    api_url: str
    ca_pem: str | None = None
    access: ClusterAccess | None = None
    image_map: ImageMap = dataclasses.field(default_factory=ImageMap)
    # Environment every pod gets before its own env (e.g. the GCS emulator endpoint).
    cluster_env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    # CrashLoopBackOff: first delay, doubling up to the cap (the real kubelet: 10 s, 300 s).
    backoff_base_seconds: float = 10.0
    backoff_max_seconds: float = 300.0
    # Node shutdown (spot reclaim): grace of regular pods, capped by each pod's own
    # (disruptions.node_shutdown_pod_grace); GKE spot: 15 s of the 30 s notice.
    shutdown_grace_seconds: float = REGULAR_POD_SHUTDOWN_GRACE_SECONDS
    # A reclaimed spot VM's node pool (managed instance group) recreates it under the same
    # name after this many seconds; None: it never comes back (`tardigrade local up
    # --no-replace`). See disruptions.DEFAULT_REPLACE_AFTER_SECONDS.
    replace_after_seconds: float | None = None
    # The node Lease's duration; the kubelet renews it every quarter of it. The controller
    # manager's --node-monitor-grace-period must exceed the renew interval.
    node_lease_seconds: float = NODE_LEASE_SECONDS
    python_path: tuple[str, ...] = dataclasses.field(
        default_factory=lambda: tuple(project_python_path())
    )
    # Simulated nodes (`simulated.py`): seconds from ContainerCreating to Running (image pull,
    # create, start). Zero by default: benches measure the control plane, not a runtime.
    # kwok's "general" pod stages wait 1 s plus up to 5 s of jitter (pod-create.yaml, `delay`).
    simulated_start_seconds: float = 0.0
