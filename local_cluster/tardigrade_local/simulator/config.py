"""Settings of the simulator's node agents (`host.py`)."""

from __future__ import annotations

import dataclasses
import ssl
from collections.abc import Mapping
from typing import Protocol

from tardigrade_local.gke.disruptions import REGULAR_POD_SHUTDOWN_GRACE_SECONDS
from tardigrade_local.paths import StateLayout

# The mark of a simulated node (`simulated.py`), in the style of kwok's `kwok.x-k8s.io/node:
# fake`, and the runtime its Node reports.
SIMULATED_ANNOTATION = "local.tardigrade.dev/simulated"
SIMULATED_RUNTIME_VERSION = "simulated://0.1"


class ClusterAccess(Protocol):
    """How the node agents authenticate: the control plane's CA issues each identity."""

    def ssl_context(self, identity: str) -> ssl.SSLContext: ...


# A kubelet's Lease (kubelet config `nodeLeaseDurationSeconds`, 40 s), renewed every quarter
# of it (`nodeLeaseRenewIntervalFraction`, 0.25: pkg/kubelet/kubelet.go).
NODE_LEASE_SECONDS = 40.0
LEASE_RENEW_FRACTION = 0.25


@dataclasses.dataclass(frozen=True)
class SimulatorSettings:
    layout: StateLayout
    # kube-apiserver's URL (TLS), where the node agents reach it.
    api_url: str
    access: ClusterAccess | None = None
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
    # Simulated nodes (`simulated.py`): seconds from ContainerCreating to Running (image pull,
    # create, start). Zero by default: benches measure the control plane, not a runtime.
    # kwok's "general" pod stages wait 1 s plus up to 5 s of jitter (pod-create.yaml, `delay`).
    simulated_start_seconds: float = 0.0
