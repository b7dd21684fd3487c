"""Where this trainer's wall time goes, phase by phase: the trainer's side of the goodput account.

The operator splits a job's wall time into buckets (its goodput account). What happens inside
a trainer it cannot see: the clock here keeps one running phase at a time and the seconds
spent in each, and rank 0's progress report carries them (contract.PHASE_SECONDS_FIELDS),
the running phase counted up to the moment the report is served. Phases:

- accelerator_start: from the process's start (phases.process_started) until its devices are
  up and jax.distributed is initialised;
- restore: the restore of the gang's checkpoint (or the initialisation of a new state);
- compile: the loop waiting for its compiled step (a loop that compiles inside its first
  step counts that step as training: JAX gives no sign of it from outside);
- checkpoint_stall: the loop blocked by a save;
- train: the step loop, from its first step on, stalls left out.

Time in no phase (between them: the loop's own set-up) is left out of every figure, and the
operator books it as `other`. Monotonic clock; dependency-free.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

ACCELERATOR_START = "accelerator_start"
RESTORE = "restore"
COMPILE = "compile"
CHECKPOINT_STALL = "checkpoint_stall"
TRAIN = "train"
PHASES = (ACCELERATOR_START, RESTORE, COMPILE, CHECKPOINT_STALL, TRAIN)


class PhaseClock:
    """The seconds spent in each phase; one phase (or none) runs at a time."""

    def __init__(self, seconds_since_start: float = 0.0,
                 now: Callable[[], float] = time.monotonic) -> None:
        """Starts in accelerator_start, `seconds_since_start` into it (the process began
        before this clock was made)."""
        self._now = now
        self._lock = threading.Lock()
        self._totals = dict.fromkeys(PHASES, 0.0)
        self._running: str | None = ACCELERATOR_START
        self._since = self._now() - max(0.0, seconds_since_start)

    def switch(self, phase: str | None) -> str | None:
        """End the running phase and start `phase` (None: no phase); returns the one ended."""
        if phase is not None and phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}: one of {', '.join(PHASES)}")
        with self._lock:
            now = self._now()
            ended = self._running
            if ended is not None:
                self._totals[ended] += now - self._since
            self._running, self._since = phase, now
            return ended

    @contextlib.contextmanager
    def during(self, phase: str) -> Iterator[None]:
        """Count the block as `phase`, then go back to the phase that ran before it."""
        before = self.switch(phase)
        try:
            yield
        finally:
            self.switch(before)

    @property
    def running(self) -> str | None:
        with self._lock:
            return self._running

    def seconds(self) -> dict[str, float]:
        """Seconds per phase so far, the running one included: the report's fields."""
        with self._lock:
            totals = dict(self._totals)
            if self._running is not None:
                totals[self._running] += self._now() - self._since
        # Microseconds: a save that blocked the loop for 0.3 ms still shows.
        return {f"{phase}_seconds": round(value, 6) for phase, value in totals.items()}


def since_process_start() -> float:
    """Seconds since this process's trainer started (0 where that is not known)."""
    from tardigrade_sdk import phases

    started = phases.process_started()
    return 0.0 if started is None else max(0.0, time.time() - started)
