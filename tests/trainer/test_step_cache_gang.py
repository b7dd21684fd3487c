"""End-to-end: a relaunched gang's ranks load the compiled step from their own caches
(step_cache.py), rank 1 included, which JAX's persistent cache never serves, and train on to
the losses of a gang without any cache."""

from __future__ import annotations

from pathlib import Path

import pytest
from tardigrade_trainer import compile_cache
from trainer_harness import launch

pytestmark = pytest.mark.slow

BASE = {"steps": 6, "devices_per_process": 2}


def _run(work, name, config):
    gang = launch(work / name, processes=2, checkpoint_path=str(work / name / "ckpt"),
                  config={**BASE, **config})
    assert gang.wait() == [0, 0], gang.describe()
    return gang


def test_a_relaunched_rank_1_loads_its_step_and_trains_to_the_same_losses(tmp_path):
    cache = {"compilation_cache_dir": str(tmp_path / "jax-cache")}
    without = _run(tmp_path, "without", {"compilation_cache_in_root": False})
    first = _run(tmp_path, "first", cache)
    second = _run(tmp_path, "second", cache)

    assert [e.get("step_cache") for e in without.events("compiled", 1)] == ["off"]
    assert [e["step_cache"] for e in first.events("compiled", 1)] == ["miss"]
    (loaded,) = second.events("compiled", 1)
    assert loaded["step_cache"] == "hit", second.describe()
    # Rank 0 tells how every rank got its step: the bench reads rank 0's log only.
    (told,) = second.events("compiled", 0)
    assert [r.split()[0] for r in told["step_cache_ranks"]] == ["hit", "hit"]
    # Each rank's folder, in the pods' own copy of the shared path (compile_cache.py): these
    # ranks share this host's temporary directory, as a relaunch on the same node would.
    copy = compile_cache.location(cache["compilation_cache_dir"], "")
    assert copy is not None
    assert sorted(p.name for p in (Path(copy.local) / "tardigrade-step-cache").iterdir()) \
        == ["rank-0", "rank-1"]

    reference = without.losses()
    assert sorted(reference) == list(range(1, BASE["steps"] + 1))
    for rank in (0, 1):
        assert first.losses(rank) == reference  # float equality: the same program
        assert second.losses(rank) == reference
