"""The checkpoint manager: async sharded save, agreed commit, resharding restore."""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import datetime
import functools
import hashlib
import json
import logging
import math
import mmap
import os
import re
import shutil
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import jax
import numpy as np
import tensorstore as ts

from tardigrade_trainer import testhooks
from tardigrade_trainer.checkpoint import (
    agreement,
    cast,
    chunkfiles,
    digest,
    durability,
    formatversion,
    restoreplan,
    rootrecord,
    targetless,
    writers,
    zarrgroup,
)
from tardigrade_trainer.checkpoint import deadline as deadlines
from tardigrade_trainer.checkpoint import leaves as leafkinds
from tardigrade_trainer.checkpoint.background import SaveThread
from tardigrade_trainer.checkpoint.deadline import Deadline, DeadlineExceeded
from tardigrade_trainer.checkpoint.errors import (
    CheckpointCorruptError,
    CheckpointDeadlineError,
    CheckpointError,
    CheckpointIOError,
    CheckpointUsageError,
    FencedError,
)
from tardigrade_trainer.checkpoint.extra import ExtraError, check_extra
from tardigrade_trainer.checkpoint.lineage import LEGACY_LINEAGE, MarkerLine, line_steps
from tardigrade_trainer.checkpoint.policy import KeepLast, KeepPolicy, deletable
from tardigrade_trainer.checkpoint.storage import StorageRetries, is_unavailable

log = logging.getLogger(__name__)

# The format written; the ones read. Format 1 markers (no lineage, owner or attempt) belong to
# the first line of their root (docs/checkpoint-format.md).
FORMAT = "tardigrade-checkpoint/2"
READABLE_FORMATS = frozenset({"tardigrade-checkpoint/1", FORMAT})
COMMIT_FILE = "metadata.json"
# How long past a save's deadline `wait` listens for the save's own failure (within the
# deadline's margin, which is at least this).
_OWN_ERROR_GRACE_SECONDS = 0.5
_STEP_DIR = re.compile(r"^step_(\d{8,})$")


# Storage errors from TensorStore carry an absl status code; anything else is our own bug.
_STATUS = re.compile(r"^[A-Z][A-Z_]+: ")


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    step: int
    path: str
    time: str
    process_count: int
    mesh: dict[str, int]
    arrays: dict[str, dict[str, Any]]
    extra: dict[str, Any]
    # leaf name -> shard region -> digest of the bytes written (see digest.py)
    digests: dict[str, dict[str, str]] = dataclasses.field(default_factory=dict)
    digest_algorithm: str = digest.LEGACY_ALGORITHM
    # The line it was committed on, and by which attempt of which job (None before format 2).
    lineage: str = LEGACY_LINEAGE
    attempt: int | None = None
    owner: dict[str, str] | None = None

    def line(self) -> MarkerLine:
        uid = self.owner.get("uid") if self.owner else None
        return MarkerLine(self.step, self.lineage, uid, self.attempt)
    # Every chunk is stored, fill-value ones too: a missing chunk is an error on restore.
    # (Markers from before this field omit it: their all-zero chunks may be absent.)
    all_chunks_stored: bool = False

    def to_json(self) -> str:
        payload = {"format": FORMAT, **dataclasses.asdict(self)}
        payload.pop("path")
        return json.dumps(payload, sort_keys=True, indent=1)


@dataclasses.dataclass(frozen=True)
class _HostLeaf:
    """One state leaf after its device->host copy: only the shards this host must write."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    chunk: tuple[int, ...]
    # numpy data, or (CPU backend) a private on-device copy that is already host memory.
    shards: list[tuple[tuple[slice, ...], np.ndarray | jax.Array]]
    prng_impl: str | None = None  # a typed PRNG key leaf, stored as its key data


class _Waitable(Protocol):
    def result(self) -> Any: ...  # a read's digest of what it read, when it computed one


@dataclasses.dataclass(frozen=True)
class _ChunkFileRead:
    """A whole chunk read straight from its file, or through TensorStore if it has none."""

    file: concurrent.futures.Future[tuple[bool, str | None]]
    through_tensorstore: Callable[[], _Waitable]

    def result(self) -> str | None:
        found, digest_of_read = self.file.result()
        if not found:
            self.through_tensorstore().result()
        return digest_of_read


@dataclasses.dataclass(frozen=True)
class _ChunkFiles:
    """Where an unencoded array's chunk files are, and its chunk shape."""

    directory: str
    chunk: tuple[int, ...]


@dataclasses.dataclass
class _Scratch:
    """A saved shard that sticks out of this host's slices, read whole into scratch memory
    once per restore, however many of the slices it straddles; checked once too."""

    read: _Waitable
    data: np.ndarray
    got: str | None = None

    def digest(self, algorithm: str) -> tuple[str, bool]:
        """(digest of what was read, whether this call computed it)."""
        if self.got is not None:
            return self.got, False
        got = self.read.result()
        self.got = got if isinstance(got, str) else digest.digest_array(self.data, algorithm)
        return self.got, True


@dataclasses.dataclass(frozen=True)
class _Part:
    """One read into (part of) a restore buffer, and the digest it must match if recorded:
    either in place (`read` into `view`) or the overlap of a `scratch` read."""

    piece: digest.Piece | None
    read: _Waitable | None = None
    view: np.ndarray | None = None
    scratch: _Scratch | None = None


@dataclasses.dataclass
class _PendingRead:
    """A restore buffer being filled; `result` checks each piece as it lands (once: every
    device holding a replica of the slice asks for the same buffer)."""

    buffer: np.ndarray
    box: digest.Region
    parts: list[_Part]
    algorithm: str
    finished: bool = False

    def result(self, mismatches: list[str], name: str) -> np.ndarray:
        if self.finished:
            return self.buffer
        for part in self.parts:
            if part.scratch is not None:
                got, first = part.scratch.digest(self.algorithm)
            else:
                assert part.read is not None and part.view is not None
                got, first = part.read.result(), True
                if part.piece is None:
                    continue
                if not isinstance(got, str):
                    got = digest.digest_array(part.view, self.algorithm)
            assert part.piece is not None
            if got != part.piece.want and first:
                mismatches.append(f"{name}[{part.piece.key}]: restored {got}, "
                                  f"saved {part.piece.want}")
            if part.scratch is not None:
                overlap = part.piece.overlap(self.box)
                _view(self.buffer, digest.local(overlap, self.box))[...] = _view(
                    part.scratch.data, digest.local(overlap, part.piece.region))
        self.finished = True
        return self.buffer


def _view(array: np.ndarray, region: digest.Region) -> np.ndarray:
    return array[region] if region else array[...]


def _page_aligned_empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An uninitialised host array whose data starts on a page boundary.

    `jax.device_put` onto a CPU device adopts such a buffer as the device buffer instead of
    copying it (numpy's own 16-byte alignment is not enough). Reading into it replaces two
    copies of the state into newly allocated memory (TensorStore's result array, then the
    device buffer) with one; first touches of new memory dominate restore time on VMs that
    hand freed pages back to their host. Replicas of a slice share one such buffer: JAX
    treats adopted buffers as immutable and copies instead of reusing them when donated.
    """
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    page = mmap.PAGESIZE
    raw = np.empty(nbytes + page, np.uint8)
    offset = -raw.ctypes.data % page
    return raw[offset : offset + nbytes].view(dtype).reshape(shape)


def step_dir(step: int) -> str:
    return f"step_{step:08d}"


def kvstore_spec(path: str) -> dict[str, Any]:
    """TensorStore kvstore spec for a local path or a gs://bucket/prefix URL."""
    if path.startswith("gs://"):
        bucket, _, prefix = path[len("gs://") :].partition("/")
        if not bucket:
            raise CheckpointIOError(f"checkpoint path {path!r} names no bucket")
        prefix = prefix.strip("/")
        return {"driver": "gcs", "bucket": bucket, "path": f"{prefix}/" if prefix else ""}
    if "://" in path:
        raise CheckpointIOError(f"unsupported checkpoint path {path!r} (use gs:// or a path)")
    return {"driver": "file", "path": os.path.abspath(path).rstrip("/") + "/"}


def leaf_names(tree: Any) -> list[str]:
    """Stable, path-derived names of a pytree's leaves (the manifest keys)."""
    paths = jax.tree_util.tree_flatten_with_path(tree)[0]
    names = []
    for path, _ in paths:
        name = jax.tree_util.keystr(path, simple=True, separator="/") or "root"
        names.append(re.sub(r"[^A-Za-z0-9_.\-/]", "_", name))
    if len(set(names)) != len(names):
        raise CheckpointError("state leaves do not have unique names")
    return names


def gathered_state_hash(tree: Any) -> str:
    """SHA-256 over every leaf's full (gathered) value: equal across meshes iff values are."""
    from jax.experimental import multihost_utils

    digest = hashlib.sha256()
    for name, leaf in zip(leaf_names(tree), jax.tree_util.tree_leaves(tree), strict=True):
        value = np.asarray(multihost_utils.process_allgather(leaf, tiled=True))
        digest.update(name.encode())
        digest.update(str(value.dtype).encode() + str(value.shape).encode())
        digest.update(np.ascontiguousarray(value).tobytes())
    return digest.hexdigest()


class CheckpointManager:
    """Saves and restores pytrees of `jax.Array`s under one checkpoint root.

    Every process constructs one with the same root. `save` returns once this host's shards
    are copied to host memory; a background thread writes them, then process 0 gathers
    every host's word (agreement.py) and writes the commit marker. Only one save is in
    flight at a time.
    """

    def __init__(
        self,
        root: str,
        *,
        keep: KeepPolicy | None = None,
        barrier_timeout_seconds: float = 600.0,
        on_event: Callable[[dict[str, Any]], None] | None = None,
        checksum: bool = False,
        storage: StorageRetries | None = None,
        verify_restore: bool = True,
        restore_inflight_bytes: int = restoreplan.DEFAULT_INFLIGHT_BYTES,
    ) -> None:
        if restore_inflight_bytes < 1:
            raise ValueError(f"restore_inflight_bytes must be >= 1 (bytes of reads a restore "
                             f"may have in flight), got {restore_inflight_bytes}")
        self.restore_inflight_bytes = restore_inflight_bytes
        self.root = root.rstrip("/")
        self.keep = keep or KeepLast(3)
        self.barrier_timeout_seconds = barrier_timeout_seconds
        self.on_event = on_event or (lambda event: None)
        self.checksum = checksum
        self.verify_restore = verify_restore
        self.storage = storage or StorageRetries()
        self.process_id = jax.process_index()
        self.process_count = jax.process_count()
        self._kv_spec = kvstore_spec(self.root)
        # Many files in flight hide per-file latency (open, rename, fsync where TensorStore
        # does it), far beyond TensorStore's default of one per core.
        self._context = ts.Context({"file_io_concurrency": {"limit": 64},
                                    **self.storage.context_spec()})
        if self._kv_spec["driver"] == "gcs":
            self.storage.apply_stall_timeout()
        # On a local filesystem a save's data files skip TensorStore's fsync per file and per
        # directory: each host flushes its filesystem once before the "written" barrier.
        # The commit marker and everything else still go through the fsyncing `_context`.
        self._flush_filesystem = self._kv_spec["driver"] == "file" and durability.available()
        self._write_context = ts.Context({
            "file_io_concurrency": {"limit": 64},
            "file_io_sync": not self._flush_filesystem,
            **self.storage.context_spec(),
        })
        # Unencoded chunks on a local disk are read and written without TensorStore's copies
        # (see chunkfiles.py); written ones rely on the syncfs above for durability.
        self._chunk_io = chunkfiles.ChunkFileIO() if self._kv_spec["driver"] == "file" else None
        self._write_chunk_files = self._flush_filesystem and not checksum
        try:
            self._kv = ts.KvStore.open(self._kv_spec, context=self._context).result()
        except Exception as err:
            raise CheckpointIOError(f"cannot open checkpoint root {self.root}: {err}") from err
        self._executor = SaveThread("checkpoint-writer")
        self._pending: concurrent.futures.Future[CheckpointInfo | None] | None = None
        self._saves = 0  # every process counts the same saves: a gang-wide save id
        self._write_plan: tuple[Any, dict[str, writers.LeafPlan]] | None = None
        self._previous_channel: str | None = None
        # Retention deletes run after a commit on a thread of their own: a save on notice
        # stops them instead of waiting behind them (see wait()).
        self._retention: threading.Thread | None = None
        self._retention_stop = threading.Event()
        # Local-disk writes a missed deadline left running: the next save waits for them.
        self._stragglers: list[concurrent.futures.Future[int]] = []
        self.last_committed: CheckpointInfo | None = None
        # Who commits (process 0, once `open_root` ran) and the root record as last read.
        self.identity: rootrecord.JobIdentity | None = None
        self.attempt = 0
        self._record: rootrecord.RootRecord | None = None
        self._record_loaded = False
        self._lines: dict[int, MarkerLine] = {}  # committed markers are immutable

    # --- inspection ---------------------------------------------------------------------------
    def path_of(self, step: int) -> str:
        return f"{self.root}/{step_dir(step)}"

    def list_steps(self) -> tuple[list[int], list[int]]:
        """(committed, partial) steps under the root, each sorted ascending."""
        try:
            keys = self._kv.list().result()
        except Exception as err:
            raise CheckpointIOError(f"cannot list checkpoint root {self.root}: {err}") from err
        seen: set[int] = set()
        committed: set[int] = set()
        for key in keys:
            first, _, rest = key.decode().partition("/")
            match = _STEP_DIR.match(first)
            if not match:
                continue
            seen.add(int(match.group(1)))
            if rest == COMMIT_FILE:
                committed.add(int(match.group(1)))
        return sorted(committed), sorted(seen - committed)

    def latest_committed(self) -> int | None:
        """The newest committed step of the current line (it follows rollbacks)."""
        steps = self.line_steps()
        return steps[-1] if steps else None

    # --- ownership, fencing, lineage (rootrecord.py, lineage.py) -------------------------------
    def root_record(self) -> rootrecord.RootRecord | None:
        if not self._record_loaded:
            self.reload_root()
        return self._record

    def reload_root(self) -> rootrecord.RootRecord | None:
        """Read the root record again, e.g. once process 0 has claimed or forked the root."""
        self._record = rootrecord.load(self._kv, self.root)[0]
        self._record_loaded = True
        return self._record

    def _marker_line(self, step: int) -> MarkerLine:
        if step not in self._lines:
            self._lines[step] = self.read_info(step).line()
        return self._lines[step]

    def _line_of(self, record: rootrecord.RootRecord | None, committed: list[int]) -> list[int]:
        markers = [self._marker_line(s) for s in committed]
        if record is None:
            return line_steps(markers, None, LEGACY_LINEAGE, None)
        return line_steps(markers, record.branches, record.lineage, record.fence)

    def line_steps(self) -> list[int]:
        """Committed steps of the current line, ascending."""
        return self._line_of(self.root_record(), self.list_steps()[0])

    def on_current_line(self, info: CheckpointInfo) -> bool:
        return info.step in self._line_of(self.root_record(), [info.step])

    def _swap_record(self, change: Callable[[rootrecord.RootRecord | None], rootrecord.RootRecord]
                     ) -> rootrecord.RootRecord:
        for _ in range(8):
            record, generation = rootrecord.load(self._kv, self.root)
            new = change(record)
            if rootrecord.store(self._kv, new, generation, self.root):
                self._record, self._record_loaded = new, True
                return new
        raise CheckpointIOError(f"{self.root}/{rootrecord.ROOT_FILE} keeps changing under us: "
                                "another gang is starting on the same checkpoint root")

    def open_root(self, identity: rootrecord.JobIdentity, attempt: int
                  ) -> rootrecord.RootRecord:
        """Process 0 of a starting gang: claim or adopt the root for `identity` and fence off
        every older attempt. Raises ForeignRootError or FencedError."""
        self.identity, self.attempt = identity, attempt

        def claim(record: rootrecord.RootRecord | None) -> rootrecord.RootRecord:
            steps = self._line_of(record, self.list_steps()[0])
            return rootrecord.take_over(record, identity, attempt, steps[-1] if steps else -1,
                                        self.root)

        return self._swap_record(claim)

    def fork_root(self, step: int | None, request: str | None) -> rootrecord.RootRecord:
        """Make a new line, starting from committed `step` (None: from nothing), current."""
        parent = None if step is None else self.read_info(step).lineage

        def branch(record: rootrecord.RootRecord | None) -> rootrecord.RootRecord:
            if record is None:
                raise FencedError(f"{self.root} has no root record: open_root first")
            return rootrecord.fork(record, parent, step, request)

        record = self._swap_record(branch)
        self.on_event({"event": "checkpoint_line_started", "lineage": record.lineage,
                       "from_step": step})
        return record

    def read_info(self, step: int) -> CheckpointInfo:
        key = f"{step_dir(step)}/{COMMIT_FILE}"
        try:
            result = self._kv.read(key).result()
        except Exception as err:
            raise CheckpointIOError(
                f"cannot read {self.path_of(step)}/{COMMIT_FILE}: {err}"
            ) from err
        if result.state != "value":
            raise CheckpointCorruptError(f"checkpoint {self.path_of(step)} is not committed")
        try:
            data = json.loads(bytes(result.value))
            if data.get("format") not in READABLE_FORMATS:
                raise ValueError(formatversion.why_unreadable(data.get("format"), READABLE_FORMATS))
            if data.get("step") != step:
                raise ValueError(f"unexpected format/step {data.get('format')}/{data.get('step')}")
            fields = {f.name for f in dataclasses.fields(CheckpointInfo)} - {"path"}
            # Checkpoints from before digests were recorded have none: nothing to check; those
            # from before the algorithm was recorded used SHA-256.
            optional = {"digests", "digest_algorithm", "lineage", "attempt", "owner",
                        "all_chunks_stored"}
            info = CheckpointInfo(path=self.path_of(step),
                                  **{k: data[k] for k in fields if k in data or k not in optional})
            digest.check_algorithm(info.digest_algorithm)
            return info
        except (ValueError, KeyError, TypeError) as err:
            raise CheckpointCorruptError(
                f"commit marker {self.path_of(step)}/{COMMIT_FILE} is unreadable: {err}"
            ) from err

    def check_writable(self) -> None:
        """Fail fast (before training) when the root cannot be written; process 0 probes."""
        if self.process_id != 0:
            return
        key = f".probe-{os.getpid()}-{time.time_ns()}"
        try:
            self._kv.write(key, b"probe").result()
            self._kv.delete_range(ts.KvStore.KeyRange(key, key + "\0")).result()
        except Exception as err:
            raise CheckpointIOError(f"checkpoint path {self.root} is not writable: {err}") from err

    # --- save ---------------------------------------------------------------------------------
    def save(
        self,
        step: int,
        state: Any,
        *,
        extra: Mapping[str, Any] | None = None,
        mesh: Mapping[str, int] | None = None,
        deadline: Deadline | None = None,
    ) -> float:
        """Start saving `state` as `step`; returns the seconds the caller was blocked.

        `extra` (JSON values) goes into the commit marker. With `deadline` (a save on
        notice), every wait of the save gives up at the deadline and the save fails as
        CheckpointDeadlineError; retention deletes are left for the next start.
        """
        try:
            checked_extra = check_extra(extra)
        except ExtraError as err:
            raise CheckpointUsageError(str(err)) from None
        self.wait(deadline)
        started = time.perf_counter()
        try:
            host_leaves = self._copy_to_host(state)
        except leafkinds.LeafError as err:
            raise CheckpointUsageError(f"cannot save step {step}: {err}") from None
        blocked = time.perf_counter() - started
        self.on_event({"event": "checkpoint_started", "step": step, "blocked_s": round(blocked, 6)})
        self._saves += 1
        self._pending = self._executor.submit(
            self._write_and_commit, step, host_leaves, checked_extra, dict(mesh or {}), deadline
        )
        return blocked

    def wait(self, deadline: Deadline | None = None) -> CheckpointInfo | None:
        """Block until the save in flight (if any) is committed; re-raise its failure.

        Without a deadline, retention deletes after that commit are waited for too. With
        one, they are told to stop (a save on notice must not wait behind deletes) and the
        wait for the save ends at the deadline as CheckpointDeadlineError.
        """
        pending, self._pending = self._pending, None
        if deadline is not None:
            self._retention_stop.set()
        info = None
        if pending is not None:
            try:
                info = deadlines.result(pending, deadline, "the save in flight")
            except DeadlineExceeded as err:
                # The save is held to the same deadline, so its own error (which names what it
                # was waiting for) is due at the same moment: give it that moment.
                try:
                    info = pending.result(timeout=_OWN_ERROR_GRACE_SECONDS)
                except concurrent.futures.TimeoutError:
                    raise CheckpointDeadlineError(str(err)) from None
        if deadline is None:
            self._join_retention()
        return info

    def _join_retention(self) -> None:
        if self._retention is not None:
            self._retention.join()
            self._retention = None

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._executor.shutdown(wait=True)
            if self._chunk_io is not None:
                self._chunk_io.close()

    def _copy_to_host(self, state: Any) -> list[_HostLeaf]:
        leaves = jax.tree_util.tree_leaves(state)
        names = leaf_names(state)
        impls: dict[str, str] = {}
        leaves = list(leaves)
        for i, (name, leaf) in enumerate(zip(names, leaves, strict=True)):
            if isinstance(leaf, jax.Array):
                leafkinds.check_global(name, leaf, self.process_count)
                if leafkinds.is_prng_key(leaf):
                    impls[name] = leafkinds.key_impl(leaf)
                    leaves[i] = jax.random.key_data(leaf)
            elif not leafkinds.is_host_value(leaf):
                raise leafkinds.LeafError(
                    f"state leaf {name!r} is a {type(leaf).__name__}: a checkpoint holds "
                    "jax.Arrays, numpy arrays and Python numbers")
        named = [(name, leaf) for name, leaf in zip(names, leaves, strict=True)
                 if isinstance(leaf, jax.Array)]
        # The plan depends only on the layout, which a training loop keeps: computing it
        # (seconds for thousands of devices) once keeps it out of every later save's stall.
        layout_key = tuple((name, leaf.shape, leaf.dtype, leaf.sharding) for name, leaf in named)
        if self._write_plan is None or self._write_plan[0] != layout_key:
            self._write_plan = (layout_key, writers.plan([writers.layout(name, leaf)
                                                          for name, leaf in named]))
        plans = self._write_plan[1]
        mine = {name: [w for w in p.writes if w.device.process_index == self.process_id]
                for name, p in plans.items()}
        on_cpu = all(w.device.platform == "cpu" for ws in mine.values() for w in ws)
        if on_cpu:
            # CPU "device" memory is host memory: a private copy made by the runtime
            # (dispatched asynchronously, ordered before any later donation of the original
            # buffer) is the snapshot, and the background thread views it as numpy without
            # copying. One batched device_put dispatches all copies several times faster
            # than a copy per leaf, and dispatch is all the loop waits for.
            arrays = [i for i, leaf in enumerate(leaves) if isinstance(leaf, jax.Array)]
            copies = jax.device_put([leaves[i] for i in arrays],
                                    [leaves[i].sharding for i in arrays], may_alias=False)
            leaves = list(leaves)
            for i, copy in zip(arrays, copies, strict=True):
                leaves[i] = copy
        else:
            for name, leaf in zip(names, leaves, strict=True):
                if isinstance(leaf, jax.Array):
                    devices = {w.device for w in mine[name]}
                    for shard in leaf.addressable_shards:
                        if shard.device in devices:
                            shard.data.copy_to_host_async()
        host = []
        for name, leaf in zip(names, leaves, strict=True):
            if isinstance(leaf, jax.Array):
                shape = tuple(leaf.shape)
                chunk = plans[name].chunk
                # Off CPU, an explicit host copy: the device buffer may be donated by the next
                # train step, and device memory is the scarce resource.
                copies = {shard.device: shard.data if on_cpu else np.array(shard.data)
                          for shard in leaf.addressable_shards
                          if any(w.device == shard.device for w in mine[name])}
                shards = [
                    (w.region, copies[w.device] if w.region == w.shard
                     else writers.ShardPiece(copies[w.device], w.local()))
                    for w in mine[name]
                ]
                dtype = np.dtype(leaf.dtype).name
            else:
                value = np.asarray(leaf)
                shape, chunk = value.shape, tuple(max(1, c) for c in value.shape)
                full = tuple(slice(None) for _ in shape)
                shards = [(full, value.copy())] if self.process_id == 0 else []
                dtype = value.dtype.name
            host.append(_HostLeaf(name, shape, dtype, chunk, shards, impls.get(name)))
        return host

    def _array_spec(self, directory: str, name: str, *, write: bool = False,
                    strict: bool = False) -> dict[str, Any]:
        """`write`: store chunks equal to the fill value too (TensorStore leaves them out by
        default), so that `strict` reads can treat a missing chunk as an error, not zeros."""
        spec: dict[str, Any] = {
            "driver": "zarr3",
            "kvstore": {
                **self._kv_spec,
                "path": f"{self._kv_spec['path']}{directory}/arrays/{name}/",
            },
        }
        if write:
            spec["store_data_equal_to_fill_value"] = True
        if strict:
            spec["fill_missing_data_reads"] = False
        return spec

    def _local_array_dir(self, directory: str, name: str) -> str:
        return f"{self._kv_spec['path']}{directory}/arrays/{name}"

    def _codecs(self) -> list[dict[str, Any]]:
        codecs: list[dict[str, Any]] = [{"name": "bytes", "configuration": {"endian": "little"}}]
        if self.checksum:
            codecs.append({"name": "crc32c"})
        return codecs

    def _bounded_storage(self, until: Deadline) -> tuple[ts.KvStore, ts.Context]:
        """Storage handles for a save on notice: retries cut to fit the time that is left."""
        retries = self.storage.within(until.remaining()).context_spec()
        write = ts.Context({"file_io_concurrency": {"limit": 64},
                            "file_io_sync": not self._flush_filesystem, **retries})
        kv_context = ts.Context({"file_io_concurrency": {"limit": 64}, **retries})
        kv = deadlines.result(ts.KvStore.open(self._kv_spec, context=kv_context), until,
                              "opening the checkpoint root")
        return kv, write

    def _save_error(self, step: int, err: BaseException) -> CheckpointError:
        """What a failed save raises: storage and deadline trouble retryable, bugs not."""
        where = f"saving {self.path_of(step)} failed"
        if isinstance(err, CheckpointError):
            return err
        if isinstance(err, agreement.PeerFailed):
            kind = {agreement.IO: CheckpointIOError, agreement.DEADLINE: CheckpointDeadlineError}
            return kind.get(err.failure.kind, CheckpointError)(f"{where} on {err}")
        if isinstance(err, DeadlineExceeded):
            return CheckpointDeadlineError(f"{where}: {err}; nothing was committed")
        if isinstance(err, agreement.PeerSilent | OSError) or _STATUS.match(str(err)):
            return CheckpointIOError(f"{where}: {err}")
        return CheckpointError(f"{where}: {type(err).__name__}: {err}")

    @staticmethod
    def _failure_kind(error: CheckpointError) -> str:
        if isinstance(error, CheckpointDeadlineError):
            return agreement.DEADLINE
        return agreement.IO if isinstance(error, CheckpointIOError) else agreement.FAILED

    def _write_and_commit(
        self, step: int, leaves: list[_HostLeaf], extra: dict[str, Any], mesh: dict[str, int],
        until: Deadline | None = None,
    ) -> CheckpointInfo | None:
        started = time.perf_counter()
        directory = step_dir(step)
        pid = self.process_id
        flush: durability.FilesystemFlush | None = None
        channel = agreement.Channel(f"tardigrade-checkpoint-{step}-{self._saves}", pid,
                                    self.process_count, self.barrier_timeout_seconds, until)
        kv, write_context = self._kv, self._write_context
        try:
            if until is not None:
                deadlines.all_results(self._stragglers, until, "an earlier save's writes")
                self._stragglers = []
                kv, write_context = self._bounded_storage(until)
            marker = deadlines.result(kv.read(f"{directory}/{COMMIT_FILE}"), until,
                                      "reading the commit marker")
            if marker.state == "value":
                existing = self.read_info(step)
                if self.on_current_line(existing):
                    # Never rewrite a committed checkpoint of the line being trained.
                    self.on_event({"event": "checkpoint_skipped", "step": step,
                                   "reason": "already committed"})
                    return existing
                # A step of an abandoned line (or a fenced-off gang): process 0 deletes it,
                # marker first, before writing this line's step there.
                self.on_event({"event": "checkpoint_superseded", "step": step,
                               "lineage": existing.lineage})
            self._lines.pop(step, None)
            testhooks.hit("save_start", step, pid)
            if pid == 0:
                # Leftovers of an earlier crashed save of this step may use another chunk grid.
                self._delete_dir(directory, until)
                flush = self._open_flush(directory)
                creates = [
                    ts.open(
                        {
                            **self._array_spec(directory, leaf.name, write=True),
                            "metadata": {
                                "shape": list(leaf.shape),
                                "data_type": leaf.dtype,
                                "chunk_grid": {"name": "regular",
                                               "configuration": {"chunk_shape": list(leaf.chunk)}},
                                "chunk_key_encoding": chunkfiles.CHUNK_KEY_ENCODING,
                                "codecs": self._codecs(),
                            },
                        },
                        create=True,
                        context=write_context,
                    )
                    for leaf in leaves
                ]
                # The step is a zarr group with attributes (zarrgroup.py); the marker stays last.
                creates += zarrgroup.write(kv, directory, zarrgroup.documents(step, FORMAT, leaves))
                deadlines.all_results(creates, until, "creating the step's arrays")
                channel.prepared()
            else:
                channel.wait_prepared()
            testhooks.hit("after_prepare", step, pid)
            flush = flush or self._open_flush(directory)
            files: list[concurrent.futures.Future[int]] = []
            through_tensorstore: list[tuple[_HostLeaf, list[Any]]] = []
            for leaf in leaves:
                shards: list[Any] = list(leaf.shards)
                if self._chunk_io is not None and self._write_chunk_files and shards:
                    in_flight, shards = self._chunk_io.write(
                        self._local_array_dir(directory, leaf.name), leaf.shape, leaf.chunk,
                        shards)
                    files.extend(in_flight)
                if shards:
                    through_tensorstore.append((leaf, shards))
            opened = [
                ts.open(
                    self._array_spec(directory, leaf.name, write=True), open=True,
                    context=write_context
                )
                for leaf, _ in through_tensorstore
            ]
            writes = []
            for store_future, (_, shards) in zip(opened, through_tensorstore, strict=True):
                store = deadlines.result(store_future, until, "opening the step's arrays")
                # Snapshots are private and never mutated: TensorStore may keep referencing
                # them instead of copying every shard once more.
                writes.extend(
                    store[index].write(
                        np.asarray(data), can_reference_source_data_indefinitely=True
                    )
                    for index, data in shards
                )
            # Hashing the host copies overlaps the writes in flight (xxhash drops the GIL).
            local = digest.shard_digests((lf.name, lf.shape, lf.shards) for lf in leaves)
            # Every file write ends before the save may fail (none may outlive it), except
            # at a deadline: those left running are waited for before the next save.
            _, late = concurrent.futures.wait(files, timeout=deadlines.bounded(until, 1e9))
            if late:
                self._stragglers = [f for f in late if not f.cancel()]
                raise DeadlineExceeded(f"writing this host's chunk files had not finished at "
                                       f"{until.what if until else 'the deadline'}")
            for file in files:
                file.result()
            deadlines.all_results(writes, until, "writing this host's shards")
            if flush is not None:
                flush.flush()  # durable before the others hear of it, hence before the commit
            nbytes = sum(d.nbytes for leaf in leaves for _, d in leaf.shards)
            testhooks.hit("after_write", step, pid)
            if pid == 0:
                gathered = channel.gather_written(local)
                if self._previous_channel is not None:
                    channel.forget(self._previous_channel)  # every host is past it now
            else:
                channel.written(local)
                gathered = []
            info = CheckpointInfo(
                step=step,
                path=self.path_of(step),
                time=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                process_count=self.process_count,
                mesh=mesh,
                arrays={lf.name: {"shape": list(lf.shape), "dtype": lf.dtype,
                                  **({"prng_impl": lf.prng_impl} if lf.prng_impl else {})}
                        for lf in leaves},
                extra=extra,
                digests=digest.merge(gathered),
                digest_algorithm=digest.DEFAULT_ALGORITHM,
                **self._commit_identity(),
                all_chunks_stored=True,
            )
            if pid == 0:
                testhooks.hit("before_commit", step, pid)
                if until is not None and until.passed():
                    raise DeadlineExceeded(f"every shard was written, but not before {until.what}")
                if self.identity is not None:
                    # A gang cut off from the operator may still be running: it must not
                    # commit once a newer attempt (or a re-created job) took the root over.
                    current = rootrecord.load(self._kv, self.root)[0]
                    rootrecord.check_fence(current, self.identity, self.attempt, self.root)
                deadlines.result(kv.write(f"{directory}/{COMMIT_FILE}", info.to_json().encode()),
                                 until, "writing the commit marker")
                testhooks.hit("after_commit", step, pid)
                channel.outcome()
            else:
                channel.wait_outcome()
        except Exception as err:
            # Not committed: the previous commit stays the newest; this step dir is partial.
            error = self._save_error(step, err)
            peer = err.failure if isinstance(err, agreement.PeerFailed) else None
            if pid == 0 or peer is None:
                # Every host hears of it now, wherever it waits, with the same cause.
                with contextlib.suppress(Exception):
                    channel.fail(peer or agreement.Failure(pid, self._failure_kind(error),
                                                           str(error)))
            self.on_event({"event": "checkpoint_failed", "step": step, "error": str(error)})
            raise error from err
        finally:
            if pid == 0:
                self._previous_channel = channel.name
            if flush is not None:
                flush.close()
        self.last_committed = info
        self.on_event({
            "event": "checkpoint_committed", "step": step, "path": info.path,
            "seconds": round(time.perf_counter() - started, 6), "bytes_this_host": nbytes,
        })
        if pid != 0:
            testhooks.hit("after_gc", step, pid)
        elif until is None:
            self._start_retention(step)
        else:
            # A save on notice ends at its commit: deletes wait for the next start.
            self.on_event({"event": "checkpoint_retention_deferred", "step": step})
        return info

    def _commit_identity(self) -> dict[str, Any]:
        record = self.root_record()
        identity = self.identity
        return {"lineage": record.lineage if record else LEGACY_LINEAGE,
                "attempt": self.attempt if identity else None,
                "owner": dataclasses.asdict(identity) if identity else None}

    def _start_retention(self, newest: int) -> None:
        self._join_retention()  # one at a time; the previous one is done or stopping
        self._retention_stop = threading.Event()
        stop = self._retention_stop

        def run() -> None:
            self._collect_garbage(newest, stop)
            testhooks.hit("after_gc", newest, self.process_id)

        # A daemon: a process leaving after a save on notice must not wait for deletes.
        self._retention = threading.Thread(target=run, name="checkpoint-retention", daemon=True)
        self._retention.start()

    def apply_retention(self) -> list[int]:
        """Run the keep policy now (process 0): at start-up, for deletes a save on notice
        left undone. Returns the steps deleted."""
        if self.process_id != 0:
            return []
        newest = self.latest_committed()
        return [] if newest is None else self._collect_garbage(newest, threading.Event())

    def _open_flush(self, directory: str) -> durability.FilesystemFlush | None:
        """Before this host's first write of the step, so that syncfs sees its errors."""
        if not self._flush_filesystem:
            return None
        return durability.FilesystemFlush(self._kv_spec["path"] + directory)

    # --- garbage collection -------------------------------------------------------------------
    def _delete_dir(self, directory: str, until: Deadline | None = None) -> None:
        # The commit marker goes first: an interrupted delete leaves a partial checkpoint
        # (ignored, collected later), never a committed one with missing shards.
        deadlines.result(self._kv.delete_range(
            ts.KvStore.KeyRange(f"{directory}/{COMMIT_FILE}", f"{directory}/{COMMIT_FILE}\0")
        ), until, f"deleting {directory}")
        deadlines.result(self._kv.delete_range(
            ts.KvStore.KeyRange(f"{directory}/", f"{directory}0")), until, f"deleting {directory}")
        if self._kv_spec["driver"] == "file":
            # The file driver deletes files but leaves their (now empty) directories behind.
            shutil.rmtree(self._kv_spec["path"] + directory, ignore_errors=True)

    def collect_partials(self, below: int | None = None) -> list[int]:
        """Delete partial checkpoints (all, or those older than `below`); process 0 only.

        Call only when no save of this gang is in flight, e.g. at start-up.
        """
        if self.process_id != 0:
            return []
        _, partial = self.list_steps()
        doomed = [s for s in partial if below is None or s < below]
        for step in doomed:
            self._delete_dir(step_dir(step))
            self.on_event({"event": "checkpoint_partial_removed", "step": step})
        return doomed

    def _collect_garbage(self, newest: int, stop: threading.Event) -> list[int]:
        """Apply the keep policy up to `newest`; `stop` ends it between two deletes."""
        deleted = []
        try:
            committed, _ = self.list_steps()
            line = self._line_of(self.root_record(), committed)
            for step in deletable(self.keep, [s for s in line if s <= newest]):
                if stop.is_set():
                    return deleted
                self._delete_dir(step_dir(step))
                self._lines.pop(step, None)
                deleted.append(step)
                self.on_event({"event": "checkpoint_deleted", "step": step})
            # Steps of abandoned lines (or of fenced-off gangs) older than this commit can
            # never become the newest of the current line again.
            for step in sorted(set(committed) - set(line)):
                if stop.is_set():
                    return deleted
                if step < newest:
                    self._delete_dir(step_dir(step))
                    self._lines.pop(step, None)
                    deleted.append(step)
                    self.on_event({"event": "checkpoint_abandoned_removed", "step": step})
            if not stop.is_set():
                self.collect_partials(below=newest)
        except Exception as err:  # cleanup is best effort; the next commit retries it
            log.warning("checkpoint garbage collection failed: %s", err)
        return deleted

    def verify(self, step: int) -> tuple[int, list[str]]:
        """Read committed checkpoint `step` back and compare every region with its digest.

        Returns (regions checked, mismatches). For audits and tests: it reads the whole
        checkpoint on this host.
        """
        info = self.read_info(step)
        specs = {name: self._array_spec(step_dir(step), name) for name in info.digests}
        return digest.verify_stored(specs, info.digests, self._context,
                                    info.digest_algorithm)

    # --- restore ------------------------------------------------------------------------------
    def _read_box(self, store: ts.TensorStore, box: digest.Region,
                  pieces: list[digest.Piece] | None, algorithm: str,
                  files: _ChunkFiles | None, scratches: dict[str, _Scratch]) -> _PendingRead:
        """Read `box` of `store` into new memory, piece by recorded piece when checking.

        `scratches` holds this leaf's saved shards read whole so far (shared between boxes).
        """
        buffer = _page_aligned_empty(tuple(b.stop - b.start for b in box),
                                     store.dtype.numpy_dtype)
        if pieces is None:
            read = self._read_region(store, box, buffer, files)
            return _PendingRead(buffer, box, [_Part(None, read, view=buffer)], algorithm)
        parts = []
        for piece in pieces:
            if piece.inside:
                view = _view(buffer, digest.local(piece.region, box))
                read = self._read_region(store, piece.region, view, files, algorithm)
                parts.append(_Part(piece, read, view=view))
                continue
            if piece.key not in scratches:
                data = _page_aligned_empty(tuple(r.stop - r.start for r in piece.region),
                                           store.dtype.numpy_dtype)
                scratches[piece.key] = _Scratch(
                    self._read_region(store, piece.region, data, files, algorithm), data)
            parts.append(_Part(piece, scratch=scratches[piece.key]))
        return _PendingRead(buffer, box, parts, algorithm)

    def _read_region(self, store: ts.TensorStore, region: digest.Region, into: np.ndarray,
                     files: _ChunkFiles | None, algorithm: str | None = None) -> _Waitable:
        """Start filling `into` with `region` of `store`: from its chunk file if it is one.

        With `algorithm`, a chunk file read also hashes what it read, on its I/O thread.
        """

        def through_tensorstore() -> _Waitable:
            target = ts.array(into, copy=False, write=True, context=self._context)
            return target.write(store[region])

        if files is not None and self._chunk_io is not None:
            key = chunkfiles.chunk_key(region, store.shape, files.chunk)
            if key is not None and self._chunk_io.can_read_into(into):
                path = os.path.join(files.directory, key)
                then = (None if algorithm is None
                        else functools.partial(digest.digest_array, algorithm=algorithm))
                return _ChunkFileRead(self._chunk_io.read_into(path, into, then),
                                      through_tensorstore)
        return through_tensorstore()

    def _chunk_files(self, directory: str, name: str, store: ts.TensorStore
                     ) -> _ChunkFiles | None:
        if self._chunk_io is None:
            return None
        metadata = store.spec(retain_context=False).to_json().get("metadata", {})
        if not chunkfiles.is_plain(store.codec.to_json(), metadata.get("chunk_key_encoding")):
            return None
        chunk = store.chunk_layout.read_chunk.shape
        return _ChunkFiles(self._local_array_dir(directory, name), tuple(chunk or ()))

    def restore(self, step: int, target: Any = None, *, dtype: cast.DTypes = None,
                sharding: targetless.ShardingChoice | None = None) -> tuple[Any, CheckpointInfo]:
        """Read checkpoint `step` into the shapes and shardings of `target`.

        `target` is a pytree of `jax.ShapeDtypeStruct`s (or arrays) carrying `.sharding` for
        the CURRENT mesh; each host reads only the slices its devices hold, whatever mesh
        or process count wrote them. With `verify_restore`, every byte read is checked
        against the digests in the commit marker: a saved shard that only partly overlaps
        this host's slices (after a resharding) is read whole to be checked.

        Without `target`, the checkpoint's own leaves, as nested dicts (targetless.py; numpy
        arrays, or jax.Arrays with `sharding`). A target or `dtype` of another dtype than the
        stored one casts (cast.py).
        """
        info = self.read_info(step)
        if target is None:
            target = targetless.target(info.arrays, sharding)
        elif sharding is not None:
            raise CheckpointUsageError("restore(sharding=...) is for a restore without a target: "
                                       "give the target's leaves their shardings instead")
        names = leaf_names(target)
        leaves, treedef = jax.tree_util.tree_flatten(target)
        try:
            targets = [leafkinds.read_target(n, leaf)
                       for n, leaf in zip(names, leaves, strict=True)]
        except leafkinds.LeafError as err:
            raise CheckpointUsageError(f"cannot restore {info.path}: {err}") from None
        targets = cast.with_dtypes(names, targets, dtype)
        problems = []
        for name, target_leaf in zip(names, targets, strict=True):
            problem = cast.mismatch(name, info.arrays.get(name), target_leaf)
            if problem:
                problems.append(problem)
        if problems:
            raise CheckpointCorruptError(
                f"checkpoint {info.path} does not match the model: " + "; ".join(problems[:5])
            )
        directory = step_dir(step)
        # Checkpoints from before digests were recorded have none: crc32c, if on, is all.
        check = self.verify_restore and bool(info.digests)
        algorithm = info.digest_algorithm
        mismatches: list[str] = []
        checked = 0
        try:
            stores = [
                ts.open(self._array_spec(directory, n, strict=info.all_chunks_stored), open=True,
                        read=True, context=self._context)
                for n in names
            ]
            # Reads are consumed (checked, put on their devices) oldest first, as soon as the
            # next ones would exceed the bytes allowed in flight.
            window = restoreplan.ReadWindow(self.restore_inflight_bytes)
            # Per leaf: its devices in order (None: a host value, read whole by every host)
            # and what was read for each.
            placed: list[tuple[list[jax.Device | None], dict[jax.Device | None, Any]]] = []

            def place(read: _PendingRead, name: str, devices: list[jax.Device | None],
                      into: dict[jax.Device | None, Any], dtype: np.dtype) -> None:
                buffer = cast.to_dtype(read.result(mismatches, name), dtype)  # after the check
                for device in devices:
                    into[device] = buffer if device is None else jax.device_put(buffer, device)

            for name, store_future, leaf in zip(names, stores, targets, strict=True):
                store = store_future.result()
                recorded = info.digests.get(name) if check else None
                try:
                    regions = (None if recorded is None
                               else restoreplan.RegionIndex(recorded, len(leaf.shape)))
                except ValueError as err:
                    raise CheckpointCorruptError(
                        f"the commit marker's digests are incomplete: {err}") from err
                files = self._chunk_files(directory, name, store)
                if recorded is None and cast.needed(store, leaf.dtype):
                    # Nothing to check: TensorStore casts as it reads, not from chunk files.
                    store, files = cast.on_read(store, leaf.dtype), None
                itemsize = store.dtype.numpy_dtype.itemsize
                # slices are unhashable before 3.12: boxes are keyed by their region key
                boxes: dict[str, list[jax.Device | None]] = {}
                order: list[jax.Device | None] = []
                whole = {None: tuple(slice(0, n) for n in leaf.shape)}
                for device, index in (whole if leaf.sharding is None else
                                      leaf.sharding.addressable_devices_indices_map(leaf.shape)
                                      ).items():
                    boxes.setdefault(digest.region_key(index, leaf.shape), []).append(device)
                    order.append(device)
                on_device: dict[jax.Device | None, Any] = {}
                placed.append((order, on_device))
                scratches: dict[str, _Scratch] = {}
                for key, devices in boxes.items():
                    box = digest.parse_region(key)
                    try:
                        pieces = None if regions is None else regions.pieces(box)
                    except ValueError as err:
                        raise CheckpointCorruptError(
                            f"the commit marker's digests are incomplete: {err}") from err
                    new_scratch = {p.key: p.region for p in pieces or ()
                                   if not p.inside and p.key not in scratches}
                    nbytes = itemsize * sum(math.prod(r.stop - r.start for r in region)
                                            for region in [box, *new_scratch.values()])
                    window.admit(nbytes)
                    read = self._read_box(store, box, pieces, algorithm, files, scratches)
                    checked += sum(part.piece is not None and part.scratch is None
                                   for part in read.parts)
                    window.started(nbytes, functools.partial(place, read, name, devices,
                                                             on_device, leaf.dtype))
                checked += len(scratches)
            window.drain()
            arrays = []
            for leaf, (order, on_device) in zip(targets, placed, strict=True):
                if leaf.sharding is None:
                    arrays.append(leaf.finish(on_device[None]))
                    continue
                arrays.append(leaf.finish(jax.make_array_from_single_device_arrays(
                    leaf.shape, leaf.sharding, [on_device[device] for device in order])))
        except CheckpointError:
            raise
        except Exception as err:
            if is_unavailable(err):  # an outage, not bad data: retrying later may succeed
                raise CheckpointIOError(
                    f"checkpoint {info.path} cannot be read now: {err}") from err
            raise CheckpointCorruptError(f"checkpoint {info.path} cannot be read: {err}") from err
        if mismatches:
            raise CheckpointCorruptError(
                f"checkpoint {info.path} does not hold what was saved: "
                + "; ".join(mismatches[:5]))
        self.on_event({"event": "checkpoint_restored", "step": step, "path": info.path,
                       "saved_process_count": info.process_count, "saved_mesh": info.mesh,
                       "regions_verified": checked})
        return jax.tree_util.tree_unflatten(treedef, arrays), info
