"""Goodput of a training run, from its step log and the disruptions it went through.

Goodput = time spent on steps whose result was kept / wall time. A step computed by one attempt
is kept unless a later attempt resumed from an earlier step (then it was computed again: the
first computation was lost). Pure functions over the trainer's JSON-lines records (as
`StepLog.records`, each tagged with its `attempt`), so they can be checked without a cluster.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any


@dataclasses.dataclass(frozen=True)
class StepRun:
    """One computation of one step."""

    attempt: int
    step: int
    time: float  # when it ended: the trainer's clock, seconds since the epoch
    seconds: float  # time spent on it (see `step_runs`)


@dataclasses.dataclass(frozen=True)
class Disruption:
    kind: str  # "preemption" or "resize"
    time: float  # when it was caused, same clock as the trainer's
    attempt: int  # the attempt it hit


@dataclasses.dataclass(frozen=True)
class DisruptionCost:
    disruption: Disruption
    # From the disruption to the first step of a later attempt (None: training never resumed).
    recovery_seconds: float | None
    # Its parts: until the hit attempt's last record (the save on notice, if any), until the
    # next attempt's trainer started; the rest is start-up (restore, compilation).
    stopped_seconds: float | None
    relaunch_seconds: float | None
    steps_lost: int  # steps the hit attempt computed that were not kept


@dataclasses.dataclass(frozen=True)
class RunReport:
    wall_seconds: float
    kept_seconds: float
    steps_kept: int
    steps_computed: int
    costs: tuple[DisruptionCost, ...]

    @property
    def goodput(self) -> float:
        return self.kept_seconds / self.wall_seconds if self.wall_seconds > 0 else 0.0

    def of_kind(self, kind: str) -> list[DisruptionCost]:
        return [c for c in self.costs if c.disruption.kind == kind]


def step_runs(records: Iterable[Mapping[str, Any]]) -> list[StepRun]:
    """Every step computation, in time order.

    A step's time is the gap since the previous step of the same attempt. The first step of an
    attempt also pays for start-up and compilation, which is not training: it counts as the
    median step of its attempt (of the whole run when the attempt has no other step).
    """
    by_attempt: dict[int, list[tuple[float, int]]] = {}
    for record in records:
        if record.get("event") == "step":
            by_attempt.setdefault(int(record["attempt"]), []).append(
                (float(record["time"]), int(record["step"])))
    gaps: dict[int, list[float]] = {}
    for attempt, steps in by_attempt.items():
        steps.sort()
        gaps[attempt] = [b[0] - a[0] for a, b in itertools.pairwise(steps)]
    every_gap = [g for values in gaps.values() for g in values]
    fallback = statistics.median(every_gap) if every_gap else 0.0
    runs = []
    for attempt, steps in by_attempt.items():
        first = statistics.median(gaps[attempt]) if gaps[attempt] else fallback
        for (when, step), seconds in zip(steps, [first, *gaps[attempt]], strict=True):
            runs.append(StepRun(attempt, step, when, seconds))
    return sorted(runs, key=lambda r: (r.time, r.attempt, r.step))


def resume_steps(runs: Sequence[StepRun]) -> dict[int, int]:
    """attempt -> the step it resumed after (its first step - 1)."""
    first: dict[int, int] = {}
    for run in runs:
        first[run.attempt] = min(first.get(run.attempt, run.step), run.step)
    return {attempt: step - 1 for attempt, step in first.items()}


def kept(runs: Sequence[StepRun]) -> list[bool]:
    """For each run: is its result part of the final model? Not when any later attempt
    resumed from before it."""
    resumed = resume_steps(runs)
    attempts = sorted(resumed)
    # The lowest resume point of all attempts after each one.
    horizon: dict[int, float] = {}
    lowest = math.inf
    for attempt in reversed(attempts):
        horizon[attempt] = lowest
        lowest = min(lowest, resumed[attempt])
    return [run.step <= horizon[run.attempt] for run in runs]


def disruption_cost(runs: Sequence[StepRun], keep: Sequence[bool], disruption: Disruption,
                    lifetimes: Mapping[int, tuple[float, float]]) -> DisruptionCost:
    def since(times: Iterable[float]) -> float | None:
        after = [t for t in times if t >= disruption.time]
        return min(after) - disruption.time if after else None

    later = [r for r in runs if r.attempt > disruption.attempt]
    hit = lifetimes.get(disruption.attempt)
    lost = sum(1 for r, k in zip(runs, keep, strict=True)
               if r.attempt == disruption.attempt and not k)
    return DisruptionCost(
        disruption,
        recovery_seconds=since(r.time for r in later),
        # Killed at once (no save), its last record may predate the disruption.
        stopped_seconds=max(0.0, hit[1] - disruption.time) if hit else None,
        relaunch_seconds=since(first for a, (first, _) in lifetimes.items()
                               if a > disruption.attempt),
        steps_lost=lost,
    )


def attempt_lifetimes(records: Iterable[Mapping[str, Any]]) -> dict[int, tuple[float, float]]:
    """attempt -> (its first record: the trainer started, its last: it stopped)."""
    spans: dict[int, tuple[float, float]] = {}
    for record in records:
        attempt, when = int(record["attempt"]), float(record["time"])
        first, last = spans.get(attempt, (when, when))
        spans[attempt] = (min(first, when), max(last, when))
    return spans


def run_report(records: Sequence[Mapping[str, Any]], disruptions: Sequence[Disruption],
               started: float, ended: float | None = None) -> RunReport:
    """The report of one run from `started` (the job's submission) to `ended` (default: its
    last step)."""
    runs = step_runs(records)
    keep = kept(runs)
    lifetimes = attempt_lifetimes(r for r in records if "time" in r and "attempt" in r)
    end = ended if ended is not None else max((r.time for r in runs), default=started)
    costs = tuple(disruption_cost(runs, keep, d, lifetimes) for d in disruptions)
    return RunReport(
        wall_seconds=end - started,
        kept_seconds=sum(r.seconds for r, k in zip(runs, keep, strict=True) if k),
        steps_kept=sum(keep),
        steps_computed=len(runs),
        costs=costs,
    )


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 1]); with few values p99 is the largest."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1 if q > 0 else 0)]
