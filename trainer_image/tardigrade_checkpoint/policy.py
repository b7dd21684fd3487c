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

    def saved(self) -> None:
        self._last_time = self.clock()
