"""Capacity: unschedulable ranks, a node autoscaler's verdicts on them, and what the job says.

Scenarios: a scale-up under way holds off a shrink (bounded); a NotTriggerScaleUp or
FailedScaleUp verdict shrinks at once within minReplicas; when minReplicas cannot be reached
the job waits in phase Pending with reason WaitingForCapacity (Stalled, CapacityLimited),
never Resizing or Restarting for good; the condition ends when the nodes come.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

import pytest
from tardigrade_contract import contract
from tardigrade_operator.observation.autoscaling import (
    FAILED_SCALE_UP,
    NOT_TRIGGER_SCALE_UP,
    TRIGGERED_SCALE_UP,
    newest_signals,
    parse_event,
)
from tardigrade_operator.observation.observed import DecisionSettings

from tests.operator.fake_cluster import FakeCluster, iso, spec

SETTINGS = DecisionSettings(unschedulable_timeout=timedelta(seconds=60),
                            grow_back_after=timedelta(seconds=300),
                            scale_up_wait=timedelta(seconds=600))
MESSAGES = {
    TRIGGERED_SCALE_UP: "pod triggered scale-up: [{pool-a 2->3 (max: 4)}]",
    NOT_TRIGGER_SCALE_UP: "pod didn't trigger scale-up: 1 max node group size reached",
    FAILED_SCALE_UP: "Node scale up in zones us-central1-a associated with this pod failed: "
                     "GCE out of resources. Pod is at risk of not being scheduled.",
}


def autoscaler_event(pod: str, reason: str, when: datetime) -> dict[str, Any]:
    """An Event as the cluster autoscaler records it on a pod (core/v1 JSON)."""
    return {
        "metadata": {"name": f"{pod}.{reason.lower()}", "namespace": "ml"},
        "involvedObject": {"kind": "Pod", "namespace": "ml", "name": pod, "apiVersion": "v1"},
        "reason": reason, "message": MESSAGES[reason],
        "type": "Warning" if reason == FAILED_SCALE_UP else "Normal",
        "source": {"component": "cluster-autoscaler"},
        "firstTimestamp": iso(when), "lastTimestamp": iso(when), "count": 1,
    }


def place(cluster: FakeCluster, placed: int) -> list[dict[str, Any]]:
    """The first `placed` ranks run; the rest are Unschedulable since now."""
    pods = cluster.attempt_pods()
    for index, pod in enumerate(pods):
        if index < placed:
            pod["spec"]["nodeName"] = f"node-{index}"
            pod["status"] = {"phase": "Running", "containerStatuses": [
                {"name": "trainer", "state": {"running": {}}}]}
        else:
            pod["status"] = {"phase": "Pending", "conditions": [
                {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                 "message": "0/2 nodes are available: 2 Insufficient cpu.",
                 "lastTransitionTime": iso(cluster.now)}]}
    return pods[placed:]


def condition(cluster: FakeCluster, kind: str) -> tuple[str, str] | None:
    found = next((c for c in cluster.status.conditions if c.type == kind), None)
    return None if found is None else (found.status, found.reason)


def started(replicas: int, placed: int, **overrides: Any) -> tuple[FakeCluster, list[str]]:
    cluster = FakeCluster(spec(replicas=replicas, **overrides), settings=SETTINGS)
    cluster.reconcile()
    stuck = [p["metadata"]["name"] for p in place(cluster, placed)]
    return cluster, stuck


# ------------------------------------------------------------------------------ events ---


def test_autoscaler_events_are_read_newest_first_per_pod():
    t0 = datetime.fromisoformat("2026-12-02T12:00:00+00:00")
    events = [
        autoscaler_event("tiny-a1-2", TRIGGERED_SCALE_UP, t0),
        autoscaler_event("tiny-a1-2", NOT_TRIGGER_SCALE_UP, t0 + timedelta(seconds=30)),
        autoscaler_event("tiny-a1-1", TRIGGERED_SCALE_UP, t0 + timedelta(seconds=5)),
        {**autoscaler_event("tiny-a1-3", TRIGGERED_SCALE_UP, t0), "reason": "Scheduled"},
        {**autoscaler_event("tiny-a1-4", TRIGGERED_SCALE_UP, t0),
         "involvedObject": {"kind": "Node", "name": "tiny-a1-4"}},
    ]
    signals = newest_signals(events)
    assert {name: s.reason for name, s in signals.items()} == {
        "tiny-a1-2": NOT_TRIGGER_SCALE_UP, "tiny-a1-1": TRIGGERED_SCALE_UP}
    assert signals["tiny-a1-1"].time == t0 + timedelta(seconds=5)


def test_an_events_k8s_io_event_is_read_too():
    event = {"reason": TRIGGERED_SCALE_UP, "regarding": {"kind": "Pod", "name": "p"},
             "note": "pod triggered scale-up", "eventTime": "2026-12-02T12:00:00.000000Z"}
    name, signal = parse_event(event)
    assert (name, signal.reason, signal.message) == ("p", TRIGGERED_SCALE_UP,
                                                     "pod triggered scale-up")


# ------------------------------------------------------------------- decisions, a table ---

# (replicas, minReplicas, verdict on the stuck rank, seconds later) ->
# (phase, phase reason, replicas the gang is relaunched with or None, CapacityLimited)
CASES = [
    # A scale-up is under way: no shrink, even past the unschedulable timeout.
    (3, 1, TRIGGERED_SCALE_UP, 120, "Pending", "WaitingForScaleUp", None, None),
    # ... but only for scale_up_wait: then capacity is unavailable and the gang shrinks.
    (3, 1, TRIGGERED_SCALE_UP, 600, "Resizing", "Resize", 2, ("True", "Unschedulable")),
    # The autoscaler says no node group can take the rank: shrink at once.
    (3, 1, NOT_TRIGGER_SCALE_UP, 1, "Resizing", "Resize", 2, ("True", "Unschedulable")),
    (3, 1, FAILED_SCALE_UP, 1, "Resizing", "Resize", 2, ("True", "Unschedulable")),
    # No autoscaler at all: the unschedulable timeout decides.
    (3, 1, None, 59, "Pending", "GangStarting", None, None),
    (3, 1, None, 60, "Resizing", "Resize", 2, ("True", "Unschedulable")),
    # minReplicas does not allow a smaller gang: wait for capacity, clearly.
    (3, 3, NOT_TRIGGER_SCALE_UP, 1, "Pending", "WaitingForCapacity", None,
     ("True", "WaitingForCapacity")),
    (3, None, None, 60, "Pending", "WaitingForCapacity", None, ("True", "WaitingForCapacity")),
    (3, None, TRIGGERED_SCALE_UP, 60, "Pending", "WaitingForScaleUp", None, None),
]


@pytest.mark.parametrize(("replicas", "min_replicas", "verdict", "later", "phase", "reason",
                          "relaunch", "limited"), CASES)
def test_what_an_unschedulable_rank_does_to_the_job(replicas, min_replicas, verdict, later,
                                                     phase, reason, relaunch, limited):
    extra = {} if min_replicas is None else {"minReplicas": min_replicas}
    cluster, stuck = started(replicas, placed=2, **extra)
    if verdict is not None:
        cluster.events.append(autoscaler_event(stuck[0], verdict, cluster.now))
    cluster.advance(later)
    plan = cluster.reconcile()
    assert (cluster.status.phase, condition(cluster, "Running")[1]) == (phase, reason)
    assert condition(cluster, "CapacityLimited") == limited
    if relaunch is None:
        assert plan.delete_pods == [], "the running ranks are left alone"
        assert cluster.status.recoveries == []
    else:
        assert cluster.status.recoveries[-1].to_replicas == relaunch
        assert len(plan.delete_pods) == replicas


def test_waiting_for_scale_up_names_the_scale_up_and_the_bound():
    cluster, stuck = started(3, placed=2, minReplicas=1)
    cluster.events.append(autoscaler_event(stuck[0], TRIGGERED_SCALE_UP, cluster.now))
    cluster.advance(90)
    cluster.reconcile()
    assert ("waits for a node scale-up triggered at 2026-12-02T12:00:00Z (for at most 600s)"
            in cluster.status.message)
    assert "pool-a 2->3" in cluster.status.message
    # The message has no clock in it: the status is not rewritten on every pass.
    before = cluster.status.model_copy(deep=True)
    cluster.advance(30)
    cluster.reconcile()
    assert cluster.status == before
    assert condition(cluster, "Reconciling") == ("True", "WaitingForScaleUp")
    assert condition(cluster, "Stalled")[0] == "False"


def test_a_later_no_replaces_an_earlier_scale_up():
    cluster, stuck = started(3, placed=2, minReplicas=1)
    cluster.events.append(autoscaler_event(stuck[0], TRIGGERED_SCALE_UP, cluster.now))
    cluster.advance(30)
    cluster.reconcile()
    assert cluster.status.phase == "Pending"
    cluster.events.append(autoscaler_event(stuck[0], FAILED_SCALE_UP, cluster.now))
    cluster.reconcile()
    assert cluster.status.phase == "Resizing"
    assert "GCE out of resources" in cluster.status.recoveries[-1].reason


def test_waiting_for_capacity_is_stalled_and_ends_when_nodes_come():
    cluster, _ = started(2, placed=0)
    cluster.advance(60)
    plan = cluster.reconcile()
    assert (cluster.status.phase, condition(cluster, "Running")[1]) == ("Pending",
                                                                        "WaitingForCapacity")
    assert condition(cluster, "Stalled") == ("True", "WaitingForCapacity")
    assert condition(cluster, "Reconciling")[0] == "False"
    assert condition(cluster, "Ready")[0] == "False"
    assert [e.reason for e in plan.events] == ["WaitingForCapacity"]
    assert "unschedulable for 60s and no node scale-up under way" in cluster.status.message
    # Said once, not on every pass.
    assert cluster.reconcile().events == []
    cluster.run_all()
    cluster.reconcile()
    assert cluster.status.phase == "Running"
    assert condition(cluster, "CapacityLimited") == ("False", "CapacityAvailable")
    assert condition(cluster, "Stalled")[0] == "False"


def test_a_preempted_gang_without_capacity_waits_for_capacity_not_restarting_forever():
    """The newcomer scenario with a VM that never returns: the relaunched gang has no node."""
    cluster = FakeCluster(spec(replicas=2), settings=SETTINGS)
    cluster.reconcile()
    cluster.run_all()
    cluster.reconcile()
    for pod in cluster.attempt_pods():
        cluster.disrupt(pod)
    cluster.reconcile()
    assert cluster.status.phase == "Restarting"
    cluster.terminate_all(contract.EXIT_PREEMPTED_SAVED, step=8, checkpoint=8)
    plan = cluster.reconcile()
    assert len(plan.create_pods) == 2
    place(cluster, placed=0)
    cluster.advance(30)
    cluster.reconcile()
    assert cluster.status.phase == "Restarting", "a replacement node may be on its way"
    cluster.advance(30)
    cluster.reconcile()
    assert (cluster.status.phase, condition(cluster, "Running")[1]) == ("Pending",
                                                                        "WaitingForCapacity")
    assert cluster.status.restarts.preemptions == 1
    assert cluster.status.restarts.resizes == 0


def test_a_shrunk_gang_that_still_cannot_be_placed_waits_and_still_grows_back():
    cluster, stuck = started(3, placed=1, minReplicas=2)
    cluster.events.append(autoscaler_event(stuck[0], NOT_TRIGGER_SCALE_UP, cluster.now))
    cluster.reconcile()
    assert cluster.status.recoveries[-1].to_replicas == 2
    cluster.terminate_all(contract.EXIT_PREEMPTED_SAVED, step=4, checkpoint=4)
    cluster.reconcile()
    place(cluster, placed=1)
    cluster.advance(60)
    cluster.reconcile()
    assert (cluster.status.phase, condition(cluster, "Running")[1]) == ("Pending",
                                                                        "WaitingForCapacity")
    assert cluster.status.replicas == 2
    cluster.run_all()
    cluster.reconcile()
    assert cluster.status.phase == "Running"
    # Still short of spec.replicas on purpose: the condition stays, and growing back is tried.
    assert condition(cluster, "CapacityLimited")[0] == "True"
    cluster.advance(300)
    cluster.reconcile()
    assert cluster.status.recoveries[-1].to_replicas == 3


def test_argocd_reads_waiting_for_capacity_as_degraded_and_a_scale_up_as_progressing():
    from tests.operator.test_argocd_health import _job, health

    cluster, stuck = started(2, placed=0)
    cluster.events.append(autoscaler_event(stuck[0], TRIGGERED_SCALE_UP, cluster.now))
    cluster.advance(60)
    cluster.reconcile()
    assert health(_job(cluster))[0] == "Progressing"
    cluster.events.append(autoscaler_event(stuck[0], NOT_TRIGGER_SCALE_UP, cluster.now))
    cluster.reconcile()
    status, message = health(_job(cluster))
    assert status == "Degraded"
    assert message.startswith("WaitingForCapacity: ")
    assert "max node group size reached" in message


def test_ranks_packed_onto_the_node_another_rank_triggered_wait_for_it_too():
    """The autoscaler tells only the rank that triggered the scale-up; the rank packed onto the
    same upcoming node hears nothing, and may still be unschedulable after its peer got bound
    to the new node."""
    cluster, stuck = started(2, placed=0, minReplicas=1)
    cluster.events.append(autoscaler_event(stuck[0], TRIGGERED_SCALE_UP, cluster.now))
    cluster.advance(120)
    cluster.reconcile()
    assert condition(cluster, "Running")[1] == "WaitingForScaleUp"
    first = cluster.attempt_pods()[0]
    first["spec"]["nodeName"] = "pool-a-3"  # the new node took rank 0 first
    first["status"] = {"phase": "Pending"}
    plan = cluster.reconcile()
    assert plan.delete_pods == [] and cluster.status.recoveries == []
    assert condition(cluster, "Running")[1] == "WaitingForScaleUp"
    # But the autoscaler's own "no" for that rank is capacity really unavailable.
    cluster.events.append(autoscaler_event(stuck[1], NOT_TRIGGER_SCALE_UP, cluster.now))
    cluster.reconcile()
    assert cluster.status.recoveries[-1].to_replicas == 1
