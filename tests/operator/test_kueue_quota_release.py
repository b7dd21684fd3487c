"""A Workload's quota goes back to Kueue only once no pod of the gang is active, terminating
pods included (docs/kueue.md, "Quota freed last"): each write that frees quota (releasing it
after an eviction, deleting the Workload for a resize or a move, dropping a grow's request,
finishing it, dropping a label-less job's Workloads) is carried through the handlers' own
Workload step with the pods as a pass observes them, once with a rank still terminating
(deleted, its trainer saving inside the grace period) and once after it is gone."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest
from tardigrade_operator import handlers, naming
from tardigrade_operator.api.parse import parse_spec
from tardigrade_operator.api.types import TrainingJobStatus
from tardigrade_operator.decision import queueing
from tardigrade_operator.decision.queueing import Flavor, WorkloadCondition, WorkloadView
from tardigrade_operator.observation.pods import PodView, parse_pod

from tests.operator.fake_cluster import JOB, spec

QUEUE = "team-queue"
FLAVORS = {"spot": Flavor({"cloud.google.com/gke-spot": "true"}, [])}
ADMITTED = {"QuotaReserved": WorkloadCondition("True", "QuotaReserved", ""),
            "Admitted": WorkloadCondition("True", "Admitted", ""),
            "PodsReady": WorkloadCondition("True", "Started", "")}
EVICTED = {**ADMITTED, "Evicted": WorkloadCondition("True", "Preempted", "preempted")}


def pod(rank: int, phase: str = "Running", deleting: bool = True) -> PodView:
    """A rank of attempt 1 on a node, as parse_pod reads it from the API."""
    meta: dict[str, Any] = {
        "name": naming.pod_name(JOB.name, 1, rank),
        "labels": naming.pod_labels(JOB.name, 1, rank),
        "ownerReferences": [JOB.owner_reference()]}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:30Z"
    view = parse_pod({"metadata": meta, "spec": {"nodeName": f"node-{rank}"},
                      "status": {"phase": phase}})
    assert view is not None
    return view


# Rank 1 was deleted and its trainer still saves (phase Running until the kubelet ends it);
# rank 0 already finished.
TERMINATING = [pod(0, "Failed"), pod(1)]
# Still bound to its node and deleted before its container started.
STARTING = [pod(0, "Failed"), pod(1, "Pending")]
GONE = [pod(0, "Failed")]


@dataclasses.dataclass
class Writer:
    """Records the Workload writes (kube.ClusterWriter's Kueue calls)."""

    writes: list[queueing.WorkloadAction] = dataclasses.field(default_factory=list)

    def apply_workload(self, namespace: str, action: queueing.WorkloadAction) -> None:
        assert namespace == JOB.namespace
        self.writes.append(action)

    def priority_value(self, name: str) -> int | None:
        return None


@dataclasses.dataclass
class Memo:
    writer: Writer = dataclasses.field(default_factory=Writer)


def workload(conditions: dict[str, WorkloadCondition], body: dict[str, Any], *,
             admitted: int | None = 2, **extra: Any) -> WorkloadView:
    fields: dict[str, Any] = {"queue_name": QUEUE, **extra}
    return WorkloadView(
        name=queueing.workload_name(JOB.name, JOB.uid), owner_uid=JOB.uid,
        resource_version="7", count=body["replicas"], conditions=conditions,
        admitted_count=admitted, admitted_flavors={"cpu": "spot"} if admitted else {},
        cluster_queue="team" if admitted else None,
        podset_hash=queueing.podset_hash(parse_spec(body)), **fields)


def written(body: dict[str, Any], phase: str, main: WorkloadView,
            pods: list[PodView], grow: WorkloadView | None = None) -> list[type]:
    """The kinds of Workload write one pass's Workload step makes (handlers._write_workload)."""
    parsed = parse_spec(body)
    gate = queueing.gate_for(QUEUE, main, FLAVORS, body["replicas"], grow, spec=parsed,
                             gang_active=any(p.active for p in pods))
    memo = Memo()
    plan = type("Plan", (), {"status": TrainingJobStatus(phase=phase)})()
    asyncio.run(handlers._write_workload(
        (JOB.namespace, JOB.name), JOB.uid, {"labels": {queueing.QUEUE_LABEL: QUEUE}},
        parsed, plan, gate, (main, []), pods, memo))  # type: ignore[arg-type]
    return [type(action) for action in memo.writer.writes]


def test_a_terminating_or_starting_pod_counts_as_active():
    assert [p.active for p in TERMINATING] == [False, True]
    assert [p.active for p in STARTING] == [False, True]
    assert not any(p.active for p in GONE)


@pytest.mark.parametrize("pods", [TERMINATING, STARTING], ids=["terminating", "starting"])
def test_the_quota_of_an_evicted_workload_is_released_once_no_rank_is_left(pods):
    body = spec()
    evicted = workload(EVICTED, body)
    assert queueing.ReleaseQuota not in written(body, "Queued", evicted, pods)
    assert written(body, "Queued", evicted, GONE) == [queueing.ReleaseQuota]


@pytest.mark.parametrize("pods", [TERMINATING, STARTING], ids=["terminating", "starting"])
def test_a_workload_remade_for_a_move_is_deleted_once_no_rank_is_left(pods):
    # Admitted in another LocalQueue than the job's label names: made again there.
    body = spec()
    moved = workload(ADMITTED, body, queue_name="old-queue")
    assert queueing.DeleteWorkload not in written(body, "Queued", moved, pods)
    assert written(body, "Queued", moved, GONE) == [queueing.DeleteWorkload]


@pytest.mark.parametrize("pods", [TERMINATING, STARTING], ids=["terminating", "starting"])
def test_a_grow_request_goes_with_the_gang_only_once_no_rank_is_left(pods):
    # Grown from 2 to 4: Kueue reserved the 2 extra replicas, the gang stopped after a save
    # and its own Workload is being deleted; the request goes once no rank is left.
    body = spec(replicas=4)
    going = workload(ADMITTED, spec(), deleting=True)
    grow = WorkloadView(
        name=queueing.grow_workload_name(JOB.name, JOB.uid), owner_uid=JOB.uid,
        resource_version="3", count=2, conditions=ADMITTED, admitted_count=2,
        role=queueing.GROW_ROLE, queue_name=QUEUE,
        podset_hash=queueing.podset_hash(parse_spec(body)))
    assert written(body, "Queued", going, pods, grow) == []
    assert written(body, "Queued", going, GONE, grow) == [queueing.DeleteWorkload]


@pytest.mark.parametrize("phase", ["Succeeded", "Failed"])
def test_a_finished_jobs_workload_is_finished_once_no_rank_is_left(phase):
    body = spec()
    admitted = workload(ADMITTED, body)
    assert written(body, phase, admitted, TERMINATING) == []
    assert written(body, phase, admitted, GONE) == [queueing.FinishWorkload]


def test_a_held_jobs_stray_workloads_go_once_no_rank_is_left():
    # The queue label removed where the admin's rule requires one: held, its gang saves and
    # stops, and only then do its Workloads (and their quota) go.
    stray = workload(ADMITTED, spec())

    def dropped(pods: list[PodView]) -> list[type]:
        memo = Memo()
        asyncio.run(handlers._drop_strays(JOB.namespace, (stray,), pods, True,
                                          memo))  # type: ignore[arg-type]
        return [type(action) for action in memo.writer.writes]

    assert dropped(TERMINATING) == []
    assert dropped(GONE) == [queueing.DeleteWorkload]

