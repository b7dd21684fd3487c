"""Accelerator snapshots: the state's copy off the devices before the next step reuses them,
to host memory now, or (opt-in) to spare device memory first, read to the host afterwards.

A training step donates its state: the next step reuses the state's device buffers, so
every byte of the saved step must be off them before that step starts. Off the CPU that
leaves two places for it:

* host memory: the device->host copy runs at the link's speed (about 3.2 GB/s on the TPU
  v5e host we measured; 2 GiB in 0.67 s) and the next step waits for it;
* device memory: a copy on the device runs at memory speed (2 GiB in 8 ms on a v5e), and is
  read to host memory from the save thread while the loop trains on.

Device memory is the scarce resource: a second copy of the whole state halves the model a
user can train. So a staged copy takes only device memory the training has not used (the
device's limit less the peak in use and the programs' reserved memory seen at the first
save, less a margin: `DeviceBudget`), and at most what the user allows. The shards that fit
are staged on the device, the rest are copied to host memory before `save` returns.

Staging is off by default (budget 0), on what the chip showed: on the TPU v5e we measured,
a device->host copy stalls the steps it overlaps as long as it runs, wherever it is issued
from (the main thread of a loop running beside such a copy kept its full speed: the copy
holds no GIL; the device did not overlap it with the steps). A loop that saved 2 GiB lost
0.68 s with nothing staged and 0.67 s with all of it staged (and 2 GiB more device memory
in use); the reference trainer with room to stage lost more per save staged than copied at
once (docs/BENCHMARKS.md, "On a TPU chip"). Where the platform overlaps copies with
compute, a budget turns the wait into background work.

A staged shard is cut into pieces of at most `piece_bytes` on the device, and the save
thread reads them one at a time, freeing each piece's device memory as soon as it is on the
host: a read holds up a step that wants to start for at most one piece.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

# A device read holds up the loop for at most one piece (8 MiB: 2.5 ms at 3.2 GB/s).
DEFAULT_PIECE_BYTES = 8 << 20
# Device memory left free whatever the budget: fragmentation, and the runtime's own.
MARGIN_FRACTION = 0.1
MIN_MARGIN_BYTES = 512 << 20


def device_memory(device: Any) -> dict[str, int] | None:
    """JAX's memory statistics of `device` (bytes_limit, bytes_in_use, peak_bytes_in_use),
    or None where the platform keeps none."""
    try:
        stats = device.memory_stats()
    except Exception:  # platforms without the call (the CPU) raise or return None
        return None
    if not stats or "bytes_limit" not in stats or "bytes_in_use" not in stats:
        return None
    return stats


class DeviceBudget:
    """Bytes of device memory a snapshot may stage, per device.

    `limit_bytes`: None (automatic): the device memory the training has never used, measured
    at the first save: bytes_limit - peak_bytes_in_use - peak_bytes_reserved - margin (a
    tenth of the device, at least 512 MiB). The reserved bytes are the compiled programs'
    working memory, which the runtime reserves at load and does not count as in use: the
    reference model's step reserves 13.3 of a v5e's 15.7 GiB, and a staged copy that took
    part of it failed the next step's load ("RuntimeProgramAllocationFailure"). The first
    save's headroom holds for later ones (their own staging raises the device's peak, which
    must not shrink the budget save after save); each save also stays within what is free
    at that moment. 0: never stage (the loop waits for every
    byte). A number: at most that many bytes, within what is free."""

    def __init__(self, limit_bytes: int | None = None) -> None:
        if limit_bytes is not None and limit_bytes < 0:
            raise ValueError(f"a staging budget must be >= 0 bytes, got {limit_bytes}")
        self.limit_bytes = limit_bytes
        self._headroom: dict[Any, int] = {}

    def for_device(self, device: Any) -> int:
        if self.limit_bytes == 0:
            return 0
        stats = device_memory(device)
        if stats is None:
            return 0
        limit = int(stats["bytes_limit"])
        margin = max(MIN_MARGIN_BYTES, int(limit * MARGIN_FRACTION))
        in_use = int(stats["bytes_in_use"])
        reserved = int(stats.get("bytes_reserved", 0))
        if device not in self._headroom:
            peak = max(in_use, int(stats.get("peak_bytes_in_use", in_use)))
            peak_reserved = max(reserved, int(stats.get("peak_bytes_reserved", reserved)))
            self._headroom[device] = max(0, limit - peak - peak_reserved - margin)
        free_now = max(0, limit - in_use - reserved - margin)
        budget = min(self._headroom[device], free_now)
        return budget if self.limit_bytes is None else min(budget, self.limit_bytes)


@functools.cache
def _row_slicer(rows: int) -> Any:
    """A compiled `x[start:start + rows]` (start traced: one program per piece shape)."""
    return jax.jit(lambda x, start: jax.lax.dynamic_slice_in_dim(x, start, rows, axis=0))


def _copy(shard: jax.Array) -> jax.Array:
    return jax.device_put(shard, shard.sharding, may_alias=False)


class StagedShard:
    """A shard's copy in device memory, in pieces; host data on first `np.asarray`.

    Takes what the writers take of a shard's host data (`np.asarray`, `.nbytes`, `.shape`,
    `.dtype`); reading it to the host frees its device memory piece by piece."""

    def __init__(self, shard: jax.Array, piece_bytes: int) -> None:
        self.shape = tuple(shard.shape)
        self.dtype = np.dtype(shard.dtype)
        self.nbytes = int(shard.nbytes)
        rows = self.shape[0] if self.shape else 0
        row_bytes = self.nbytes // rows if rows else self.nbytes
        per_piece = max(1, piece_bytes // row_bytes) if row_bytes else rows
        if rows < 2 or per_piece >= rows:
            self._pieces = [_copy(shard)]
        else:
            # Dispatched now, before the caller returns to a loop that donates `shard`: the
            # device orders these reads before the next step's writes.
            self._pieces = [_row_slicer(min(per_piece, rows - start))(shard, start)
                            for start in range(0, rows, per_piece)]
        self._host: np.ndarray | None = None
        self._lock = threading.Lock()

    @property
    def device_bytes(self) -> int:
        """Device memory this shard still holds."""
        return sum(int(p.nbytes) for p in self._pieces)

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        with self._lock:
            if self._host is None:
                self._host = self._to_host()
        host = self._host
        return host if dtype is None else host.astype(dtype, copy=False)

    def _to_host(self) -> np.ndarray:
        if len(self._pieces) == 1:
            host = np.asarray(self._pieces[0])
            self._pieces[0].delete()
            self._pieces = []
            return host
        host = np.empty(self.shape, self.dtype)
        row = 0
        while self._pieces:
            piece = self._pieces.pop(0)
            part = np.asarray(piece)
            piece.delete()  # its device memory is free from here
            host[row : row + part.shape[0]] = part
            row += part.shape[0]
        return host

    def release(self) -> None:
        """Free the device memory without reading it (a save that failed before its write)."""
        with self._lock:
            for piece in self._pieces:
                piece.delete()
            self._pieces = []


def stage(shards: Sequence[tuple[Any, jax.Array]], budget: DeviceBudget,
          piece_bytes: int = DEFAULT_PIECE_BYTES) -> dict[int, StagedShard | np.ndarray]:
    """Host data for each (device, single-device array), by position: staged on the device
    (a StagedShard) while the device's budget lasts, largest shards first (they hold the loop
    longest), else copied to host memory here (the caller waits for those)."""
    remaining: dict[Any, int] = {}
    staged: dict[int, StagedShard | np.ndarray] = {}
    direct: list[int] = []
    order = sorted(range(len(shards)), key=lambda i: -int(shards[i][1].nbytes))
    for i in order:
        device, data = shards[i]
        if device not in remaining:
            remaining[device] = budget.for_device(device)
        size = int(data.nbytes)
        if 0 < size <= remaining[device]:
            staged[i] = StagedShard(data, piece_bytes)
            remaining[device] -= size
        else:
            direct.append(i)
    # Every direct copy in flight before the first wait: the device's DMA engines overlap.
    for i in direct:
        shards[i][1].copy_to_host_async()
    for i in direct:
        staged[i] = np.asarray(shards[i][1])
    return staged


def staged_bytes(values: Sequence[Any]) -> int:
    return sum(v.nbytes for v in values if isinstance(v, StagedShard))
