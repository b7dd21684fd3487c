"""Scheduled host maintenance of a GPU/TPU node, as GKE announces and performs it: the
scheduled-maintenance-time label ahead, then at the start a NoSchedule taint and a termination
that gives pods their own grace period; the VM comes back under its name without the label."""

from __future__ import annotations

import time

import pytest
from kube_helpers import Kube, python_pod, wait_for
from kubernetes.client import ApiException, V1Node
from tardigrade_local.cluster import LocalCluster
from tardigrade_local.gke.disruptions import (
    IMPENDING_TERMINATION_TAINT,
    SCHEDULED_MAINTENANCE_LABEL,
)
from tardigrade_local.gke.nodes import NodeConfig

pytestmark = pytest.mark.slow

# A spot reclaim here would give pods 2 s; the pod below needs 4 s after its SIGTERM.
SPOT_GRACE = 2
SAVE_SECONDS = 4
SAVER = f"""
import signal, sys, time
def on_term(*_):
    time.sleep({SAVE_SECONDS})
    sys.exit(42)
signal.signal(signal.SIGTERM, on_term)
print("ready", flush=True)
time.sleep(600)
"""


def test_maintenance_is_announced_then_terminates_the_node_with_the_pods_grace(tmp_path):
    with LocalCluster(tmp_path / "state", nodes=[NodeConfig("gpu-1")], with_gcs=False,
                      shutdown_grace_seconds=SPOT_GRACE, replace_after_seconds=1.0) as cluster:
        kube = Kube(str(cluster.kubeconfig))
        kube.create_pod(python_pod("trainer", SAVER, grace=30))
        kube.wait_phase("trainer", ("Running",), timeout=60)
        # Its SIGTERM handler is in place once it says so.
        wait_for(lambda: "ready" in kube.core.read_namespaced_pod_log("trainer", "default"),
                 30, "the pod ready", interval=0.2)
        first_vm = kube.core.read_node("gpu-1").metadata.uid
        start = cluster.schedule_maintenance("gpu-1", 3.0)
        labels = kube.core.read_node("gpu-1").metadata.labels
        assert labels[SCHEDULED_MAINTENANCE_LABEL] == str(int(start))
        assert kube.pod("trainer")["status"]["phase"] == "Running"  # only announced

        def tainted() -> bool:
            try:
                node = kube.core.read_node("gpu-1")
            except ApiException:  # gone already (404): the shutdown is over
                return False
            return any(t.key == IMPENDING_TERMINATION_TAINT and t.effect == "NoSchedule"
                       for t in node.spec.taints or [])

        wait_for(tainted, 30, "the impending-termination taint", interval=0.1)
        assert time.time() >= start - 0.5
        pod = kube.wait_phase("trainer", ("Failed",), timeout=30)
        terminated = pod["status"]["containerStatuses"][0]["state"]["terminated"]
        # It got its own grace (30 s), not a spot reclaim's 2 s: it finished its save.
        assert terminated["exitCode"] == 42, terminated
        assert any(c["type"] == "DisruptionTarget" for c in pod["status"]["conditions"])
        # The VM comes back under its name, registered anew: untainted, with no maintenance
        # scheduled any more.

        def successor() -> V1Node | None:
            try:
                node = kube.core.read_node("gpu-1")
            except ApiException:  # between the old Node's deletion and the new registration
                return None
            return node if node.metadata.uid != first_vm else None

        back = wait_for(successor, 30, "the VM back")
        assert not any(t.key == IMPENDING_TERMINATION_TAINT for t in back.spec.taints or [])
        assert SCHEDULED_MAINTENANCE_LABEL not in back.metadata.labels
