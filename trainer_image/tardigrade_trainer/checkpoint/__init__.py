"""Sharded, asynchronous, atomically committed checkpoints on TensorStore (local or gs://).

Layout under the checkpoint root:

    step_00000100/arrays/<leaf name>/   one zarr3 array per state leaf, chunk = one shard
    step_00000100/metadata.json         the commit marker, written last by process 0

A step directory without metadata.json is partial: never restored, deleted later.
"""

from tardigrade_trainer.checkpoint.manager import (
    CheckpointCorruptError,
    CheckpointDeadlineError,
    CheckpointError,
    CheckpointInfo,
    CheckpointIOError,
    CheckpointManager,
    CheckpointUsageError,
)
from tardigrade_trainer.checkpoint.policy import (
    KeepEvery,
    KeepLast,
    KeepPolicy,
    SaveInterval,
    keep_union,
)

__all__ = [
    "CheckpointCorruptError",
    "CheckpointDeadlineError",
    "CheckpointError",
    "CheckpointIOError",
    "CheckpointInfo",
    "CheckpointManager",
    "CheckpointUsageError",
    "KeepEvery",
    "KeepLast",
    "KeepPolicy",
    "SaveInterval",
    "keep_union",
]
