"""The job's stage, derived from its status alone, one row per case."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from tardigrade_operator.api.types import Condition, Recovery, TrainingJobStatus
from tardigrade_operator.decision.stage import LAUNCHING, Stage, pending_recovery, stage

from tests.operator.fake_cluster import FakeCluster, spec

T = datetime(2026, 12, 2, tzinfo=UTC)


def status(phase: str = "Running", attempt: int = 1, running_reason: str = "GangRunning",
           recovery_attempt: int | None = None) -> TrainingJobStatus:
    conditions = [Condition(type="Running", status="True" if phase == "Running" else "False",
                            reason=running_reason, message="", last_transition_time=T)]
    recoveries = [] if recovery_attempt is None else [
        Recovery(cause="Preemption", time=T, attempt=recovery_attempt)]
    return TrainingJobStatus(phase=phase, attempt=attempt, conditions=conditions,
                             recoveries=recoveries)


@pytest.mark.parametrize(("case", "given", "expected"), [
    ("never launched", status("Pending", attempt=0, running_reason="Created"), Stage.NEW),
    ("suspended before the first launch", status("Suspended", attempt=0), Stage.NEW),
    ("launch written, pods not all seen", status("Pending", running_reason=LAUNCHING),
     Stage.LAUNCHING),
    ("relaunch written, pods not all seen", status("Restarting", running_reason=LAUNCHING,
                                                   recovery_attempt=1), Stage.LAUNCHING),
    ("gang seen, starting", status("Pending", running_reason="GangStarting"), Stage.RUNNING),
    ("gang training", status("Running"), Stage.RUNNING),
    ("relaunch recorded, not launched", status("Restarting", running_reason="Preemption",
                                               recovery_attempt=2), Stage.RECOVERING),
    ("relaunch recorded while suspended", status("Suspended", recovery_attempt=2),
     Stage.RECOVERING),
    ("suspended, nothing recorded", status("Suspended", running_reason="Suspended"),
     Stage.SUSPENDED),
    ("succeeded", status("Succeeded", recovery_attempt=2), Stage.FINISHED),
    ("failed before launching", status("Failed", attempt=0), Stage.FINISHED),
])
def test_stage(case, given, expected):
    assert stage(given) is expected, case


def test_pending_recovery_is_the_relaunch_past_the_current_attempt():
    assert pending_recovery(status(recovery_attempt=2)).attempt == 2
    assert pending_recovery(status(recovery_attempt=1)) is None  # launched already
    assert pending_recovery(status()) is None


def test_a_whole_preemption_walks_the_stages_in_order():
    """The stages decide writes, pass by pass, through a launch and a preemption."""
    cluster = FakeCluster(spec(failurePolicy={"backoffSeconds": 0}))
    seen = [stage(cluster.status)]
    cluster.reconcile()  # launch written
    seen.append(stage(cluster.status))
    cluster.run_all()
    cluster.reconcile()  # every rank seen running
    seen.append(stage(cluster.status))
    cluster.disrupt(cluster.attempt_pods()[0])
    cluster.reconcile()  # relaunch recorded, old gang stopped
    seen.append(stage(cluster.status))
    cluster.terminate_all(75, step=7, checkpoint=7)
    cluster.reconcile()  # old gang gone: the new one is launched
    seen.append(stage(cluster.status))
    cluster.run_all()
    cluster.reconcile()
    seen.append(stage(cluster.status))
    assert seen == [Stage.NEW, Stage.LAUNCHING, Stage.RUNNING, Stage.RECOVERING,
                    Stage.LAUNCHING, Stage.RUNNING]
