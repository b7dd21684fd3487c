"""Which checkpoint a starting gang restores: one decision by process 0, followed by every host.

Process 0 takes the root over for its job and attempt (ownership and fencing), applies a
rollback request once, then picks the newest committed step of the current line, which must
be at least the operator's pin; a job whose own line is empty may start from another job's
root (`initFrom`, read only). Any refusal is broadcast, so every host stops with the same
error class, and process 0's termination message says why.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.experimental import multihost_utils
from tardigrade_checkpoint import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointIOError,
    CheckpointManager,
    CheckpointMissingError,
    FencedError,
    ForeignRootError,
    JobIdentity,
)
from tardigrade_contract import contract

from tardigrade_sdk import distributed

OWN_ROOT, INIT_FROM = 0, 1
# Broadcast codes for a refusal by process 0, most specific class first.
_REFUSALS: tuple[type[CheckpointError], ...] = (
    CheckpointMissingError, ForeignRootError, FencedError, CheckpointIOError,
    CheckpointCorruptError, CheckpointError)


@dataclasses.dataclass(frozen=True)
class RestoreChoice:
    step: int  # -1: start from scratch
    source: int = OWN_ROOT  # OWN_ROOT, or INIT_FROM: env.init_from_path

    @property
    def restores(self) -> bool:
        return self.step >= 0


def identity(env: contract.TrainerEnvironment) -> JobIdentity:
    return JobIdentity(env.namespace, env.job_name, env.job_uid)


def _missing_pin(env: contract.TrainerEnvironment, line: list[int]) -> CheckpointMissingError:
    newest = line[-1] if line else None
    found = (f"the newest committed step of its current line is {newest}" if newest is not None
             else "it holds no committed step of its current line")
    fix = (f"set spec.checkpoint.restoreStep: {newest} to continue from there, or "
           if newest is not None else "")
    return CheckpointMissingError(
        f"this launch must restore step {env.restore_step} or newer (the newest checkpoint "
        f"the operator saw committed) from {env.checkpoint_path}, but {found}: committed "
        f"checkpoints were deleted or moved outside the trainer. To go on, {fix}delete and "
        "re-create the job to start over")


def _init_from(env: contract.TrainerEnvironment, manager: CheckpointManager) -> RestoreChoice:
    assert env.init_from_path is not None
    source = CheckpointManager(env.init_from_path, storage=manager.storage)
    try:
        line = source.line_steps()
    finally:
        source.close()
    step = env.init_from_step if env.init_from_step is not None else (line[-1] if line else None)
    if step is None or step not in source.list_steps()[0]:
        committed = source.list_steps()[0]
        raise CheckpointMissingError(
            f"spec.checkpoint.initFrom names step {step if step is not None else '(newest)'} of "
            f"{env.init_from_path}, which is not a committed checkpoint there (committed: "
            f"{committed or 'none'}): fix initFrom.step or initFrom.path")
    return RestoreChoice(step, INIT_FROM)


def decide(env: contract.TrainerEnvironment, manager: CheckpointManager) -> RestoreChoice:
    """Process 0 only: take the root over and choose. Raises the refusals above."""
    record = manager.open_root(identity(env), env.attempt)
    if env.rollback_step is not None and not record.has_request(str(env.rollback_request)):
        committed = manager.list_steps()[0]
        if env.rollback_step not in committed:
            raise CheckpointMissingError(
                f"spec.checkpoint.restoreStep: {env.rollback_step} is not a committed "
                f"checkpoint under {env.checkpoint_path} (committed steps: "
                f"{committed or 'none'}): choose one of those, or remove restoreStep")
        manager.fork_root(env.rollback_step, env.rollback_request)
        return RestoreChoice(env.rollback_step)
    line = manager.line_steps()
    if env.restore_step == contract.RESTORE_NONE:
        if line:
            manager.fork_root(None, None)
        return RestoreChoice(-1)
    if env.restore_step != contract.RESTORE_LATEST and (
            (line and line[-1] < int(env.restore_step))
            or (not line and env.init_from_path is None)):
        raise _missing_pin(env, line)
    if line:
        return RestoreChoice(line[-1])
    if env.init_from_path is not None:
        return _init_from(env, manager)
    return RestoreChoice(-1)


def choose(env: contract.TrainerEnvironment, manager: CheckpointManager) -> RestoreChoice:
    """Every process: the choice of process 0, or the same error class it stopped with."""
    choice, refusal = RestoreChoice(-1), -1
    error: CheckpointError | None = None
    if jax.process_index() == 0:
        try:
            choice = decide(env, manager)
        except CheckpointError as err:
            error = err
            refusal = next(i for i, cls in enumerate(_REFUSALS) if isinstance(err, cls))
    if jax.process_count() > 1:
        sent = multihost_utils.broadcast_one_to_all(
            np.array([choice.step, choice.source, refusal], np.int32))
        choice, refusal = RestoreChoice(int(sent[0]), int(sent[1])), int(sent[2])
    if refusal >= 0:
        # Every rank's termination message says why: the operator reports whichever rank it
        # sees stop first.
        why = distributed.text_from_root(f"tardigrade-restore-refusal-{env.attempt}",
                                         str(error) if error is not None else None, 30)
        if error is not None:
            raise error
        raise _REFUSALS[refusal](f"process 0 refused to start: {why}")
    # Process 0 may have claimed or forked the root: commits must follow its record.
    manager.reload_root()
    return choice
