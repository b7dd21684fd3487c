"""End to end: a VM stops without a shutdown under a training gang (the Node object stays),
and comes back later under its name. Real operator, real multi-process JAX trainers."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from tardigrade_local.cluster import LocalCluster

from tests.e2e.harness import Cluster, OperatorProcess, running_operator, trainingjob, wait_for

pytestmark = pytest.mark.slow

# Fast node-loss detection, set on the components (local_cluster/README.md, "The control
# plane"): the kubelets renew a 2 s Lease every 0.5 s; kube-controller-manager looks every
# 0.5 s and marks a node whose Lease went unrenewed for 3 s Unknown. The halted gang's pods
# tolerate the unreachable taint 5 s (their own toleration, not the 300 s kube-apiserver
# gives by default), so taint eviction comes within the test.
NODE_LEASE = 2.0
NODE_MONITOR_PERIOD = 0.5
NODE_MONITOR_GRACE = 3.0
TOLERATION_SECONDS = 5
NODE_LOST_AFTER = 8.0
# The surviving rank's SIGTERM grace (terminationGracePeriodSeconds): its save on notice
# cannot finish without the frozen peer, and the relaunch waits for it to be gone.
POD_GRACE = 30.0
BACK_AFTER = 90.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("nodeloss")
    with LocalCluster(root / "cluster", nodes=3, node_lease_seconds=NODE_LEASE,
                      node_monitor_period_seconds=NODE_MONITOR_PERIOD,
                      node_monitor_grace_seconds=NODE_MONITOR_GRACE) as local:
        yield Cluster(local)


@pytest.fixture(scope="module")
def operator(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[OperatorProcess]:
    with running_operator(cluster, tmp_path_factory.mktemp("operator"),
                          env={"TARDIGRADE_NODE_LOST_AFTER_SECONDS": f"{NODE_LOST_AFTER:g}"}
                          ) as process:
        yield process


def _ready(cluster: Cluster, node: str) -> str:
    conditions = cluster.core.read_node(node).status.conditions or []
    return next((c.status for c in conditions if c.type == "Ready"), "Unknown")


def _unreachable_taints(cluster: Cluster, node: str) -> set[str]:
    return {t.effect for t in cluster.core.read_node(node).spec.taints or []
            if t.key == "node.kubernetes.io/unreachable"}


def _evicted(cluster: Cluster, pod: str) -> object | None:
    """The pod once kube-controller-manager's taint eviction deleted it (DisruptionTarget,
    DeletionByTaintManager), or None before."""
    found = cluster.core.read_namespaced_pod(pod, "default")
    conditions = {c.type: c for c in found.status.conditions or []}
    target = conditions.get("DisruptionTarget")
    if found.metadata.deletion_timestamp and target and target.reason == "DeletionByTaintManager":
        return found
    return None


def test_halted_vm_is_a_preemption_relaunched_without_waiting_for_its_pods(
        cluster: Cluster, operator: OperatorProcess):
    name = "e2e-halt"
    # Long enough that the gang is still training when the VM halts, however late the status
    # shows the first commit on a loaded machine.
    job = trainingjob(name, steps=200)
    job["spec"]["checkpoint"]["interval"] = {"steps": 5}
    job["spec"].setdefault("podTemplate", {})["tolerations"] = [{
        "key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute",
        "tolerationSeconds": TOLERATION_SECONDS}]
    cluster.apply(job)
    log = cluster.step_log(name)
    wait_for(lambda: (log.collect(), (cluster.status(name).get("lastCheckpoint") or {}).get(
        "step", 0) >= 5)[1], 300, "a committed checkpoint")
    victim = next(p for p in cluster.pods(name) if p.metadata.labels["tardigrade.dev/rank"] == "1")
    node = victim.spec.node_name
    halted = time.monotonic()
    cluster.local.halt_node(node, back_after_seconds=BACK_AFTER)

    def relaunched() -> dict | None:
        log.collect()
        status = cluster.status(name)
        return status if status.get("attempt", 0) >= 2 else None

    status = wait_for(relaunched, 120, "the relaunch")
    # Bounded: the node monitor grace, the operator's tolerance, the survivor's grace, a few
    # passes; not the VM's return.
    assert time.monotonic() - halted < NODE_MONITOR_GRACE + NODE_LOST_AFTER + POD_GRACE + 20
    # What the real controllers did meanwhile: the node Unknown, tainted unreachable (both
    # effects), and the victim deleted by taint eviction at its toleration's end. No kubelet
    # confirms that deletion: the API still says Running, Terminating.
    assert _ready(cluster, node) == "Unknown"
    wait_for(lambda: _unreachable_taints(cluster, node) == {"NoSchedule", "NoExecute"}, 30,
             "the node lifecycle controller's unreachable taints")
    old = wait_for(lambda: _evicted(cluster, victim.metadata.name), 60, "taint eviction")
    assert old.status.phase == "Running"  # nobody reported otherwise
    assert "tardigrade.dev/gang-tracking" not in (old.metadata.finalizers or [])
    recovery = status["recoveries"][-1]
    assert recovery["cause"] == "Preemption", recovery
    # Whichever came first: the operator giving up on the node (its NODE_LOST_AFTER) or the
    # taint eviction of the victim (its toleration): both are the loss of that node.
    assert (f"node {node} not ready" in recovery["reason"]
            or recovery["reason"] == f"{victim.metadata.name}: DeletionByTaintManager"), recovery

    status = cluster.wait_phase(name, {"Succeeded"}, timeout=600, collector=log)
    operator.assert_alive()
    assert status["restarts"]["preemptions"] == 1, status["recoveries"]
    assert status["restarts"]["failures"] == 0
    # No save on notice here: the operator pins the newest commit it has seen (progress reads
    # are paced, so it can lag), and the trainer restores the newest commit at or after it.
    assert len(log.restored) == 1 and log.restored[0] >= status["recoveries"][-1]["restoreStep"]
    # The VM came back under its name; its kubelet reported the old pod, which then went.
    wait_for(lambda: _ready(cluster, node) == "True", 120, "the VM back")
    wait_for(lambda: not any(p.metadata.name == victim.metadata.name
                             for p in cluster.pods(name)), 120, "the old pod to go")
    for step, losses in log.losses.items():
        assert max(losses) - min(losses) <= 1e-5 * max(1.0, abs(losses[0])), (step, losses)


def test_a_node_unknown_while_the_gang_trains_on_is_not_a_loss(
        cluster: Cluster, operator: OperatorProcess):
    name = "e2e-flap"
    job = trainingjob(name, steps=1_000_000)  # trains for as long as the test looks
    job["spec"]["checkpoint"]["interval"] = {"steps": 1000}
    cluster.apply(job)
    cluster.wait_phase(name, {"Running"}, timeout=300)
    wait_for(lambda: (cluster.status(name).get("step") or 0) >= 5, 120, "training past step 5")
    victim = next(p for p in cluster.pods(name) if p.metadata.labels["tardigrade.dev/rank"] == "1")
    node = victim.spec.node_name
    # The kubelet is cut off from the control plane past the operator's tolerance; the ranks
    # still reach each other and rank 0's step keeps advancing.
    cluster.local.partition_node(node, NODE_MONITOR_GRACE + NODE_LOST_AFTER + 6)
    wait_for(lambda: _ready(cluster, node) == "Unknown", 30, "the node Unknown")
    before = cluster.status(name)["step"]
    wait_for(lambda: _ready(cluster, node) == "True", 60, "the node back")
    wait_for(lambda: cluster.status(name)["step"] > before + 10, 60, "training on")
    status = cluster.status(name)
    operator.assert_alive()
    assert status["phase"] == "Running", status
    assert status["restarts"]["total"] == 0, status["recoveries"]
    assert status["attempt"] == 1
    assert {p.metadata.name for p in cluster.pods(name)} == {f"{name}-a1-0", f"{name}-a1-1"}
    cluster.kubectl("delete", "trainingjob", name, "--wait=false")
