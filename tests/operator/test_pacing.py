"""When a job's loop passes again and reads progress (pacing.py), without a server."""

from __future__ import annotations

from datetime import timedelta

import pytest
from tardigrade_contract import contract
from tardigrade_operator.config import OperatorConfig
from tardigrade_operator.decision.decide import decide
from tardigrade_operator.decision.pacing import (
    READ_GAP_SECONDS,
    PacingSettings,
    ProgressPoll,
    decided_anew,
    next_deadline,
    report_news,
    seconds_to_next_pass,
    settled,
)

from tests.operator.fake_cluster import FakeCluster, spec

SETTINGS = PacingSettings(busy_seconds=2.0, progress_min_seconds=2.0, progress_max_seconds=60.0)
QUIET = report_news(contract.ProgressReport(step=10, checkpoint_step=0), None)


def reads(poll: ProgressPoll, outcomes: list[tuple[object, bool]],
          settings: PacingSettings = SETTINGS) -> list[float]:
    """The interval after each read, each read happening when the previous one fell due."""
    intervals = []
    for news, busy in outcomes:
        poll = poll.after_read(poll.due, news, busy, settings)
        intervals.append(poll.interval)
    return intervals


def test_reads_of_a_quiet_job_back_off_to_the_maximum():
    assert reads(ProgressPoll(), [(QUIET, False)] * 8) == [2, 4, 8, 16, 32, 60, 60, 60]


def test_the_step_advancing_is_not_news_but_a_new_checkpoint_is():
    later = report_news(contract.ProgressReport(step=99, checkpoint_step=0), None)
    saved = report_news(contract.ProgressReport(step=99, checkpoint_step=50), None)
    assert later == QUIET
    assert reads(ProgressPoll(), [(QUIET, False), (QUIET, False), (later, False),
                                  (saved, False), (saved, False)]) == [2, 4, 8, 2, 4]


@pytest.mark.parametrize("news", [
    report_news(None, None),  # rank 0 stopped answering
    report_news(None, "rank 0 (tiny-a1-0): step must be a non-negative integer"),
])
def test_a_report_vanishing_or_turning_malformed_starts_over(news):
    assert reads(ProgressPoll(), [(QUIET, False)] * 4 + [(news, False)]) == [2, 4, 8, 16, 2]


def test_a_busy_job_reads_at_every_pass_and_an_event_makes_the_read_due_at_once():
    poll = ProgressPoll()
    assert reads(poll, [(QUIET, False)] * 3 + [(QUIET, True)] * 2) == [2, 4, 8, 2, 2]
    poll = poll.after_read(0.0, QUIET, False, SETTINGS).after_read(2.0, QUIET, False, SETTINGS)
    assert not poll.is_due(5.0)
    woken = poll.reset(5.0)
    assert woken.is_due(5.0)
    assert woken.after_read(5.0, QUIET, False, SETTINGS).interval == 2


def test_a_storm_of_events_reads_at_most_once_per_gap():
    # A thousand pods restarting wake the job a thousand times in a few seconds.
    poll = ProgressPoll().after_read(10.0, QUIET, True, SETTINGS)
    woken = poll.reset(10.2)
    assert not woken.is_due(10.2) and woken.due == 10.0 + READ_GAP_SECONDS
    # The busy loop comes back for it when it falls due, not a whole busy interval later.
    assert seconds_to_next_pass(10.2, woken, True, None, SETTINGS) == pytest.approx(0.8)
    assert woken.reset(12.5).is_due(12.5)


def test_jitter_takes_up_to_a_fifth_off_an_interval():
    poll = ProgressPoll(interval=8.0, news=QUIET)
    assert poll.after_read(100.0, QUIET, False, SETTINGS, draw=0.0).due == 116.0
    assert poll.after_read(100.0, QUIET, False, SETTINGS, draw=0.5).due == 114.4


def test_the_fixed_loop_reads_at_every_pass():
    fixed = PacingSettings(fixed=True)
    assert reads(ProgressPoll(), [(QUIET, False)] * 4, fixed) == [2, 2, 2, 2]
    assert seconds_to_next_pass(0.0, ProgressPoll(due=50.0), False, None, fixed) == 2.0


def test_the_next_pass_waits_for_the_read_a_deadline_or_the_maximum():
    poll = ProgressPoll(due=130.0, interval=30.0)
    assert seconds_to_next_pass(100.0, poll, busy=True, deadline_in=None,
                                settings=SETTINGS) == 2.0
    assert seconds_to_next_pass(100.0, poll, False, None, SETTINGS) == 30.0
    assert seconds_to_next_pass(100.0, poll, False, 5.0, SETTINGS) == 5.0
    assert seconds_to_next_pass(100.0, poll, False, -3.0, SETTINGS) == 0.0
    assert seconds_to_next_pass(100.0, ProgressPoll(due=500.0), False, None, SETTINGS) == 60.0
    assert seconds_to_next_pass(100.0, poll, True, None, SETTINGS, again=True) == 0.0


def test_a_pass_that_records_a_recovery_is_followed_at_once():
    """Its own status write wakes nobody: the launch that builds on it must not wait."""
    cluster = running(failurePolicy={"backoffSeconds": 0})
    cluster.terminate(cluster.attempt_pods()[0], 1)
    cluster.terminate(cluster.attempt_pods()[1], 143)
    observed = cluster.observe()
    plan = decide(observed)
    assert plan.status.phase == "Restarting" and not plan.create_pods
    assert decided_anew(observed, plan)
    cluster.reconcile()
    observed = cluster.observe()
    plan = decide(observed)
    assert plan.create_pods  # the relaunch, decided on the recorded recovery
    progress_only = running()
    progress_only.progress = contract.ProgressReport(step=40)
    observed = progress_only.observe()
    plan = decide(observed)
    assert plan.status.step == 40 and not decided_anew(observed, plan)


# ----------------------------------------------------------------- settled or busy ---


def passes(cluster: FakeCluster) -> bool:
    """One pass; whether it left the job settled."""
    observed = cluster.observe()
    plan = decide(observed)
    cluster.reconcile()
    return settled(observed, plan)


def running(**overrides) -> FakeCluster:
    cluster = FakeCluster(spec(**overrides))
    assert not passes(cluster)  # launch written: pods and service to create
    cluster.run_all()
    assert not passes(cluster)  # phase Running written: the next pass decides on it
    assert cluster.status.phase == "Running"
    assert passes(cluster)  # nothing under way
    return cluster


def test_a_training_gang_is_settled():
    cluster = running()
    cluster.progress = contract.ProgressReport(step=12, checkpoint_step=10)
    assert passes(cluster)


def test_launching_starting_and_recovering_are_busy():
    cluster = FakeCluster(spec(failurePolicy={"backoffSeconds": 30}))
    assert not passes(cluster)  # first launch
    assert not passes(cluster)  # pods not running yet
    cluster.run_all()
    assert not passes(cluster)
    assert passes(cluster)
    cluster.terminate(cluster.attempt_pods()[1], 1)  # a crash: backoff of 30 s
    assert not passes(cluster)
    cluster.terminate(cluster.attempt_pods()[0], 143)
    assert not passes(cluster)
    assert cluster.status.phase == "Restarting"
    assert not passes(cluster)  # waiting out the backoff is busy: time alone ends it


def test_a_rank_on_a_node_that_is_not_ready_or_due_for_maintenance_is_busy():
    cluster = running()
    node = cluster.attempt_pods()[0]["spec"]["nodeName"]
    cluster.nodes_ready = {node: False}
    cluster.nodes_not_ready_since = {node: cluster.now}
    assert not passes(cluster)
    cluster.nodes_ready, cluster.nodes_not_ready_since = {node: True}, {}
    assert passes(cluster)
    cluster.nodes_maintenance = {node: cluster.now + timedelta(hours=6)}
    assert not passes(cluster)


def test_a_recovery_stays_busy_until_training_passes_its_restore():
    cluster = running(failurePolicy={"backoffSeconds": 0})
    cluster.progress = contract.ProgressReport(step=30, checkpoint_step=20)
    passes(cluster)
    cluster.progress = None
    cluster.disrupt(cluster.attempt_pods()[0])
    assert not passes(cluster)
    cluster.terminate_all(contract.EXIT_PREEMPTED_SAVED, step=31, checkpoint=31)
    assert not passes(cluster)  # the new gang is launched
    cluster.run_all()
    assert not passes(cluster)
    assert cluster.status.phase == "Running"
    assert not passes(cluster)  # no step past the restore yet: its downtime is open
    cluster.progress = contract.ProgressReport(step=32, checkpoint_step=31)
    passes(cluster)
    assert cluster.status.recoveries[-1].downtime_seconds is not None
    assert passes(cluster)


def test_an_ended_job_is_settled_once_nothing_runs():
    cluster = running()
    cluster.terminate(cluster.attempt_pods()[0], contract.EXIT_CONFIG_ERROR)
    assert not passes(cluster)  # the job fails: rank 1 is stopped
    assert cluster.status.phase == "Failed"
    assert not passes(cluster)  # rank 1 still terminating (forced if stuck): busy
    cluster.terminate(cluster.attempt_pods()[1], 143)
    passes(cluster)  # the tracking finalizers are released
    assert passes(cluster)


def test_a_finishing_gang_waits_for_the_last_rank_s_exit():
    cluster = running()
    cluster.terminate(cluster.attempt_pods()[0], 0)
    assert passes(cluster)  # rank 1 still trains: its exit will be an event
    cluster.terminate(cluster.attempt_pods()[1], 0)
    assert not passes(cluster)
    assert cluster.status.phase == "Succeeded"


def test_a_gang_shrunk_for_capacity_has_a_deadline_to_grow_back():
    grow_back = timedelta(minutes=5)
    cluster = running()
    observed = cluster.observe()
    assert next_deadline(observed, decide(observed), grow_back) is None
    cluster.spec = spec(replicas=2, minReplicas=1)
    cluster.status.replicas = 1
    cluster.status.conditions.append(cluster.status.conditions[0].model_copy(update={
        "type": "CapacityLimited", "status": "True", "reason": "Unschedulable"}))
    since = cluster.status.conditions[-1].last_transition_time
    observed = cluster.observe()
    assert next_deadline(observed, decide(observed), grow_back) == since + grow_back


def test_a_bad_pacing_setting_names_the_setting(monkeypatch):
    monkeypatch.setenv("TARDIGRADE_PACING", "lazy")
    with pytest.raises(SystemExit, match="TARDIGRADE_PACING='lazy': expected one of adaptive"):
        OperatorConfig.from_env()
    monkeypatch.setenv("TARDIGRADE_PACING", "fixed")
    monkeypatch.setenv("TARDIGRADE_PROGRESS_MAX_INTERVAL_SECONDS", "90")
    settings = OperatorConfig.from_env().pacing_settings()
    assert settings.fixed and settings.progress_max_seconds == 90
    monkeypatch.setenv("TARDIGRADE_PROGRESS_MAX_INTERVAL_SECONDS", "0")
    with pytest.raises(SystemExit, match="TARDIGRADE_PROGRESS_MAX_INTERVAL_SECONDS=0: expected"):
        OperatorConfig.from_env()
