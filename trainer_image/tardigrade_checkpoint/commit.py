"""The commit protocol: one save, from this host's snapshot to an agreed commit marker.

    process 0: delete leftovers of the step, create its arrays     -> "prepared"
    every host: write its shards, make them durable, hash them     -> "written" + digests
    process 0: check the fence, write the commit marker            -> "outcome"

Each arrow is a message of agreement.py, so a failure anywhere reaches every host with its
cause. A step is committed only once its marker exists; anything less is a partial step that
is never restored. Every wait is bounded by the save's deadline when it has one (a save on
notice); the fault points of faults.py mark each stage.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import datetime
import re
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from tardigrade_checkpoint import agreement, digest, durability, layout, zarrgroup
from tardigrade_checkpoint import deadline as deadlines
from tardigrade_checkpoint import faults as points
from tardigrade_checkpoint.deadline import Deadline, DeadlineExceeded
from tardigrade_checkpoint.errors import (
    CheckpointDeadlineError,
    CheckpointError,
    CheckpointIOError,
)
from tardigrade_checkpoint.faults import SaveFaults
from tardigrade_checkpoint.marker import FORMAT, CheckpointInfo
from tardigrade_checkpoint.rootlines import RootLines
from tardigrade_checkpoint.rootstore import Handles, RootStore
from tardigrade_checkpoint.snapshot import HostLeaf

# Storage errors from TensorStore carry an absl status code; anything else is our own bug.
_STATUS = re.compile(r"^[A-Z][A-Z_]+: ")


def save_error(where: str, err: BaseException) -> CheckpointError:
    """What a failed save raises: storage and deadline trouble retryable, bugs not."""
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


def failure_kind(error: CheckpointError) -> str:
    """How the other hosts hear of `error`: retryable (storage, deadline) or not."""
    if isinstance(error, CheckpointDeadlineError):
        return agreement.DEADLINE
    return agreement.IO if isinstance(error, CheckpointIOError) else agreement.FAILED


class Committer:
    """Runs the protocol for each save of one manager, in order, on its save thread."""

    def __init__(self, store: RootStore, lines: RootLines, *, process_id: int,
                 process_count: int, barrier_timeout_seconds: float, checksum: bool,
                 on_event: Callable[[dict[str, Any]], None], faults: SaveFaults) -> None:
        self.store = store
        self.lines = lines
        self.process_id = process_id
        self.process_count = process_count
        self.barrier_timeout_seconds = barrier_timeout_seconds
        self.checksum = checksum
        self.on_event = on_event
        self.faults = faults
        self._previous_channel: str | None = None
        # Local-disk writes a missed deadline left running: the next save waits for them.
        self._stragglers: list[concurrent.futures.Future[int]] = []

    def commit(self, step: int, leaves: list[HostLeaf], extra: dict[str, Any],
               mesh: dict[str, int], save_id: int, until: Deadline | None = None
               ) -> tuple[CheckpointInfo, bool]:
        """(the step's marker, whether this save wrote it: False when the step was already
        committed on the current line). Raises a CheckpointError when nothing was committed.
        """
        started = time.perf_counter()
        store = self.store
        directory = layout.step_dir(step)
        pid = self.process_id
        flush: durability.FilesystemFlush | None = None
        channel = agreement.Channel(f"tardigrade-checkpoint-{step}-{save_id}", pid,
                                    self.process_count, self.barrier_timeout_seconds, until)
        handles = store.handles
        try:
            if until is not None:
                deadlines.all_results(self._stragglers, until, "an earlier save's writes")
                self._stragglers = []
                handles = store.bounded(until)
            existing = store.marker_if_any(handles, step, until)
            if existing is not None:
                if self.lines.on_current_line(existing):
                    # Never rewrite a committed checkpoint of the line being trained.
                    self.on_event({"event": "checkpoint_skipped", "step": step,
                                   "reason": "already committed"})
                    return existing, False
                # A step of an abandoned line (or a fenced-off gang): process 0 deletes it,
                # marker first, before writing this line's step there.
                self.on_event({"event": "checkpoint_superseded", "step": step,
                               "lineage": existing.lineage})
            self.lines.forget(step)
            self.faults.at(points.SAVE_START, step, pid)
            if pid == 0:
                # Leftovers of an earlier crashed save of this step may use another chunk grid.
                store.delete_dir(directory, until)
                flush = store.open_flush(directory)
                store.create_arrays(handles, directory, [
                    (leaf.name, layout.array_metadata(leaf.shape, leaf.dtype, leaf.chunk,
                                                      self.checksum))
                    for leaf in leaves], until,
                    # The step is a zarr group with attributes; the marker stays the last write.
                    groups=zarrgroup.documents(step, FORMAT, leaves))
                channel.prepared()
            else:
                channel.wait_prepared()
            self.faults.at(points.AFTER_PREPARE, step, pid)
            flush = flush or store.open_flush(directory)
            local = self._write(handles, directory, leaves, until)
            if flush is not None:
                flush.flush()  # durable before the others hear of it, hence before the commit
            nbytes = sum(d.nbytes for leaf in leaves for _, d in leaf.shards)
            self.faults.at(points.AFTER_WRITE, step, pid)
            if pid == 0:
                gathered = channel.gather_written(local)
                if self._previous_channel is not None:
                    channel.forget(self._previous_channel)  # every host is past it now
            else:
                channel.written(local)
                gathered = []
            info = CheckpointInfo(
                step=step,
                path=store.path_of(step),
                time=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                process_count=self.process_count,
                mesh=mesh,
                arrays={leaf.name: leaf.recorded() for leaf in leaves},
                extra=extra,
                digests=digest.merge(gathered),
                digest_algorithm=digest.DEFAULT_ALGORITHM,
                **self.lines.commit_identity(),
                all_chunks_stored=True,
            )
            if pid == 0:
                self.faults.at(points.BEFORE_COMMIT, step, pid)
                if until is not None and until.passed():
                    raise DeadlineExceeded(f"every shard was written, but not before {until.what}")
                self.lines.check_fence()
                store.write_marker(handles, info, until)
                self.faults.at(points.AFTER_COMMIT, step, pid)
                channel.outcome()
            else:
                channel.wait_outcome()
        except Exception as err:
            # Not committed: the previous commit stays the newest; this step dir is partial.
            error = save_error(f"saving {store.path_of(step)} failed", err)
            peer = err.failure if isinstance(err, agreement.PeerFailed) else None
            if pid == 0 or peer is None:
                # Every host hears of it now, wherever it waits, with the same cause.
                with contextlib.suppress(Exception):
                    channel.fail(peer or agreement.Failure(pid, failure_kind(error), str(error)))
            self.on_event({"event": "checkpoint_failed", "step": step, "error": str(error)})
            raise error from err
        finally:
            if pid == 0:
                self._previous_channel = channel.name
            if flush is not None:
                flush.close()
        self.on_event({
            "event": "checkpoint_committed", "step": step, "path": info.path,
            "seconds": round(time.perf_counter() - started, 6), "bytes_this_host": nbytes,
        })
        return info, True

    def _write(self, handles: Handles, directory: str, leaves: list[HostLeaf],
               until: Deadline | None) -> Any:
        """Write this host's shards; returns their digests (once every write has ended)."""
        store = self.store
        files: list[concurrent.futures.Future[int]] = []
        through_tensorstore: list[tuple[HostLeaf, list[Any]]] = []
        for leaf in leaves:
            in_flight, shards = store.write_chunk_files(directory, leaf.name, leaf.shape,
                                                        leaf.chunk, list(leaf.shards))
            files.extend(in_flight)
            if shards:
                through_tensorstore.append((leaf, shards))
        opened = store.open_for_write(handles, directory,
                                      [leaf.name for leaf, _ in through_tensorstore])
        writes = []
        for store_future, (_, shards) in zip(opened, through_tensorstore, strict=True):
            array = deadlines.result(store_future, until, "opening the step's arrays")
            # Snapshots are private and never mutated: TensorStore may keep referencing
            # them instead of copying every shard once more.
            writes.extend(
                array[index].write(np.asarray(data), can_reference_source_data_indefinitely=True)
                for index, data in shards
            )
        # Hashing the host copies overlaps the writes in flight (xxhash drops the GIL).
        local = digest.shard_digests((lf.name, lf.shape, lf.shards) for lf in leaves)
        # Every file write ends before the save may fail (none may outlive it), except
        # at a deadline: those left running are waited for before the next save.
        late = deadlines.unfinished(files, until)
        if late:
            self._stragglers = [f for f in late if not f.cancel()]
            raise DeadlineExceeded(f"writing this host's chunk files had not finished at "
                                   f"{until.what if until else 'the deadline'}")
        for file in files:
            file.result()
        deadlines.all_results(writes, until, "writing this host's shards")
        return local
