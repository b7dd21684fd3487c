"""The memory tier's snapshot staged in spare device memory (memory_tier.take_snapshot with the
bucket save's staging budget, memory_session.MemoryTier.snapshot): what is staged, what is
copied to the host at once, how it shares the budget with a bucket save, and that the
committed snapshot holds the step's state even when the next step donated it.

The CPU keeps no memory statistics and snapshots without staging: the tests that stage take
the CPU's devices for an accelerator's (staging_loop.take_cpu_for_accelerator), and hold the
one device reader (staging.py) so that staged copies stay on the devices until they let go."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from staging_loop import FREE_DEVICE, take_cpu_for_accelerator
from tardigrade_checkpoint import CheckpointManager, memory_tier, staging
from tardigrade_checkpoint.stagingbudget import DeviceBudget
from tardigrade_contract import contract
from tardigrade_sdk.memory_session import MemoryTier

KIB = 1 << 10


@pytest.fixture
def accelerator(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Snapshots (the bucket's and the memory tier's) stage as on an accelerator; the devices
    report room to spare; every staging copy is recorded (`.calls`, bytes per copy)."""
    monkeypatch.setattr(memory_tier, "_on_cpu", lambda devices: False)
    return take_cpu_for_accelerator(monkeypatch.setattr, fail=0)


@contextlib.contextmanager
def reader_held() -> Iterator[None]:
    """The device reader busy until the block ends: what is staged meanwhile stays staged."""
    gate = threading.Event()
    staging._device_reader().submit(gate.wait)
    try:
        yield
    finally:
        gate.set()


def _state(seed: int) -> dict[str, Any]:
    """A leaf split over two devices, one replicated on both, a host value, a PRNG key."""
    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
    rng = np.random.default_rng(seed)
    return {"w": jax.device_put(rng.standard_normal((256, 64)).astype(np.float32),
                                NamedSharding(mesh, PartitionSpec("data"))),
            "b": jax.device_put(np.full((64,), seed, np.float32),
                                NamedSharding(mesh, PartitionSpec())),
            "count": np.int32(seed), "key": jax.random.key(seed)}


def _host(state: dict[str, Any]) -> dict[str, np.ndarray]:
    return {name: np.asarray(jax.random.key_data(v) if name == "key" else v).copy()
            for name, v in state.items()}


def _target(state: dict[str, Any]) -> dict[str, Any]:
    return {name: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding)
            if isinstance(v, jax.Array) else v for name, v in state.items()}


def _assert_restores(store: memory_tier.MemoryStore, step: int, target: dict[str, Any],
                     expected: dict[str, np.ndarray]) -> None:
    manifest, data = store.load(0, step)
    back = memory_tier.assemble([(manifest, data)], target)
    assert _host(back).keys() == expected.keys()
    for name, want in _host(back).items():
        np.testing.assert_array_equal(want, expected[name], err_msg=name)
        assert want.dtype == expected[name].dtype


def _tier(tmp_path: Path, budget: DeviceBudget | None) -> tuple[MemoryTier, list[dict]]:
    env = contract.TrainerEnvironment(
        job_name="staged", namespace="ns", attempt=1, coordinator_address="127.0.0.1:1",
        num_processes=1, process_id=0, checkpoint_path=str(tmp_path / "ckpt"),
        save_on_preemption=False, job_uid="uid-1", memory_tier_dir=str(tmp_path / "memory"),
        memory_tier_interval=5)
    events: list[dict] = []
    return MemoryTier(env, events.append, budget=budget), events


def _device_piece_bytes(state: dict[str, Any]) -> int:
    """What a memory snapshot copies off the devices: each region once."""
    return int(state["w"].nbytes + state["b"].nbytes + jax.random.key_data(state["key"]).nbytes)


def _outstanding(budget: DeviceBudget) -> int:
    return sum(budget.outstanding(d) for d in jax.devices())


def test_a_snapshot_within_the_budget_is_staged_and_its_commit_reads_it(tmp_path, accelerator):
    budget = DeviceBudget(memory_stats=lambda device: dict(FREE_DEVICE))
    tier, events = _tier(tmp_path, budget)
    state = _state(1)
    expected = _host(state)
    with reader_held():
        tier.snapshot(5, state, {"data_position": 6}, None)
        started = events[-1]
        assert started["event"] == "memory_snapshot_started"
        # Every device piece staged, in one copy program per device: the loop waited for no
        # host copy. Until the reader gets to them they hold the shared budget.
        assert started["staged_bytes"] == _device_piece_bytes(state) == sum(accelerator.calls)
        assert len(accelerator.calls) == 2
        assert started["staging_budget"] == "auto" and started["staging_budget_bytes"] > 0
        assert _outstanding(budget) == started["staged_bytes"]
    tier.wait()
    assert _outstanding(budget) == 0  # read, and given back
    committed = [e for e in events if e["event"] == "memory_snapshot_committed"]
    assert [e["step"] for e in committed] == [5]
    _assert_restores(tier.store, 5, _target(state), expected)
    tier.close()


def test_a_budget_of_zero_copies_every_shard_to_the_host_at_once(tmp_path, accelerator):
    off = DeviceBudget(0, memory_stats=lambda device: dict(FREE_DEVICE))
    state = _state(2)
    expected = _host(state)
    report = staging.StagingReport()
    snapshot = memory_tier.take_snapshot(state, off, report)
    assert all(isinstance(p.value, np.ndarray) for p in snapshot.pieces)
    assert report.staged_bytes == 0 and accelerator.calls == []
    tier, events = _tier(tmp_path, off)
    tier.snapshot(5, state, {}, None)
    tier.wait()
    started = events[0]
    assert (started["staged_bytes"], started["staging_budget"]) == (0, "off")
    assert accelerator.calls == []
    _assert_restores(tier.store, 5, _target(state), expected)
    tier.close()


def test_on_the_cpu_nothing_is_staged_whatever_the_budget(tmp_path, monkeypatch):
    def no_staging(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a snapshot on the CPU staged")

    monkeypatch.setattr(staging, "stage", no_staging)
    monkeypatch.setattr(staging, "prepare", no_staging)
    budget = DeviceBudget(memory_stats=lambda device: dict(FREE_DEVICE))
    tier, events = _tier(tmp_path, budget)
    state = _state(3)
    expected = _host(state)
    tier.prepare(state)
    tier.snapshot(5, state, {}, None)
    tier.wait()
    assert events[0]["staged_bytes"] == 0
    _assert_restores(tier.store, 5, _target(state), expected)
    tier.close()


def test_a_bucket_save_and_a_memory_snapshot_never_stage_beyond_the_budget_together(
        tmp_path, accelerator, monkeypatch):
    cap = 40 * KIB  # per device: one save's half of w (32 KiB) and b, not two saves'
    manager = CheckpointManager(str(tmp_path / "ckpt"), snapshot_device_bytes=cap)
    budget = manager.staging_budget
    tier, events = _tier(tmp_path, budget)  # the session's wiring: one budget for both
    peaks: list[int] = []
    staged = budget.staged

    def recorded(device: Any, nbytes: int) -> None:
        staged(device, nbytes)
        peaks.append(budget.outstanding(device))

    monkeypatch.setattr(budget, "staged", recorded)

    # Alone, each stages all of its shards within the cap.
    first = _state(4)
    tier.snapshot(5, first, {}, None)
    tier.wait()
    alone = [e for e in events if e["event"] == "memory_snapshot_started"][-1]["staged_bytes"]
    assert alone == _device_piece_bytes(first)
    manager.save(5, first)
    manager.wait()
    bucket_alone = manager.last_staging["staged_bytes"]
    assert bucket_alone > cap  # over both devices: more than one device's cap
    assert _outstanding(budget) == 0

    # A bucket save's copies still staged: the snapshot gets what they leave of the cap.
    second = _state(5)
    expected_second = _host(second)
    with reader_held():
        manager.save(10, second)
        assert manager.last_staging["staged_bytes"] == bucket_alone
        tier.snapshot(10, second, {}, None)
        shared = [e for e in events if e["event"] == "memory_snapshot_started"][-1]
        assert shared["staged_bytes"] < alone
        assert all(budget.outstanding(d) <= cap for d in jax.devices())
    manager.wait()
    tier.wait()
    # ...and the reverse: a memory snapshot's copies leave the bucket save the rest.
    third = _state(6)
    expected_third = _host(third)
    with reader_held():
        tier.snapshot(15, third, {}, None)
        manager.save(15, third)
        assert manager.last_staging["staged_bytes"] < bucket_alone
        assert all(budget.outstanding(d) <= cap for d in jax.devices())
    manager.wait()
    tier.wait()
    assert peaks and max(peaks) <= cap
    assert _outstanding(budget) == 0
    for step, state, expected in ((10, second, expected_second), (15, third, expected_third)):
        _assert_restores(tier.store, step, _target(state), expected)
        restored, _ = manager.restore(step, _target(state))
        for name in ("w", "b"):
            np.testing.assert_array_equal(np.asarray(restored[name]), expected[name])
    tier.close()
    manager.close()


def test_a_snapshot_holds_its_step_after_the_next_steps_donate_the_state(tmp_path,
                                                                          accelerator):
    budget = DeviceBudget(memory_stats=lambda device: dict(FREE_DEVICE))
    tier, _ = _tier(tmp_path, budget)
    state = _state(7)
    expected = _host(state)
    step = jax.jit(lambda s: {**s, "w": s["w"] * 0.0 - 1.0, "b": s["b"] * 0.0 + 9.0},
                   donate_argnums=0)
    arrays = {k: v for k, v in state.items() if k in ("w", "b")}
    with reader_held():  # the staged copies are read only after the steps reused the buffers
        tier.snapshot(5, state, {}, None)
        original = arrays["w"]
        for _ in range(3):
            arrays = step(arrays)
        jax.block_until_ready(arrays)
        assert original.is_deleted()  # donated
    tier.wait()
    _assert_restores(tier.store, 5, _target(state), expected)
    np.testing.assert_array_equal(np.asarray(arrays["w"]), -1.0)
    tier.close()


def test_a_commit_that_fails_before_reading_gives_the_staged_copies_back(tmp_path, accelerator,
                                                                        monkeypatch):
    budget = DeviceBudget(memory_stats=lambda device: dict(FREE_DEVICE))
    tier, events = _tier(tmp_path, budget)

    def refused(*args: Any, **kwargs: Any) -> Any:
        raise OSError(28, "No space left on device")  # the memory volume full

    monkeypatch.setattr(memory_tier.MemoryStore, "open_data", refused)
    with reader_held():  # no copy is read: the failed commit must release them
        tier.snapshot(5, _state(8), {}, None)
        tier.wait()
        assert events[0]["staged_bytes"] > 0
        assert _outstanding(budget) == 0
    assert events[-1]["event"] == "memory_snapshot_failed"
    assert "No space left" in events[-1]["error"]
    tier.close()
