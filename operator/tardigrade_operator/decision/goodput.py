"""The goodput account: a job's wall time since creation, split into where it went. Pure.

One pass at a time, the time since the account's end (`accountedUntil`) is booked to the
bucket the previous pass observed the job in (`current`): the state it was seen in is the one
it kept until this pass saw another. What the operator cannot see, inside a running trainer,
the trainer's progress report says (contract.PHASE_SECONDS_FIELDS): its phases' seconds since
its process started. The running attempt's time goes first to a pool of unexplained seconds,
and each report moves the growth of its phases out of that pool into their buckets (pro rata
when the pool holds less than they grew: the trainer started before the operator saw its
container run); a first report that comes in the pass that sees the pods start (or still
queued) takes the trainer's phases out of that interval, the rest staying where it was. What
no report explains stays in `other`. When a recovery says how many steps its restore lost,
their price (steps lost x the step loop's seconds per step) moves from `productive` to
`lostSteps`. A job first accounted once it had launched (an operator older than the account
ran it until now) books its past to `other`, less what its trainer's first report explains.

Every move takes from one bucket what it gives to another, and the pass adds exactly the
interval it books, so the buckets always add up to the wall time (whole milliseconds, kept as
integers while computing) and none goes below zero (tests/operator/test_goodput.py checks it
for arbitrary histories).

The account is moved on with the pass's other status changes, or when the job's state
changes, or at least every REFRESH: a job that waits in a queue is not written every pass.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from datetime import datetime, timedelta

from tardigrade_contract import contract

from tardigrade_operator.api.types import (
    Goodput,
    GoodputBucket,
    GoodputSeconds,
    GoodputTrainerPhases,
    TrainingJobStatus,
)
from tardigrade_operator.observation.observed import Observed
from tardigrade_operator.observation.pods import PodView

REFRESH = timedelta(minutes=5)
TERMINAL = ("Succeeded", "Failed")
# The trainer's phases (report field -> bucket), in the order they happen.
PHASE_BUCKETS: tuple[tuple[str, str], ...] = (
    ("accelerator_start", "accelerator_start"),
    ("restore", "restore"),
    ("compile", "compile"),
    ("checkpoint_stall", "checkpoint_stall"),
    ("train", "productive"),
)
# Buckets by their status name (camelCase) -> the model's field.
FIELDS: dict[str, str] = {
    "queued": "queued", "podStart": "pod_start", "acceleratorStart": "accelerator_start",
    "restore": "restore", "compile": "compile", "checkpointStall": "checkpoint_stall",
    "lostSteps": "lost_steps", "productive": "productive", "other": "other",
}
# The state in which the running attempt's time waits for its trainer's word.
RUNNING: GoodputBucket = "productive"


@dataclasses.dataclass(frozen=True)
class Sighting:
    """What one pass saw that the account books by: the job's state and the trainer's word."""

    now: datetime
    phase: str
    attempt: int
    completion_time: datetime | None
    pods: Sequence[PodView]
    report: contract.ProgressReport | None


def classify(phase: str, attempt: int, pods: Sequence[PodView],
             trainer_seen: bool) -> GoodputBucket | None:
    """The bucket a job in this state spends its time in; None once it has ended.
    `trainer_seen`: the current attempt's trainer has reported its phases."""
    if phase in TERMINAL:
        return None
    if phase == "Suspended":
        return "other"
    if phase == "Queued":
        return "queued"
    live = [p for p in pods if p.attempt == attempt and p.active and not p.deleting]
    if not live:
        # Before the first launch: waiting to be admitted and launched. Between attempts: the
        # disrupted gang stopping, a backoff, the operator relaunching.
        return "queued" if phase == "Pending" else "other"
    if any(not p.node_name for p in live):
        return "queued"  # a pod waits for capacity (unschedulable, or a scale-up)
    if any(not (p.phase == "Running" and p.container_started) for p in live):
        return "podStart"
    return RUNNING if trainer_seen else "acceleratorStart"


def _ms(seconds: float) -> int:
    return round(seconds * 1000)


def _reported_phases(report: contract.ProgressReport | None,
                     attempt: int) -> dict[str, float] | None:
    """The report's phase seconds when it is the current attempt's and carries them (a
    trainer that predates them sends none)."""
    if report is None or report.attempt not in (None, attempt):
        return None
    if all(getattr(report, f"{name}_seconds") is None for name, _ in PHASE_BUCKETS):
        return None
    return {name: getattr(report, f"{name}_seconds") or 0.0 for name, _ in PHASE_BUCKETS}


def _trains_without_phases(report: contract.ProgressReport | None, attempt: int) -> bool:
    """The current attempt's trainer predates the phase fields and has trained a step."""
    return (report is not None and report.attempt in (None, attempt)
            and _reported_phases(report, attempt) is None
            and report.step > (report.restore_step or 0))


class _Ledger:
    """The account in whole milliseconds while a pass works on it."""

    def __init__(self, previous: Goodput | None) -> None:
        seconds = previous.seconds if previous is not None else GoodputSeconds()
        self.ms = {field: _ms(getattr(seconds, field)) for field in FIELDS.values()}
        self.pool = _ms(previous.unexplained_seconds) if previous is not None else 0

    def add(self, field: str, ms: int) -> None:
        self.ms[field] += ms

    def move(self, source: str, target: str, ms: int) -> int:
        """Move up to `ms` from one bucket to another; returns what was moved."""
        moved = max(0, min(ms, self.ms[source]))
        self.ms[source] -= moved
        self.ms[target] += moved
        return moved


def account(before: Goodput | None, created: datetime | None, seen: Sighting,
            old_status: TrainingJobStatus, new_status: TrainingJobStatus,
            written_anyway: bool) -> Goodput:
    """The account after this pass. `before`: the status's account (None: none yet);
    `written_anyway`: the pass writes the status for other reasons."""
    if before is None:
        start = min(created or seen.now, seen.now)
        before = Goodput(accounted_until=start, attempt=seen.attempt, current=(
            classify(seen.phase, seen.attempt, seen.pods, False) if old_status.attempt == 0
            else "other"))
    end = seen.now
    if seen.phase in TERMINAL and seen.completion_time is not None:
        end = min(end, seen.completion_time)
    if before.current is None and seen.phase in TERMINAL:
        end = before.accounted_until  # ended, and still: the account has ended too
    end = max(end, before.accounted_until)
    same_attempt = before.attempt == seen.attempt
    trainer = before.trainer if same_attempt else None
    phases = _reported_phases(seen.report, seen.attempt)
    legacy = phases is None and _trains_without_phases(seen.report, seen.attempt)
    current = classify(seen.phase, seen.attempt, seen.pods,
                       trainer is not None or phases is not None or legacy)
    lost = _newly_lost_steps(old_status, new_status)
    due = (written_anyway or current != before.current or not same_attempt or bool(lost)
           or phases is not None or legacy or end - before.accounted_until >= REFRESH)
    if not due:
        return before

    ledger = _Ledger(before)
    # Whole milliseconds, rounded down: the account never runs past the pass's time.
    interval = (end - before.accounted_until) // timedelta(milliseconds=1)
    booked = before.current
    if (booked not in (RUNNING, "acceleratorStart", None) and same_attempt and trainer is None
            and phases is not None):
        # The trainer started and reported within one interval (seen queued, or its pods
        # starting): its phases, which fit in its process's life, say how much of the interval
        # was at least its own.
        running = min(interval, sum(_ms(seconds) for seconds in phases.values()))
        ledger.add(FIELDS[booked], interval - running)
        ledger.add("accelerator_start", running)
        ledger.pool += running
    elif booked in (RUNNING, "acceleratorStart"):
        if same_attempt:
            # The running attempt's time: unexplained until its trainer says where it went.
            ledger.add(_pool_field(trainer), interval)
            ledger.pool += interval
        else:
            # The previous attempt's gang until it was seen disrupted, stopping since.
            ledger.add("other", interval)
    else:  # None: the job had ended and is back (its end was undone): the gap is other
        ledger.add(FIELDS[booked or "other"], interval)
    if not same_attempt:
        ledger.pool = 0  # what the old attempt left unexplained stays where it is
    if phases is not None:
        trainer = _explain(ledger, trainer, phases, seen.attempt)
    elif legacy:
        # A trainer that reports steps but no phases: its running time is training.
        ledger.move(_pool_field(trainer), "productive", ledger.pool)
        ledger.pool = 0
        trainer = trainer or GoodputTrainerPhases(attempt=seen.attempt)
    price = _lost_price(lost, before.seconds_per_step)
    if price:
        ledger.move("productive", "lost_steps", price)
    return _result(ledger, before.accounted_until + timedelta(milliseconds=interval),
                   seen.attempt, current, trainer,
                   _seconds_per_step(seen.report, phases, before.seconds_per_step))


def _pool_field(trainer: GoodputTrainerPhases | None) -> str:
    """Where unexplained running time waits: the trainer's start until its first report."""
    return "accelerator_start" if trainer is None else "other"


def _explain(ledger: _Ledger, trainer: GoodputTrainerPhases | None, phases: dict[str, float],
             attempt: int) -> GoodputTrainerPhases:
    """Move the growth of the trainer's phases since its last report out of the pool."""
    source = _pool_field(trainer)
    last = trainer.model_dump() if trainer is not None else {}
    grown = {name: max(0, _ms(phases[name]) - _ms(last.get(name, 0.0)))
             for name, _ in PHASE_BUCKETS}
    total = sum(grown.values())
    available = min(ledger.pool, ledger.ms[source])
    scale = 1.0 if total <= available else available / total
    given = 0
    for name, bucket in PHASE_BUCKETS:
        given += ledger.move(source, bucket, min(int(grown[name] * scale), available - given))
    left = min(ledger.pool - given, ledger.ms[source])
    # After the first report the rest of the pool waits in `other`.
    ledger.move(source, "other", left)
    ledger.pool = max(0, left)
    # A counter that went back (a new process in the same attempt) counts from there.
    return GoodputTrainerPhases(attempt=attempt, **{
        name: max(phases[name], 0.0) for name, _ in PHASE_BUCKETS})


def _newly_lost_steps(old: TrainingJobStatus, new: TrainingJobStatus) -> int:
    """Steps lost by recoveries whose loss this pass recorded."""
    known = {(r.attempt, r.cause) for r in old.recoveries if r.steps_lost is not None}
    return sum(r.steps_lost or 0 for r in new.recoveries
               if r.steps_lost is not None and (r.attempt, r.cause) not in known)


def _lost_price(steps: int, seconds_per_step: float | None) -> int:
    return _ms(steps * seconds_per_step) if steps and seconds_per_step else 0


def _seconds_per_step(report: contract.ProgressReport | None, phases: dict[str, float] | None,
                      before: float | None) -> float | None:
    """The step loop's seconds per step in this attempt, from its report."""
    if report is None or phases is None:
        return before
    steps = report.step - (report.restore_step or 0)
    if steps <= 0 or phases["train"] <= 0:
        return before
    return round(phases["train"] / steps, 6)


def _result(ledger: _Ledger, accounted_until: datetime, attempt: int,
            current: GoodputBucket | None, trainer: GoodputTrainerPhases | None,
            seconds_per_step: float | None) -> Goodput:
    wall = sum(ledger.ms.values())
    seconds = GoodputSeconds(**{field: ms / 1000 for field, ms in ledger.ms.items()})
    return Goodput(
        wall_seconds=wall / 1000,
        fraction=round(ledger.ms["productive"] / wall, 6) if wall else 0.0,
        seconds=seconds, accounted_until=accounted_until, attempt=attempt, current=current,
        unexplained_seconds=max(0, ledger.pool) / 1000, trainer=trainer,
        seconds_per_step=seconds_per_step)


def buckets(goodput: Goodput) -> dict[str, float]:
    """Seconds per bucket, by their status names."""
    return {name: getattr(goodput.seconds, field) for name, field in FIELDS.items()}


def account_pass(obs: Observed, new_status: TrainingJobStatus) -> Goodput:
    """The account the pass's status carries: `new_status` is the one the decision writes."""
    old_status = obs.status
    unaccounted = {"goodput"}
    written_anyway = (new_status.model_dump(exclude=unaccounted)
                      != old_status.model_dump(exclude=unaccounted))
    seen = Sighting(now=obs.now, phase=new_status.phase, attempt=new_status.attempt,
                    completion_time=new_status.completion_time, pods=obs.gang.current,
                    report=obs.progress)
    return account(old_status.goodput, obs.created, seen, old_status, new_status,
                   written_anyway)
