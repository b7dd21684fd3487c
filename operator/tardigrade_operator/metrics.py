"""Prometheus metrics of the operator."""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Iterator

from prometheus_client import REGISTRY, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from tardigrade_operator.api.types import TrainingJobStatus

RECOVERIES = Counter(
    "tardigrade_recoveries_total", "Gang relaunches by cause", ["cause"]
)
RECOVERY_DOWNTIME = Histogram(
    "tardigrade_recovery_downtime_seconds",
    "From a disruption until the relaunched gang trained again",
    ["cause"],
    buckets=(1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1800),
)
RECONCILE_SECONDS = Histogram(
    "tardigrade_reconcile_duration_seconds", "Time to observe, decide and act for one job",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
)


class JobPhaseCollector(Collector):
    """`tardigrade_jobs{phase}`: how many TrainingJobs are in each phase right now."""

    def __init__(self) -> None:
        self.phases: dict[tuple[str, str], str] = {}

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily("tardigrade_jobs", "TrainingJobs by phase", labels=["phase"])
        for phase, count in sorted(Tally(self.phases.values()).items()):
            family.add_metric([phase], count)
        yield family


JOB_PHASES = JobPhaseCollector()
REGISTRY.register(JOB_PHASES)


def record_transition(key: tuple[str, str], old: TrainingJobStatus,
                      new: TrainingJobStatus) -> None:
    JOB_PHASES.phases[key] = new.phase
    known = {(r.attempt, r.cause) for r in old.recoveries}
    for recovery in new.recoveries:
        if (recovery.attempt, recovery.cause) not in known:
            RECOVERIES.labels(recovery.cause).inc()
    closed = {r.attempt for r in old.recoveries if r.downtime_seconds is not None}
    for recovery in new.recoveries:
        if recovery.downtime_seconds is not None and recovery.attempt not in closed:
            RECOVERY_DOWNTIME.labels(recovery.cause).observe(recovery.downtime_seconds)


def forget(key: tuple[str, str]) -> None:
    JOB_PHASES.phases.pop(key, None)
