"""Sharded, asynchronous, atomically committed checkpoints on TensorStore (local or gs://).

Layout under the checkpoint root:

    step_00000100/arrays/<leaf name>/   one zarr3 array per state leaf, chunk = one shard
                                        (or one piece of a replicated one: writers.py)
    step_00000100/zarr.json             zarr v3 group metadata with the step's attributes
                                        (and one per intermediate directory: zarrgroup.py)
    step_00000100/metadata.json         the commit marker, written last by process 0
    tardigrade-root.json                owner, fence and lines of the root (rootrecord.py)

A step directory without metadata.json is partial: never restored, deleted later. The format
and its semantics (lineage, ownership, fencing) are in docs/checkpoint-format.md.
"""

from tardigrade_trainer.checkpoint.errors import (
    CheckpointCorruptError,
    CheckpointDeadlineError,
    CheckpointError,
    CheckpointIOError,
    CheckpointMissingError,
    CheckpointUsageError,
    FencedError,
    ForeignRootError,
)
from tardigrade_trainer.checkpoint.manager import CheckpointInfo, CheckpointManager
from tardigrade_trainer.checkpoint.policy import (
    KeepEvery,
    KeepLast,
    KeepPolicy,
    SaveInterval,
    keep_union,
)
from tardigrade_trainer.checkpoint.rootrecord import JobIdentity

__all__ = [
    "CheckpointCorruptError",
    "CheckpointDeadlineError",
    "CheckpointError",
    "CheckpointIOError",
    "CheckpointInfo",
    "CheckpointManager",
    "CheckpointMissingError",
    "CheckpointUsageError",
    "FencedError",
    "ForeignRootError",
    "JobIdentity",
    "KeepEvery",
    "KeepLast",
    "KeepPolicy",
    "SaveInterval",
    "keep_union",
]
