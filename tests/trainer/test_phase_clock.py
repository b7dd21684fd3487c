"""The trainer's side of the goodput account (phase_clock.py): the seconds of each phase, and
a real trainer's progress report carrying them."""

from __future__ import annotations

import signal
import time
import urllib.request

import pytest
from tardigrade_contract import contract
from tardigrade_sdk.phase_clock import (
    CHECKPOINT_STALL,
    COMPILE,
    RESTORE,
    TRAIN,
    PhaseClock,
)
from trainer_harness import TINY, free_port, launch, wait_for


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_phases_count_while_they_run_and_a_block_returns_to_the_phase_before_it():
    clock = FakeClock()
    phases = PhaseClock(seconds_since_start=2.0, now=clock)
    clock.now += 1.0
    # The running phase counts up to the moment the report is served.
    assert phases.seconds()["accelerator_start_seconds"] == 3.0
    phases.switch(None)
    clock.now += 5.0  # in no phase: the operator books it as other
    with phases.during(RESTORE):
        clock.now += 4.0
    phases.switch(TRAIN)
    clock.now += 10.0
    with phases.during(CHECKPOINT_STALL):
        clock.now += 1.5
    assert phases.running == TRAIN
    clock.now += 2.0
    assert phases.seconds() == {
        "accelerator_start_seconds": 3.0, "restore_seconds": 4.0, "compile_seconds": 0.0,
        "checkpoint_stall_seconds": 1.5, "train_seconds": 12.0}
    with pytest.raises(ValueError, match="unknown phase 'lunch'"):
        phases.switch("lunch")


def test_a_phase_left_by_an_exception_stops_counting():
    clock = FakeClock()
    phases = PhaseClock(now=clock)
    phases.switch(None)
    with pytest.raises(RuntimeError), phases.during(COMPILE):
        clock.now += 2.0
        raise RuntimeError("compile failed")
    clock.now += 7.0
    assert phases.running is None and phases.seconds()["compile_seconds"] == 2.0


@pytest.mark.slow
def test_a_real_trainers_progress_report_carries_its_phase_seconds(tmp_path):
    port = free_port()
    config = {**TINY, "steps": 100000, "devices_per_process": 1}
    launched = time.time()
    gang = launch(tmp_path, processes=1, checkpoint_path=str(tmp_path / "ckpt"), config=config,
                  interval_steps=5, progress_port=port)
    seen: list[contract.ProgressReport] = []

    def saved_and_trained() -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/progress", timeout=2) as r:
                report = contract.ProgressReport.from_json(r.read().decode())
        except OSError:
            return False
        seen.append(report)
        return (report.checkpoint_step or 0) >= 10 and (report.train_seconds or 0) > 0

    try:
        wait_for(saved_and_trained, 180, "rank 0 to report a save at step 10 or later")
        asked = time.time()
    finally:
        gang.signal(signal.SIGTERM)
        gang.wait()
    report = seen[-1]
    phases = {name: getattr(report, name) for name in contract.PHASE_SECONDS_FIELDS}
    # Every phase took time: the start-up (imports, jax.distributed), initialising the state
    # (nothing to restore), compiling the step, the saves at 5 and 10, the steps.
    assert all(seconds is not None and seconds > 0 for seconds in phases.values()), phases
    # The phases do not overlap: together they fit in the process's life so far (its start is
    # read from /proc to about 10 ms).
    assert sum(phases.values()) <= asked - launched + 0.05, phases
    # A later report counts on from an earlier one, never back.
    first = seen[0]
    for name in contract.PHASE_SECONDS_FIELDS:
        assert (getattr(first, name) or 0) <= phases[name], name
