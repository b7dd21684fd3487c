"""Content digests of saved shards: recorded in the commit marker, checked on restore.

At save time each host hashes the exact bytes it hands to storage (its host copy of every
shard it writes); process 0 puts all digests into `metadata.json`, keyed by leaf name and the
shard's region. They tie the commit marker to the content of that save: a chunk left over
from an earlier, crashed save of the same step, a region written twice or never, or a
restore that reads something else than was written, all show up as a mismatch. (The zarr
crc32c codec checks each chunk against itself, not against what the trainer meant to write.)
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
import tensorstore as ts

Digests = dict[str, dict[str, str]]  # leaf name -> region key -> hex digest


def region_key(index: Sequence[slice], shape: Sequence[int]) -> str:
    """'0:4,0:6' for a region of an array of `shape`; '' for a scalar."""
    parts = []
    for part, size in zip(index, shape, strict=True):
        start, stop, step = part.indices(size)
        if step != 1:
            raise ValueError(f"strided region {index} cannot be a shard")
        parts.append(f"{start}:{stop}")
    return ",".join(parts)


def parse_region(key: str) -> tuple[slice, ...]:
    if not key:
        return ()
    return tuple(slice(int(a), int(b)) for a, b in (p.split(":") for p in key.split(",")))


def digest_array(value: Any) -> str:
    """SHA-256 (128 bits kept) of an array's little-endian bytes in C order, with dtype/shape."""
    array = np.ascontiguousarray(np.asarray(value))
    if array.dtype.byteorder == ">":
        array = array.astype(array.dtype.newbyteorder("<"))
    digest = hashlib.sha256(f"{array.dtype.str}{array.shape}".encode())
    digest.update(memoryview(array).cast("B") if array.size else b"")
    return digest.hexdigest()[:32]


def shard_digests(
    leaves: Iterable[tuple[str, Sequence[int], Iterable[tuple[Sequence[slice], Any]]]],
) -> Digests:
    """Digests of (leaf name, shape, [(region, host data)]) as a host is about to write them."""
    result: Digests = {}
    for name, shape, shards in leaves:
        for index, data in shards:
            result.setdefault(name, {})[region_key(index, shape)] = digest_array(data)
    return result


def merge(parts: Iterable[Mapping[str, Mapping[str, str]]]) -> Digests:
    merged: Digests = {}
    for part in parts:
        for name, regions in part.items():
            merged.setdefault(name, {}).update(regions)
    return merged


def verify_restored(names: Sequence[str], arrays: Sequence[Any], recorded: Digests) -> tuple[
    int, list[str]
]:
    """Check restored arrays against the recorded digests, region by region.

    Every recorded region that one of this host's shards holds whole is hashed and compared.
    Returns (regions checked, mismatch descriptions). On the mesh that saved, every region is
    some host's shard; on another mesh, regions that straddle shards are left to crc32c.
    """
    checked, mismatches = 0, []
    for name, array in zip(names, arrays, strict=True):
        regions = recorded.get(name, {})
        if not regions:
            continue
        shape = tuple(array.shape)
        shards = array.addressable_shards if isinstance(array, jax.Array) else []
        seen: set[str] = set()
        for shard in shards:
            own = region_key(shard.index, shape)
            bounds = [(p.indices(n)[0], p.indices(n)[1]) for p, n in zip(shard.index, shape,
                                                                         strict=True)]
            for key, want in regions.items():
                if key in seen:
                    continue
                region = parse_region(key)
                inside = all(lo <= r.start and r.stop <= hi
                             for r, (lo, hi) in zip(region, bounds, strict=True))
                if not inside:
                    continue
                local = tuple(slice(r.start - lo, r.stop - lo)
                              for r, (lo, _) in zip(region, bounds, strict=True))
                data = np.asarray(shard.data)
                got = digest_array(data if key == own else data[local])
                seen.add(key)
                checked += 1
                if got != want:
                    mismatches.append(f"{name}[{key}]: restored {got}, saved {want}")
    return checked, mismatches


def verify_stored(array_specs: Mapping[str, dict[str, Any]], recorded: Digests,
                  context: ts.Context) -> tuple[int, list[str]]:
    """Read every recorded region back from storage and compare digests (offline checks)."""
    checked, mismatches = 0, []
    for name, regions in sorted(recorded.items()):
        store = ts.open(array_specs[name], open=True, read=True, context=context).result()
        for key, want in sorted(regions.items()):
            got = digest_array(store[parse_region(key)].read().result())
            checked += 1
            if got != want:
                mismatches.append(f"{name}[{key}]: stored {got}, saved {want}")
    return checked, mismatches
