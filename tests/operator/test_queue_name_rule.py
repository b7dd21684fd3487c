"""The admin's rule that TrainingJobs carry Kueue's queue label (queue_name_rule.py, chart value
kueue.requireQueueName): a covered, unlabelled job is held before any pod or Workload and told
the fix; a labelled one, one elsewhere, or any job with the rule off runs as before."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from tardigrade_operator.api.parse import parse_spec
from tardigrade_operator.config import OperatorConfig
from tardigrade_operator.decision import queueing
from tardigrade_operator.decision.queue_name_rule import (
    ENV,
    REASON,
    QueueNameRule,
    held_for_queue_name,
)
from tardigrade_operator.decision.queueing import JobIdentity, gate_for

from tests.operator.fake_cluster import JOB, FakeCluster, spec

NOW = datetime(2026, 1, 1, tzinfo=UTC)
EVERYWHERE = QueueNameRule(everywhere=True)
TEAMS = QueueNameRule(namespaces=frozenset({"team-a", "team-b"}))


def test_the_rule_holds_only_unlabelled_never_launched_jobs_in_covered_namespaces():
    assert held_for_queue_name(EVERYWHERE, "any", None, launched=False)
    assert held_for_queue_name(TEAMS, "team-a", None, launched=False)
    assert not held_for_queue_name(TEAMS, "lab", None, launched=False)
    assert not held_for_queue_name(EVERYWHERE, "any", "team-queue", launched=False)
    assert not held_for_queue_name(QueueNameRule(), "any", None, launched=False)
    # Launched before the rule was turned on: left to run.
    assert not held_for_queue_name(EVERYWHERE, "any", None, launched=True)


@pytest.mark.parametrize(("value", "rule"), [
    (None, QueueNameRule()), ("", QueueNameRule()), ("false", QueueNameRule()),
    ("true", EVERYWHERE), ('["team-a", "team-b"]', TEAMS), ("[]", QueueNameRule()),
])
def test_the_setting_parses_each_form_the_chart_renders(value, rule):
    assert QueueNameRule.parse(value) == rule


@pytest.mark.parametrize(("value", "named"), [
    ("yes", "expected false, true"), ('{"team-a": true}', "expected false, true"),
    ('["Team_A"]', "'Team_A' is not a namespace name"), ("[1]", "expected false, true"),
])
def test_a_bad_setting_is_refused_naming_it(monkeypatch, value, named):
    with pytest.raises(ValueError, match=r"kueue\.requireQueueName") as err:
        QueueNameRule.parse(value)
    assert named in str(err.value) and ENV in str(err.value)
    monkeypatch.setenv(ENV, value)
    with pytest.raises(SystemExit, match=r"kueue\.requireQueueName"):
        OperatorConfig.from_env()


def test_the_setting_reaches_the_decision(monkeypatch):
    monkeypatch.setenv(ENV, '["team-a"]')
    config = OperatorConfig.from_env()
    assert config.decision_settings().queue_name_rule.covers("team-a")
    assert not config.decision_settings().queue_name_rule.covers("team-b")
    monkeypatch.delenv(ENV)
    assert not OperatorConfig.from_env().decision_settings().queue_name_rule.covers("team-a")


def test_a_held_job_creates_no_pod_nor_workload_and_is_told_the_fix():
    hold = queueing.queue_name_hold(JOB.namespace)
    cluster = FakeCluster(spec(), queue=hold)
    for _ in range(2):
        plan = cluster.reconcile()
        assert plan.create_pods == []
    assert cluster.status.phase == "Queued"
    held = cluster.status.conditions[-1]
    assert held.reason == REASON == hold.reason()
    assert cluster.status.message == held.message
    for part in ("add the label kueue.x-k8s.io/queue-name:",
                 f"a LocalQueue of namespace {JOB.namespace}",
                 "chart value kueue.requireQueueName"):
        assert part in cluster.status.message
    assert cluster.status.queue is None
    identity = JobIdentity(JOB.name, JOB.namespace, JOB.uid)
    assert queueing.workload_actions(identity, parse_spec(spec()), cluster.status, hold,
                                     False, None, NOW) == []


def test_adding_the_label_later_queues_the_job_in_kueue_on_the_next_pass():
    cluster = FakeCluster(spec(), queue=queueing.queue_name_hold(JOB.namespace))
    cluster.reconcile()
    # The owner adds the label: the next pass builds Kueue's gate, which makes the Workload.
    labelled = gate_for("team-queue", None, {}, 2)
    cluster.queue = labelled
    plan = cluster.reconcile()
    assert plan.create_pods == [] and cluster.status.phase == "Queued"
    assert cluster.status.conditions[-1].reason == "Queued"
    assert cluster.status.queue is not None and cluster.status.queue.local_queue == "team-queue"
    actions = queueing.workload_actions(JobIdentity(JOB.name, JOB.namespace, JOB.uid),
                                        parse_spec(spec()), cluster.status, labelled, False,
                                        None, NOW)
    assert [type(a).__name__ for a in actions] == ["CreateWorkload"]


def test_a_job_without_the_hold_launches_and_counts_as_launched():
    cluster = FakeCluster(spec())
    assert cluster.reconcile().create_pods
    # What observe reads as "launched": a gang that ran before the rule is not stopped by it.
    assert cluster.status.attempt > 0
    assert not held_for_queue_name(EVERYWHERE, JOB.namespace, None,
                                   launched=cluster.status.attempt > 0)
