"""An Orbax `CheckpointManager` behind a `TrainingSession`, for loops with Orbax checkpoints.

Orbax is optional (`pip install 'tardigrade[orbax]'`): it is imported when a backend is
built, never at import time, so the trainer image without it still imports this module.
The session keeps its own decisions: Orbax saves when the session says so (`force=True`,
bypassing Orbax's interval), restores the step the operator chose, and never consults JAX's
preemption sync point itself (the session's watcher is the gang's one caller; a second
caller feeding step numbers would move the agreed step).

The restore decision follows the operator's pin as a floor (the newest committed step at or
after `TARDIGRADE_RESTORE_STEP`, or a CheckpointMissingError), decided by process 0 for every
rank. Orbax's directory has no checkpoint lines, root record, ownership or fencing: a rollback
(`restoreStep`) or `initFrom` is refused as a usage error (exit 2), and the shared-root probe
and the save-on-notice deadline are ours only (Orbax's save cannot be bounded; its overrun is
reported as with any save).
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from tardigrade_checkpoint import (
    CheckpointIOError,
    CheckpointMissingError,
    CheckpointUsageError,
)
from tardigrade_checkpoint.deadline import Deadline
from tardigrade_contract import contract

from tardigrade_sdk.checkpoint_backend import Committed, Restored

INSTALL_HINT = "pip install 'tardigrade[orbax]' (orbax-checkpoint)"


def _orbax() -> Any:
    try:
        import orbax.checkpoint as ocp
    except ImportError as err:
        raise ImportError(f"the Orbax backend needs orbax-checkpoint: {INSTALL_HINT}") from err
    return ocp


class OrbaxCheckpoints:
    """Saves `StandardSave(state)` and restores `StandardRestore(target)` per step."""

    def __init__(self, manager: Any,
                 on_event: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.manager = manager
        # The same events as our CheckpointManager's, for the same logs and metrics.
        self.on_event = on_event or (lambda event: None)
        # Orbax asks JAX's preemption sync point inside every save; the session already did,
        # at this step, with its own counter (see the module docstring).
        manager.reached_preemption = lambda step: False
        self._lock = threading.Lock()
        self._pending: tuple[int, float] | None = None  # step, when its save started
        self._committed: Committed | None = None

    @classmethod
    def from_env(cls, env: contract.TrainerEnvironment,
                 on_event: Callable[[dict[str, Any]], None] | None = None,
                 **options: Any) -> OrbaxCheckpoints:
        """An Orbax manager at the operator's path, keeping `keepLast` checkpoints; `options`
        go to `CheckpointManagerOptions`."""
        ocp = _orbax()
        options.setdefault("max_to_keep", env.keep_last)
        if env.checkpoint_keep_every:
            options.setdefault("keep_period", env.checkpoint_keep_every)
        return cls(ocp.CheckpointManager(env.checkpoint_path,
                                         options=ocp.CheckpointManagerOptions(**options)),
                   on_event)

    def _path(self, step: int) -> str:
        return f"{str(self.manager.directory).rstrip('/')}/{step}"

    def _now(self) -> str:
        return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")

    def prepare(self) -> None:
        # Orbax writes into a temporary directory and renames it when committed: what a crash
        # leaves is never listed as a step, and Orbax cleans it up itself.
        pass

    def choose_restore(self, env: contract.TrainerEnvironment) -> Any:
        """Process 0 picks the newest committed step at or after the pin; all ranks follow."""
        import jax
        import numpy as np
        from jax.experimental import multihost_utils

        from tardigrade_sdk.restore_choice import RestoreChoice

        if env.rollback_step is not None or env.init_from_path is not None:
            raise CheckpointUsageError(
                "the Orbax checkpoint backend supports neither spec.checkpoint.restoreStep "
                "(rollback) nor spec.checkpoint.initFrom: use the tardigrade format for them")
        missing, step = -2, -1
        if jax.process_index() == 0 and env.restore_step != contract.RESTORE_NONE:
            committed = self.committed_steps()
            if env.restore_step == contract.RESTORE_LATEST:
                step = committed[-1] if committed else -1
            else:
                floor = int(env.restore_step)
                step = committed[-1] if committed and committed[-1] >= floor else missing
        if jax.process_count() > 1:
            step = int(multihost_utils.broadcast_one_to_all(np.int32(step)))
        if step == missing:
            raise CheckpointMissingError(
                f"this launch must restore step {env.restore_step} or newer (the newest "
                f"checkpoint the operator saw committed) from {env.checkpoint_path}, but no "
                "such Orbax checkpoint is committed there: committed checkpoints were deleted "
                "or moved outside the trainer")
        return RestoreChoice(step)

    def started(self) -> None:
        pass  # Orbax applies max_to_keep / keep_period itself

    def prepare_save(self, state: Any, step_program: Any = None) -> None:
        pass  # nothing of Orbax's save is prepared ahead

    def committed_steps(self) -> list[int]:
        try:
            self.manager.reload()
            return sorted(self.manager.all_steps())
        except OSError as err:
            raise CheckpointIOError(f"cannot list Orbax checkpoints under "
                                    f"{self.manager.directory}: {err}") from err

    def restore(self, choice: Any, target: Any) -> Restored:
        ocp = _orbax()
        step = choice.step
        state = self.manager.restore(step, args=ocp.args.StandardRestore(target))
        with self._lock:
            self._committed = Committed(step, self._path(step))
        self.on_event({"event": "checkpoint_restored", "step": step, "path": self._path(step),
                       "format": "orbax"})
        return Restored(state, step + 1)

    def save(self, step: int, state: Any, extra: Mapping[str, Any],
             mesh: Mapping[str, int] | None = None,
             deadline: Deadline | None = None) -> float | None:
        ocp = _orbax()
        self._settle()
        if step in self.manager.all_steps():
            # Never rewrite a committed checkpoint (e.g. after restoring an older one).
            self.on_event({"event": "checkpoint_skipped", "step": step,
                           "reason": "already committed"})
            with self._lock:
                self._committed = Committed(step, self._path(step))
            return None
        started = time.perf_counter()
        try:
            self.manager.save(step, args=ocp.args.StandardSave(state), force=True)
        except OSError as err:
            self.on_event({"event": "checkpoint_failed", "step": step, "error": str(err)})
            raise CheckpointIOError(f"saving Orbax step {step} failed: {err}") from err
        blocked = time.perf_counter() - started
        self.on_event({"event": "checkpoint_started", "step": step, "blocked_s": round(blocked, 6)})
        with self._lock:
            self._pending = (step, started)
        return blocked

    def _settle(self) -> None:
        """Orbax finished the save in flight: it is committed."""
        with self._lock:
            pending = self._pending
        if pending is None or self.manager.is_saving_in_progress():
            return
        step, started = pending
        committed = Committed(step, self._path(step), self._now())
        with self._lock:
            self._pending = None
            self._committed = committed
        self.on_event({"event": "checkpoint_committed", "step": step, "path": committed.path,
                       "seconds": round(time.perf_counter() - started, 6)})

    def wait(self, deadline: Deadline | None = None) -> None:
        try:
            self.manager.wait_until_finished()
        except OSError as err:
            self.on_event({"event": "checkpoint_failed", "error": str(err)})
            raise CheckpointIOError(f"an Orbax save failed: {err}") from err
        self._settle()

    def saving(self) -> bool:
        return bool(self.manager.is_saving_in_progress())

    def committed(self) -> Committed | None:
        self._settle()
        with self._lock:
            return self._committed

    def close(self) -> None:
        self.wait()
        self.manager.close()
