"""The write plan: every host an even share of a save, each region written exactly once."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tardigrade_checkpoint import writers

REPO = Path(__file__).resolve().parents[2]


@dataclasses.dataclass(frozen=True)
class FakeDevice:
    id: int
    process_index: int


def _devices(hosts: int, per_host: int) -> list[FakeDevice]:
    return [FakeDevice(h * per_host + i, h) for h in range(hosts) for i in range(per_host)]


def _replicated(name: str, shape: tuple[int, ...], devices: list[FakeDevice],
                itemsize: int = 4) -> writers.LeafLayout:
    return writers.LeafLayout(name, shape, itemsize,
                              {d: tuple(slice(None) for _ in shape) for d in devices})


def _rows(name: str, shape: tuple[int, int], devices: list[FakeDevice], parts: int,
          ) -> writers.LeafLayout:
    """Rows cut into `parts` shards; device i holds shard i % parts (replicas across hosts)."""
    step = shape[0] // parts
    return writers.LeafLayout(name, shape, 4, {
        d: (slice(i % parts * step, (i % parts + 1) * step), slice(None))
        for i, d in enumerate(devices)})


def _assert_tiles_once(layout: writers.LeafLayout, plan: writers.LeafPlan) -> None:
    """Every element written exactly once, every piece one chunk of the regular grid."""
    covered = 0
    seen = set()
    for write in plan.writes:
        key = tuple((r.start, r.stop) for r in write.region)
        assert key not in seen
        seen.add(key)
        covered += math.prod(r.stop - r.start for r in write.region)
        for r, c, size in zip(write.region, plan.chunk, layout.shape, strict=True):
            assert r.start % c == 0 and r.stop - r.start == min(c, size - r.start)
        # the writer holds what it writes
        held = layout.indices[write.device]
        assert all(h.indices(n)[0] <= r.start and r.stop <= h.indices(n)[1]
                   for h, r, n in zip(held, write.region, layout.shape, strict=True))
    assert covered == math.prod(layout.shape)


@pytest.mark.parametrize("hosts", [2, 4, 8])
def test_names_that_hash_alike_no_longer_land_on_one_host(hosts):
    # With CRC32 of these names, 2 hosts got 1.75x an even share and 8 hosts 2x.
    devices = _devices(hosts, 2)
    leaves = [_replicated(f"opt/{i}/mu", (64, 32), devices) for i in range(16)]
    plans = writers.plan(leaves)
    load = writers.bytes_per_host(plans, {leaf.name: 4 for leaf in leaves})
    even = sum(math.prod(leaf.shape) * 4 for leaf in leaves) / hosts
    assert max(load.values()) / even <= 1.25
    for leaf in leaves:
        _assert_tiles_once(leaf, plans[leaf.name])


def test_one_replicated_leaf_is_split_across_the_hosts_that_hold_it():
    devices = _devices(4, 2)
    leaf = _replicated("embed", (1024, 16), devices)
    plan = writers.plan([leaf])["embed"]
    assert plan.chunk == (256, 16)
    assert sorted(w.device.process_index for w in plan.writes) == [0, 1, 2, 3]
    _assert_tiles_once(leaf, plan)


def test_pieces_of_sharded_leaves_stay_on_the_grid_of_their_shards():
    # 3 row shards of 30 rows, each held by 2 hosts: a piece may not cross a shard boundary.
    devices = _devices(2, 3)
    leaf = _rows("w", (90, 8), devices, parts=3)
    plan = writers.plan([leaf])["w"]
    assert plan.chunk == (15, 8)
    _assert_tiles_once(leaf, plan)
    # Rows of 7 per shard cannot be cut in two on one grid: another axis is cut instead.
    odd = _rows("odd", (21, 8), devices, parts=3)
    odd_plan = writers.plan([odd])["odd"]
    assert odd_plan.chunk == (7, 4)
    _assert_tiles_once(odd, odd_plan)


def test_a_region_held_by_one_host_is_written_by_it_whole():
    devices = _devices(2, 1)
    leaf = writers.LeafLayout("w", (8, 4), 4, {
        devices[0]: (slice(0, 4), slice(None)), devices[1]: (slice(4, 8), slice(None))})
    plan = writers.plan([leaf])["w"]
    assert plan.chunk == (4, 4)
    assert {(w.region[0].start, w.device.process_index) for w in plan.writes} == {(0, 0), (4, 1)}


def test_small_leaves_are_not_cut_into_tiny_objects():
    devices = _devices(8, 1)
    big = [_replicated(f"w{i}", (512, 64), devices) for i in range(8)]
    bias = _replicated("b", (64,), devices)
    plans = writers.plan([*big, bias])
    assert len(plans["b"].writes) == 1 and plans["b"].chunk == (64,)
    count = _replicated("count", (), devices)
    assert writers.plan([count])["count"].chunk == ()


def test_every_host_computes_the_same_plan_whatever_order_it_lists_devices_in():
    devices = _devices(4, 2)
    leaves = [_replicated(f"l{i}", (16 * (i + 1), 8), devices) for i in range(6)]
    shuffled = [writers.LeafLayout(leaf.name, leaf.shape, leaf.itemsize,
                                   dict(reversed(list(leaf.indices.items()))))
                for leaf in leaves]
    assert writers.plan(leaves) == writers.plan(shuffled)


def test_the_plan_is_computed_once_per_layout_not_per_save(tmp_path, monkeypatch):
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec
    from tardigrade_checkpoint import CheckpointManager

    calls = []
    real_plan = writers.plan
    monkeypatch.setattr(writers, "plan", lambda leaves: calls.append(1) or real_plan(leaves))
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(4, 1), ("data", "model"))
    manager = CheckpointManager(str(tmp_path))
    value = np.arange(32, dtype=np.float32).reshape(8, 4)
    rows = {"w": jax.device_put(value, NamedSharding(mesh, PartitionSpec("data")))}
    for step in (1, 2):
        manager.save(step, rows)
        manager.wait()
    assert len(calls) == 1
    cols = {"w": jax.device_put(value, NamedSharding(mesh, PartitionSpec(None, "data")))}
    manager.save(3, cols)
    manager.wait()
    assert len(calls) == 2
    manager.close()


@pytest.mark.slow
def test_the_reference_model_is_balanced_on_2_4_and_8_hosts():
    # 16 CPU devices in a fresh process (this one has 4): host h owns devices 16/H*h...
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    out = subprocess.run([sys.executable, str(REPO / "bench" / "checkpoint_balance.py"),
                          "--devices", "16", "--json"], env=env, capture_output=True,
                         text=True, timeout=300, check=True).stdout
    rows = json.loads(out)
    assert sorted({row["hosts"] for row in rows}) == [2, 4, 8]
    for row in rows:
        assert row["after"]["max_even"] <= 1.25, row
        assert sum(row["after"]["bytes_per_host"]) == row["bytes"], row
