"""The decision function, scenario by scenario, without a server."""

from __future__ import annotations

from datetime import timedelta

import pytest
from tardigrade_contract import contract
from tardigrade_operator.decision.decide import decide
from tardigrade_operator.observation.observed import DecisionSettings
from tardigrade_operator.observation.pods import nodes_shutting_down

from tests.operator.fake_cluster import FakeCluster, pod_env, spec

SAVED = contract.EXIT_PREEMPTED_SAVED


def launched(cluster: FakeCluster) -> FakeCluster:
    cluster.reconcile()
    cluster.run_all()
    cluster.reconcile()
    assert cluster.status.phase == "Running"
    return cluster


def test_first_launch_creates_service_and_gang():
    cluster = FakeCluster(spec())
    plan = cluster.reconcile()
    assert plan.create_service["spec"]["clusterIP"] == "None"
    assert [p["metadata"]["name"] for p in plan.create_pods] == ["tiny-a1-0", "tiny-a1-1"]
    assert cluster.status.phase == "Pending"
    assert (cluster.status.attempt, cluster.status.replicas) == (1, 2)
    assert cluster.status.selector == "tardigrade.dev/job=tiny"
    env = pod_env(plan.create_pods[1])
    assert env[contract.ENV_RESTORE_STEP] == contract.RESTORE_LATEST
    assert env[contract.ENV_PROCESS_ID] == "1"
    assert env[contract.ENV_COORDINATOR_ADDRESS] == "tiny-a1-0.tiny:8476"


def test_reconcile_is_idempotent():
    cluster = FakeCluster(spec())
    cluster.reconcile()
    again = cluster.reconcile()
    assert again.create_pods == [] and again.create_service is None
    assert cluster.status.attempt == 1


def test_running_gang_reports_running_with_progress():
    cluster = launched(FakeCluster(spec()))
    cluster.progress = contract.ProgressReport(step=12, loss=3.5, checkpoint_step=10,
                                               checkpoint_path="gs://bucket/tiny/10")
    cluster.reconcile()
    assert cluster.status.step == 12
    assert cluster.status.loss == 3.5
    assert cluster.status.last_checkpoint.step == 10
    assert any(e.reason == "Running" for e in cluster.plans[1].events)


def test_preemption_stops_the_gang_and_relaunches_from_the_coordinated_save():
    cluster = launched(FakeCluster(spec()))
    cluster.progress = contract.ProgressReport(step=30, checkpoint_step=20)
    victim = cluster.attempt_pods()[0]
    cluster.disrupt(victim)
    plan = cluster.reconcile()
    # Both ranks get SIGTERM at once so they save at the same step.
    assert sorted(name for name, _ in plan.delete_pods) == ["tiny-a1-0", "tiny-a1-1"]
    assert cluster.status.phase == "Restarting"
    assert cluster.status.restarts.preemptions == 1
    assert cluster.status.restarts.failures == 0
    assert cluster.status.recoveries[-1].cause == "Preemption"
    assert "TerminationByKubelet" in cluster.status.recoveries[-1].reason

    waiting = cluster.reconcile()  # still saving: nothing new
    assert waiting.create_pods == [] and cluster.status.restarts.preemptions == 1

    cluster.advance(5)
    cluster.terminate_all(SAVED, step=31, checkpoint=31)
    plan = cluster.reconcile()
    assert [p["metadata"]["name"] for p in plan.create_pods] == ["tiny-a2-0", "tiny-a2-1"]
    env = pod_env(plan.create_pods[0])
    assert env[contract.ENV_RESTORE_STEP] == "31"
    recovery = cluster.status.recoveries[-1]
    assert (recovery.restore_step, recovery.steps_lost) == (31, 0)
    assert cluster.status.last_checkpoint.step == 31

    # The old gang's pods were released once their saved step was recorded, and are gone.
    assert sorted(cluster.pods) == ["tiny-a2-0", "tiny-a2-1"]

    cluster.run_all()
    cluster.advance(7)
    cluster.progress = contract.ProgressReport(step=32)
    cluster.reconcile()
    assert cluster.status.phase == "Running"
    assert cluster.status.recoveries[-1].downtime_seconds == 12


@pytest.mark.parametrize(
    ("pod_status", "description"),
    [
        # The eviction manager stops a running pod: its container ran (pkg/kubelet/eviction).
        ({"reason": "Evicted", "phase": "Failed",
          "message": "The node was low on resource: memory.",
          "containerStatuses": [{"name": "trainer", "state": {"terminated": {
              "exitCode": 137, "reason": "Error"}}}]}, "evicted"),
        ({"phase": "Unknown"}, "node unreachable"),
        ({"phase": "Failed", "reason": "Terminated"}, "GKE node shutdown"),
    ],
)
def test_other_disruptions_count_as_preemptions(pod_status, description):
    cluster = launched(FakeCluster(spec()))
    cluster.attempt_pods()[1]["status"] = pod_status
    cluster.reconcile()
    assert cluster.status.restarts.preemptions == 1, description
    assert cluster.status.restarts.failures == 0


def test_a_node_shutting_down_stops_the_gang_at_once_before_any_pod_says_so():
    """A spot reclaim as kube-apiserver shows it: the kubelet marks its Node Ready=False,
    "node is shutting down", and SIGTERMs its pods; their DisruptionTarget comes only with
    their terminal phase. The other ranks must get their SIGTERM now, while the reclaimed
    ranks can still save with them."""
    cluster = launched(FakeCluster(spec()))
    cluster.progress = contract.ProgressReport(step=30, checkpoint_step=20)
    cluster.nodes_ready = {"node-0": True, "node-1": False}
    cluster.nodes_shutting_down = frozenset({"node-1"})
    plan = cluster.reconcile()
    assert sorted(name for name, _ in plan.delete_pods) == ["tiny-a1-0", "tiny-a1-1"]
    assert cluster.status.restarts.preemptions == 1 and cluster.status.restarts.failures == 0
    assert cluster.status.recoveries[-1].reason == "tiny-a1-1: NodeShutdown"


def test_the_shutdown_notice_comes_from_the_ready_condition_of_the_newest_node_object():
    since = "2026-01-01T00:00:00Z"
    index = [("node-a", [(10, True, "", False), (20, False, since, True)]),
             ("node-b", [(30, False, since, True), (40, True, "", False)]),
             ("node-c", [(50, False, since, False)])]  # not Ready for another reason
    assert nodes_shutting_down(index) == {"node-a"}


def test_node_not_ready_counts_as_preemption():
    cluster = launched(FakeCluster(spec()))
    cluster.nodes_ready = {"node-0": True, "node-1": False}
    cluster.reconcile()
    assert cluster.status.restarts.preemptions == 1
    assert "node node-1 not ready" in cluster.status.recoveries[-1].reason


def test_node_the_index_has_not_seen_yet_is_not_lost():
    cluster = launched(FakeCluster(spec()))
    cluster.nodes_ready = {"node-0": True}  # node-1 is newer than the operator's index
    cluster.reconcile()
    assert cluster.status.restarts.total == 0
    assert cluster.status.phase == "Running"


def test_vanished_pod_of_a_running_gang_counts_as_preemption():
    cluster = launched(FakeCluster(spec()))
    del cluster.pods["tiny-a1-1"]
    cluster.reconcile()
    assert cluster.status.restarts.preemptions == 1


def test_saved_and_preempted_exit_code_is_a_preemption():
    cluster = launched(FakeCluster(spec()))
    cluster.terminate(cluster.attempt_pods()[0], SAVED)
    cluster.reconcile()
    assert cluster.status.restarts.preemptions == 1


def test_retryable_exit_codes_do_not_use_the_failure_budget():
    cluster = launched(FakeCluster(spec(failurePolicy={"retryableExitCodes": [42]})))
    cluster.terminate(cluster.attempt_pods()[0], 42)
    cluster.reconcile()
    assert cluster.status.restarts.retries == 1
    assert cluster.status.restarts.failures == 0
    assert cluster.status.recoveries[-1].cause == "Retry"


def test_crash_restarts_with_exponential_backoff_then_fails_with_the_logs():
    cluster = launched(FakeCluster(spec()))
    for failures in (1, 2):
        cluster.terminate(cluster.attempt_pods()[0], 1, "Traceback...\nValueError: boom")
        cluster.reconcile()
        assert cluster.status.restarts.failures == failures
        cluster.terminate_all(143)
        plan = cluster.reconcile()
        assert plan.create_pods == [], "must wait for the backoff"
        assert cluster.status.phase == "Restarting"
        backoff = 10 * 2 ** (failures - 1)
        cluster.advance(backoff - 1)
        assert cluster.reconcile().create_pods == []
        cluster.advance(1)
        assert len(cluster.reconcile().create_pods) == 2
        cluster.run_all()
        cluster.reconcile()
    cluster.terminate(cluster.attempt_pods()[1], 1, "Traceback...\nValueError: boom")
    plan = cluster.reconcile()
    assert cluster.status.phase == "Failed"
    assert "maxRestarts=2" in cluster.status.message
    assert "ValueError: boom" in cluster.status.message
    assert any(e.reason == "RestartBudgetExhausted" for e in plan.events)
    assert [c.status for c in cluster.status.conditions if c.type == "Failed"] == ["True"]
    # Terminal: nothing is launched again.
    assert cluster.reconcile().create_pods == []


def test_a_crash_after_a_peer_was_preempted_is_blamed_on_the_preemption():
    cluster = launched(FakeCluster(spec()))
    first, second = cluster.attempt_pods()
    cluster.disrupt(first)
    cluster.terminate(second, 1, "collective failed: peer gone")
    cluster.reconcile()
    assert (cluster.status.restarts.preemptions, cluster.status.restarts.failures) == (1, 0)


def test_preemption_budget():
    cluster = launched(FakeCluster(spec(failurePolicy={"maxPreemptions": 1})))
    cluster.disrupt(cluster.attempt_pods()[0])
    cluster.reconcile()
    cluster.terminate_all(SAVED, step=5, checkpoint=5)
    cluster.reconcile()
    cluster.run_all()
    cluster.reconcile()
    cluster.disrupt(cluster.attempt_pods()[0])
    cluster.reconcile()
    assert cluster.status.phase == "Failed"
    assert "maxPreemptions=1" in cluster.status.message


def test_success_when_every_rank_finishes():
    cluster = launched(FakeCluster(spec()))
    cluster.terminate(cluster.attempt_pods()[0], 0)
    cluster.reconcile()
    assert cluster.status.phase == "Running", "wait for every rank"
    cluster.terminate_all(0, step=200, checkpoint=200)
    plan = cluster.reconcile()
    assert cluster.status.phase == "Succeeded"
    assert cluster.status.completion_time == cluster.now
    assert cluster.status.step == 200
    assert any(e.reason == "Completed" for e in plan.events)
    assert [c.status for c in cluster.status.conditions if c.type == "Succeeded"] == ["True"]


def test_scale_up_and_down_relaunch_with_the_new_count():
    cluster = launched(FakeCluster(spec(maxReplicas=4)))
    for new_count in (3, 1):
        cluster.spec["replicas"] = new_count
        cluster.generation += 1
        cluster.reconcile()
        assert cluster.status.phase == "Resizing"
        cluster.terminate_all(SAVED, step=40, checkpoint=40)
        plan = cluster.reconcile()
        assert len(plan.create_pods) == new_count
        env = pod_env(plan.create_pods[0])
        assert env[contract.ENV_NUM_PROCESSES] == str(new_count)
        assert env[contract.ENV_RESTORE_STEP] == "40"
        cluster.run_all()
        cluster.reconcile()
        assert cluster.status.phase == "Running"
        assert cluster.status.replicas == new_count
    assert cluster.status.restarts.resizes == 2
    assert cluster.status.restarts.failures == 0
    assert cluster.status.observed_generation == 3


def test_suspend_and_resume():
    cluster = launched(FakeCluster(spec()))
    cluster.spec["suspend"] = True
    plan = cluster.reconcile()
    assert len(plan.delete_pods) == 2 and cluster.status.phase == "Suspended"
    cluster.terminate_all(SAVED, step=9, checkpoint=9)
    assert cluster.reconcile().create_pods == []
    cluster.spec["suspend"] = False
    plan = cluster.reconcile()
    assert len(plan.create_pods) == 2
    assert cluster.status.recoveries[-1].cause == "Resume"
    assert cluster.status.restarts.total == 0


def test_suspended_from_the_start_launches_nothing():
    cluster = FakeCluster(spec(suspend=True))
    assert cluster.reconcile().create_pods == []
    assert cluster.status.phase == "Suspended"


def test_invalid_spec_fails_with_the_field_named():
    cluster = FakeCluster(spec(replicas=0))
    plan = cluster.reconcile()
    assert plan.create_pods == []
    assert cluster.status.phase == "Failed"
    assert "spec.replicas" in cluster.status.message
    assert [c.reason for c in cluster.status.conditions if c.type == "Failed"] == ["InvalidSpec"]


def test_lost_status_write_adopts_the_newer_attempt():
    cluster = launched(FakeCluster(spec()))
    stale = cluster.status.model_copy(deep=True)
    cluster.disrupt(cluster.attempt_pods()[0])
    cluster.reconcile()
    cluster.terminate_all(SAVED, step=3, checkpoint=3)
    cluster.reconcile()  # attempt 2 created
    cluster.status = stale  # the status write of attempt 2 was lost
    plan = cluster.reconcile()
    assert cluster.status.attempt == 2
    assert plan.create_pods == []


def test_half_created_gang_is_completed_not_counted():
    cluster = FakeCluster(spec(replicas=3))
    cluster.reconcile()
    del cluster.pods["tiny-a1-2"]  # the operator died between two creates
    plan = cluster.reconcile()
    assert [p["metadata"]["name"] for p in plan.create_pods] == ["tiny-a1-2"]
    assert cluster.status.restarts.total == 0


def test_stuck_terminating_pod_is_forced():
    cluster = launched(FakeCluster(spec()))
    cluster.disrupt(cluster.attempt_pods()[0])
    cluster.reconcile()
    cluster.advance(30 + 31)
    plan = cluster.reconcile()
    assert sorted(plan.delete_pods) == [("tiny-a1-0", 0), ("tiny-a1-1", 0)]


def test_shrinks_when_capacity_is_short_and_grows_back_later():
    settings = DecisionSettings(unschedulable_timeout=timedelta(seconds=60),
                                grow_back_after=timedelta(seconds=300))
    cluster = FakeCluster(spec(replicas=3, minReplicas=1), settings=settings)
    cluster.reconcile()
    pods = cluster.attempt_pods()
    for index, pod in enumerate(pods[:2]):
        pod["spec"]["nodeName"] = f"node-{index}"
        pod["status"] = {"phase": "Running",
                         "containerStatuses": [{"name": "trainer", "state": {"running": {}}}]}
    pods[2]["status"]["conditions"] = [{"type": "PodScheduled", "status": "False",
                                        "reason": "Unschedulable",
                                        "lastTransitionTime": "2026-12-02T12:00:00Z"}]
    cluster.advance(59)
    cluster.reconcile()
    assert cluster.status.phase == "Pending"
    cluster.advance(1)
    cluster.reconcile()
    assert cluster.status.phase == "Resizing"
    assert cluster.status.recoveries[-1].to_replicas == 2
    cluster.terminate_all(SAVED, step=4, checkpoint=4)
    plan = cluster.reconcile()
    assert len(plan.create_pods) == 2
    cluster.run_all()
    cluster.reconcile()
    assert (cluster.status.phase, cluster.status.replicas) == ("Running", 2)
    assert cluster.reconcile().delete_pods == [], "running short on purpose is not a resize"
    cluster.advance(300)
    cluster.reconcile()
    assert cluster.status.phase == "Resizing"
    assert cluster.status.recoveries[-1].to_replicas == 3


@pytest.mark.parametrize("code", [contract.EXIT_CONFIG_ERROR, contract.EXIT_CHECKPOINT_CORRUPT])
def test_a_spec_the_trainer_cannot_run_fails_at_once(code):
    cluster = launched(FakeCluster(spec()))
    message = contract.TerminationMessage(
        reason="ConfigError", message="global_batch_size=16 cannot be split evenly").to_json()
    cluster.terminate(cluster.attempt_pods()[1], code, message)
    plan = cluster.reconcile()
    assert cluster.status.phase == "Failed"
    assert cluster.status.restarts.failures == 0
    assert "global_batch_size=16 cannot be split evenly" in cluster.status.message
    assert any(e.reason == "CannotRun" for e in plan.events)


def _partial_launch(cluster: FakeCluster, created: int) -> None:
    """Apply the next plan as an operator killed after creating `created` of its pods."""
    plan = decide(cluster.observe())
    cluster.status = plan.status  # the status is written first
    for pod in plan.create_pods[:created]:
        cluster.pods[pod["metadata"]["name"]] = {**pod, "status": {"phase": "Pending"}}


@pytest.mark.parametrize("created", [0, 1, 2])
def test_a_relaunch_cut_short_is_finished_not_counted(created):
    cluster = launched(FakeCluster(spec(replicas=3)))
    cluster.disrupt(cluster.attempt_pods()[0])
    cluster.reconcile()
    cluster.terminate_all(SAVED, step=31, checkpoint=31)
    _partial_launch(cluster, created)
    cluster.run_all()  # the ranks that exist start training before the operator is back
    plan = cluster.reconcile()
    assert sorted(p["metadata"]["name"] for p in plan.create_pods) == [
        f"tiny-a2-{rank}" for rank in range(created, 3)]
    assert plan.delete_pods == []
    assert cluster.status.restarts.preemptions == 1 and cluster.status.restarts.total == 1
    assert [r.cause for r in cluster.status.recoveries] == ["Preemption"]
    cluster.run_all()
    cluster.reconcile()
    assert (cluster.status.phase, cluster.status.attempt) == ("Running", 2)
    assert cluster.status.restarts.total == 1


def test_a_first_launch_cut_short_with_a_rank_running_is_finished():
    cluster = FakeCluster(spec())
    _partial_launch(cluster, 1)
    cluster.run_all()
    plan = cluster.reconcile()
    assert [p["metadata"]["name"] for p in plan.create_pods] == ["tiny-a1-1"]
    assert cluster.status.restarts.total == 0 and cluster.status.recoveries == []


def test_a_rank_that_vanishes_after_the_launch_was_seen_is_a_preemption():
    cluster = launched(FakeCluster(spec()))
    del cluster.pods["tiny-a1-1"]  # e.g. its finalizer stripped by hand, then deleted
    plan = cluster.reconcile()
    assert plan.create_pods == []
    assert cluster.status.restarts.preemptions == 1
    assert cluster.status.recoveries[-1].reason == "tiny-a1-1: gone"


def test_a_deleted_pod_that_never_got_a_node_does_not_hold_up_the_relaunch():
    settings = DecisionSettings(unschedulable_timeout=timedelta(seconds=60))
    cluster = FakeCluster(spec(replicas=3, minReplicas=2), settings=settings)
    cluster.reconcile()
    cluster.run_all()
    stuck = cluster.attempt_pods()[2]
    stuck["spec"].pop("nodeName")
    stuck["status"] = {"phase": "Pending", "conditions": [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
         "lastTransitionTime": "2026-12-02T12:00:00Z"}]}
    cluster.advance(60)
    plan = cluster.reconcile()
    assert cluster.status.phase == "Resizing"
    assert "tiny-a1-2" in [name for name, _ in plan.delete_pods]
    # The two that ran save and exit; the third stays Pending, deleted: no kubelet ever
    # reports on it, and nothing of it needs recording.
    for pod in cluster.attempt_pods()[:2]:
        cluster.terminate(pod, SAVED, contract.TerminationMessage(
            reason="PreemptedSaved", step=7, checkpoint_step=7).to_json())
    assert cluster.pods["tiny-a1-2"]["status"]["phase"] == "Pending"
    plan = cluster.reconcile()
    assert "tiny-a1-2" in plan.release_pods
    assert [p["metadata"]["name"] for p in plan.create_pods] == ["tiny-a2-0", "tiny-a2-1"]
    assert cluster.status.restarts.resizes == 1 and cluster.status.restarts.total == 1
