"""Status conditions: metav1.Condition shape and the kstatus summary (Ready/Reconciling/Stalled)."""

from __future__ import annotations

import re
import typing

import pytest
from pydantic import ValidationError
from tardigrade_contract import contract
from tardigrade_operator.api.conditions import CATALOG, SUSPENDING, summary_conditions
from tardigrade_operator.api.types import (
    CONDITION_REASON_PATTERN,
    Condition,
    Phase,
    TrainingJobStatus,
)

from tests.operator.fake_cluster import T0, FakeCluster, spec

SAVED = contract.EXIT_PREEMPTED_SAVED


@pytest.mark.parametrize(("phase", "reason", "ready", "reconciling", "stalled"), [
    ("Pending", "Launching", "False", "True", "False"),
    ("Pending", "ContainerCannotStart", "False", "True", "False"),
    ("Running", "GangRunning", "True", "False", "False"),
    ("Restarting", "Preemption", "False", "True", "False"),
    ("Restarting", "BackOff", "False", "True", "False"),
    ("Resizing", "Resize", "False", "True", "False"),
    ("Suspended", SUSPENDING, "False", "True", "False"),
    ("Suspended", "Suspended", "False", "False", "False"),
    ("Succeeded", "Completed", "True", "False", "False"),
    ("Failed", "RestartBudgetExhausted", "False", "False", "True"),
    ("Failed", "InvalidSpec", "False", "False", "True"),
])
def test_summary_table(phase, reason, ready, reconciling, stalled):
    got = {c.type: (c.status, c.reason) for c in summary_conditions(phase, reason, "why")}
    assert got == {"Ready": (ready, reason), "Reconciling": (reconciling, reason),
                   "Stalled": (stalled, reason)}


def test_every_phase_has_a_summary():
    for phase in typing.get_args(Phase):
        kinds = [c.type for c in summary_conditions(phase, "Some", "")]
        assert kinds == ["Ready", "Reconciling", "Stalled"]


@pytest.mark.parametrize("reason", ["", "not camel", "Has-Dash", "1Digit", "Trailing:"])
def test_condition_rejects_reasons_that_are_not_camel_case(reason):
    with pytest.raises(ValidationError, match="reason"):
        Condition(type="Ready", status="True", reason=reason, message="",
                  last_transition_time=T0)


def test_condition_needs_a_transition_time():
    with pytest.raises(ValidationError, match=r"lastTransitionTime|last_transition_time"):
        TrainingJobStatus.model_validate(
            {"conditions": [{"type": "Ready", "status": "True", "reason": "A", "message": ""}]})


def _conditions(cluster: FakeCluster) -> dict[str, Condition]:
    return {c.type: c for c in cluster.status.conditions}


def _summary(cluster: FakeCluster) -> tuple[str, str, str]:
    found = _conditions(cluster)
    return (found["Ready"].status, found["Reconciling"].status, found["Stalled"].status)


def test_a_training_run_is_ready_and_not_reconciling_until_a_preemption():
    cluster = FakeCluster(spec())
    cluster.reconcile()
    assert _summary(cluster) == ("False", "True", "False")
    cluster.run_all()
    cluster.reconcile()
    assert _summary(cluster) == ("True", "False", "False")
    ready_since = _conditions(cluster)["Ready"].last_transition_time
    # Training goes on for a long time: passes change nothing, transition times stay.
    for _ in range(3):
        cluster.advance(600)
        cluster.progress = contract.ProgressReport(step=cluster.now.minute + 1)
        cluster.reconcile()
        assert _summary(cluster) == ("True", "False", "False")
        assert _conditions(cluster)["Ready"].last_transition_time == ready_since
    cluster.disrupt(cluster.attempt_pods()[0])
    cluster.reconcile()
    assert _summary(cluster) == ("False", "True", "False")
    assert _conditions(cluster)["Reconciling"].reason == "Preemption"
    assert _conditions(cluster)["Ready"].last_transition_time == cluster.now
    cluster.terminate_all(SAVED, step=5, checkpoint=5)
    cluster.reconcile()
    cluster.run_all()
    cluster.advance(5)
    cluster.reconcile()
    assert _summary(cluster) == ("True", "False", "False")
    assert _conditions(cluster)["Ready"].last_transition_time == cluster.now


def test_reason_and_message_follow_the_phase_without_a_transition():
    cluster = FakeCluster(spec())
    cluster.reconcile()
    launched_at = _conditions(cluster)["Reconciling"].last_transition_time
    cluster.advance(3)
    cluster.run_all()
    cluster.terminate(cluster.attempt_pods()[1], 1, "boom")
    cluster.reconcile()
    reconciling = _conditions(cluster)["Reconciling"]
    assert (reconciling.status, reconciling.reason) == ("True", "Failure")
    assert reconciling.last_transition_time == launched_at


def test_exhausted_budget_stalls_the_job():
    cluster = FakeCluster(spec(failurePolicy={"maxRestarts": 0}))
    cluster.reconcile()
    cluster.run_all()
    cluster.reconcile()
    cluster.terminate(cluster.attempt_pods()[0], 1, "ValueError: boom")
    cluster.reconcile()
    assert cluster.status.phase == "Failed"
    assert _summary(cluster) == ("False", "False", "True")
    stalled = _conditions(cluster)["Stalled"]
    assert stalled.reason == "RestartBudgetExhausted"
    assert "ValueError: boom" in stalled.message


def test_invalid_spec_stalls_and_names_the_field():
    cluster = FakeCluster(spec(replicas=0))
    cluster.reconcile()
    found = _conditions(cluster)
    assert (found["InvalidSpec"].status, found["InvalidSpec"].reason) == ("True", "SpecInvalid")
    assert (found["Stalled"].status, found["Stalled"].reason) == ("True", "InvalidSpec")
    assert "spec.replicas" in found["Stalled"].message


def test_suspension_reconciles_while_the_gang_stops_then_rests():
    cluster = FakeCluster(spec())
    cluster.reconcile()
    cluster.run_all()
    cluster.reconcile()
    cluster.spec["suspend"] = True
    cluster.generation += 1
    cluster.reconcile()
    assert _summary(cluster) == ("False", "True", "False")
    cluster.terminate_all(SAVED, step=9, checkpoint=9)
    cluster.reconcile()
    assert cluster.status.phase == "Suspended"
    assert _summary(cluster) == ("False", "False", "False")
    assert {c.observed_generation for c in cluster.status.conditions} == {2}


def test_a_job_that_ended_before_summary_conditions_gets_them():
    cluster = FakeCluster(spec())
    cluster.status = TrainingJobStatus.model_validate({
        "phase": "Succeeded", "attempt": 1, "replicas": 2,
        "conditions": [{"type": "Succeeded", "status": "True", "reason": "Completed",
                        "message": "done", "lastTransitionTime": "2026-12-01T00:00:00Z"}],
    })
    cluster.reconcile()
    assert _summary(cluster) == ("True", "False", "False")
    assert _conditions(cluster)["Ready"].reason == "Completed"


def test_documented_reasons_are_valid_reasons():
    pattern = re.compile(CONDITION_REASON_PATTERN)
    for doc in CATALOG:
        for reason in re.findall(r"`([^`]+)`", doc.reasons):
            if not reason.startswith(("spec.", "kubectl")):
                assert pattern.match(reason), (doc.type, reason)
