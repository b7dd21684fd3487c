"""Settings of the local kubelet and of the nodes it runs."""

from __future__ import annotations

import dataclasses
import ssl
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

from tardigrade_local.gke.disruptions import REGULAR_POD_SHUTDOWN_GRACE_SECONDS
from tardigrade_local.kubelet.images import ImageMap
from tardigrade_local.paths import StateLayout, project_python_path

PODSITE_DIR = Path(__file__).resolve().parent / "podsite"
# The mark of a simulated node (`simulated.py`), in the style of kwok's `kwok.x-k8s.io/node:
# fake`, and the runtime its Node reports.
SIMULATED_ANNOTATION = "local.tardigrade.dev/simulated"
SIMULATED_RUNTIME_VERSION = "simulated://0.1"


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
