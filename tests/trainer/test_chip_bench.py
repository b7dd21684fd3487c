"""bench/chip.py, the TPU bench, on this machine's CPU with the tiny model: the relaunch-only
arm (the seed fills the cache the warm relaunch reads) and the floor it is judged against."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.slow


def test_a_warm_relaunch_is_reported_against_the_floor_of_the_machine(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TARDIGRADE_")}
    env["JAX_PLATFORMS"] = "cpu"
    done = subprocess.run(
        [sys.executable, str(REPO_ROOT / "bench" / "chip.py"), "--dir", str(tmp_path / "run"),
         "--model", "tiny", "--steps", "2", "--interval", "100", "--skip-checkpoint-bench",
         "--relaunches", "warm"],
        env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "seed run (fresh start, filling the compilation cache" in out, out
    # The warm relaunch found what the seed stored: the step came from the step cache.
    warm = re.search(r"relaunch warm \(restored step (\d+)\): first step at ([\d.]+) s.*"
                     r"'step_cache': 'hit'", out)
    assert warm and int(warm.group(1)) >= 1, out
    # The floor loaded the very entry the relaunch loaded (the cache's newest), onto devices
    # it opened itself.
    floor = re.search(r"floor: (\{.*\})", out)
    assert floor, out
    found = json.loads(floor.group(1))
    assert found["devices"].endswith("cpu") and found["step_entry_bytes"] > 0, found
    assert found["step_loaded_s"] >= found["devices_open_s"] > 0, found
    assert "the warm relaunch's first step came" in out, out
