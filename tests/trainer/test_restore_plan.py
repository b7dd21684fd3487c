"""Restore at scale: saved regions found by index, and a bound on the bytes of reads in flight."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from tardigrade_checkpoint import CheckpointManager, digest, restoreplan
from tardigrade_checkpoint.manager import gathered_state_hash


def _grid(shape: tuple[int, int], grid: tuple[int, int]) -> dict[str, str]:
    rows, cols = shape[0] // grid[0], shape[1] // grid[1]
    return {digest.region_key((slice(i * rows, (i + 1) * rows), slice(j * cols, (j + 1) * cols)),
                              shape): f"d{i}-{j}"
            for i in range(grid[0]) for j in range(grid[1])}


def _keys(pieces: list[digest.Piece]) -> list[tuple[str, str, bool]]:
    return sorted((p.key, p.want, p.inside) for p in pieces)


@pytest.mark.parametrize("box", [
    (slice(0, 64), slice(0, 32)),      # everything
    (slice(8, 24), slice(0, 16)),      # whole cells
    (slice(5, 29), slice(3, 30)),      # straddles cells on both axes
    (slice(60, 64), slice(31, 32)),    # one corner
])
def test_the_index_finds_the_same_pieces_as_the_full_scan(box):
    recorded = _grid((64, 32), (8, 4))
    index = restoreplan.RegionIndex(recorded, 2)
    assert index.is_grid
    assert _keys(index.pieces(box)) == _keys(digest.plan_pieces(box, recorded))


def test_uneven_grids_and_scalars_are_indexed_too():
    # Last row of shards is shorter (a zarr grid's edge chunk); a scalar leaf has one region.
    recorded = {"0:4,0:3": "a", "0:4,3:6": "b", "4:6,0:3": "c", "4:6,3:6": "d"}
    index = restoreplan.RegionIndex(recorded, 2)
    assert index.is_grid
    box = (slice(3, 6), slice(2, 4))
    assert _keys(index.pieces(box)) == _keys(digest.plan_pieces(box, recorded))
    scalar = restoreplan.RegionIndex({"": "s"}, 0)
    assert scalar.is_grid and [p.key for p in scalar.pieces(())] == [""]


def test_a_marker_that_misses_a_region_is_still_reported_as_incomplete():
    recorded = _grid((64, 32), (8, 4))
    del recorded["8:16,8:16"]
    index = restoreplan.RegionIndex(recorded, 2)
    assert not index.is_grid
    with pytest.raises(ValueError, match="cover 64 of the 128 elements"):
        index.pieces((slice(8, 16), slice(8, 24)))
    # A tiling that is no grid (regions of different widths per row) is still planned.
    rows = {"0:2,0:3": "a", "0:2,3:4": "b", "2:4,0:1": "c", "2:4,1:4": "d"}
    other = restoreplan.RegionIndex(rows, 2)
    assert not other.is_grid
    assert _keys(other.pieces((slice(1, 3), slice(0, 4)))) == _keys(
        digest.plan_pieces((slice(1, 3), slice(0, 4)), rows))
    with pytest.raises(ValueError, match="rank 1, not 2"):
        restoreplan.RegionIndex({"0:4": "x"}, 2).pieces((slice(0, 4), slice(0, 1)))


class CountingReads:
    """Wraps the manager's reader: bytes of reads started and not yet waited for."""

    def __init__(self, read: Any) -> None:
        self.read = read
        self.in_flight = 0
        self.peak = 0
        self.reads = 0

    def __call__(self, store: Any, region: Any, into: np.ndarray, files: Any,
                 algorithm: str | None = None) -> Any:
        waitable = self.read(store, region, into, files, algorithm)
        self.reads += 1
        self.in_flight += into.nbytes
        self.peak = max(self.peak, self.in_flight)
        return _Counted(waitable, self, into.nbytes)


class _Counted:
    def __init__(self, waitable: Any, counter: CountingReads, nbytes: int) -> None:
        self.waitable, self.counter, self.nbytes = waitable, counter, nbytes
        self.done = False

    def result(self) -> Any:
        got = self.waitable.result()
        if not self.done:
            self.done = True
            self.counter.in_flight -= self.nbytes
        return got


SHARD_BYTES = 16 * 32 * 4


def _state(mesh: Mesh) -> dict[str, jax.Array]:
    rng = np.random.default_rng(5)
    sharding = NamedSharding(mesh, PartitionSpec("data", None))
    return {f"layer{i}": jax.device_put(rng.standard_normal((64, 32)).astype(np.float32),
                                        sharding) for i in range(6)}


@pytest.mark.parametrize(("target_mesh", "spec"), [
    ((4, 1), PartitionSpec("data", None)),   # the saved layout: whole shards
    ((2, 2), PartitionSpec("data", "model")),  # resharded: saved shards read whole as scratch
], ids=["same-mesh", "resharded"])
@pytest.mark.parametrize("verify", [True, False])
def test_restore_keeps_reads_in_flight_under_the_bound(tmp_path, monkeypatch, target_mesh,
                                                       spec, verify):
    devices = np.array(jax.devices()[:4])
    saved = _state(Mesh(devices.reshape(4, 1), ("data", "model")))
    limit = 3 * SHARD_BYTES
    manager = CheckpointManager(str(tmp_path), restore_inflight_bytes=limit,
                                verify_restore=verify)
    manager.save(1, saved)
    manager.wait()
    counter = CountingReads(manager.store.read_region)
    monkeypatch.setattr(manager.store, "read_region", counter)
    mesh = Mesh(devices.reshape(target_mesh), ("data", "model"))
    target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(mesh, spec))
              for k, v in saved.items()}
    restored, _ = manager.restore(1, target)
    assert gathered_state_hash(restored) == gathered_state_hash(saved)
    total = sum(v.nbytes for v in saved.values())
    assert counter.reads >= 6 and counter.in_flight == 0
    # The whole state (6 x 8 KiB) would be in flight at once without the bound.
    assert 0 < counter.peak <= limit < total
    manager.close()


def test_the_bound_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="restore_inflight_bytes must be >= 1"):
        CheckpointManager(str(tmp_path), restore_inflight_bytes=0)
