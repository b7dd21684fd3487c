"""End to end on real nodes: a VM stops without a shutdown under a training gang (the Node
object stays), and comes back later under its name; a node cut off from the control plane
while its pods train on. The chart's operator, real multi-process JAX trainers in the
trainer-cpu image on real kubelets; the VM's halt and the partition are GKE's part
(`RealNodeCluster.halt`, `RealNodeCluster.partition`; local_cluster/README.md, "Ungraceful
node loss")."""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import UTC, datetime

import pytest

from tests.e2e.harness import (
    NEEDS_REAL_NODES,
    InstalledOperator,
    RealCluster,
    real_cluster,
    wait_for,
)

pytestmark = [
    pytest.mark.slow,
    NEEDS_REAL_NODES,
]

# Fast node-loss detection: the kubelets renew a 4 s Lease every second (their
# nodeLeaseDurationSeconds); kube-controller-manager looks every second and marks a node whose
# Lease went unrenewed for 6 s Unknown (short, yet not so short that a real kubelet on a
# loaded 2-core machine flaps). The halted gang's pods tolerate the unreachable taint 5 s
# (their own toleration, not the 300 s kube-apiserver gives by default), so taint eviction
# comes within the test.
NODE_LEASE = 4
NODE_MONITOR_PERIOD = 1.0
NODE_MONITOR_GRACE = 6.0
TOLERATION_SECONDS = 5
NODE_LOST_AFTER = 10.0
# The surviving rank's SIGTERM grace (terminationGracePeriodSeconds): its save on notice
# cannot finish without the lost peer, and the relaunch waits for it to be gone.
POD_GRACE = 30.0
BACK_AFTER = 90.0
NODE_BACK_SECONDS = 300.0
# One trainer per spot node (a node has 2 CPUs): a gang of 2 has a spare node.
SPOT_NODES = 3
ONE_TRAINER = {"cpu": "1100m", "memory": "256Mi"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealCluster]:
    # Short: the kubelet's socket paths live under each node's directory.
    with real_cluster(tmp_path_factory.mktemp("loss"), SPOT_NODES,
                      node_lease_seconds=NODE_LEASE,
                      node_monitor_period_seconds=NODE_MONITOR_PERIOD,
                      node_monitor_grace_seconds=NODE_MONITOR_GRACE) as running:
        yield running


# Added to the chart's install (tests/e2e/conftest.py's `operator`).
OPERATOR_HELM_VALUES = (
    "--set", f"operator.nodeLostAfterSeconds={NODE_LOST_AFTER:g}",
)


@pytest.fixture(autouse=True)
def _one_job_at_a_time(cluster: RealCluster) -> Iterator[None]:
    yield
    cluster.clear_jobs()


def _ready_condition(cluster: RealCluster, node: str) -> object | None:
    try:
        conditions = cluster.core.read_node(node).status.conditions or []
    except Exception:  # not registered (yet)
        return None
    return next((c for c in conditions if c.type == "Ready"), None)


def _ready(cluster: RealCluster, node: str) -> str:
    condition = _ready_condition(cluster, node)
    return str(getattr(condition, "status", "Unknown"))


def _unknown_for(cluster: RealCluster, node: str) -> float:
    """How long the node has been Unknown, by its Ready condition's transition (0 if not)."""
    condition = _ready_condition(cluster, node)
    if getattr(condition, "status", None) != "Unknown":
        return 0.0
    since: datetime = condition.last_transition_time  # type: ignore[union-attr]
    return (datetime.now(UTC) - since).total_seconds()


def _unreachable_taints(cluster: RealCluster, node: str) -> set[str]:
    return {t.effect for t in cluster.core.read_node(node).spec.taints or []
            if t.key == "node.kubernetes.io/unreachable"}


def _evicted(cluster: RealCluster, pod: str) -> object | None:
    """The pod once kube-controller-manager's taint eviction deleted it (DisruptionTarget,
    DeletionByTaintManager), or None before."""
    found = cluster.core.read_namespaced_pod(pod, "default")
    conditions = {c.type: c for c in found.status.conditions or []}
    target = conditions.get("DisruptionTarget")
    if found.metadata.deletion_timestamp and target and target.reason == "DeletionByTaintManager":
        return found
    return None


def _one_per_node(cluster: RealCluster, name: str) -> None:
    nodes = [p.spec.node_name for p in cluster.pods(name)]
    assert len(set(nodes)) == len(nodes), nodes


def test_halted_vm_is_a_preemption_relaunched_without_waiting_for_its_pods(
        cluster: RealCluster, operator: InstalledOperator):
    name = "e2e-halt"
    # Long enough that the gang is still training when the VM halts, however late the status
    # shows the first commit on a loaded machine.
    job = cluster.trainingjob(name, steps=200)
    job["spec"]["resources"]["requests"] = dict(ONE_TRAINER)
    job["spec"]["checkpoint"]["interval"] = {"steps": 5}
    job["spec"]["podTemplate"]["tolerations"] = [{
        "key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute",
        "tolerationSeconds": TOLERATION_SECONDS}]
    cluster.apply(job)
    log = cluster.step_log(name)
    wait_for(lambda: (log.collect(), (cluster.status(name).get("lastCheckpoint") or {}).get(
        "step", 0) >= 5)[1], 300, "a committed checkpoint")
    _one_per_node(cluster, name)
    victim = next(p for p in cluster.pods(name) if p.metadata.labels["tardigrade.dev/rank"] == "1")
    node = cluster.spot_node_of(victim)
    halted = time.monotonic()
    cluster.real.halt(node, back_after_seconds=BACK_AFTER)

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
    # The VM came back under its name (a fresh disk): its kubelet registered with the Node
    # that stayed, which turns Ready and untainted. The evicted pod goes (the operator
    # force-deletes it once past its deletion deadline, or the returned kubelet, finding no
    # container of it, finishes its deletion).
    wait_for(lambda: _ready(cluster, node) == "True", NODE_BACK_SECONDS, "the VM back")
    wait_for(lambda: not _unreachable_taints(cluster, node), 60, "the taints lifted")
    wait_for(lambda: not any(p.metadata.name == victim.metadata.name
                             for p in cluster.pods(name)), 120, "the old pod to go")
    for step, losses in log.losses.items():
        assert max(losses) - min(losses) <= 1e-5 * max(1.0, abs(losses[0])), (step, losses)


def test_a_node_unknown_while_the_gang_trains_on_is_not_a_loss(
        cluster: RealCluster, operator: InstalledOperator):
    name = "e2e-flap"
    job = cluster.trainingjob(name, steps=1_000_000)  # trains for as long as the test looks
    job["spec"]["resources"]["requests"] = dict(ONE_TRAINER)
    job["spec"]["checkpoint"]["interval"] = {"steps": 1000}
    cluster.apply(job)
    cluster.wait_phase(name, {"Running"}, timeout=300)
    wait_for(lambda: (cluster.status(name).get("step") or 0) >= 5, 120, "training past step 5")
    _one_per_node(cluster, name)
    victim = next(p for p in cluster.pods(name) if p.metadata.labels["tardigrade.dev/rank"] == "1")
    node = cluster.spot_node_of(victim)
    # The node and the control plane are cut off from each other past the operator's
    # tolerance (the node Unknown longer than NODE_LOST_AFTER); the ranks still reach each
    # other and rank 0's step keeps advancing.
    cluster.real.partition(node)
    try:
        wait_for(lambda: _unknown_for(cluster, node) > NODE_LOST_AFTER + 3, 60,
                 "the node Unknown past the operator's tolerance")
        before = cluster.status(name)["step"]
    finally:
        cluster.real.heal(node)
    wait_for(lambda: _ready(cluster, node) == "True", 60, "the node back")
    wait_for(lambda: cluster.status(name)["step"] > before + 10, 60, "training on")
    status = cluster.status(name)
    operator.assert_alive()
    assert status["phase"] == "Running", status
    assert status["restarts"]["total"] == 0, status["recoveries"]
    assert status["attempt"] == 1
    assert {p.metadata.name for p in cluster.pods(name)} == {f"{name}-a1-0", f"{name}-a1-1"}
    cluster.kubectl("delete", "trainingjob", name, "--wait=false")
