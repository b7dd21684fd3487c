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

This package is the checkpoint library: usable on its own by any JAX loop, it imports only
`tardigrade_contract` of ours, never the SDK or the reference trainer
(tests/test_package_layering.py).

Module map, one job each (`CheckpointManager` in manager.py is the façade over all of them):

    layout       where things are under a root; a leaf's zarr3 array spec and metadata
    marker       the commit marker: its fields, written and parsed (formatversion: what a
                 reader does with a format number it does not know)
    zarrgroup    the zarr v3 group files and attributes of a step, for plain zarr readers
    rootstore    the storage interface every module below reads and writes a root through
                 (TensorStore's kvstore and zarr3 arrays; on a local disk also the next two)
      chunkfiles   local-disk backend: whole unencoded chunks with O_DIRECT
      durability   local-disk backend: one syncfs per save instead of an fsync per file
    storage      retry and stall bounds for object storage; outage or bad data
    snapshot     save, part 1: copy this host's shards off the devices (the loop waits)
    writers      which host writes which piece of a replicated region
    commit       save, part 2: the commit protocol, from snapshot to commit marker
    agreement    the hosts' messages during a commit: done, or failed and why
    background   the one save thread; deadline: bounded waits for a save on notice
    retention    which committed and partial steps process 0 deletes, and when
    policy       keep policies and save intervals
    rootlines    the current line and who may commit (rootrecord: the root record's
                 schema and compare-and-swap; lineage: which markers are on the line)
    restore      the resharding restore, every byte checked; restoreplan: its reads;
                 targetless: the tree, shapes and dtypes from the marker; cast: dtype casts
    leaves       the kinds of leaf a checkpoint holds, and the ones it refuses
    digest       digests of saved regions and their checks; extra: the marker's `extra`
    faults       the named points of a save where tests inject faults (no-op in production)
    sharedprobe  start-up check that every host sees the same root
    memory_tier  snapshots of a host's own shards in its memory and its peers' (a sealed
                 manifest written last), and the gang's choice of the newest one whole
                 (docs/memory-tier.md); the SDK's memory_session drives it
    coordination small collectives over JAX's coordination service (no device), which
                 sharedprobe and the SDK's gang start-up use
    statehash    a whole state's hash, for tests and debugging; errors: the exceptions
"""

from tardigrade_checkpoint.errors import (
    CheckpointCorruptError,
    CheckpointDeadlineError,
    CheckpointError,
    CheckpointIOError,
    CheckpointMissingError,
    CheckpointUsageError,
    FencedError,
    ForeignRootError,
)
from tardigrade_checkpoint.manager import CheckpointInfo, CheckpointManager
from tardigrade_checkpoint.policy import (
    AnySave,
    ContinuousSaving,
    KeepEvery,
    KeepLast,
    KeepPolicy,
    SaveContext,
    SaveInterval,
    SavePolicy,
    keep_union,
)
from tardigrade_checkpoint.rootrecord import JobIdentity

__all__ = [
    "AnySave",
    "CheckpointCorruptError",
    "CheckpointDeadlineError",
    "CheckpointError",
    "CheckpointIOError",
    "CheckpointInfo",
    "CheckpointManager",
    "CheckpointMissingError",
    "CheckpointUsageError",
    "ContinuousSaving",
    "FencedError",
    "ForeignRootError",
    "JobIdentity",
    "KeepEvery",
    "KeepLast",
    "KeepPolicy",
    "SaveContext",
    "SaveInterval",
    "SavePolicy",
    "keep_union",
]
