"""Operator metrics as Prometheus scrapes them, driven by real decide() status transitions."""

from __future__ import annotations

import sys

import kopf
import prometheus_client
from prometheus_client.parser import text_string_to_metric_families
from tardigrade_contract import contract
from tardigrade_operator import metrics
from tardigrade_operator.api.types import TrainingJobStatus

from tests.operator.fake_cluster import FakeCluster, spec

SAVED = contract.EXIT_PREEMPTED_SAVED


def _scrape() -> dict[str, list]:
    text = prometheus_client.generate_latest(prometheus_client.REGISTRY).decode()
    return {family.name: family.samples for family in text_string_to_metric_families(text)}


def _value(metric: str, **labels: str) -> float | None:
    return prometheus_client.REGISTRY.get_sample_value(metric, labels)


def _step(cluster: FakeCluster, key: tuple[str, str]) -> None:
    before = cluster.status
    cluster.reconcile()
    metrics.record_transition(key, before, cluster.status)


def test_build_info_names_the_versions():
    samples = _scrape()["tardigrade_build_info"]
    assert len(samples) == 1
    labels = samples[0].labels
    assert samples[0].name == "tardigrade_build_info" and samples[0].value == 1
    assert labels["kopf"] == kopf.__version__
    assert labels["python"] == "{}.{}.{}".format(*sys.version_info[:3])
    assert labels["version"] not in ("", "unknown")


def test_every_phase_is_reported_even_without_jobs():
    key = ("metrics-phases", "only")
    metrics.forget(key)
    before = {s.labels["phase"]: s.value for s in _scrape()["tardigrade_jobs"]}
    assert set(before) == set(metrics.PHASES)
    metrics.JOB_PHASES.phases[key] = "Failed"
    after = {s.labels["phase"]: s.value for s in _scrape()["tardigrade_jobs"]}
    assert after["Failed"] == before["Failed"] + 1
    metrics.forget(key)
    assert {s.labels["phase"]: s.value for s in _scrape()["tardigrade_jobs"]} == before


def test_a_preemption_is_counted_once_per_job_with_downtime_and_steps_lost():
    key = ("metrics-ns", "preempted")
    job = {"namespace": key[0], "name": key[1], "cause": "Preemption"}
    cluster = FakeCluster(spec())
    for _ in range(2):
        _step(cluster, key)
        cluster.run_all()
    cluster.progress = contract.ProgressReport(step=30, checkpoint_step=20)
    _step(cluster, key)
    cluster.disrupt(cluster.attempt_pods()[0])
    _step(cluster, key)
    _step(cluster, key)  # the same disruption seen again is not a second recovery
    assert _value("tardigrade_recoveries_total", **job) == 1
    cluster.terminate_all(SAVED, step=30, checkpoint=25)
    _step(cluster, key)  # relaunch from 25: steps 26..30 are trained again
    assert _value("tardigrade_steps_lost_total", **job) == 5
    assert _value("tardigrade_downtime_seconds_total", **job) is None
    cluster.run_all()
    cluster.advance(12)
    cluster.progress = contract.ProgressReport(step=26)
    _step(cluster, key)
    _step(cluster, key)
    assert _value("tardigrade_downtime_seconds_total", **job) == 12
    assert _value("tardigrade_steps_lost_total", **job) == 5
    assert _value("tardigrade_recoveries_total", **job) == 1
    # Another job's series are its own.
    assert _value("tardigrade_recoveries_total", namespace="metrics-ns", name="other",
                  cause="Preemption") is None


def test_deleting_a_job_drops_its_series():
    key = ("metrics-ns", "deleted")
    old = TrainingJobStatus()
    new = TrainingJobStatus.model_validate({"phase": "Restarting", "recoveries": [
        {"cause": "Failure", "time": "2026-12-02T12:00:00Z", "attempt": 2, "stepsLost": 3,
         "downtimeSeconds": 4.0}]})
    metrics.record_transition(key, old, new)
    labels = {"namespace": key[0], "name": key[1], "cause": "Failure"}
    assert _value("tardigrade_recoveries_total", **labels) == 1
    assert _value("tardigrade_steps_lost_total", **labels) == 3
    metrics.forget(key)
    assert _value("tardigrade_recoveries_total", **labels) is None
    assert _value("tardigrade_steps_lost_total", **labels) is None
    assert _value("tardigrade_downtime_seconds_total", **labels) is None


def test_a_jobs_goodput_account_is_scraped_per_bucket_and_dropped_with_the_job():
    key = ("metrics-ns", "goodput")
    cluster = FakeCluster(spec())
    _step(cluster, key)
    cluster.run_all()
    cluster.advance(12)
    _step(cluster, key)
    cluster.advance(30)
    cluster.progress = contract.ProgressReport(step=20, attempt=1, accelerator_start_seconds=5,
                                               train_seconds=20)
    _step(cluster, key)
    account = cluster.status.goodput
    scraped = {s.labels["bucket"]: s.value for s in _scrape()["tardigrade_goodput_seconds"]
               if (s.labels["namespace"], s.labels["name"]) == key}
    assert scraped["productive"] == 20 and scraped["acceleratorStart"] == 5
    assert sum(scraped.values()) == account.wall_seconds == 42
    assert _value("tardigrade_goodput_ratio", namespace=key[0], name=key[1]) == account.fraction
    metrics.forget(key)
    assert _value("tardigrade_goodput_ratio", namespace=key[0], name=key[1]) is None
    assert not [s for s in _scrape()["tardigrade_goodput_seconds"]
                if (s.labels["namespace"], s.labels["name"]) == key]
