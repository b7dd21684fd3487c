"""What a save costs the training loop: the time the loop lost over the steps it overlapped.

A save's own `blocked_s` is only part of it: on an accelerator the next step may wait for the
device buffers it donates, and a save's background work may slow the steps it overlaps. So
the session times the loop itself: each step's wall time (from one `report` to the next),
the median of recent steps with no save in flight as the baseline, and, for each save, the
sum of the excess of every step from the save's start until it has committed (or failed).
Exact when every step is waited for (the reference loop reads its loss at every logged
step); with unlogged steps the excess lands on the step that waits, inside the same sum.
"""

from __future__ import annotations

import collections
import dataclasses
import statistics
from collections.abc import Mapping
from typing import Any

# Steps without a save in flight that make the baseline, and how many it needs.
BASELINE_STEPS = 20
MIN_BASELINE_STEPS = 3


@dataclasses.dataclass
class _Open:
    step: int
    reason: str
    blocked_s: float
    # What the save staged on the device (staged_bytes, staging_budget_bytes, staging_budget).
    staging: dict[str, Any]
    durations: list[float] = dataclasses.field(default_factory=list)


class SaveStall:
    """Feed it every step's end and every save's start; it returns one record per save."""

    def __init__(self) -> None:
        self._baseline: collections.deque[float] = collections.deque(maxlen=BASELINE_STEPS)
        self._last_end: float | None = None
        self._open: _Open | None = None

    def save_started(self, step: int, reason: str, blocked_s: float,
                     staging: Mapping[str, Any] | None = None) -> dict[str, Any] | None:
        """Returns the record of the previous save when it was still open: a save waits for
        the one before it, so that one has ended, and its steps are all counted. `staging`:
        what the save staged, carried into its record."""
        previous, self._open = self._close(), _Open(step, reason, blocked_s,
                                                    {"staged_bytes": 0, **(staging or {})})
        return previous

    def step_ended(self, now: float, saving: bool) -> dict[str, Any] | None:
        """`now`: the step's end (a monotonic clock); `saving`: a save is still in flight.
        Returns the record of the save that has just ended, if any."""
        last, self._last_end = self._last_end, now
        if last is None:
            return None
        duration = now - last
        if self._open is None:
            self._baseline.append(duration)
            return None
        self._open.durations.append(duration)
        return None if saving else self._close()

    def _close(self) -> dict[str, Any] | None:
        done, self._open = self._open, None
        if done is None or not done.durations:
            return None
        if len(self._baseline) < MIN_BASELINE_STEPS:
            return None  # no steady steps to compare with (the save came right after start)
        median = statistics.median(self._baseline)
        lost = sum(done.durations) - median * len(done.durations)
        return {"step": done.step, "reason": done.reason, "lost_s": round(lost, 6),
                "steps": len(done.durations), "step_s": round(median, 6),
                "blocked_s": round(done.blocked_s, 6), **done.staging}
