"""Why a checkpoint could not be saved or restored; the entry point maps each to an exit code."""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or restored."""


class CheckpointIOError(CheckpointError):
    """Storage refused a read or write (unwritable path, unreachable bucket): retryable."""


class CheckpointCorruptError(CheckpointError):
    """A committed checkpoint cannot be read back or does not match the model."""


class CheckpointDeadlineError(CheckpointIOError):
    """A save on notice did not commit before its deadline: nothing committed, retryable."""


class CheckpointUsageError(CheckpointError, ValueError):
    """Asked for what a checkpoint cannot hold (an `extra` that is not JSON, a host-local
    array, a sharding that does not divide a dimension): retrying will not help."""


class CheckpointMissingError(CheckpointCorruptError):
    """The step a launch must restore (or one at least as new) is not committed on the current
    line: someone deleted committed work, or the spec names a step that was never saved."""


class ForeignRootError(CheckpointError):
    """The checkpoint root belongs to another job: a config error, never retried."""


class FencedError(CheckpointError):
    """A newer attempt (or a re-created job of the same name) took the root over: this gang is
    stale and must neither start nor commit."""
