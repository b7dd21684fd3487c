"""Named points of a save (and the end of a training step) where a test may inject a fault.

The commit protocol calls `faults.at(point, step, process_id)` at each save point below, in
this order; `TrainingSession` calls it at `step_end`, `start_up` and `restore`, the reference
trainer at `compile`. Production code passes `NO_FAULTS`. The
fault-injecting implementations live with the tests, which pass them to
`CheckpointManager(faults=...)` or `TrainingSession(faults=...)`: nothing here reads the
environment.
"""

from __future__ import annotations

from typing import Protocol

SAVE_START = "save_start"  # the save thread has started on this step
AFTER_PREPARE = "after_prepare"  # process 0 created the step's arrays
AFTER_WRITE = "after_write"  # this host's shards are durable, before it says so
BEFORE_COMMIT = "before_commit"  # process 0 heard from every host
AFTER_COMMIT = "after_commit"  # process 0 wrote the commit marker
AFTER_GC = "after_gc"  # retention after the commit is done (process 0) or skipped (others)
STEP_END = "step_end"  # the training loop finished a step (TrainingSession.report)
# Phases before the first step, where a test holds a trainer to send it a notice there.
START_UP = "start_up"  # the session's start, before jax.distributed (step 0)
RESTORE = "restore"  # before the restore of the chosen step (that step)
COMPILE = "compile"  # the reference trainer compiles its step (step 0)
POINTS = (SAVE_START, AFTER_PREPARE, AFTER_WRITE, BEFORE_COMMIT, AFTER_COMMIT, AFTER_GC,
          STEP_END, START_UP, RESTORE, COMPILE)


class SaveFaults(Protocol):
    def at(self, point: str, step: int, process_id: int) -> None:
        """Called at `point` of `step` on `process_id`; may raise, block or end the process."""
        ...


class _NoFaults:
    def at(self, point: str, step: int, process_id: int) -> None:
        return None


NO_FAULTS: SaveFaults = _NoFaults()
