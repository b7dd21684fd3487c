"""What a `TrainingSession` needs from a checkpoint format, and our own format behind it.

The session decides when to save and which step to restore; a backend only lists committed
steps, saves, restores and reports what it committed. `TardigradeCheckpoints` wraps our
`CheckpointManager`; `orbax_backend.OrbaxCheckpoints` wraps an Orbax `CheckpointManager`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from tardigrade_trainer import contract
from tardigrade_trainer.checkpoint import (
    CheckpointIOError,
    CheckpointManager,
    KeepEvery,
    KeepLast,
    KeepPolicy,
    keep_union,
)


@dataclasses.dataclass(frozen=True)
class Committed:
    """A committed checkpoint, as the operator hears of it (progress, termination message)."""

    step: int
    path: str
    time: str | None = None


class Checkpoints(Protocol):
    def prepare(self) -> None:
        """Before the restore decision: fail fast on unwritable storage, drop leftovers."""
        ...

    def committed_steps(self) -> list[int]:
        """Committed steps, ascending (asked on process 0 only)."""
        ...

    def restore(self, step: int, target: Any) -> Any:
        """Checkpoint `step` read into `target` (a pytree of `jax.ShapeDtypeStruct`s with the
        current mesh's shardings)."""
        ...

    def save(self, step: int, state: Any, extra: Mapping[str, Any],
             mesh: Mapping[str, int] | None = None) -> float | None:
        """Start saving `state` as `step` (may return before it is committed); the seconds
        the loop was blocked, if known."""
        ...

    def wait(self) -> None:
        """Block until the save in flight is committed; CheckpointIOError if it failed."""
        ...

    def committed(self) -> Committed | None:
        """The newest checkpoint this rank knows committed (restored or saved), if any."""
        ...

    def close(self) -> None: ...


def keep_policy(env: contract.TrainerEnvironment) -> KeepPolicy:
    """The retention the operator asked for (spec.checkpoint.keep)."""
    policies: list[KeepPolicy] = [KeepLast(env.checkpoint_keep_last or 1)]
    if env.checkpoint_keep_every:
        policies.append(KeepEvery(env.checkpoint_keep_every))
    return keep_union(*policies)


class TardigradeCheckpoints:
    """Our format: every restored byte checked against its digest, restores reshard."""

    def __init__(self, manager: CheckpointManager) -> None:
        self.manager = manager
        self._lock = threading.Lock()
        self._committed: Committed | None = None

    @classmethod
    def from_env(cls, env: contract.TrainerEnvironment,
                 on_event: Callable[[dict[str, Any]], None] | None = None,
                 **options: Any) -> TardigradeCheckpoints:
        """A manager at the operator's path with its keep policy; `options` go to
        `CheckpointManager` (storage retries, checksum, ...)."""
        backend: TardigradeCheckpoints

        def events(event: dict[str, Any]) -> None:
            if event["event"] == "checkpoint_committed":
                info = backend.manager.last_committed
                backend._set(Committed(event["step"], event["path"],
                                       info.time if info else None))
            if on_event is not None:
                on_event(event)

        backend = cls(CheckpointManager(env.checkpoint_path, keep=keep_policy(env),
                                        on_event=events, **options))
        return backend

    def _set(self, committed: Committed) -> None:
        with self._lock:
            self._committed = committed

    def prepare(self) -> None:
        self.manager.check_writable()
        # No save of this gang can be in flight yet, so every partial checkpoint is garbage.
        self.manager.collect_partials()

    def committed_steps(self) -> list[int]:
        return self.manager.list_steps()[0]

    def restore(self, step: int, target: Any) -> Any:
        state, info = self.manager.restore(step, target)
        self.manager.last_committed = info
        self._set(Committed(info.step, info.path, info.time))
        return state

    def save(self, step: int, state: Any, extra: Mapping[str, Any],
             mesh: Mapping[str, int] | None = None) -> float | None:
        # Storage failed the previous save (logged and counted by its checkpoint_failed
        # event)? The last commit is intact, so keep training and try again now.
        with contextlib.suppress(CheckpointIOError):
            self.manager.wait()
        return self.manager.save(step, state, extra=extra, mesh=mesh)

    def wait(self) -> None:
        self.manager.wait()

    def committed(self) -> Committed | None:
        with self._lock:
            return self._committed

    def close(self) -> None:
        self.manager.close()
