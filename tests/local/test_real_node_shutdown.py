"""A real node's shutdown reaches the real kubelet's graceful node shutdown through logind on
the node's system bus, as a VM's does (a spot reclaim); a node lost without a shutdown gets no
say; GKE's spot reclaim of a real node (the cluster's control endpoint) is its shutdown. One
node at a time."""

from __future__ import annotations

import os
import sys
import time
from datetime import datetime

import pytest
from kube_helpers import Kube, condition, container_status, wait_for
from tardigrade_local import nodeimage, nodepower
from tardigrade_local.cluster import LocalCluster
from tardigrade_local.gke.disruptions import (
    DISRUPTION_TARGET,
    NODE_SHUTDOWN_MESSAGE,
    NODE_SHUTDOWN_NODE_MESSAGE,
    NODE_SHUTDOWN_REASON,
    REASON_TERMINATION_BY_KUBELET,
    REGULAR_POD_SHUTDOWN_GRACE_SECONDS,
    SHUTDOWN_GRACE_PERIOD_SECONDS,
    DisruptionError,
    Disruptor,
)
from tardigrade_local.nodefootprint import LEFTOVER_KINDS
from tardigrade_local.realnode import RealNode, sweep_orphans

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux") or os.geteuid() != 0,
                       reason="a real node needs Linux and root (namespaces, mounts, cgroups)"),
]

POD_TIMEOUT_SECONDS = 180.0
POD_GRACE_SECONDS = 10  # below the regular pods' 15 s: the pod's own grace applies
NOTHING_LEFT = {kind: [] for kind in LEFTOVER_KINDS}
# Traps SIGTERM the way a trainer does (save, then exit with EXIT_CODE), writing to its log.
TRAPPING_POD = """
trap 'echo SIGTERM received; sleep 1; echo saved; exit $EXIT_CODE' TERM
echo started
while true; do sleep 1; done
"""
EXIT_PREEMPTED_SAVED = 75  # the trainer's (tardigrade_contract.contract)
# Ignores SIGTERM and asks for more grace than a regular pod gets in a shutdown.
STUBBORN_POD = "trap 'echo SIGTERM ignored' TERM; echo started; while true; do sleep 1; done"
STUBBORN_GRACE_SECONDS = 60


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    sweep_orphans()
    state = tmp_path_factory.mktemp("realnode-shutdown") / "state"
    with LocalCluster(state, nodes=[], with_gcs=False, node_egress=True) as running:
        yield running


@pytest.fixture(scope="module")
def kube(cluster):
    return Kube(str(cluster.kubeconfig))


def trapping_pod(name: str, node: str, exit_code: int, script: str = TRAPPING_POD,
                 grace: int = POD_GRACE_SECONDS) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": {
        "restartPolicy": "Never", "nodeSelector": {"kubernetes.io/hostname": node},
        "terminationGracePeriodSeconds": grace,
        "containers": [{"name": "main", "image": nodeimage.BUSYBOX_IMAGE,
                        "imagePullPolicy": "Never", "command": ["sh", "-c", script],
                        "env": [{"name": "EXIT_CODE", "value": str(exit_code)}]}]}}


def container_log(node: RealNode, pod: str) -> str:
    """The container's log as the kubelet wrote it under the node's directory (the node is
    gone, so not through the API server)."""
    logs = sorted(node.pod_logs_dir.glob(f"default_{pod}_*/main/*.log"))
    assert logs, f"no log of {pod} under {node.pod_logs_dir}"
    return logs[-1].read_text()


def started(kube: Kube, pod: str) -> dict:
    def running() -> dict | None:
        found = kube.pod(pod)
        state = ((found or {}).get("status", {}).get("containerStatuses") or [{}])[0]
        return found if "running" in (state.get("state") or {}) else None

    return wait_for(running, POD_TIMEOUT_SECONDS, what=f"{pod}'s container running")


def ready(kube: Kube, node: str) -> dict:
    found = kube.plain(kube.core.read_node(node))
    return next(c for c in found["status"]["conditions"] if c["type"] == "Ready")


def test_a_shutdown_goes_through_the_kubelets_graceful_node_shutdown(
        cluster, kube, tmp_path_factory):
    node = RealNode.for_cluster(cluster.info, "real-node-1", tmp_path_factory.mktemp("node"))
    try:
        node.start()
        # The kubelet took its lock, so it found logind's InhibitDelayMaxUSec enough and did
        # not try to override it (which writes into /etc, then calls systemd).
        assert node.logind.holders() == [nodepower.KUBELET_LOCK_HOLDER]
        kubelet_log = (node.logs_dir / "kubelet.log").read_text()
        assert 'shutdownGracePeriodRequested="30s"' in kubelet_log
        assert "Failed to start node shutdown manager" not in kubelet_log
        # A trainer that saved on SIGTERM (exit 75), a pod that exits 0 on it, and one that
        # ignores it.
        kube.create_pod(trapping_pod("saved", node.name, EXIT_PREEMPTED_SAVED))
        kube.create_pod(trapping_pod("clean", node.name, 0))
        kube.create_pod(trapping_pod("stubborn", node.name, 0, script=STUBBORN_POD,
                                     grace=STUBBORN_GRACE_SECONDS))
        for name in ("saved", "clean", "stubborn"):
            started(kube, name)
            wait_for(lambda name=name: "started" in container_log(node, name),
                     POD_TIMEOUT_SECONDS, what=f"{name}'s first line")
        before = time.time()
        account = node.shutdown()
    finally:
        node.stop()
    # logind went on because the kubelet let go, not because the delay ran out.
    assert account["holders"] == [nodepower.KUBELET_LOCK_HOLDER]
    assert account["released"] is True, account
    assert account["still_held"] == []
    # The regular pods' share of the grace (30 s - 15 s for critical pods) ran out for the
    # stubborn pod; the critical pods' group, empty, is not waited for.
    assert account["seconds"] >= REGULAR_POD_SHUTDOWN_GRACE_SECONDS
    assert account["seconds"] < SHUTDOWN_GRACE_PERIOD_SECONDS
    # The machine is off: nothing of it is left on ours.
    assert node.leftovers() == NOTHING_LEFT

    # The kubelet reported the node not ready before it went.
    node_ready = ready(kube, node.name)
    assert node_ready["status"] == "False"
    assert node_ready["message"] == NODE_SHUTDOWN_NODE_MESSAGE

    # The kubelet's status function (nodeshutdown_manager.go, killPods) sets Failed, reason
    # Terminated, "unless it was already in a successful terminal phase": a pod whose
    # containers all exit 0 on SIGTERM ends Succeeded, without that reason and message, yet
    # with the condition: once the containers stopped, SyncTerminatingPod (kubelet.go) writes
    # generateAPIPodStatus's phase from their exit codes, which keeps the reason only for an
    # unchanged phase.
    for name, exit_code, phase, reason, message in (
            ("saved", EXIT_PREEMPTED_SAVED, "Failed", NODE_SHUTDOWN_REASON,
             NODE_SHUTDOWN_MESSAGE),
            ("clean", 0, "Succeeded", None, None)):
        pod = kube.pod(name)
        assert pod is not None
        assert pod["status"]["phase"] == phase, pod["status"]
        assert pod["status"].get("reason") == reason, pod["status"]
        assert pod["status"].get("message") == message, pod["status"]
        target = condition(pod, DISRUPTION_TARGET)
        assert target is not None and target["status"] == "True", pod["status"]
        assert target["reason"] == REASON_TERMINATION_BY_KUBELET
        assert target["message"] == NODE_SHUTDOWN_MESSAGE
        # The container got SIGTERM and ended on its own, within its grace.
        log = container_log(node, name)
        assert "SIGTERM received" in log and "saved" in log
        terminated = container_status(pod)["state"]["terminated"]
        assert terminated["exitCode"] == exit_code
        finished = datetime.fromisoformat(terminated["finishedAt"].replace("Z", "+00:00"))
        assert finished.timestamp() - before < min(POD_GRACE_SECONDS,
                                                   REGULAR_POD_SHUTDOWN_GRACE_SECONDS) + 1

    # A pod's own grace, when longer, is cut to its group's: logind went on after the regular
    # pods' 15 s (asserted above), not the pod's 60 s. The kubelet stops waiting for the group
    # then, and the machine powers off before the pod's last status can be sent: what the API
    # shows of it is a race (on GKE too, where the power-off follows the release closely), so
    # only its SIGTERM is asserted.
    assert "SIGTERM ignored" in container_log(node, "stubborn")


def test_a_halt_kills_everything_at_once_with_no_word_from_the_kubelet(
        cluster, kube, tmp_path_factory):
    node = RealNode.for_cluster(cluster.info, "real-node-2", tmp_path_factory.mktemp("node"),
                                index=2)
    try:
        node.start()
        kube.create_pod(trapping_pod("halted", node.name, EXIT_PREEMPTED_SAVED))
        started(kube, "halted")
        wait_for(lambda: "started" in container_log(node, "halted"), POD_TIMEOUT_SECONDS,
                 what="the pod's first line")
        assert node.leftovers()["processes"]
        node.halt()
        # Everything died at once: nothing is left the moment halt() returns.
        assert node.leftovers() == NOTHING_LEFT
    finally:
        node.stop()
    assert "SIGTERM" not in container_log(node, "halted")
    pod = kube.pod("halted")
    assert pod is not None
    # The API still believes what the kubelet last said: running, not disrupted.
    assert pod["status"]["phase"] == "Running"
    assert condition(pod, DISRUPTION_TARGET) is None
    assert ready(kube, node.name)["status"] == "True"


def test_gkes_spot_reclaim_of_a_real_node_is_its_shutdown_then_the_node_goes(
        cluster, kube, tmp_path_factory):
    disruptor = Disruptor(cluster.info["control_url"])
    node = RealNode.for_cluster(cluster.info, "real-node-3", tmp_path_factory.mktemp("node"),
                                index=3)
    try:
        node.start()
        kube.create_pod(trapping_pod("reclaimed", node.name, EXIT_PREEMPTED_SAVED))
        started(kube, "reclaimed")
        wait_for(lambda: "started" in container_log(node, "reclaimed"), POD_TIMEOUT_SECONDS,
                 what="the pod's first line")
        with pytest.raises(DisruptionError, match="replaceAfterSeconds"):
            disruptor.preempt_node(node.name, replace_after_seconds=5)
        disruptor.preempt_node(node.name, wait=True)
        # The cluster process powered the machine off: nothing of it is left on ours.
        assert node.leftovers() == NOTHING_LEFT
    finally:
        node.stop()
    # GKE's cloud node lifecycle controller deleted the Node of the VM that is gone.
    assert node.name not in kube.node_names()
    pod = kube.pod("reclaimed")
    assert pod is not None
    assert pod["status"]["phase"] == "Failed", pod["status"]
    assert condition(pod, DISRUPTION_TARGET)["reason"] == REASON_TERMINATION_BY_KUBELET
    assert "SIGTERM received" in container_log(node, "reclaimed")
