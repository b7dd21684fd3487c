"""Ranks on nodes that stop reporting: ungraceful loss (relaunch without waiting for the API
to let go of the pods) and NotReady flaps (ridden out while the gang makes progress)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from tardigrade_contract import contract
from tardigrade_operator.observation.observed import DecisionSettings
from tardigrade_operator.observation.pods import not_ready_since

from tests.operator.fake_cluster import T0, FakeCluster, iso, spec

FINALIZER = "tardigrade.dev/gang-tracking"
LOST_AFTER = 60


def training(step: int = 100, checkpoint: int = 80) -> FakeCluster:
    """A 2-rank gang on node-0 and node-1, rank 0 reporting `step`, `checkpoint` committed."""
    cluster = FakeCluster(spec(), settings=DecisionSettings(
        node_lost_after=timedelta(seconds=LOST_AFTER)))
    cluster.reconcile()
    cluster.run_all()
    cluster.nodes_ready = {"node-0": True, "node-1": True}
    cluster.progress = contract.ProgressReport(step=step, checkpoint_step=checkpoint,
                                               checkpoint_path=f"gs://bucket/tiny/{checkpoint}")
    cluster.reconcile()
    assert cluster.status.phase == "Running"
    assert cluster.status.last_progress_time == cluster.now
    return cluster


def node_down(cluster: FakeCluster, node: str = "node-1") -> None:
    """What the node lifecycle controller writes after the node monitor grace period:
    Ready=Unknown, lastTransitionTime now."""
    cluster.nodes_ready = {**(cluster.nodes_ready or {}), node: False}
    cluster.nodes_not_ready_since = {**cluster.nodes_not_ready_since, node: cluster.now}


def run_for(cluster: FakeCluster, seconds: int, progressing: bool, every: int = 5) -> None:
    """Reconcile every `every` seconds; rank 0's step advances only while `progressing`."""
    for _ in range(seconds // every):
        cluster.advance(every)
        if progressing and cluster.progress is not None:
            cluster.progress = contract.ProgressReport(
                step=cluster.progress.step + 1, checkpoint_step=cluster.progress.checkpoint_step,
                checkpoint_path=cluster.progress.checkpoint_path)
        # Otherwise rank 0 serves the same step: rank 1 is gone and the collective hangs.
        cluster.reconcile()


# ------------------------------------------------------------------------- NotReady flaps ---


@pytest.mark.parametrize(
    ("down_seconds", "progressing", "lost"),
    [
        (10, True, False),  # kubelet restart: a few seconds NotReady, training goes on
        (LOST_AFTER - 5, False, False),  # not long enough yet, even with the gang stalled
        (LOST_AFTER + 60, True, False),  # partition from the control plane only: ranks train
        (LOST_AFTER, False, True),  # down past the tolerance and no progress: lost
        (LOST_AFTER + 60, False, True),
    ],
)
def test_not_ready_node_is_a_loss_only_past_the_tolerance_without_progress(
        down_seconds, progressing, lost):
    cluster = training()
    node_down(cluster)
    run_for(cluster, down_seconds, progressing)
    if lost:
        assert cluster.status.restarts.preemptions == 1
        assert cluster.status.restarts.failures == 0
        assert "tiny-a1-1: node node-1 not ready" in cluster.status.recoveries[-1].reason
    else:
        assert cluster.status.restarts.total == 0
        assert cluster.status.phase == "Running"
        assert all(not p["metadata"].get("deletionTimestamp") for p in cluster.pods.values())


def test_node_back_before_the_tolerance_leaves_the_gang_alone():
    cluster = training()
    node_down(cluster)
    run_for(cluster, LOST_AFTER - 10, progressing=False)
    cluster.nodes_ready = {"node-0": True, "node-1": True}  # kubelet posts Ready again
    cluster.nodes_not_ready_since = {}
    run_for(cluster, 2 * LOST_AFTER, progressing=True)
    assert cluster.status.restarts.total == 0
    assert cluster.status.phase == "Running"


def test_peer_crash_while_a_node_is_out_is_a_preemption_not_a_failure():
    cluster = training()
    node_down(cluster)
    cluster.advance(5)
    # Rank 0's collective to the unreachable rank fails: the trainer exits with an error.
    cluster.terminate(cluster.attempt_pods()[0], 1, "collective timed out")
    cluster.reconcile()
    assert cluster.status.restarts.preemptions == 1
    assert cluster.status.restarts.failures == 0
    assert "while tiny-a1-1: node node-1 not ready" in cluster.status.recoveries[-1].reason


def test_progress_time_moves_only_when_the_step_advances():
    cluster = training(step=100)
    first = cluster.status.last_progress_time
    cluster.advance(5)
    cluster.reconcile()  # same step served again
    assert cluster.status.last_progress_time == first
    cluster.advance(5)
    cluster.progress = contract.ProgressReport(step=101)
    cluster.reconcile()
    assert cluster.status.last_progress_time == T0 + timedelta(seconds=10)


# -------------------------------------------------------------------------- ungraceful loss ---


def lose_node_1() -> FakeCluster:
    """The VM under rank 1 stopped: node Unknown, rank 1 still Running in the API, rank 0
    stalled; the operator declares the loss and asks for both pods to go."""
    cluster = training(step=100, checkpoint=80)
    node_down(cluster)
    run_for(cluster, LOST_AFTER, progressing=False)
    assert cluster.status.phase == "Restarting"
    assert cluster.status.restarts.preemptions == 1
    return cluster


def test_relaunch_does_not_wait_for_pods_on_a_lost_node():
    cluster = lose_node_1()
    lost_at = cluster.now
    old = cluster.attempt_pods()
    # The healthy rank 0 stops on SIGTERM; rank 1's kubelet is gone: it stays Running and
    # Terminating, whatever the API server is asked.
    cluster.terminate(old[0], contract.EXIT_PREEMPTED_SAVED)
    cluster.advance(2)
    plan = cluster.reconcile()
    assert sorted(p["metadata"]["name"] for p in plan.create_pods) == ["tiny-a2-0", "tiny-a2-1"]
    assert "tiny-a1-1" in plan.release_pods
    assert cluster.status.attempt == 2
    assert cluster.status.recoveries[-1].restore_step == 80  # newest committed checkpoint
    assert cluster.status.restarts.failures == 0
    assert cluster.now - lost_at <= timedelta(seconds=5)
    env = next(p for p in plan.create_pods if p["metadata"]["name"] == "tiny-a2-0")
    assert any(e.get("value") == "80" for e in env["spec"]["containers"][0]["env"])


def test_pod_deleted_by_the_taint_manager_does_not_hold_the_relaunch():
    cluster = training(step=100, checkpoint=80)
    node_down(cluster)
    cluster.advance(300)  # default toleration of node.kubernetes.io/unreachable
    rank1 = cluster.attempt_pods()[1]
    cluster.disrupt(rank1, "DeletionByTaintManager")
    rank1["metadata"]["deletionTimestamp"] = iso(cluster.now + timedelta(seconds=30))
    cluster.reconcile()
    assert cluster.status.restarts.preemptions == 1
    cluster.terminate(cluster.attempt_pods()[0], contract.EXIT_PREEMPTED_SAVED)
    plan = cluster.reconcile()
    assert [p["metadata"]["name"] for p in plan.create_pods] == ["tiny-a2-0", "tiny-a2-1"]
    assert "tiny-a1-1" in plan.release_pods
    assert FINALIZER not in cluster.pods["tiny-a1-1"]["metadata"]["finalizers"]


def test_stuck_pod_of_an_old_attempt_is_released_and_forced_not_waited_for():
    cluster = lose_node_1()
    cluster.terminate(cluster.attempt_pods()[0], contract.EXIT_PREEMPTED_SAVED)
    cluster.reconcile()
    # The release patch was lost (operator restarted): the pod is tracked again.
    stuck = cluster.pods["tiny-a1-1"]
    stuck["metadata"]["finalizers"] = [FINALIZER]
    assert [p["metadata"]["name"] for p in cluster.attempt_pods(2)] == ["tiny-a2-0", "tiny-a2-1"]
    cluster.advance(90)
    plan = cluster.reconcile()
    assert "tiny-a1-1" in plan.release_pods
    assert ("tiny-a1-1", 0) in plan.delete_pods  # past its deadline: forced
    assert "tiny-a1-1" not in cluster.pods  # nothing keeps it now
    assert cluster.status.restarts.preemptions == 1  # counted once


def test_vm_back_under_the_same_name_reports_the_old_pod_failed_as_a_preemption():
    cluster = training()
    node_down(cluster)
    cluster.advance(20)
    cluster.reconcile()
    # The VM is recreated under its name before the tolerance: the kubelet registers Ready,
    # finds no container for the pod and reports it as the kubelet does for a container it
    # cannot locate.
    cluster.nodes_ready = {"node-0": True, "node-1": True}
    cluster.nodes_not_ready_since = {}
    cluster.terminate(cluster.attempt_pods()[1], 137, reason="ContainerStatusUnknown")
    cluster.reconcile()
    assert cluster.status.restarts.preemptions == 1
    assert cluster.status.restarts.failures == 0
    assert "ContainerStatusUnknown" in cluster.status.recoveries[-1].reason


def test_pods_on_a_healthy_node_are_still_waited_for():
    cluster = lose_node_1()
    # Rank 0 is still saving within its grace period: the relaunch waits for it.
    cluster.advance(2)
    plan = cluster.reconcile()
    assert plan.create_pods == []
    assert "tiny-a1-0" not in plan.release_pods


def test_not_ready_since_reads_the_newest_object_of_each_name():
    down = iso(T0)
    index = [
        ("node-a", [(5, False, down)]),
        ("node-b", [(3, False, down), (9, True, iso(T0 + timedelta(seconds=40)))]),
        ("node-c", [(4, True, down)]),
        ("node-d", [(2, False, "")]),  # no lastTransitionTime: unknown, not "now"
    ]
    assert not_ready_since(index) == {"node-a": T0}


def test_without_node_access_a_pod_never_confirmed_deleted_is_given_up():
    """A namespaced install sees no nodes: the taint manager's deletion (300 s after the node
    went Unknown) is the first sign, and the pod then stays Terminating for good."""
    cluster = training(step=100, checkpoint=80)
    cluster.nodes_ready = None
    rank1 = cluster.attempt_pods()[1]
    cluster.disrupt(rank1, "DeletionByTaintManager")
    rank1["metadata"]["deletionTimestamp"] = iso(cluster.now)
    cluster.reconcile()
    cluster.terminate(cluster.attempt_pods()[0], contract.EXIT_PREEMPTED_SAVED)
    cluster.advance(20)
    assert cluster.reconcile().create_pods == []  # may still be stopping: wait
    cluster.advance(20)
    plan = cluster.reconcile()
    assert [p["metadata"]["name"] for p in plan.create_pods] == ["tiny-a2-0", "tiny-a2-1"]
    assert "tiny-a1-1" in plan.release_pods
    assert cluster.status.restarts.preemptions == 1
