"""The checkpoint manager: the package's façade over snapshot, commit, retention and restore.

`CheckpointManager` wires one root's storage (rootstore.py) to the modules that do the work
and holds what lives across saves: the save thread, the save in flight, the gang-wide save
count and the last commit. The module map is in `checkpoint/__init__.py`.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
from tardigrade_contract.contract import (
    DEFAULT_CHECKPOINT_BARRIER_TIMEOUT_SECONDS,
    DEFAULT_CHECKPOINT_KEEP_LAST,
)

from tardigrade_checkpoint import (
    cast,
    chunkfiles,
    digest,
    restore,
    restoreplan,
    rootrecord,
    staging,
    targetless,
)
from tardigrade_checkpoint import deadline as deadlines
from tardigrade_checkpoint import leaves as leafkinds
from tardigrade_checkpoint.background import SaveThread
from tardigrade_checkpoint.commit import Committer
from tardigrade_checkpoint.deadline import Deadline, DeadlineExceeded
from tardigrade_checkpoint.errors import (  # noqa: F401  (re-exported)
    CheckpointCorruptError,
    CheckpointDeadlineError,
    CheckpointError,
    CheckpointIOError,
    CheckpointUsageError,
    FencedError,
)
from tardigrade_checkpoint.extra import ExtraError, check_extra
from tardigrade_checkpoint.faults import AFTER_GC, NO_FAULTS, SaveFaults
from tardigrade_checkpoint.layout import (  # noqa: F401  (re-exported)
    COMMIT_FILE,
    kvstore_spec,
    leaf_names,
    step_dir,
)
from tardigrade_checkpoint.marker import (  # noqa: F401  (re-exported)
    FORMAT,
    READABLE_FORMATS,
    CheckpointInfo,
)
from tardigrade_checkpoint.policy import KeepLast, KeepPolicy
from tardigrade_checkpoint.retention import Retention
from tardigrade_checkpoint.rootlines import RootLines
from tardigrade_checkpoint.rootstore import RootStore
from tardigrade_checkpoint.snapshot import HostLeaf, Snapshotter
from tardigrade_checkpoint.statehash import gathered_state_hash  # noqa: F401
from tardigrade_checkpoint.storage import StorageRetries

# How long past a save's deadline `wait` listens for the save's own failure (within the
# deadline's margin, which is at least this).
_OWN_ERROR_GRACE_SECONDS = 0.5


class CheckpointManager:
    """Saves and restores pytrees of `jax.Array`s under one checkpoint root.

    Every process constructs one with the same root. `save` returns once this host's shards
    are copied to host memory; a background thread writes them, then process 0 gathers
    every host's word (agreement.py) and writes the commit marker. Only one save is in
    flight at a time.

    `chunk_files`: on a local disk, read and write whole unencoded chunks with O_DIRECT
    (chunkfiles.py) instead of through TensorStore. `snapshot_device_bytes`: on an
    accelerator, the device memory per device a snapshot may stage so that `save` need not
    wait for the device->host copy (staging.py): None (the default) as much as the training
    leaves free (stagingbudget.py), N at most N bytes of that, 0 never. `faults`:
    test-only fault injection at the save's stages (faults.py); the default does nothing.
    """

    def __init__(
        self,
        root: str,
        *,
        keep: KeepPolicy | None = None,
        barrier_timeout_seconds: float = DEFAULT_CHECKPOINT_BARRIER_TIMEOUT_SECONDS,
        on_event: Callable[[dict[str, Any]], None] | None = None,
        checksum: bool = False,
        storage: StorageRetries | None = None,
        verify_restore: bool = True,
        restore_inflight_bytes: int = restoreplan.DEFAULT_INFLIGHT_BYTES,
        chunk_files: bool = True,
        snapshot_device_bytes: int | None = None,
        faults: SaveFaults = NO_FAULTS,
    ) -> None:
        if restore_inflight_bytes < 1:
            raise ValueError(f"restore_inflight_bytes must be >= 1 (bytes of reads a restore "
                             f"may have in flight), got {restore_inflight_bytes}")
        self.restore_inflight_bytes = restore_inflight_bytes
        self.root = root.rstrip("/")
        self.keep = keep or KeepLast(DEFAULT_CHECKPOINT_KEEP_LAST)
        self.barrier_timeout_seconds = barrier_timeout_seconds
        self.on_event = on_event or (lambda event: None)
        self.checksum = checksum
        self.verify_restore = verify_restore
        self.storage = storage or StorageRetries()
        self.faults = faults
        self.process_id = jax.process_index()
        self.process_count = jax.process_count()
        self.store = RootStore(self.root, self.storage, checksum=checksum,
                               chunk_files=chunk_files)
        self._lines = RootLines(self.store, self._emit)
        self._snapshots = Snapshotter(self.process_id, self.process_count,
                                      staging.DeviceBudget(snapshot_device_bytes))
        self._committer = Committer(
            self.store, self._lines, process_id=self.process_id,
            process_count=self.process_count, barrier_timeout_seconds=barrier_timeout_seconds,
            checksum=checksum, on_event=self._emit, faults=faults)
        self._retention = Retention(self.store, self._lines, self.keep, self._emit, faults,
                                    self.process_id)
        self._executor = SaveThread("checkpoint-writer")
        self._pending: concurrent.futures.Future[CheckpointInfo | None] | None = None
        self._saves = 0  # every process counts the same saves: a gang-wide save id
        self.last_committed: CheckpointInfo | None = None

    def _emit(self, event: dict[str, Any]) -> None:
        self.on_event(event)  # looked up per event: callers may replace `on_event`

    @property
    def chunk_io(self) -> chunkfiles.ChunkFileIO | None:
        """The local-disk chunk-file backend, when this root uses it."""
        return self.store.chunk_io

    @property
    def identity(self) -> rootrecord.JobIdentity | None:
        """Who commits (process 0, once `open_root` ran)."""
        return self._lines.identity

    @property
    def attempt(self) -> int:
        return self._lines.attempt

    # --- inspection ---------------------------------------------------------------------------
    def path_of(self, step: int) -> str:
        return self.store.path_of(step)

    def list_steps(self) -> tuple[list[int], list[int]]:
        """(committed, partial) steps under the root, each sorted ascending."""
        return self.store.list_steps()

    def latest_committed(self) -> int | None:
        """The newest committed step of the current line (it follows rollbacks)."""
        steps = self.line_steps()
        return steps[-1] if steps else None

    def read_info(self, step: int) -> CheckpointInfo:
        return self.store.read_info(step)

    def verify(self, step: int) -> tuple[int, list[str]]:
        """Read committed checkpoint `step` back and compare every region with its digest.

        Returns (regions checked, mismatches). For audits and tests: it reads the whole
        checkpoint on this host.
        """
        info = self.read_info(step)
        specs = {name: self.store.array_spec(step_dir(step), name) for name in info.digests}
        return digest.verify_stored(specs, info.digests, self.store.context,
                                    info.digest_algorithm)

    def check_writable(self) -> None:
        """Fail fast (before training) when the root cannot be written; process 0 probes."""
        if self.process_id == 0:
            self.store.check_writable()

    # --- ownership, fencing, lineage (rootlines.py) -------------------------------------------
    def root_record(self) -> rootrecord.RootRecord | None:
        return self._lines.root_record()

    def reload_root(self) -> rootrecord.RootRecord | None:
        """Read the root record again, e.g. once process 0 has claimed or forked the root."""
        return self._lines.reload_root()

    def line_steps(self) -> list[int]:
        """Committed steps of the current line, ascending."""
        return self._lines.line_steps()

    def on_current_line(self, info: CheckpointInfo) -> bool:
        return self._lines.on_current_line(info)

    def open_root(self, identity: rootrecord.JobIdentity, attempt: int
                  ) -> rootrecord.RootRecord:
        """Process 0 of a starting gang: claim or adopt the root for `identity` and fence off
        every older attempt. Raises ForeignRootError or FencedError."""
        return self._lines.open_root(identity, attempt)

    def fork_root(self, step: int | None, request: str | None) -> rootrecord.RootRecord:
        """Make a new line, starting from committed `step` (None: from nothing), current."""
        return self._lines.fork_root(step, request)

    # --- save (snapshot.py, commit.py) ---------------------------------------------------------
    @property
    def saving(self) -> bool:
        """True while a save is in flight (not yet committed or failed); never blocks."""
        return self._pending is not None and not self._pending.done()

    @property
    def last_staged_bytes(self) -> int:
        """Device memory the last save staged on this host (accelerators; 0 on the CPU)."""
        return self._snapshots.last_staged_bytes

    @property
    def staging_budget(self) -> staging.DeviceBudget:
        """The device memory this process's snapshots may stage: the memory tier's share it
        with the saves (stagingbudget.py)."""
        return self._snapshots.budget

    @property
    def last_staging(self) -> dict[str, Any]:
        """What the last save staged on this host, as its `checkpoint_started` event says:
        `staged_bytes`, `staging_budget_bytes` (this host's devices' budgets, summed) and
        `staging_budget` (where the budget came from: "auto", "setting" or "off")."""
        report = self._snapshots.last_staging
        return {"staged_bytes": report.staged_bytes,
                "staging_budget_bytes": report.budget_bytes,
                "staging_budget": self._snapshots.budget.source}

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
            host_leaves = self._snapshots.copy_to_host(state)
        except leafkinds.LeafError as err:
            raise CheckpointUsageError(f"cannot save step {step}: {err}") from None
        blocked = time.perf_counter() - started
        failed = self._snapshots.last_staging
        if failed.failed_bytes:
            # The device could not hold the staged copy after all: those shards went to the
            # host (the save is whole), and the budget stages less from now on.
            self._emit({"event": "checkpoint_staging_failed", "level": "warning", "step": step,
                        "failed_bytes": failed.failed_bytes, "error": "; ".join(failed.errors),
                        "message": f"staging {failed.failed_bytes} bytes of the snapshot in "
                                   "device memory failed: copied to host memory instead"})
        self._emit({"event": "checkpoint_started", "step": step, "blocked_s": round(blocked, 6),
                    **self.last_staging})
        self._saves += 1
        self._pending = self._executor.submit(
            self._write_and_commit, step, host_leaves, checked_extra, dict(mesh or {}),
            self._saves, deadline)
        return blocked

    def prepare_save(self, state: Any, step_program: Any = None) -> None:
        """Optional, once the loop has run a step: get ready to save states of `state`'s
        layout, so the first save blocks no longer than the ones after it (snapshot.py).
        `step_program`: the compiled training step, or its `memory_analysis()`: the staging
        budget leaves its needs to it (stagingbudget.py)."""
        try:
            self._snapshots.prepare(state, step_program)
        except leafkinds.LeafError as err:
            raise CheckpointUsageError(f"cannot save this state: {err}") from None

    def _write_and_commit(self, step: int, leaves: list[HostLeaf], extra: dict[str, Any],
                          mesh: dict[str, int], save_id: int, until: Deadline | None
                          ) -> CheckpointInfo:
        info, written = self._committer.commit(step, leaves, extra, mesh, save_id, until)
        if not written:
            return info
        self.last_committed = info
        if self.process_id != 0:
            self.faults.at(AFTER_GC, step, self.process_id)
        elif until is None:
            self._retention.start(step)
        else:
            # A save on notice ends at its commit: deletes wait for the next start.
            self._emit({"event": "checkpoint_retention_deferred", "step": step})
        return info

    def wait(self, deadline: Deadline | None = None) -> CheckpointInfo | None:
        """Block until the save in flight (if any) is committed; re-raise its failure.

        Without a deadline, retention deletes after that commit are waited for too. With
        one, they are told to stop (a save on notice must not wait behind deletes) and the
        wait for the save ends at the deadline as CheckpointDeadlineError.
        """
        pending, self._pending = self._pending, None
        if deadline is not None:
            self._retention.stop()
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
            self._retention.join()
        return info

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._executor.shutdown(wait=True)
            self.store.close()

    # --- retention (retention.py) -------------------------------------------------------------
    def apply_retention(self) -> list[int]:
        """Run the keep policy now (process 0): at start-up, for deletes a save on notice
        left undone. Returns the steps deleted."""
        newest = self._retention_due()
        return [] if newest is None else self._retention.collect(newest, threading.Event())

    def start_retention(self) -> None:
        """`apply_retention` in the background, as after a save: a relaunch's first step
        does not wait behind the deletes (seconds for a large checkpoint on some storage).
        The next save, `wait` and `close` wait for them; a save on notice stops them."""
        newest = self._retention_due()
        if newest is not None:
            self._retention.start(newest, after_save=False)

    def _retention_due(self) -> int | None:
        """The newest committed step, up to which the keep policy applies (process 0 only)."""
        return self.latest_committed() if self.process_id == 0 else None

    def collect_partials(self, below: int | None = None) -> list[int]:
        """Delete partial checkpoints (all, or those older than `below`); process 0 only.

        Call only when no save of this gang is in flight, e.g. at start-up.
        """
        if self.process_id != 0:
            return []
        return self._retention.collect_partials(below)

    # --- restore (restore.py) -----------------------------------------------------------------
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
        started = time.perf_counter()
        info = self.read_info(step)
        read_from = time.perf_counter()
        timings: dict[str, float] = {}
        state, checked = restore.read_state(self.store, info, target, dtype=dtype,
                                            sharding=sharding,
                                            verify=self.verify_restore,
                                            inflight_bytes=self.restore_inflight_bytes,
                                            timings=timings)
        done = time.perf_counter()
        self._emit({"event": "checkpoint_restored", "step": step, "path": info.path,
                    "saved_process_count": info.process_count, "saved_mesh": info.mesh,
                    "regions_verified": checked, "seconds": round(done - started, 3),
                    "marker_s": round(read_from - started, 3),
                    **{k: round(v, 3) for k, v in timings.items()}})
        return state, info
