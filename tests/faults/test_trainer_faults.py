"""Trainer-side faults, a fast subset: SIGKILL inside saves, GCS errors and stalls.

The long run is `python bench/faults_trainer.py --trials 50`; these few trials run in CI.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from tardigrade_checkpoint import CheckpointCorruptError, CheckpointManager
from tardigrade_checkpoint.digest import digest_array, region_key

from tests.faults.gcs_scenarios import (
    Scenarios,
    faulty_gcs,
    gang_hears_of_a_refused_commit,
    gang_rolls_back_through_lost_answers,
    trainer_rides_out_an_outage,
)
from tests.faults.kill_trials import Campaign, Kill

REPO = Path(__file__).resolve().parents[2]
SEED = int(os.environ.get("TARDIGRADE_FAULT_SEED", "20261202"))


# --- digests: what the kill trials check against ---------------------------------------------

def _state(mesh: Mesh, seed: int) -> dict[str, jax.Array]:
    rng = np.random.default_rng(seed)
    return {"w": jax.device_put(rng.standard_normal((8, 6)).astype(np.float32),
                                NamedSharding(mesh, PartitionSpec("data"))),
            "n": jax.device_put(np.int32(seed), NamedSharding(mesh, PartitionSpec()))}


def test_commit_records_a_digest_per_shard_and_restore_checks_them(tmp_path):
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    manager = CheckpointManager(str(tmp_path))
    state = _state(mesh, 1)
    manager.save(5, state)
    info = manager.wait()
    assert info is not None
    full = region_key((slice(None), slice(None)), (8, 6))
    assert info.digests == {"w": {full: digest_array(np.asarray(state["w"]))},
                            "n": {"": digest_array(np.int32(1))}}
    assert manager.verify(5) == (2, [])
    target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding)
              for k, v in state.items()}
    # A chunk rewritten with other valid data passes crc32c, but not the recorded digest:
    # this is what a stale chunk of an earlier, crashed save of the same step would look like.
    other = CheckpointManager(str(tmp_path / "other"))
    other.save(5, _state(mesh, 2))
    other.wait()
    chunk = next((tmp_path / "step_00000005" / "arrays" / "w" / "c").rglob("*"))
    while chunk.is_dir():
        chunk = next(chunk.iterdir())
    twin = tmp_path / "other" / chunk.relative_to(tmp_path)
    chunk.write_bytes(twin.read_bytes())
    checked, mismatches = manager.verify(5)
    assert checked == 2 and len(mismatches) == 1 and mismatches[0].startswith("w[")
    with pytest.raises(CheckpointCorruptError, match="does not hold what was saved"):
        manager.restore(5, target)
    manager.close()
    other.close()


# --- A: SIGKILL of trainer processes ---------------------------------------------------------

@pytest.mark.slow
def test_sigkill_inside_a_save_then_restore_and_clean_stop(tmp_path):
    print(f"kill trial seed {SEED}")
    # One process keeps this CI subset cheap; the bench and test_multiprocess kill gangs of 2.
    campaign = Campaign(tmp_path, processes=1, seed=SEED)
    try:
        point = random.Random(SEED).choice(["after_prepare", "after_write", "before_commit"])
        killed = campaign.trial(Kill("hook", (0,), step=4, point=point))
        assert killed.ok, killed
        assert killed.landed_in_save and killed.committed == [2] and killed.partial == [4]
        assert killed.checkpoints_verified == 1 and killed.regions_verified > 0
        # The next gang restores step 2, verifies it, removes the partial step 4, and gets
        # SIGTERM as soon as it logged the restore. Two ends are right (a notice in any phase,
        # sdk/notice.py): the notice lands before the first step (during the restore's end or
        # the compilation), so nothing is newer than step 2 and the rank exits 75 naming it; or
        # the gang trained a step first, and it saves the agreed step (JAX's preemption sync
        # manager hears of the notice on its own thread: a few steps after the first on a
        # loaded machine).
        stopped = campaign.finish(at_restore=True)
        assert stopped.ok, stopped
        assert stopped.restored == 2 and stopped.restore_regions == stopped.expected_regions
        assert stopped.partials_removed == 1 and stopped.partial == []
        if stopped.stopped_before_training:
            assert stopped.committed == [2], stopped.committed
        else:
            assert stopped.committed[0] >= 2 and stopped.committed[-1] > 2, stopped.committed
    finally:
        campaign.close()


# --- B: GCS errors and stalls ----------------------------------------------------------------

@pytest.fixture(scope="module")
def scenarios():
    with faulty_gcs(seed=SEED) as proxy:
        yield Scenarios(proxy)


STORAGE_SCENARIOS = [
    "transient_write_errors", "persistent_write_errors", "commit_marker_refused",
    "transient_read_errors", "persistent_read_errors", "stalled_reads",
    "root_record_answers_lost",
]


@pytest.fixture(scope="module")
def storage_outcomes() -> dict[str, dict[str, Any]]:
    """The storage scenarios, run in a process of their own (gcs_scenarios.main says why)."""
    done = subprocess.run(
        [sys.executable, "-m", "tests.faults.gcs_scenarios", *STORAGE_SCENARIOS, str(SEED)],
        cwd=REPO, capture_output=True, text=True, timeout=900, check=False)
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    outcomes = {row["name"]: row for row in rows}
    assert set(outcomes) == set(STORAGE_SCENARIOS), (done.returncode, done.stderr[-4000:])
    return outcomes


# Stalled writes (~40 s here) and random 503s run in the bench only.
@pytest.mark.parametrize("name", STORAGE_SCENARIOS)
def test_checkpoint_under_storage_faults(storage_outcomes, name):
    outcome = storage_outcomes[name]
    assert "error" not in outcome, outcome["error"]
    assert outcome["faults"] != "none", outcome


@pytest.mark.slow
def test_trainer_reports_failed_saves_and_fails_preemption_save_clearly(scenarios, tmp_path):
    outcome = trainer_rides_out_an_outage(scenarios.proxy, tmp_path, resume=False)
    assert "error 503" in outcome.faults, outcome


@pytest.mark.slow
def test_a_gang_hears_at_once_that_storage_refused_the_commit(scenarios, tmp_path):
    outcome = gang_hears_of_a_refused_commit(scenarios.proxy, tmp_path)
    assert "error 500" in outcome.faults, outcome


@pytest.mark.slow
def test_a_rollback_whose_root_record_answers_are_lost_makes_one_branch(scenarios, tmp_path):
    outcome = gang_rolls_back_through_lost_answers(scenarios.proxy, tmp_path)
    assert "lost answer" in outcome.faults, outcome
