"""Read and write whole unencoded chunk files on a local disk without TensorStore's copies.

Each shard is one chunk of its zarr3 array, and with the plain `bytes` codec (no crc32c) an
encoded chunk is exactly the shard's little-endian bytes in C order. TensorStore's zarr3
write path copies every chunk twice into newly allocated memory (its chunk cache, then the
encoded buffer) before the page cache takes a third copy. On VMs whose hypervisor reclaims
freed guest memory, first touches of memory cost more than the copies themselves: on the
2-core benchmark VM a 1 GiB save spent 1.0-1.9 s in those writes, mostly kernel time.

So on local disks a save writes the chunk files itself, with O_DIRECT: each writer thread
copies its shard through one small, reused, page-aligned bounce buffer and the disk reads it
from there; the page cache is not involved, and neither is fresh memory (~0.5 s per GiB on
the same VM, 0.2 s of CPU). Where the filesystem refuses O_DIRECT (tmpfs, some network and
FUSE filesystems) it falls back to ordinary writes. Durability is the manager's syncfs
either way: it commits the files' metadata and flushes the device's write cache.

A restore reads a chunk that lands whole in a page-aligned stretch of its restore buffer
the same way in reverse: O_DIRECT, from the disk straight into the buffer JAX will adopt,
where TensorStore's read goes through the page cache and its own buffer first.

TensorStore still owns the format: process 0 creates every array (its `zarr.json`) through
TensorStore with the chunk key encoding pinned below, and tests check that TensorStore reads
these files back bit for bit and that these reads agree with TensorStore's. Anything else
(shards that are not exactly one chunk, arrays with a crc32c codec, chunks TensorStore
never wrote because they held only the fill value, gs://) goes through TensorStore.
"""

from __future__ import annotations

import concurrent.futures
import errno
import mmap
import os
import sys
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

# Pinned in the metadata of every array we create, so the file names below are its keys.
CHUNK_KEY_ENCODING = {"name": "default", "configuration": {"separator": "/"}}
THREADS = 16
# O_DIRECT needs the buffer address, the length and the file offset aligned to the logical
# block size (512 or 4096 bytes on current disks): 4096 satisfies both.
ALIGNMENT = 4096
BOUNCE_BYTES = 2 << 20


def chunk_key(index: Sequence[slice], shape: Sequence[int], chunk: Sequence[int]) -> str | None:
    """The zarr3 key of the chunk that `index` covers exactly, or None if it covers none."""
    if not chunk:
        return "c"
    coordinates = []
    for part, extent, size in zip(index, shape, chunk, strict=True):
        start, stop, step = part.indices(extent)
        if step != 1 or start % size or stop - start != size:
            return None
        coordinates.append(str(start // size))
    return "c/" + "/".join(coordinates)


def is_plain(codecs: Mapping[str, Any], key_encoding: Mapping[str, Any] | None) -> bool:
    """True if an array's chunk files are its chunks' raw little-endian bytes at our keys."""
    if key_encoding is not None and (
        key_encoding.get("name") != "default"
        or key_encoding.get("configuration", {}).get("separator", "/") != "/"
    ):
        return False
    chain = codecs.get("codecs", [])
    return len(chain) == 1 and chain[0].get("name") == "bytes" and chain[0].get(
        "configuration", {}).get("endian", "little") == "little"


def _little_endian_bytes(data: Any) -> memoryview:
    array = np.asarray(data)  # waits for this shard's device-to-host copy, if still running
    if sys.byteorder != "little" and array.dtype.itemsize > 1:
        array = array.astype(array.dtype.newbyteorder("<"))
    return as_bytes(np.ascontiguousarray(array))


def as_bytes(array: np.ndarray) -> memoryview:
    """A C-contiguous array's memory as bytes (bfloat16 & co. have no buffer protocol)."""
    return memoryview(array.reshape(-1).view(np.uint8))


def _reserve(fd: int, size: int) -> None:
    """Allocate the whole file at once: one extent to read back sequentially, not one per
    write of whichever of the concurrent writers got there first."""
    if size and hasattr(os, "posix_fallocate"):
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as err:
            if err.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise  # ENOSPC: better now than half-way through the write


def _write_all(fd: int, view: memoryview, offset: int) -> None:
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


class ChunkFileIO:
    """A pool of I/O threads (`os.pwrite`/`os.preadv` drop the GIL); one per manager."""

    def __init__(self, direct: bool = True) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(THREADS, "checkpoint-chunk-io")
        self._bounce = threading.local()
        # Cleared for good the first time the filesystem refuses O_DIRECT.
        self.direct = direct and hasattr(os, "O_DIRECT")
        # Chunk files handed to the pool: a bench that compares this path with TensorStore's
        # reports whether it ran at all.
        self.files_written = 0
        self.files_read = 0

    def _bounce_buffer(self) -> memoryview:
        if not hasattr(self._bounce, "buffer"):
            self._bounce.buffer = mmap.mmap(-1, BOUNCE_BYTES)  # anonymous: page-aligned
        return memoryview(self._bounce.buffer)

    def _open(self, path: str, flags: int) -> tuple[int, bool]:
        flags |= os.O_CLOEXEC
        if self.direct:
            try:
                return os.open(path, flags | os.O_DIRECT, 0o644), True
            except OSError as err:
                if err.errno != errno.EINVAL:
                    raise
                self.direct = False
        return os.open(path, flags, 0o644), False

    def _write_file(self, path: str, data: Any) -> int:
        view = _little_endian_bytes(data)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, direct = self._open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            _reserve(fd, len(view))
            done = self._direct(self._write_aligned, fd, view) if direct else 0
        finally:
            os.close(fd)
        if done < len(view):
            # The unaligned tail (or all of it) goes through the page cache.
            fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
            try:
                _write_all(fd, view[done:], done)
            finally:
                os.close(fd)
        return len(view)

    def _direct(self, transfer: Callable[[int, memoryview], int], fd: int,
                view: memoryview) -> int:
        """Bytes moved by `transfer` with O_DIRECT; 0 if the filesystem refused it on I/O."""
        try:
            return transfer(fd, view)
        except OSError as err:
            if err.errno != errno.EINVAL:
                raise
            self.direct = False  # accepted by open(2), refused by the transfer itself
            return 0

    def _write_aligned(self, fd: int, view: memoryview) -> int:
        bounce = self._bounce_buffer()
        # numpy copies without the GIL (a memoryview assignment holds it: with 16 writers
        # copying, a training loop that needs the GIL between its steps ran at 60% speed).
        into, source = np.frombuffer(bounce, np.uint8), np.frombuffer(view, np.uint8)
        aligned = len(view) - len(view) % ALIGNMENT
        for offset in range(0, aligned, BOUNCE_BYTES):
            size = min(BOUNCE_BYTES, aligned - offset)
            np.copyto(into[:size], source[offset : offset + size])
            _write_all(fd, bounce[:size], offset)
        return aligned

    def write(self, array_dir: str, shape: Sequence[int], chunk: Sequence[int],
              shards: Iterable[tuple[Sequence[slice], Any]]
              ) -> tuple[list[concurrent.futures.Future[int]], list[tuple[Sequence[slice], Any]]]:
        """Start writing the shards that are whole chunks; return (futures, the others)."""
        futures, others = [], []
        for index, data in shards:
            key = chunk_key(index, shape, chunk)
            if key is None:
                others.append((index, data))
            else:
                self.files_written += 1
                futures.append(
                    self._pool.submit(self._write_file, os.path.join(array_dir, key), data))
        return futures, others

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    @staticmethod
    def can_read_into(view: np.ndarray) -> bool:
        return bool(view.flags.c_contiguous) and view.ctypes.data % ALIGNMENT == 0

    def read_into(self, path: str, view: np.ndarray,
                  then: Callable[[np.ndarray], str] | None = None
                  ) -> concurrent.futures.Future[tuple[bool, str | None]]:
        """Start filling `view` (see `can_read_into`) with a chunk file's bytes.

        The future gives (found, then(view)): `then` (a digest) runs on the I/O thread
        while the other reads are in flight. `found` is False if the file does not exist
        (TensorStore leaves out chunks that hold only the fill value); a file of the wrong
        size raises ValueError.
        """
        self.files_read += 1
        return self._pool.submit(self._read_then, path, view, then)

    def _read_then(self, path: str, view: np.ndarray,
                   then: Callable[[np.ndarray], str] | None) -> tuple[bool, str | None]:
        if not self._read_file(path, view):
            return False, None
        return True, then(view) if then is not None else None

    def _read_file(self, path: str, view: np.ndarray) -> bool:
        target = as_bytes(view)
        try:
            fd, direct = self._open(path, os.O_RDONLY)
        except FileNotFoundError:
            return False
        try:
            size = os.fstat(fd).st_size
            if size != len(target):
                raise ValueError(f"chunk file {path} holds {size} bytes, not {len(target)}")
            done = self._direct(_read_aligned, fd, target) if direct else 0
        finally:
            os.close(fd)
        if done < len(target):
            with open(path, "rb", buffering=0) as rest:
                _read_all(rest.fileno(), target[done:], done)
        return True


def _read_aligned(fd: int, view: memoryview) -> int:
    aligned = len(view) - len(view) % ALIGNMENT
    _read_all(fd, view[:aligned], 0)
    return aligned


def _read_all(fd: int, view: memoryview, offset: int) -> None:
    while view:
        got = os.preadv(fd, [view], offset)
        if got == 0:
            raise ValueError("chunk file ended early")
        view, offset = view[got:], offset + got
