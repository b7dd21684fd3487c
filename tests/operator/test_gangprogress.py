"""The ranks-running message by quarter of the gang, and the status writes it leaves a launch
and a recovery: a bound that does not grow with the gang."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from tardigrade_contract import contract
from tardigrade_operator.apply.kube import status_json
from tardigrade_operator.decision.gang_messages import ranks_running, running_range
from tardigrade_operator.observation.observed import DecisionSettings

from tests.operator.fake_cluster import FakeCluster, iso, spec

SIZES = [1, 2, 3, 4, 5, 8, 64, 255, 256, 1024]


@pytest.mark.parametrize(("running", "replicas", "message"), [
    (0, 1, "attempt 2: 0/1 ranks running"),
    (1, 1, "attempt 2: 1/1 ranks running"),
    (3, 4, "attempt 2: 3/4 ranks running"),
    (0, 8, "attempt 2: 0-1/8 ranks running"),
    (1, 8, "attempt 2: 0-1/8 ranks running"),
    (2, 8, "attempt 2: 2-3/8 ranks running"),
    (7, 8, "attempt 2: 6-7/8 ranks running"),
    (8, 8, "attempt 2: 8/8 ranks running"),
    (4, 5, "attempt 2: 4/5 ranks running"),
    (0, 256, "attempt 2: 0-63/256 ranks running"),
    (64, 256, "attempt 2: 64-127/256 ranks running"),
    (200, 256, "attempt 2: 192-255/256 ranks running"),
    (255, 256, "attempt 2: 192-255/256 ranks running"),
    (256, 256, "attempt 2: 256/256 ranks running"),
    (1023, 1024, "attempt 2: 768-1023/1024 ranks running"),
])
def test_message_names_the_quarter(running: int, replicas: int, message: str) -> None:
    assert ranks_running(2, running, replicas) == message


@pytest.mark.parametrize("replicas", SIZES)
def test_every_count_lies_in_its_range_and_at_most_five_messages(replicas: int) -> None:
    messages = set()
    for running in range(replicas + 1):
        low, high = running_range(running, replicas)
        assert low <= running <= high
        messages.add(ranks_running(1, running, replicas))
    assert len(messages) <= 5


def _writes(cluster: FakeCluster, before: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """One reconcile pass; 1 if it changed the status (the writer skips equal ones)."""
    cluster.reconcile()
    after = status_json(cluster.status)
    return int(after != before), after


def _start_one_by_one(cluster: FakeCluster, before: dict[str, Any]) -> int:
    """Each pod of the current attempt starts in turn, a reconcile pass after each."""
    writes = 0
    for index, pod in enumerate(cluster.attempt_pods()):
        pod["spec"]["nodeName"] = f"node-{index}"
        pod["status"] = {"phase": "Running", "podIP": f"127.0.{index // 250}.{index % 250 + 1}",
                         "containerStatuses": [{"name": "trainer", "state": {"running": {}}}]}
        wrote, before = _writes(cluster, before)
        writes += wrote
    assert cluster.status.phase == "Running"
    return writes


def _launch_and_recover(replicas: int) -> tuple[int, int]:
    """Status writes while a gang of `replicas` comes up, then while it comes back from the
    loss of one host (recreated), its pods starting one at a time."""
    cluster = FakeCluster(spec(replicas=replicas))
    before = status_json(cluster.status)
    launch, before = _writes(cluster, before)
    launch += _start_one_by_one(cluster, before)
    before = status_json(cluster.status)
    cluster.disrupt(cluster.attempt_pods()[0])
    recovery, before = _writes(cluster, before)
    cluster.advance(5)
    cluster.terminate_all(contract.EXIT_PREEMPTED_SAVED, step=7, checkpoint=7)
    wrote, before = _writes(cluster, before)
    recovery += wrote
    assert cluster.status.attempt == 2 and len(cluster.attempt_pods()) == replicas
    recovery += _start_one_by_one(cluster, before)
    return launch, recovery


def test_status_writes_do_not_grow_with_the_gang() -> None:
    small, large = _launch_and_recover(8), _launch_and_recover(64)
    assert large == small
    # Launch: the launch itself, then a message per quarter reached; recovery: the
    # decision, the relaunch, then the same quarters.
    assert max(small) <= 7


def _capacity_wait(replicas: int) -> int:
    """Status writes while a gang that may not shrink waits for capacity and its pods are
    placed one at a time, the scheduler's message changing with each."""
    cluster = FakeCluster(spec(replicas=replicas, minReplicas=replicas),
                          settings=DecisionSettings(unschedulable_timeout=timedelta(seconds=60)))
    cluster.reconcile()
    pods = cluster.attempt_pods()
    for pod in pods:
        pod["status"] = {"phase": "Pending", "conditions": [
            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
             "message": f"0/{replicas} nodes are available: {replicas} Insufficient cpu.",
             "lastTransitionTime": iso(cluster.now)}]}
    cluster.advance(60)
    before = status_json(cluster.status)
    writes, before = _writes(cluster, before)
    assert f"waiting for capacity: {replicas}/{replicas} pods" in cluster.status.message
    for placed, pod in enumerate(pods[:-1], start=1):
        pod["spec"]["nodeName"] = f"node-{placed}"
        pod["status"] = {"phase": "Running",
                         "containerStatuses": [{"name": "trainer", "state": {"running": {}}}]}
        for waiting in pods[placed:]:
            waiting["status"]["conditions"][0]["message"] = (
                f"{placed}/{replicas} nodes are available: {replicas - placed} Insufficient cpu.")
        cluster.advance(1)
        wrote, before = _writes(cluster, before)
        writes += wrote
        assert "waiting for capacity" in cluster.status.message
    return writes


def test_waiting_for_capacity_is_rewritten_by_quarter_only() -> None:
    small, large = _capacity_wait(8), _capacity_wait(32)
    assert large == small
    assert small <= 9
