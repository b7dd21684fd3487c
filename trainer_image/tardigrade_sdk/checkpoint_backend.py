"""What a `TrainingSession` needs from a checkpoint format, and our own format behind it.

The session decides when to save; the restore decision is the backend's `choose_restore`
(run on every rank, decided by process 0 and broadcast). A backend lists committed steps,
saves (by a deadline on notice), restores and reports what it committed.
`TardigradeCheckpoints` wraps our `CheckpointManager` and decides through `restore_choice`
(lines, ownership, fencing, the pin as a floor, rollback, initFrom);
`orbax_backend.OrbaxCheckpoints` wraps an Orbax `CheckpointManager` (the pin as a floor only).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from tardigrade_checkpoint import (
    CheckpointIOError,
    CheckpointManager,
    KeepEvery,
    KeepLast,
    KeepPolicy,
    keep_union,
)
from tardigrade_checkpoint.deadline import Deadline
from tardigrade_contract import contract


@dataclasses.dataclass(frozen=True)
class Committed:
    """A committed checkpoint, as the operator hears of it (progress, termination message)."""

    step: int
    path: str
    time: str | None = None


@dataclasses.dataclass(frozen=True)
class Restored:
    """What a restore gave: the state and the first step to train after it."""

    state: Any
    start_step: int


class Checkpoints(Protocol):
    def prepare(self) -> None:
        """Before the restore decision: fail fast on unwritable or unshared storage."""
        ...

    def choose_restore(self, env: contract.TrainerEnvironment) -> Any:
        """Every rank: the gang's one restore decision (an object with `step`, -1 for none,
        and `restores`), or the error process 0 refused with."""
        ...

    def restore(self, choice: Any, target: Any) -> Restored:
        """The chosen checkpoint read into `target` (a pytree of `jax.ShapeDtypeStruct`s with
        the current mesh's shardings)."""
        ...

    def started(self) -> None:
        """After the restore (or the fresh start): start the deletes the keep policy still owes
        (beside the training: the next save waits for them)."""
        ...

    def save(self, step: int, state: Any, extra: Mapping[str, Any],
             mesh: Mapping[str, int] | None = None,
             deadline: Deadline | None = None) -> float | None:
        """Start saving `state` as `step` (may return before it is committed); the seconds
        the loop was blocked, if known. With `deadline`, a save that cannot commit by then
        fails (CheckpointIOError) instead of running on."""
        ...

    def prepare_save(self, state: Any, step_program: Any = None) -> None:
        """Once a step has run: get ready to save states like `state`, so that the first save
        stalls the loop no longer than the next ones. `step_program`: the compiled training
        step (or its `memory_analysis()`), if the loop has it."""
        ...

    def wait(self, deadline: Deadline | None = None) -> None:
        """Block until the save in flight is committed; CheckpointIOError if it failed (or
        did not commit by `deadline`)."""
        ...

    def saving(self) -> bool:
        """True while a save is in flight; never blocks."""
        ...

    def committed(self) -> Committed | None:
        """The newest checkpoint this rank knows committed (restored or saved), if any."""
        ...

    def close(self) -> None: ...


def keep_policy(env: contract.TrainerEnvironment) -> KeepPolicy:
    """The retention the operator asked for (spec.checkpoint.keep)."""
    policies: list[KeepPolicy] = [KeepLast(env.keep_last)]
    if env.checkpoint_keep_every:
        policies.append(KeepEvery(env.checkpoint_keep_every))
    return keep_union(*policies)


class TardigradeCheckpoints:
    """Our format: every restored byte checked against its digest, restores reshard."""

    def __init__(self, manager: CheckpointManager,
                 env: contract.TrainerEnvironment | None = None,
                 on_event: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.manager = manager
        self.env = env
        self.on_event = on_event
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
                                        on_event=events, **options),
                      env=env, on_event=on_event)
        return backend

    def _set(self, committed: Committed) -> None:
        with self._lock:
            self._committed = committed

    def prepare(self) -> None:
        import jax
        from tardigrade_checkpoint.sharedprobe import check_shared

        self.manager.check_writable()
        # Before anything is saved or restored: a root private to each host would take
        # checkpoints that no gang can restore.
        check_shared(self.manager.root, process_id=jax.process_index(),
                     process_count=jax.process_count(),
                     context_spec=self.manager.storage.context_spec(),
                     barrier_timeout_seconds=self.manager.barrier_timeout_seconds)

    def committed_steps(self) -> list[int]:
        return self.manager.list_steps()[0]

    def choose_restore(self, env: contract.TrainerEnvironment) -> Any:
        from tardigrade_sdk import restore_choice

        # Ownership, fencing, rollback, the pin as a floor, initFrom: process 0 decides.
        choice = restore_choice.choose(env, self.manager)
        # No save of this gang can be in flight yet, so every partial checkpoint is garbage.
        self.manager.collect_partials()
        return choice

    def restore(self, choice: Any, target: Any) -> Restored:
        from tardigrade_sdk import restore_choice

        if choice.source == restore_choice.OWN_ROOT:
            state, info = self.manager.restore(choice.step, target)
        else:
            env = self.env
            assert env is not None and env.init_from_path is not None
            # Another job's root: read only (no claim, no retention, no partial collection).
            source = CheckpointManager(env.init_from_path, storage=self.manager.storage,
                                       verify_restore=self.manager.verify_restore,
                                       on_event=self.on_event)
            try:
                state, info = source.restore(choice.step, target)
            finally:
                source.close()
        self.manager.last_committed = info
        self._set(Committed(info.step, info.path, info.time))
        return Restored(state, int(info.extra.get("data_position", choice.step + 1)))

    def started(self) -> None:
        # Deletes the keep policy owes from a save on notice (which skips them), beside the
        # training.
        self.manager.start_retention()

    def save(self, step: int, state: Any, extra: Mapping[str, Any],
             mesh: Mapping[str, int] | None = None,
             deadline: Deadline | None = None) -> float | None:
        # Storage failed the previous save (logged and counted by its checkpoint_failed
        # event)? The last commit is intact, so keep training and try again now.
        with contextlib.suppress(CheckpointIOError):
            self.manager.wait(deadline)
        return self.manager.save(step, state, extra=extra, mesh=mesh, deadline=deadline)

    def prepare_save(self, state: Any, step_program: Any = None) -> None:
        self.manager.prepare_save(state, step_program)

    def wait(self, deadline: Deadline | None = None) -> None:
        self.manager.wait(deadline)

    def saving(self) -> bool:
        return self.manager.saving

    @property
    def staged_bytes(self) -> int:
        """Device memory the last save staged (an accelerator's snapshot, staging.py)."""
        return self.manager.last_staged_bytes

    @property
    def staging(self) -> dict[str, Any]:
        """What the last save staged: `staged_bytes`, `staging_budget_bytes` and
        `staging_budget` (auto, setting or off; CheckpointManager.last_staging)."""
        return self.manager.last_staging

    def committed(self) -> Committed | None:
        with self._lock:
            return self._committed

    def close(self) -> None:
        self.manager.close()
