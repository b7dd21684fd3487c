"""The automatic staging budget (checkpoint/stagingbudget.py) and the fallback of a staged copy
the device cannot allocate (checkpoint/staging.py), from the pure figures to a loop run by
`TrainingSession`.

The CPU keeps no memory statistics and snapshots without staging, so the tests that stage
give the budget a fake device-statistics provider and take the accelerator's path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import staging_loop
from hypothesis import given
from hypothesis import strategies as st
from staging_loop import sharded_state, take_cpu_for_accelerator
from tardigrade_checkpoint import CheckpointManager, staging, stagingbudget
from tardigrade_checkpoint.stagingbudget import (
    DeviceBudget,
    DeviceFigures,
    free_now_bytes,
    headroom_bytes,
    margin_bytes,
    program_extra_bytes,
)
from tardigrade_contract import contract
from tardigrade_trainer.config import ConfigError, TrainerConfig
from tardigrade_trainer.train import checkpoint_options

from tests.conftest import REPO_ROOT

MIB, GIB = 1 << 20, 1 << 30


# --- the budget from the figures --------------------------------------------------------------

@st.composite
def figures(draw: Any) -> tuple[DeviceFigures, int | None]:
    limit = draw(st.integers(0, 96 * GIB))
    in_use = draw(st.integers(0, limit))
    peak = draw(st.integers(in_use, max(in_use, limit)))
    reserved = draw(st.integers(0, limit))
    peak_reserved = draw(st.integers(reserved, max(reserved, limit)))
    program = draw(st.none() | st.integers(0, 2 * limit + 1))
    return DeviceFigures(limit, in_use, peak, reserved, peak_reserved), program


@given(figures())
def test_the_automatic_budget_leaves_the_step_its_needs_and_the_margin(case):
    device, program = case
    budget = headroom_bytes(device, program)
    margin = margin_bytes(device.limit)
    assert 0 <= budget <= device.limit
    assert margin >= max(stagingbudget.MIN_MARGIN_BYTES, device.limit // 10)
    if budget > 0:
        # Room for the step as the runtime saw it, as the compiled program plans it, and the
        # margin, beside the staged copy.
        assert budget + device.peak_in_use + device.peak_reserved + margin <= device.limit
        assert budget + device.in_use + (program or 0) + margin <= device.limit
        assert budget + device.in_use + device.reserved + margin <= device.limit
    # Nothing is left unused either: one byte more would eat into the step or the margin.
    needs = max(device.peak_in_use + device.peak_reserved,
                device.in_use + max(device.reserved, program or 0))
    assert budget == max(0, device.limit - needs - margin)
    # A step that needs more leaves less, never more.
    assert headroom_bytes(device, (program or 0) + GIB) <= budget
    assert 0 <= free_now_bytes(device) <= device.limit - device.in_use


@given(figures())
def test_no_room_means_nothing_staged(case):
    device, _ = case
    # A step that needs everything the device has beyond what is in use.
    assert headroom_bytes(device, device.limit - device.in_use) == 0
    # A device whose memory is all in use or reserved now.
    full = DeviceFigures(device.limit, device.in_use, reserved=device.limit - device.in_use)
    assert free_now_bytes(full) == 0


def test_the_reference_step_on_a_v5e_leaves_room_for_its_whole_snapshot():
    """docs/BENCHMARKS.md: the 184M step's working memory 8.71 GiB of the chip's 15.7, a
    2.1 GiB state: the 2.1 GiB snapshot fits the automatic budget, the margin kept."""
    chip = DeviceFigures(limit=int(15.7 * GIB), in_use=int(2.1 * GIB))
    assert headroom_bytes(chip, int(8.71 * GIB)) >= int(2.1 * GIB)
    # Keeping attention's probabilities (14.09 GiB): no room, nothing staged.
    assert headroom_bytes(chip, int(14.09 * GIB)) == 0


@pytest.mark.parametrize("stats", [None, {}, {"bytes_in_use": 1}, {"bytes_limit": 1}])
def test_without_figures_nothing_is_staged(stats):
    assert DeviceFigures.from_stats(stats) is None
    assert DeviceBudget(memory_stats=lambda device: stats).for_device("tpu:0") == 0
    assert DeviceBudget(64 * MIB, memory_stats=lambda device: stats).for_device("tpu:0") == 0


def test_the_cpu_reports_no_figures_so_the_default_stages_nothing():
    assert DeviceBudget().for_device(jax.devices()[0]) == 0


# --- the decision, with a fake device-statistics provider -------------------------------------

class Stats:
    """One device's statistics as the runtime would report them; the test moves them."""

    def __init__(self, **stats: int) -> None:
        self.stats = stats
        self.asked: list[Any] = []

    def __call__(self, device: Any) -> dict[str, int]:
        self.asked.append(device)
        return dict(self.stats)


def test_the_budget_is_automatic_unless_a_setting_caps_it_or_turns_it_off():
    stats = Stats(bytes_limit=16 * GIB, bytes_in_use=2 * GIB, peak_bytes_in_use=3 * GIB)
    auto = DeviceBudget(memory_stats=stats)
    room = headroom_bytes(DeviceFigures.from_stats(stats.stats), None)  # type: ignore[arg-type]
    assert room > 0
    assert (auto.source, auto.for_device("d0")) == ("auto", room)
    capped = DeviceBudget(256 * MIB, memory_stats=stats)
    assert (capped.source, capped.for_device("d0")) == ("setting", 256 * MIB)
    greedy = DeviceBudget(1 << 50, memory_stats=stats)  # a cap above the room is the room
    assert greedy.for_device("d0") == room
    off = DeviceBudget(0, memory_stats=stats)
    assert (off.source, off.for_device("d0")) == ("off", 0)
    assert stats.asked.count("d0") == 3  # "off" asks the device nothing


def test_the_compiled_steps_needs_count_before_its_peak_is_seen():
    # Right after the state is placed: the runtime has not seen the step's working memory.
    stats = Stats(bytes_limit=16 * GIB, bytes_in_use=2 * GIB)
    blind = DeviceBudget(memory_stats=stats).for_device("d0")

    class Analysis:  # the fields of XLA's CompiledMemoryStats the budget reads
        temp_size_in_bytes = 9 * GIB
        generated_code_size_in_bytes = 32 * MIB
        output_size_in_bytes = 2 * GIB
        alias_size_in_bytes = 2 * GIB  # the donated state is reused

    budget = DeviceBudget(memory_stats=stats)
    budget.note_program(Analysis())
    told = budget.for_device("d0")
    assert told == blind - 9 * GIB - 32 * MIB
    # A program too big for what is left: nothing staged.
    Analysis.temp_size_in_bytes = 14 * GIB
    budget.note_program(Analysis())
    assert budget.for_device("d0") == 0


def test_a_real_programs_needs_come_from_its_memory_analysis():
    x = jnp.ones((256, 128), jnp.float32)
    compiled = jax.jit(lambda a: (a * 2.0, jnp.sin(a).sum()), donate_argnums=0).lower(x).compile()
    analysis = compiled.memory_analysis()
    expected = (analysis.temp_size_in_bytes + analysis.generated_code_size_in_bytes
                + max(0, analysis.output_size_in_bytes - analysis.alias_size_in_bytes))
    assert program_extra_bytes(compiled) == expected == program_extra_bytes(analysis)
    assert analysis.output_size_in_bytes >= x.nbytes  # a program that does allocate

    class NoAnalysis:
        def memory_analysis(self) -> None:
            raise NotImplementedError

    assert program_extra_bytes(NoAnalysis()) is None
    assert program_extra_bytes(None) is None
    assert program_extra_bytes(object()) is None


# --- the setting --------------------------------------------------------------------------------

@pytest.mark.parametrize(("raw", "budget_bytes"), [
    ({}, None), ({"checkpoint_snapshot_device_mib": None}, None),
    ({"checkpoint_snapshot_device_mib": "auto"}, None),
    ({"checkpoint_snapshot_device_mib": 0}, 0),
    ({"checkpoint_snapshot_device_mib": 4096}, 4096 * MIB),
])
def test_the_setting_is_automatic_unless_written_and_zero_still_means_off(raw, budget_bytes):
    config = TrainerConfig.from_mapping(raw)
    assert checkpoint_options(config)["snapshot_device_bytes"] == budget_bytes


@pytest.mark.parametrize("value", [-1, "all", 1.5, True])
def test_a_bad_setting_names_the_field_and_what_it_takes(value):
    with pytest.raises(ConfigError, match="checkpoint_snapshot_device_mib") as err:
        TrainerConfig.from_mapping({"checkpoint_snapshot_device_mib": value})
    assert "auto" in str(err.value)


# --- a staged copy the device cannot allocate ---------------------------------------------------

def _arrays(*rows: int) -> list[jax.Array]:
    device = jax.devices()[0]
    return [jax.device_put(jnp.arange(r * 64, dtype=jnp.float32).reshape(r, 64) + i, device)
            for i, r in enumerate(rows)]


def test_a_staged_copy_that_cannot_be_allocated_is_copied_to_the_host(monkeypatch):
    state = _arrays(10, 300, 40)
    stats = Stats(bytes_limit=64 * GIB, bytes_in_use=0)
    budget = DeviceBudget(memory_stats=stats)

    def exhausted(xs):
        raise staging_loop.allocation_failure(sum(x.nbytes for x in xs))

    monkeypatch.setattr(staging._programs, "copy", exhausted)
    report = staging.StagingReport()
    got = staging.stage([(a.devices().pop(), a) for a in state], budget, report)
    assert all(isinstance(v, np.ndarray) for v in got.values())
    for i, a in enumerate(state):
        np.testing.assert_array_equal(got[i], np.asarray(a))
    total = sum(int(a.nbytes) for a in state)
    assert (report.staged_bytes, report.failed_bytes) == (0, total)
    assert "RESOURCE_EXHAUSTED" in report.errors[0]
    # The next save stages less than what failed, and keeps halving while it fails.
    assert budget.for_device(state[0].devices().pop()) == total // 2
    budget.staging_failed(state[0].devices().pop(), total)
    assert budget.for_device(state[0].devices().pop()) == total // 4


def test_any_other_error_of_the_staging_copy_is_not_hidden(monkeypatch):
    state = _arrays(10)

    def broken(xs):
        raise jax.errors.JaxRuntimeError("INTERNAL: the copy program is wrong")

    monkeypatch.setattr(staging._programs, "copy", broken)
    budget = DeviceBudget(memory_stats=Stats(bytes_limit=64 * GIB, bytes_in_use=0))
    with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL"):
        staging.stage([(a.devices().pop(), a) for a in state], budget)


@pytest.fixture
def accelerator(monkeypatch):
    """The CPU's devices taken for an accelerator's: the snapshot stages, and the devices
    report room to spare. The first save's staging copies (one per device of the two the
    state is on) cannot be allocated."""
    return take_cpu_for_accelerator(monkeypatch.setattr, fail=2)


def _target(state: dict[str, jax.Array]) -> dict[str, jax.ShapeDtypeStruct]:
    return {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding)
            for k, v in state.items()}


def test_a_save_whose_staging_fails_commits_the_whole_state_from_the_host(tmp_path, accelerator):
    events: list[dict[str, Any]] = []
    manager = CheckpointManager(str(tmp_path), on_event=events.append)
    first, second = sharded_state(1.0), sharded_state(2.0)
    expected = {1: jax.tree.map(np.asarray, first), 2: jax.tree.map(np.asarray, second)}
    manager.save(1, first)
    manager.save(2, second)  # waits for the first; its staging copy is allocated
    manager.wait()
    failed_copies, later_copies = accelerator.calls[:2], accelerator.calls[2:]
    failed = [e for e in events if e["event"] == "checkpoint_staging_failed"]
    assert len(failed) == 1 and failed[0]["step"] == 1 and failed[0]["level"] == "warning"
    assert failed[0]["failed_bytes"] == sum(failed_copies)
    started = {e["step"]: e for e in events if e["event"] == "checkpoint_started"}
    assert started[1]["staged_bytes"] == 0 and started[1]["staging_budget"] == "auto"
    assert started[1]["staging_budget_bytes"] > 0
    # The second save stages again, below half of what failed on each device.
    assert later_copies and all(n <= min(failed_copies) // 2 for n in later_copies)
    assert started[2]["staged_bytes"] == sum(later_copies) > 0
    assert {e["step"] for e in events if e["event"] == "checkpoint_committed"} == {1, 2}
    for step in (1, 2):
        restored, _ = manager.restore(step, _target(first))
        for name, want in expected[step].items():
            np.testing.assert_array_equal(np.asarray(restored[name]), want)
        assert manager.verify(step)[1] == []
    manager.close()


def test_a_loop_through_the_session_trains_on_and_logs_what_staging_did(tmp_path):
    termination = tmp_path / "termination"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(REPO_ROOT / "trainer_image"), os.environ.get("PYTHONPATH", "")])}
    steps, interval = 12, 6
    done = subprocess.run(
        [sys.executable, str(Path(staging_loop.__file__)), str(tmp_path / "ckpt"),
         str(termination), str(steps), str(interval)],
        env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == contract.EXIT_SUCCEEDED, done.stdout + done.stderr
    by_event: dict[str, list[dict[str, Any]]] = {}
    for line in done.stdout.splitlines():
        if line.startswith("{"):
            event = json.loads(line)
            by_event.setdefault(event["event"], []).append(event)
    failed = by_event["checkpoint_staging_failed"]
    assert [e["step"] for e in failed] == [interval] and failed[0]["failed_bytes"] > 0
    assert [e["step"] for e in by_event["checkpoint_committed"]] == [interval, steps]
    assert by_event["done"][0]["step"] == steps  # the loop went on after the failed staging
    lost = {e["step"]: e for e in by_event["checkpoint_loop_time_lost"]}
    assert lost[interval]["staged_bytes"] == 0 and lost[interval]["staging_budget"] == "auto"
    assert lost[interval]["staging_budget_bytes"] > 0
    started = {e["step"]: e for e in by_event["checkpoint_started"]}
    assert 0 < started[steps]["staged_bytes"] <= failed[0]["failed_bytes"] // 2
    # Both checkpoints hold the loop's state at their step.
    expected = jax.tree.map(np.asarray, sharded_state(3.0))
    manager = CheckpointManager(str(tmp_path / "ckpt"))
    for n in range(1, steps + 1):
        expected = jax.tree.map(lambda x: x * np.float32(0.5) + np.float32(1.0), expected)
        if n % interval == 0:
            restored, _ = manager.restore(n, _target(sharded_state(0.0)))
            for name, want in expected.items():
                np.testing.assert_allclose(np.asarray(restored[name]), want, rtol=1e-6)
    manager.close()
    assert json.loads(termination.read_text())["reason"] == "Succeeded"
