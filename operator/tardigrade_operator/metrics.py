"""Prometheus metrics of the operator.

Per-job series carry `namespace` and `name` (one TrainingJob is one training run, so the
cardinality is the number of jobs) and are dropped when the job is deleted. The downtime
histogram stays cluster-wide (by cause) for percentiles across jobs.
"""

from __future__ import annotations

import platform
from collections.abc import Iterator
from importlib import metadata
from typing import get_args

from prometheus_client import REGISTRY, Counter, Histogram, Info
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from tardigrade_operator.api.types import Goodput, Phase, RecoveryCause, TrainingJobStatus
from tardigrade_operator.decision.goodput import buckets as goodput_buckets

JobKey = tuple[str, str]
JOB_LABELS = ("namespace", "name")

RECOVERIES = Counter(
    "tardigrade_recoveries_total", "Gang relaunches by job and cause", [*JOB_LABELS, "cause"]
)
DOWNTIME = Counter(
    "tardigrade_downtime_seconds_total",
    "Seconds from a disruption until the relaunched gang trained again, by job and cause",
    [*JOB_LABELS, "cause"],
)
STEPS_LOST = Counter(
    "tardigrade_steps_lost_total",
    "Steps trained but not in the checkpoint a relaunch restored, by job and cause",
    [*JOB_LABELS, "cause"],
)
RECOVERY_DOWNTIME = Histogram(
    "tardigrade_recovery_downtime_seconds",
    "From a disruption until the relaunched gang trained again (all jobs)",
    ["cause"],
    buckets=(1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1800),
)
RECONCILE_SECONDS = Histogram(
    "tardigrade_reconcile_duration_seconds", "Time to observe, decide and act for one job",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
)
BUILD = Info("tardigrade_build", "Operator build: version, Python and kopf versions")

PHASES: tuple[str, ...] = get_args(Phase)
CAUSES: tuple[str, ...] = get_args(RecoveryCause)


def _distribution_version(module: str) -> str:
    """The installed version of the distribution that ships `module` ("unknown" if none)."""
    for dist in metadata.packages_distributions().get(module, []):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return "unknown"


def build_labels() -> dict[str, str]:
    return {
        "version": _distribution_version("tardigrade_operator"),
        "python": platform.python_version(),
        "kopf": _distribution_version("kopf"),
    }


BUILD.info(build_labels())


class JobPhaseCollector(Collector):
    """`tardigrade_jobs{phase}`: how many TrainingJobs are in each phase right now.

    Every phase is always reported, 0 included, so `tardigrade_jobs{phase="Failed"} > 0`
    alerts and dashboards see a series before the first failure.
    """

    def __init__(self) -> None:
        self.phases: dict[JobKey, str] = {}

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily("tardigrade_jobs", "TrainingJobs by phase", labels=["phase"])
        counts = dict.fromkeys(PHASES, 0)
        for phase in self.phases.values():
            counts[phase] = counts.get(phase, 0) + 1
        for phase, count in counts.items():
            family.add_metric([phase], count)
        yield family


JOB_PHASES = JobPhaseCollector()
REGISTRY.register(JOB_PHASES)


class GoodputCollector(Collector):
    """`tardigrade_goodput_seconds{namespace,name,bucket}` and `tardigrade_goodput_ratio`:
    each job's goodput account as its status has it (decision/goodput.py). Gauges, not
    counters: a disruption's lost steps move seconds out of `productive`."""

    def __init__(self) -> None:
        self.accounts: dict[JobKey, Goodput] = {}

    def collect(self) -> Iterator[GaugeMetricFamily]:
        seconds = GaugeMetricFamily(
            "tardigrade_goodput_seconds", "A job's wall time since creation by where it went "
            "(the buckets add up to its wall time)", labels=[*JOB_LABELS, "bucket"])
        ratio = GaugeMetricFamily(
            "tardigrade_goodput_ratio", "A job's productive training time over its wall time",
            labels=list(JOB_LABELS))
        for (namespace, name), account in sorted(self.accounts.items()):
            for bucket, value in goodput_buckets(account).items():
                seconds.add_metric([namespace, name, bucket], value)
            ratio.add_metric([namespace, name], account.fraction)
        yield seconds
        yield ratio


JOB_GOODPUT = GoodputCollector()
REGISTRY.register(JOB_GOODPUT)


def record_transition(key: JobKey, old: TrainingJobStatus, new: TrainingJobStatus) -> None:
    """Count what this status write added: new recoveries, closed downtimes, steps lost."""
    namespace, name = key
    JOB_PHASES.phases[key] = new.phase
    if new.goodput is not None:
        JOB_GOODPUT.accounts[key] = new.goodput
    before = {(r.attempt, r.cause): r for r in old.recoveries}
    for recovery in new.recoveries:
        labels = (namespace, name, recovery.cause)
        earlier = before.get((recovery.attempt, recovery.cause))
        if earlier is None:
            RECOVERIES.labels(*labels).inc()
        if recovery.downtime_seconds is not None and (
            earlier is None or earlier.downtime_seconds is None
        ):
            DOWNTIME.labels(*labels).inc(recovery.downtime_seconds)
            RECOVERY_DOWNTIME.labels(recovery.cause).observe(recovery.downtime_seconds)
        if recovery.steps_lost is not None and (earlier is None or earlier.steps_lost is None):
            STEPS_LOST.labels(*labels).inc(recovery.steps_lost)


def forget(key: JobKey) -> None:
    """Drop a deleted job's series: a gone job should not be scraped forever."""
    JOB_PHASES.phases.pop(key, None)
    JOB_GOODPUT.accounts.pop(key, None)
    for metric in (RECOVERIES, DOWNTIME, STEPS_LOST):
        for cause in CAUSES:
            # remove() raises KeyError for label sets never used.
            try:
                metric.remove(*key, cause)
            except KeyError:
                continue
