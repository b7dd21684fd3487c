"""The trainer's start-up phases (phases.py) and what JAX spent compiling (compile_stats.py):
the marks a bench splits a recovery with."""

from __future__ import annotations

import subprocess
import sys
import time

from tardigrade_sdk import phases


def test_the_process_start_comes_before_its_marks_and_a_mark_keeps_its_first_time():
    before = time.time()
    phases.mark("test_phase")
    first = phases.marks()["test_phase"]
    phases.mark("test_phase")
    marks = phases.marks()
    # Marks are logged to the millisecond: rounding may put one up to 0.5 ms after now.
    assert marks["test_phase"] == first and before - 0.01 <= first <= time.time() + 0.001
    assert marks["process_started"] < before


def test_the_process_start_is_the_processes_own():
    # A child started now: its start is after this moment, not this process's.
    parent_asked = time.time()
    out = subprocess.run(
        [sys.executable, "-c", "from tardigrade_sdk import phases; "
         "print(phases.process_started())"],
        capture_output=True, text=True, check=True).stdout
    assert parent_asked - 0.05 <= float(out) <= time.time()


def test_compile_totals_count_tracing_and_backend_compilation():
    import jax
    import jax.numpy as jnp
    from tardigrade_trainer import compile_stats

    compile_stats.watch()
    before = compile_stats.totals()
    jax.jit(lambda x: jnp.sin(x) * 3.0 + 1.0)(jnp.arange(7.0)).block_until_ready()
    after = compile_stats.totals()
    for name in ("trace_seconds", "backend_compile_seconds"):
        assert after[name] > before.get(name, 0.0), name
