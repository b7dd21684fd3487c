"""Retryable exits and kubelet admission rejections: their own budget and backoff, never a
tight relaunch loop, never charged to maxRestarts."""

from __future__ import annotations

import re
from typing import Any

import pytest
from tardigrade_contract import contract
from tardigrade_operator.api.parse import parse_spec

from tests.operator.fake_cluster import FakeCluster, spec

OOM = 137
GPU_REJECTION = {
    "phase": "Failed", "reason": "OutOfnvidia.com/gpu",
    "message": "Pod was rejected: Node didn't have enough resource: nvidia.com/gpu, "
               "requested: 8, used: 8, capacity: 8",
}


def running(cluster: FakeCluster) -> FakeCluster:
    cluster.run_all()
    cluster.reconcile()
    assert cluster.status.phase == "Running"
    return cluster


def stop_the_rest(cluster: FakeCluster) -> None:
    """The ranks the operator stopped exit on SIGTERM."""
    for pod in cluster.attempt_pods():
        if pod["status"].get("phase") not in ("Succeeded", "Failed"):
            cluster.terminate(pod, 143)


def relaunch_wait(cluster: FakeCluster) -> int:
    """Seconds from the disruption until the operator creates the next gang (1 s resolution)."""
    attempt = cluster.status.attempt
    for waited in range(0, 3600):
        if cluster.reconcile().create_pods:
            assert cluster.status.attempt == attempt + 1
            return waited
        assert cluster.status.phase == "Restarting"
        cluster.advance(1)
    raise AssertionError("never relaunched")


def oom(cluster: FakeCluster) -> None:
    cluster.terminate(cluster.attempt_pods()[0], OOM, reason="OOMKilled")


def reject(cluster: FakeCluster, status: dict[str, Any] = GPU_REJECTION) -> None:
    cluster.attempt_pods()[1]["status"] = dict(status)


def test_retryable_exits_back_off_exponentially_then_end_the_job_stalled():
    cluster = FakeCluster(spec(failurePolicy={
        "maxRestarts": 0, "retryableExitCodes": [OOM], "maxRetries": 4,
        "retryBackoffSeconds": 10, "maxRetryBackoffSeconds": 50}))
    cluster.reconcile()
    # (retries so far, expected wait): 10 s doubling, capped at maxRetryBackoffSeconds.
    for retries, wait in [(1, 10), (2, 20), (3, 40), (4, 50)]:
        running(cluster)
        oom(cluster)
        cluster.reconcile()
        assert cluster.status.restarts.retries == retries
        assert cluster.status.restarts.consecutive_retries == retries
        assert cluster.status.restarts.failures == 0
        assert cluster.status.recoveries[-1].cause == "Retry"
        stop_the_rest(cluster)
        assert relaunch_wait(cluster) == wait
        backoff = next(c for c in cluster.plans[-2].status.conditions if c.type == "Running")
        assert backoff.reason == "BackOff"
        assert "restarting after a retryable exit" in backoff.message
    running(cluster)
    oom(cluster)
    plan = cluster.reconcile()
    assert cluster.status.phase == "Failed"
    conditions = {c.type: c for c in cluster.status.conditions}
    assert conditions["Stalled"].status == "True"
    assert conditions["Stalled"].reason == "RetryBudgetExhausted"
    assert "failurePolicy.maxRetries=4" in cluster.status.message
    assert "exit code 137 (retryable)" in cluster.status.message
    assert any(e.reason == "RetryBudgetExhausted" for e in plan.events)
    assert cluster.status.restarts.retries == 4
    stop_the_rest(cluster)
    assert cluster.reconcile().create_pods == []


@pytest.mark.parametrize(("healthy_seconds", "ends"), [(600, False), (599, True)])
def test_a_gang_that_ran_for_the_reset_period_clears_the_retry_streak(healthy_seconds, ends):
    cluster = FakeCluster(spec(failurePolicy={"retryableExitCodes": [OOM], "maxRetries": 1}))
    cluster.reconcile()
    running(cluster)
    oom(cluster)
    cluster.reconcile()
    stop_the_rest(cluster)
    assert relaunch_wait(cluster) == 10
    running(cluster)
    cluster.advance(healthy_seconds)
    oom(cluster)
    cluster.reconcile()
    assert (cluster.status.phase == "Failed") is ends
    if not ends:
        assert cluster.status.restarts.consecutive_retries == 1
        assert cluster.status.restarts.retries == 2
        stop_the_rest(cluster)
        assert relaunch_wait(cluster) == 10  # the backoff started over too


def test_the_default_spec_never_relaunches_a_retryable_exit_at_once():
    # The trainer's own retryable codes (storage errors, peer timeouts) need no spec at all.
    cluster = FakeCluster(spec())
    cluster.reconcile()
    running(cluster)
    cluster.terminate(cluster.attempt_pods()[0], contract.EXIT_CHECKPOINT_IO_ERROR)
    cluster.reconcile()
    stop_the_rest(cluster)
    assert relaunch_wait(cluster) == 10


@pytest.mark.parametrize("value", [0, 0.5])
def test_no_spec_can_make_the_retry_backoff_a_tight_loop(value):
    with pytest.raises(ValueError, match="retryBackoffSeconds"):
        parse_spec(spec(failurePolicy={"retryableExitCodes": [OOM],
                                       "retryBackoffSeconds": value}))


def test_retry_backoff_above_its_cap_is_refused_naming_both_fields():
    with pytest.raises(ValueError, match=re.escape(
            "retryBackoffSeconds must be <= failurePolicy.maxRetryBackoffSeconds")):
        parse_spec(spec(failurePolicy={"retryBackoffSeconds": 60,
                                       "maxRetryBackoffSeconds": 30}))


def test_admission_rejections_never_touch_max_restarts_and_back_off_when_repeated():
    # maxRestarts 0: a single charged failure would end the job.
    cluster = FakeCluster(spec(failurePolicy={"maxRestarts": 0, "maxRetries": 0,
                                              "maxRetryBackoffSeconds": 30}))
    cluster.reconcile()
    # The first rejection relaunches at once (elsewhere); repeats back off, capped.
    for rejections, wait in [(1, 0), (2, 10), (3, 20), (4, 30), (5, 30)]:
        cluster.run_all()
        reject(cluster)
        cluster.reconcile()
        counts = cluster.status.restarts
        assert (counts.rejections, counts.consecutive_rejections) == (rejections, rejections)
        assert (counts.failures, counts.retries, counts.preemptions) == (0, 0, 0)
        assert counts.total == rejections
        recovery = cluster.status.recoveries[-1]
        assert recovery.cause == "NodeRejected"
        assert "OutOfnvidia.com/gpu: Pod was rejected: Node didn't have enough resource" in \
            recovery.reason
        stop_the_rest(cluster)
        assert relaunch_wait(cluster) == wait
    assert cluster.status.phase == "Restarting"


def test_a_rejected_rank_explains_its_peers_timeout():
    cluster = FakeCluster(spec(failurePolicy={"maxRetries": 0}))
    cluster.reconcile()
    cluster.run_all()
    cluster.terminate(cluster.attempt_pods()[0], contract.EXIT_PEER_TIMEOUT)
    reject(cluster, {"phase": "Failed", "reason": "UnexpectedAdmissionError",
                     "message": "Pod was rejected: Update plugin resources failed due to "
                                "requested number of devices unavailable for nvidia.com/gpu. "
                                "Requested: 8, Available: 0, which is unexpected."})
    cluster.reconcile()
    assert cluster.status.phase == "Restarting"
    assert cluster.status.recoveries[-1].cause == "NodeRejected"
    assert (cluster.status.restarts.retries, cluster.status.restarts.rejections) == (0, 1)


def test_a_trainer_that_exited_beside_a_running_sidecar_is_a_failure_and_is_stopped():
    cluster = FakeCluster(spec())
    cluster.reconcile()
    running(cluster)
    rank0 = cluster.attempt_pods()[0]
    rank0["status"]["containerStatuses"] = [
        {"name": "log-shipper", "state": {"running": {}}},
        {"name": "trainer", "state": {"terminated": {
            "exitCode": 1, "reason": "Error", "message": "ValueError: boom"}}},
    ]  # the pod stays Running: the sidecar holds it
    plan = cluster.reconcile()
    assert cluster.status.restarts.failures == 1
    assert cluster.status.recoveries[-1].reason == "tiny-a1-0 exited with code 1:\nValueError: boom"
    assert "tiny-a1-0" in [name for name, _ in plan.delete_pods]
    cluster.advance(60)
    assert cluster.reconcile().create_pods == [], "the sidecar's pod is still stopping"
    stop_the_rest(cluster)
    assert len(cluster.reconcile().create_pods) == 2
