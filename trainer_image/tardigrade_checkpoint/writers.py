"""Which host writes which bytes of a save: an even share of the checkpoint for every host.

Every host computes the same plan from the global shapes and shardings alone, so exactly one
copy of every region is written, and no host has to ask another.

Two steps:

* A region held by several hosts (a replicated leaf, e.g. every parameter under pure data
  parallelism) is split along one axis into one piece per host holding it, each piece one
  chunk of the saved array (as Orbax's replica-parallel saving does: `replica_slices.py`,
  `get_replica_slices`). Pieces are never made smaller than needed: a region is split only
  into pieces of at least `1/SPLIT_FRACTION` of an even share, so the many small leaves
  (biases, norms, step counters) stay one object each on object storage.
* The pieces, largest first, go to the least-loaded host among those holding them (greedy
  list scheduling: when every host may take every piece, no host ends more than its last
  piece above the average, and cutting the large regions keeps every piece small).

A previous version hashed leaf names (CRC32) to pick the writer: similar names landed on the
same host (2 hosts: 66%/34% of the bytes; 8 hosts: 21% to 1%).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

Region = tuple[slice, ...]
# A piece is at least 1/SPLIT_FRACTION of an even share (unless its region is smaller).
SPLIT_FRACTION = 8


@dataclasses.dataclass(frozen=True)
class Write:
    """`region` (global coordinates) written by `device`, which holds it in `shard`."""

    region: Region
    device: Any
    shard: Region

    def local(self) -> Region:
        """`region` in the coordinates of the device's shard."""
        return tuple(slice(r.start - s.start, r.stop - s.start)
                     for r, s in zip(self.region, self.shard, strict=True))


@dataclasses.dataclass(frozen=True)
class LeafPlan:
    """The chunk shape of a leaf's saved array (one chunk per piece) and who writes what."""

    chunk: tuple[int, ...]
    writes: list[Write]


@dataclasses.dataclass(frozen=True)
class LeafLayout:
    """What the plan needs of a leaf: its name, shape, item size and device -> shard index."""

    name: str
    shape: tuple[int, ...]
    itemsize: int
    indices: Mapping[Any, Sequence[slice]]


Bounds = tuple[tuple[int, int], ...]  # a region as (start, stop) per axis: hashable


def _bounds(index: Sequence[slice], shape: Sequence[int]) -> Bounds:
    return tuple(part.indices(size)[:2] for part, size in zip(index, shape, strict=True))


def _region(bounds: Bounds) -> Region:
    return tuple(slice(start, stop) for start, stop in bounds)


def _split(extent: int, size: int, pieces: int) -> int | None:
    """The chunk length that cuts a shard of `extent` into at most `pieces` (>= 2) chunks of
    a regular grid, or None. The grid must also cut the next shard at its start, unless the
    shard is the whole axis (`size`): zarr's last chunk may stick out of the array."""
    for count in range(pieces, 1, -1):
        length = math.ceil(extent / count)
        if length < extent and (extent % length == 0 or extent == size):
            return length
    return None


def _chunk(shape: tuple[int, ...], shard: tuple[int, ...], pieces: int) -> tuple[int, ...]:
    """Shard shape, cut along the outermost axis that allows it (contiguous pieces)."""
    for axis, (extent, size) in enumerate(zip(shard, shape, strict=True)):
        length = _split(extent, size, pieces)
        if length is not None:
            return (*shard[:axis], length, *shard[axis + 1 :])
    return shard


def _cells(region: Bounds, chunk: tuple[int, ...]) -> list[Bounds]:
    """The chunks of a regular grid that make up `region` (which starts on the grid)."""
    ranges = [
        [(start, min(start + length, stop)) for start in range(start_, stop, length)]
        for (start_, stop), length in zip(region, chunk, strict=True)
    ]
    cells: list[Bounds] = [()]
    for options in ranges:
        cells = [(*cell, part) for cell in cells for part in options]
    return cells


def plan(leaves: Sequence[LeafLayout],
         process_of: Callable[[Any], int] = lambda device: int(device.process_index),
         ) -> dict[str, LeafPlan]:
    """The write plan of a whole state: the same on every host for the same inputs."""
    total = sum(math.prod(leaf.shape) * leaf.itemsize for leaf in leaves)
    # Leaves of one shape and sharding share their device -> index map (JAX caches it), so
    # who holds which region is worked out once per distinct map.
    holders_of: dict[int, dict[Bounds, dict[int, Any]]] = {}
    for leaf in leaves:
        if id(leaf.indices) in holders_of:
            continue
        # Grouped by the slices as given first (cheap), normalised once per group.
        raw: dict[tuple[Any, ...], tuple[Sequence[slice], list[Any]]] = {}
        for device, index in leaf.indices.items():
            key = tuple((s.start, s.stop, s.step) for s in index)
            raw.setdefault(key, (index, []))[1].append(device)
        groups: dict[Bounds, list[Any]] = {}
        for index, devices in raw.values():
            groups.setdefault(_bounds(index, leaf.shape), []).extend(devices)
        holders: dict[Bounds, dict[int, Any]] = {}
        for region, devices in groups.items():
            by_process: dict[int, Any] = {}
            for device in sorted(devices, key=lambda d: (process_of(d), d.id)):
                by_process.setdefault(process_of(device), device)
            holders[region] = by_process
        holders_of[id(leaf.indices)] = holders
    hosts = {p for holders in holders_of.values() for h in holders.values() for p in h}
    piece_floor = total / max(1, len(hosts)) / SPLIT_FRACTION

    # (bytes, leaf position, piece, {process: device holding it}, its shard)
    pieces: list[tuple[int, int, Bounds, dict[int, Any], Bounds]] = []
    chunks: list[tuple[int, ...]] = []
    for position, leaf in enumerate(leaves):
        holders = holders_of[id(leaf.indices)]
        shard = tuple(b - a for a, b in next(iter(holders))) if holders else leaf.shape
        shard_bytes = math.prod(shard) * leaf.itemsize
        wanted = min([len(h) for h in holders.values()]
                     + [int(shard_bytes // piece_floor) if piece_floor else 1])
        chunk = _chunk(leaf.shape, shard, wanted) if wanted > 1 else shard
        chunks.append(tuple(max(1, c) for c in chunk))
        for region, by_process in holders.items():
            for cell in _cells(region, chunk) if chunk != shard else [region]:
                nbytes = math.prod(b - a for a, b in cell) * leaf.itemsize
                pieces.append((nbytes, position, cell, by_process, region))

    load = dict.fromkeys(sorted(hosts), 0)
    writes: list[list[Write]] = [[] for _ in leaves]
    regions: dict[Bounds, Region] = {}  # leaves of one layout share their regions
    # Largest first; ties broken by position in the state, so every host sorts alike.
    for nbytes, position, cell, by_process, region in sorted(
            pieces, key=lambda p: (-p[0], p[1], p[2])):
        host = min(by_process, key=lambda process: (load[process], process))
        load[host] += nbytes
        if cell not in regions:
            regions[cell] = _region(cell)
        if region not in regions:
            regions[region] = _region(region)
        writes[position].append(Write(regions[cell], by_process[host], regions[region]))
    return {leaf.name: LeafPlan(chunks[i], writes[i]) for i, leaf in enumerate(leaves)}


def layout(name: str, leaf: Any) -> LeafLayout:
    """The layout of a `jax.Array` (or anything with shape, dtype and sharding)."""
    shape = tuple(leaf.shape)
    itemsize = getattr(leaf.dtype, "itemsize", None) or np.dtype(leaf.dtype).itemsize
    return LeafLayout(name, shape, int(itemsize), leaf.sharding.devices_indices_map(shape))


def bytes_per_host(plans: Mapping[str, LeafPlan], itemsizes: Mapping[str, int],
                   process_of: Callable[[Any], int] = lambda device: int(device.process_index),
                   ) -> dict[int, int]:
    """Bytes each host writes under `plans` (for benches and tests)."""
    load: dict[int, int] = {}
    for name, leaf_plan in plans.items():
        for write in leaf_plan.writes:
            nbytes = math.prod(r.stop - r.start for r in write.region) * itemsizes[name]
            host = process_of(write.device)
            load[host] = load.get(host, 0) + nbytes
    return load


class ShardPiece:
    """Part of a host copy of a shard, sliced only when read (after the device->host copy).

    Anything that takes the host data of a shard (`np.asarray`, `.nbytes`) takes this too.
    """

    def __init__(self, data: Any, local: Region) -> None:
        self.data = data
        self.local = local
        self.shape = tuple(s.stop - s.start for s in local)
        self.dtype = np.dtype(data.dtype)
        self.nbytes = math.prod(self.shape) * self.dtype.itemsize

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        view = np.asarray(self.data)[self.local]
        return view if dtype is None else view.astype(dtype, copy=False)
