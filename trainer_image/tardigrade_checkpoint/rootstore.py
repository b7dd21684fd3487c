"""The storage interface: one checkpoint root, and the only place the package opens storage.

TensorStore does everything, on a local path or gs://: keys (commit markers, the root record,
listing, deletes) through one kvstore, state leaves as zarr3 arrays. On a local disk two
things are swapped in where they pay for themselves (docs/benchmarks/checkpoint.md):

* durability: one syncfs per host per save (durability.py) instead of TensorStore's fsync of
  every file and directory;
* whole chunks of unencoded arrays: the local-disk chunk-file backend (chunkfiles.py) reads
  and writes them with O_DIRECT, skipping TensorStore's copies (`chunk_files=False`: off).

Everything else (the array metadata, chunks that are not whole shards, crc32c-encoded
arrays, gs://) goes through TensorStore.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import os
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np
import tensorstore as ts

from tardigrade_checkpoint import (
    chunkfiles,
    digest,
    durability,
    layout,
    marker,
    zarrgroup,
)
from tardigrade_checkpoint import deadline as deadlines
from tardigrade_checkpoint.deadline import Deadline
from tardigrade_checkpoint.errors import CheckpointCorruptError, CheckpointIOError
from tardigrade_checkpoint.layout import COMMIT_FILE
from tardigrade_checkpoint.storage import StorageRetries

# Many files in flight hide per-file latency (open, rename, fsync where TensorStore does it),
# far beyond TensorStore's default of one per core.
_FILE_IO_CONCURRENCY = {"file_io_concurrency": {"limit": 64}}


class Waitable(Protocol):
    def result(self) -> Any: ...  # a read's digest of what it read, when it computed one


@dataclasses.dataclass(frozen=True)
class _ChunkFileRead:
    """A whole chunk read straight from its file, or through TensorStore if it has none."""

    file: concurrent.futures.Future[tuple[bool, str | None]]
    through_tensorstore: Callable[[], Waitable]

    def result(self) -> str | None:
        found, digest_of_read = self.file.result()
        if not found:
            self.through_tensorstore().result()
        return digest_of_read


@dataclasses.dataclass(frozen=True)
class ChunkFiles:
    """Where an unencoded array's chunk files are, and its chunk shape."""

    directory: str
    chunk: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Handles:
    """The kvstore and the write context one save uses (a save on notice gets bounded ones)."""

    kv: ts.KvStore
    write_context: ts.Context


class RootStore:
    """One checkpoint root (a local path or gs://bucket/prefix) on TensorStore."""

    def __init__(self, root: str, retries: StorageRetries, *, checksum: bool = False,
                 chunk_files: bool = True) -> None:
        self.root = root
        self.retries = retries
        self.spec = layout.kvstore_spec(root)
        self.local = self.spec["driver"] == "file"
        self.context = ts.Context({**_FILE_IO_CONCURRENCY, **retries.context_spec()})
        if self.spec["driver"] == "gcs":
            retries.apply_stall_timeout()
        # On a local filesystem a save's data files skip TensorStore's fsync per file and per
        # directory: each host flushes its filesystem once before the "written" barrier.
        # The commit marker and everything else still go through the fsyncing `context`.
        self.flush_filesystem = self.local and durability.available()
        write_context = self._write_context(retries)
        # Unencoded chunks on a local disk are read and written without TensorStore's copies
        # (see chunkfiles.py); written ones rely on the syncfs above for durability.
        self.chunk_io = chunkfiles.ChunkFileIO() if chunk_files and self.local else None
        self.chunk_file_writes = self.flush_filesystem and not checksum
        try:
            kv = ts.KvStore.open(self.spec, context=self.context).result()
        except Exception as err:
            raise CheckpointIOError(f"cannot open checkpoint root {root}: {err}") from err
        self.kv = kv
        self.handles = Handles(kv, write_context)

    def _write_context(self, retries: StorageRetries) -> ts.Context:
        return ts.Context({**_FILE_IO_CONCURRENCY, "file_io_sync": not self.flush_filesystem,
                           **retries.context_spec()})

    def bounded(self, until: Deadline) -> Handles:
        """Storage handles for a save on notice: retries cut to fit the time that is left."""
        retries = self.retries.within(until.remaining())
        kv_context = ts.Context({**_FILE_IO_CONCURRENCY, **retries.context_spec()})
        kv = deadlines.result(ts.KvStore.open(self.spec, context=kv_context), until,
                              "opening the checkpoint root")
        return Handles(kv, self._write_context(retries))

    def close(self) -> None:
        if self.chunk_io is not None:
            self.chunk_io.close()

    # --- keys ---------------------------------------------------------------------------------
    def path_of(self, step: int) -> str:
        return f"{self.root}/{layout.step_dir(step)}"

    def list_steps(self) -> tuple[list[int], list[int]]:
        """(committed, partial) steps under the root, each sorted ascending."""
        try:
            keys = self.kv.list().result()
        except Exception as err:
            raise CheckpointIOError(f"cannot list checkpoint root {self.root}: {err}") from err
        seen: set[int] = set()
        committed: set[int] = set()
        for key in keys:
            first, _, rest = key.decode().partition("/")
            step = layout.step_of(first)
            if step is None:
                continue
            seen.add(step)
            if rest == COMMIT_FILE:
                committed.add(step)
        return sorted(committed), sorted(seen - committed)

    def read_info(self, step: int) -> marker.CheckpointInfo:
        where = f"{self.path_of(step)}/{COMMIT_FILE}"
        try:
            result = self.kv.read(f"{layout.step_dir(step)}/{COMMIT_FILE}").result()
        except Exception as err:
            raise CheckpointIOError(f"cannot read {where}: {err}") from err
        if result.state != "value":
            raise CheckpointCorruptError(f"checkpoint {self.path_of(step)} is not committed")
        return marker.parse(bytes(result.value), step, self.path_of(step), where)

    def marker_if_any(self, handles: Handles, step: int, until: Deadline | None
                      ) -> marker.CheckpointInfo | None:
        """The step's marker, or None: one read, since process 0 may be deleting it (a step
        of an abandoned line) while another host looks."""
        key = f"{layout.step_dir(step)}/{COMMIT_FILE}"
        found = deadlines.result(handles.kv.read(key), until, "reading the commit marker")
        if found.state != "value":
            return None
        return marker.parse(bytes(found.value), step, self.path_of(step),
                            f"{self.path_of(step)}/{COMMIT_FILE}")

    def write_marker(self, handles: Handles, info: marker.CheckpointInfo,
                     until: Deadline | None) -> None:
        deadlines.result(handles.kv.write(f"{layout.step_dir(info.step)}/{COMMIT_FILE}",
                                          info.to_json().encode()),
                         until, "writing the commit marker")

    def delete_dir(self, directory: str, until: Deadline | None = None) -> None:
        # The commit marker goes first: an interrupted delete leaves a partial checkpoint
        # (ignored, collected later), never a committed one with missing shards.
        deadlines.result(self.kv.delete_range(
            ts.KvStore.KeyRange(f"{directory}/{COMMIT_FILE}", f"{directory}/{COMMIT_FILE}\0")
        ), until, f"deleting {directory}")
        deadlines.result(self.kv.delete_range(
            ts.KvStore.KeyRange(f"{directory}/", f"{directory}0")), until, f"deleting {directory}")
        if self.local:
            # The file driver deletes files but leaves their (now empty) directories behind.
            shutil.rmtree(self.spec["path"] + directory, ignore_errors=True)

    def check_writable(self) -> None:
        key = f".probe-{os.getpid()}-{time.time_ns()}"
        try:
            self.kv.write(key, b"probe").result()
            self.kv.delete_range(ts.KvStore.KeyRange(key, key + "\0")).result()
        except Exception as err:
            raise CheckpointIOError(
                f"checkpoint path {self.root} is not writable: {err}") from err

    # --- arrays -------------------------------------------------------------------------------
    def array_spec(self, directory: str, name: str, *, write: bool = False,
                   strict: bool = False) -> dict[str, Any]:
        return layout.array_spec(self.spec, directory, name, write=write, strict=strict)

    def create_arrays(self, handles: Handles, directory: str,
                      arrays: Sequence[tuple[str, dict[str, Any]]],
                      until: Deadline | None,
                      groups: Mapping[str, bytes] | None = None) -> None:
        """Create each (leaf name, zarr3 metadata) array of a step, and the step's zarr group
        files (zarrgroup.py) under `directory` (process 0)."""
        creates = [ts.open({**self.array_spec(directory, name, write=True), "metadata": meta},
                           create=True, context=handles.write_context)
                   for name, meta in arrays]
        creates += zarrgroup.write(handles.kv, directory, groups or {})
        deadlines.all_results(creates, until, "creating the step's arrays")

    def open_for_write(self, handles: Handles, directory: str, names: Sequence[str]
                       ) -> list[ts.Future]:
        return [ts.open(self.array_spec(directory, name, write=True), open=True,
                        context=handles.write_context) for name in names]

    def open_for_read(self, directory: str, names: Sequence[str], strict: bool
                      ) -> list[ts.Future]:
        return [ts.open(self.array_spec(directory, name, strict=strict), open=True, read=True,
                        context=self.context) for name in names]

    def open_flush(self, directory: str) -> durability.FilesystemFlush | None:
        """Before this host's first write of the step, so that syncfs sees its errors."""
        if not self.flush_filesystem:
            return None
        return durability.FilesystemFlush(self.spec["path"] + directory)

    def _local_array_dir(self, directory: str, name: str) -> str:
        return self.spec["path"] + layout.array_dir(directory, name)

    # --- the local-disk chunk-file backend ----------------------------------------------------
    def write_chunk_files(self, directory: str, name: str, shape: tuple[int, ...],
                          chunk: tuple[int, ...], shards: list[Any]
                          ) -> tuple[list[concurrent.futures.Future[int]], list[Any]]:
        """Start writing the shards the chunk-file backend takes; (in flight, the rest for
        TensorStore)."""
        if self.chunk_io is None or not self.chunk_file_writes or not shards:
            return [], shards
        in_flight, rest = self.chunk_io.write(self._local_array_dir(directory, name), shape,
                                              chunk, shards)
        return in_flight, list(rest)

    def chunk_files(self, directory: str, name: str, store: ts.TensorStore
                    ) -> ChunkFiles | None:
        """Where the backend may read `store`'s chunks from, if its chunks are plain files."""
        if self.chunk_io is None:
            return None
        metadata = store.spec(retain_context=False).to_json().get("metadata", {})
        if not chunkfiles.is_plain(store.codec.to_json(), metadata.get("chunk_key_encoding")):
            return None
        chunk = store.chunk_layout.read_chunk.shape
        return ChunkFiles(self._local_array_dir(directory, name), tuple(chunk or ()))

    def read_region(self, store: ts.TensorStore, region: digest.Region, into: np.ndarray,
                    files: ChunkFiles | None, algorithm: str | None = None) -> Waitable:
        """Start filling `into` with `region` of `store`: from its chunk file if it is one.

        With `algorithm`, a chunk file read also hashes what it read, on its I/O thread.
        """

        def through_tensorstore() -> Waitable:
            target = ts.array(into, copy=False, write=True, context=self.context)
            return target.write(store[region])

        if files is not None and self.chunk_io is not None:
            key = chunkfiles.chunk_key(region, store.shape, files.chunk)
            if key is not None and self.chunk_io.can_read_into(into):
                path = os.path.join(files.directory, key)
                then = (None if algorithm is None
                        else functools.partial(digest.digest_array, algorithm=algorithm))
                return _ChunkFileRead(self.chunk_io.read_into(path, into, then),
                                      through_tensorstore)
        return through_tensorstore()
