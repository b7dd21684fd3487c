"""When to save and which committed checkpoints to keep: small composable objects."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Protocol


class KeepPolicy(Protocol):
    def keep(self, steps: Sequence[int]) -> set[int]:
        """Of the committed `steps`, those this policy wants kept."""
        ...


@dataclasses.dataclass(frozen=True)
class KeepLast:
    n: int

    def keep(self, steps: Sequence[int]) -> set[int]:
        return set(sorted(steps)[-self.n :]) if self.n > 0 else set()


@dataclasses.dataclass(frozen=True)
class KeepEvery:
    """Keep every checkpoint whose step is a multiple of `k`, permanently."""

    k: int

    def keep(self, steps: Sequence[int]) -> set[int]:
        return {s for s in steps if self.k > 0 and s % self.k == 0}


@dataclasses.dataclass(frozen=True)
class _Union:
    policies: tuple[KeepPolicy, ...]

    def keep(self, steps: Sequence[int]) -> set[int]:
        kept: set[int] = set()
        for policy in self.policies:
            kept |= policy.keep(steps)
        return kept


def keep_union(*policies: KeepPolicy) -> KeepPolicy:
    """Keep a checkpoint if any of `policies` keeps it."""
    return _Union(tuple(policies))


def deletable(policy: KeepPolicy, committed: Sequence[int]) -> list[int]:
    """Committed steps the policy releases; the newest committed one is never among them."""
    if not committed:
        return []
    newest = max(committed)
    kept = policy.keep(committed) | {newest}
    return sorted(s for s in committed if s not in kept)


@dataclasses.dataclass
class SaveInterval:
    """Save every `steps` steps and/or every `seconds` seconds (whichever comes first)."""

    steps: int | None = None
    seconds: float | None = None
    clock: Callable[[], float] = time.monotonic
    _last_time: float = dataclasses.field(default=0.0, init=False)

    def __post_init__(self) -> None:
        self._last_time = self.clock()

    def due_by_step(self, step: int) -> bool:
        return bool(self.steps) and step % self.steps == 0

    def due_by_time(self) -> bool:
        return self.seconds is not None and self.clock() - self._last_time >= self.seconds

    def should_save(self, context: SaveContext) -> bool:
        return self.due_by_step(context.step) or self.due_by_time()

    def saved(self, started_at: float | None = None, blocked_seconds: float = 0.0) -> None:
        self._last_time = self.clock()


@dataclasses.dataclass(frozen=True)
class SaveContext:
    """What a save decision may look at besides the clock."""

    step: int
    saving: bool  # a save is in flight: started, neither committed nor failed yet


class SavePolicy(Protocol):
    def should_save(self, context: SaveContext) -> bool:
        """Whether to start a save at `context.step`."""
        ...

    def saved(self, started_at: float, blocked_seconds: float) -> None:
        """A save started at `started_at` (the policy's clock) and held the loop that long."""
        ...


@dataclasses.dataclass
class ContinuousSaving:
    """Save again as soon as the last save is done (committed or failed), as Orbax's
    `ContinuousCheckpointingPolicy` does, within a budget of the loop's time: the seconds a
    save holds the loop (its snapshot, and any wait before it) stay below
    `max_loop_fraction` of the loop's time from that save's start to the next one's. A save
    that held the loop for `b` seconds lets the next one start `b / max_loop_fraction` after
    it started, at the earliest: 0.05 with 0.2 s snapshots saves at most every 4 s."""

    max_loop_fraction: float
    clock: Callable[[], float] = time.monotonic
    _next_at: float | None = dataclasses.field(default=None, init=False)

    def __post_init__(self) -> None:
        if not 0 < self.max_loop_fraction <= 1:
            raise ValueError(f"max_loop_fraction must be in (0, 1], got {self.max_loop_fraction}")

    def should_save(self, context: SaveContext) -> bool:
        if context.saving:
            return False  # never two saves at once: the next one starts once this one is done
        return self._next_at is None or self.clock() >= self._next_at

    def saved(self, started_at: float, blocked_seconds: float) -> None:
        self._next_at = started_at + max(0.0, blocked_seconds) / self.max_loop_fraction


@dataclasses.dataclass(frozen=True)
class AnySave:
    """Save when any of `policies` wants to; each one hears of every save."""

    policies: tuple[SavePolicy, ...]

    def should_save(self, context: SaveContext) -> bool:
        # Every policy is asked (none short-circuited): asking may be what moves one on.
        wanted = [policy.should_save(context) for policy in self.policies]
        return any(wanted)

    def saved(self, started_at: float, blocked_seconds: float) -> None:
        for policy in self.policies:
            policy.saved(started_at, blocked_seconds)
