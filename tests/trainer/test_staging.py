"""Accelerator snapshots (checkpoint/staging.py): what is staged in device memory, what is
copied at once, and that a staged copy survives the donation of the state it was taken of.
On the CPU the device's memory statistics are absent, so the budget is given."""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tardigrade_checkpoint import staging
from tardigrade_checkpoint.background import SaveThread
from tardigrade_checkpoint.staging import DeviceBudget, StagedShard, stage
from tardigrade_sdk.savestall import SaveStall

MIB = 1 << 20


class Budget:
    """A fixed budget per device (the CPU keeps no memory statistics)."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes

    def for_device(self, device: object) -> int:
        return self.nbytes

    def staging_failed(self, device: object, nbytes: int) -> None:
        raise AssertionError("no staging copy fails here")

    def staged(self, device: object, nbytes: int) -> None:
        pass  # a fixed budget: what is staged does not lower it

    def freed(self, device: object, nbytes: int) -> None:
        pass


class FakeDevice:
    def __init__(self, **stats: int) -> None:
        self.stats = stats

    def memory_stats(self) -> dict[str, int]:
        return dict(self.stats)


def _arrays(*rows: int) -> list[jax.Array]:
    device = jax.devices()[0]
    return [jax.device_put(jnp.arange(r * 64, dtype=jnp.float32).reshape(r, 64) + i, device)
            for i, r in enumerate(rows)]


@pytest.mark.parametrize("rows", [1, 7, 64, 1000])
def test_a_staged_shard_reads_back_exactly_and_frees_its_device_memory(rows):
    (array,) = _arrays(rows)
    expected = np.asarray(array).copy()
    (staged,) = stage([(array.devices().pop(), array)], Budget(1 << 30)).values()
    assert isinstance(staged, StagedShard)
    assert staged.nbytes == expected.nbytes
    assert (staged.shape, staged.dtype) == (expected.shape, expected.dtype)
    np.testing.assert_array_equal(np.asarray(staged), expected)
    assert staged.device_bytes == 0  # given back once on the host
    np.testing.assert_array_equal(np.asarray(staged), expected)  # read once, kept


def test_staged_shards_are_read_by_one_thread_in_the_order_they_were_staged(monkeypatch):
    reads: list[tuple[str, tuple[int, ...]]] = []
    original = StagedShard._to_host

    def recorded(self):
        reads.append((threading.current_thread().name, self.shape))
        return original(self)

    monkeypatch.setattr(StagedShard, "_to_host", recorded)
    state = _arrays(10, 300, 40, 200)
    got = stage([(a.devices().pop(), a) for a in state], Budget(1 << 30))
    for i, a in enumerate(state):
        np.testing.assert_array_equal(np.asarray(got[i]), np.asarray(a))
    # Largest first, as staged, and never two at once (one reader thread).
    assert [shape for _, shape in reads] == [(300, 64), (200, 64), (40, 64), (10, 64)]
    assert {name for name, _ in reads} == {"checkpoint-device-read"}


def test_a_staged_shard_released_before_its_read_frees_its_device_memory_unread():
    gate = threading.Event()
    reader = SaveThread("test-blocked-reader")
    reader.submit(gate.wait)  # the reader is busy until the gate opens
    (array,) = _arrays(50)
    staged = StagedShard(jax.device_put(array, may_alias=False), reader)
    assert staged.device_bytes == staged.nbytes
    staged.release()
    assert staged.device_bytes == 0
    gate.set()
    reader.shutdown()


def test_a_staged_copy_survives_the_donation_of_the_state():
    state = _arrays(100, 300)
    expected = [np.asarray(a).copy() for a in state]
    got = stage([(a.devices().pop(), a) for a in state], Budget(1 << 30))
    step = jax.jit(lambda xs: [x * 0.0 - 1.0 for x in xs], donate_argnums=0)
    state = step(state)  # the next training step reuses the buffers
    jax.block_until_ready(state)
    assert all(isinstance(v, StagedShard) for v in got.values())
    for i, want in enumerate(expected):
        np.testing.assert_array_equal(np.asarray(got[i]), want)


def test_a_layouts_first_copy_needs_no_compile_and_later_ones_use_the_compiled_program():
    programs = staging.CopyPrograms()
    state = _arrays(30, 70)
    expected = [np.asarray(a).copy() for a in state]
    assert not programs.wait_compiled(state[:1])  # nothing compiles for a layout never seen
    step = jax.jit(lambda xs: [x * 0.0 - 1.0 for x in xs], donate_argnums=0)
    first = programs.copy(list(state))  # device_put: the program compiles meanwhile
    assert programs.wait_compiled(state)
    later = programs.copy(list(state))
    state = step(state)  # both copies are buffers of their own, safe from the donation
    jax.block_until_ready(state)
    for copies in (first, later):
        for got, want in zip(copies, expected, strict=True):
            np.testing.assert_array_equal(np.asarray(got), want)


def test_prepared_copy_programs_spare_the_first_save_its_device_put(monkeypatch):
    state = _arrays(13, 301, 41, 203)
    sizes = [int(a.nbytes) for a in state]
    shards = [(a.devices().pop(), a) for a in state]
    budget = Budget(sizes[1] + sizes[3])
    staging.prepare(shards, budget)
    # What a stage under this budget copies: the two largest shards, one program.
    assert staging._programs.wait_compiled([state[1], state[3]])

    def no_device_put(*args, **kwargs):
        raise AssertionError("the first save copied by device_put: nothing was prepared")

    monkeypatch.setattr(staging.jax, "device_put", no_device_put)
    got = stage(shards, budget)
    monkeypatch.undo()
    assert staging.staged_bytes(list(got.values())) == sizes[1] + sizes[3]
    for i, a in enumerate(state):
        np.testing.assert_array_equal(np.asarray(got[i]), np.asarray(a))


def test_the_largest_shards_are_staged_while_the_budget_lasts_the_rest_copied_now():
    state = _arrays(10, 300, 40, 200)  # 2.5 KiB per row
    sizes = [int(a.nbytes) for a in state]
    got = stage([(a.devices().pop(), a) for a in state], Budget(sizes[1] + sizes[3]))
    assert isinstance(got[1], StagedShard) and isinstance(got[3], StagedShard)
    assert isinstance(got[0], np.ndarray) and isinstance(got[2], np.ndarray)
    assert staging.staged_bytes(list(got.values())) == sizes[1] + sizes[3]
    nothing = stage([(a.devices().pop(), a) for a in state], Budget(0))
    assert all(isinstance(v, np.ndarray) for v in nothing.values())
    for i, a in enumerate(state):
        np.testing.assert_array_equal(np.asarray(got[i]), np.asarray(a))


def test_the_automatic_budget_is_the_memory_the_training_never_used_at_the_first_save():
    gib = 1 << 30
    device = FakeDevice(bytes_limit=16 * gib, bytes_in_use=3 * gib, peak_bytes_in_use=7 * gib)
    budget = DeviceBudget()
    margin = int(16 * gib * staging.MARGIN_FRACTION)
    assert budget.for_device(device) == 16 * gib - 7 * gib - margin
    # A later save: its own staging raised the peak, which does not shrink the budget...
    device.stats.update(peak_bytes_in_use=12 * gib)
    assert budget.for_device(device) == 16 * gib - 7 * gib - margin
    # ...but what is in use now (more state, say) does.
    device.stats.update(bytes_in_use=10 * gib)
    assert budget.for_device(device) == 16 * gib - 10 * gib - margin
    # The programs' reserved working memory is the training's too (the step's load fails
    # when a staged copy took it).
    programs = FakeDevice(bytes_limit=16 * gib, bytes_in_use=3 * gib, peak_bytes_in_use=3 * gib,
                          bytes_reserved=13 * gib, peak_bytes_reserved=13 * gib)
    assert DeviceBudget().for_device(programs) == 0
    some = FakeDevice(bytes_limit=16 * gib, bytes_in_use=3 * gib, peak_bytes_in_use=4 * gib,
                      bytes_reserved=2 * gib, peak_bytes_reserved=2 * gib)
    assert DeviceBudget().for_device(some) == 16 * gib - 4 * gib - 2 * gib - margin
    # A user's cap, and 0: never.
    assert DeviceBudget(256 * MIB).for_device(device) == 256 * MIB
    assert DeviceBudget(0).for_device(device) == 0
    full = FakeDevice(bytes_limit=16 * gib, bytes_in_use=15 * gib, peak_bytes_in_use=15 * gib)
    assert DeviceBudget().for_device(full) == 0
    # No statistics (the CPU): nothing staged.
    assert DeviceBudget().for_device(jax.devices()[0]) == 0
    with pytest.raises(ValueError, match=">= 0 bytes"):
        DeviceBudget(-1)


def test_a_saves_loop_time_lost_is_the_excess_of_the_steps_it_overlapped():
    stall = SaveStall()
    clock = 0.0
    for _ in range(6):  # steady 100 ms steps
        clock += 0.1
        assert stall.step_ended(clock, saving=False) is None
    stall.save_started(step=6, reason="interval", blocked_s=0.03,
                       staging={"staged_bytes": 123, "staging_budget_bytes": 456,
                                "staging_budget": "auto"})
    for duration, saving in [(0.13, True), (0.12, True), (0.1, False)]:
        clock += duration
        record = stall.step_ended(clock, saving=saving)
    assert record is not None
    assert record["lost_s"] == pytest.approx(0.05)
    assert (record["steps"], record["step_s"], record["staged_bytes"]) == (3, 0.1, 123)
    assert (record["staging_budget_bytes"], record["staging_budget"]) == (456, "auto")
    assert record["blocked_s"] == 0.03 and record["step"] == 6
    # A save right after the start, with no steady steps to compare with, is not judged.
    fresh = SaveStall()
    fresh.step_ended(0.0, saving=False)
    fresh.save_started(step=1, reason="interval", blocked_s=0.0)
    assert fresh.step_ended(5.0, saving=False) is None


def test_a_save_still_open_when_the_next_starts_is_closed_with_its_steps():
    stall = SaveStall()
    for clock in (0.0, 0.1, 0.2, 0.3, 0.4):
        stall.step_ended(clock, saving=False)
    assert stall.save_started(step=4, reason="interval", blocked_s=0.0) is None
    stall.step_ended(0.6, saving=True)
    stall.step_ended(0.7, saving=True)
    # The next save waited for this one: it has ended, after two steps, 0.1 s lost.
    record = stall.save_started(step=6, reason="interval", blocked_s=0.0)
    assert record is not None and record["step"] == 4 and record["steps"] == 2
    assert record["lost_s"] == pytest.approx(0.1)
