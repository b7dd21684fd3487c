"""The resharding restore: read a committed step into the current mesh's shardings.

Each host reads only the slices its devices hold, whatever mesh or process count wrote them,
at most `inflight_bytes` of reads at a time (restoreplan.ReadWindow). With verification, every
byte read is checked against the digests in the commit marker: a saved shard that only partly
overlaps this host's slices (after a resharding) is read whole into scratch memory, once, to
be checked. Reads go through the storage interface (rootstore.py), which takes whole chunks
from their files on a local disk.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import mmap
import time
from typing import Any

import jax
import numpy as np
import tensorstore as ts

from tardigrade_checkpoint import cast, digest, layout, restoreplan, targetless
from tardigrade_checkpoint import leaves as leafkinds
from tardigrade_checkpoint.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointIOError,
    CheckpointUsageError,
)
from tardigrade_checkpoint.marker import CheckpointInfo
from tardigrade_checkpoint.rootstore import ChunkFiles, RootStore, Waitable
from tardigrade_checkpoint.storage import is_unavailable


@dataclasses.dataclass
class _Scratch:
    """A saved shard that sticks out of this host's slices, read whole into scratch memory
    once per restore, however many of the slices it straddles; checked once too."""

    read: Waitable
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
    read: Waitable | None = None
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


def _read_box(root: RootStore, store: ts.TensorStore, box: digest.Region,
              pieces: list[digest.Piece] | None, algorithm: str, files: ChunkFiles | None,
              scratches: dict[str, _Scratch]) -> _PendingRead:
    """Read `box` of `store` into new memory, piece by recorded piece when checking.

    `scratches` holds this leaf's saved shards read whole so far (shared between boxes).
    """
    buffer = _page_aligned_empty(tuple(b.stop - b.start for b in box), store.dtype.numpy_dtype)
    if pieces is None:
        read = root.read_region(store, box, buffer, files)
        return _PendingRead(buffer, box, [_Part(None, read, view=buffer)], algorithm)
    parts = []
    for piece in pieces:
        if piece.inside:
            view = _view(buffer, digest.local(piece.region, box))
            read = root.read_region(store, piece.region, view, files, algorithm)
            parts.append(_Part(piece, read, view=view))
            continue
        if piece.key not in scratches:
            data = _page_aligned_empty(tuple(r.stop - r.start for r in piece.region),
                                       store.dtype.numpy_dtype)
            scratches[piece.key] = _Scratch(
                root.read_region(store, piece.region, data, files, algorithm), data)
        parts.append(_Part(piece, scratch=scratches[piece.key]))
    return _PendingRead(buffer, box, parts, algorithm)


def read_state(root: RootStore, info: CheckpointInfo, target: Any, *, verify: bool,
               inflight_bytes: int, dtype: cast.DTypes = None,
               sharding: targetless.ShardingChoice | None = None,
               timings: dict[str, float] | None = None) -> tuple[Any, int]:
    """(checkpoint `info` read into the shapes and shardings of `target`, regions verified).

    `timings`, if given, gets where the calling thread spent the restore: `read_wait_s`
    waiting for reads and their checks, `device_put_s` handing buffers to the devices.

    `target` is a pytree of `jax.ShapeDtypeStruct`s (or arrays) carrying `.sharding` for the
    current mesh; None reads the checkpoint's own leaves (targetless.py). A target or `dtype`
    of another dtype than the stored one casts (cast.py).
    """
    if target is None:
        target = targetless.target(info.arrays, sharding)
    elif sharding is not None:
        raise CheckpointUsageError("restore(sharding=...) is for a restore without a target: "
                                   "give the target's leaves their shardings instead")
    names = layout.leaf_names(target)
    leaves, treedef = jax.tree_util.tree_flatten(target)
    try:
        targets = [leafkinds.read_target(n, leaf) for n, leaf in zip(names, leaves, strict=True)]
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
    directory = layout.step_dir(info.step)
    # Checkpoints from before digests were recorded have none: crc32c, if on, is all.
    check = verify and bool(info.digests)
    algorithm = info.digest_algorithm
    mismatches: list[str] = []
    checked = 0
    try:
        stores = root.open_for_read(directory, names, strict=info.all_chunks_stored)
        # Reads are consumed (checked, put on their devices) oldest first, as soon as the
        # next ones would exceed the bytes allowed in flight.
        window = restoreplan.ReadWindow(inflight_bytes)
        # Per leaf: its devices in order (None: a host value, read whole by every host)
        # and what was read for each.
        placed: list[tuple[list[jax.Device | None], dict[jax.Device | None, Any]]] = []

        spent = timings if timings is not None else {}
        spent.update(read_wait_s=0.0, device_put_s=0.0)

        def place(read: _PendingRead, name: str, devices: list[jax.Device | None],
                  into: dict[jax.Device | None, Any], dtype: np.dtype) -> None:
            started = time.perf_counter()
            buffer = cast.to_dtype(read.result(mismatches, name), dtype)  # after the check
            checked_at = time.perf_counter()
            for device in devices:
                into[device] = buffer if device is None else jax.device_put(buffer, device)
            spent["read_wait_s"] += checked_at - started
            spent["device_put_s"] += time.perf_counter() - checked_at

        for name, store_future, leaf in zip(names, stores, targets, strict=True):
            store = store_future.result()
            recorded = info.digests.get(name) if check else None
            try:
                regions = (None if recorded is None
                           else restoreplan.RegionIndex(recorded, len(leaf.shape)))
            except ValueError as err:
                raise CheckpointCorruptError(
                    f"the commit marker's digests are incomplete: {err}") from err
            files = root.chunk_files(directory, name, store)
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
                read = _read_box(root, store, box, pieces, algorithm, files, scratches)
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
            f"checkpoint {info.path} does not hold what was saved: " + "; ".join(mismatches[:5]))
    return jax.tree_util.tree_unflatten(treedef, arrays), checked
