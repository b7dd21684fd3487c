"""A save that fails stops no host for long, and says why (issue 14, point 5)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from tardigrade_checkpoint import CheckpointManager
from tardigrade_checkpoint.manager import CheckpointUsageError, step_dir
from tardigrade_contract import contract
from trainer_harness import committed_steps, launch


@pytest.mark.parametrize(("extra", "says"), [
    ({"data_position": np.int64(8)}, r"extra\['data_position'\] is a numpy.int64"),
    ({"loss": float("nan")}, r"extra\['loss'\] is nan"),
    ({"seen": {"shards": {1, 2}}}, r"extra\['seen'\]\['shards'\] is a builtins.set"),
    ({"by_rank": {0: "a"}}, r"extra\['by_rank'\] has the key 0 \(int\)"),
])
def test_an_extra_that_is_not_json_fails_at_the_call(tmp_path, extra, says):
    events: list[dict] = []
    manager = CheckpointManager(str(tmp_path), on_event=events.append)
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    state = {"w": jax.device_put(np.ones(4, np.float32), NamedSharding(mesh, PartitionSpec()))}
    with pytest.raises(CheckpointUsageError, match=r"save\(extra=...\): " + says):
        manager.save(1, state, extra=extra)
    assert events == []  # nothing started
    assert manager.wait() is None
    assert not (tmp_path / step_dir(1)).exists()
    manager.save(1, state, extra={"data_position": 8})
    assert manager.wait().extra == {"data_position": 8}
    manager.close()


CONFIG = {"steps": 20, "devices_per_process": 2}


@pytest.mark.slow
@pytest.mark.parametrize(("hook", "code", "reason", "says"), [
    # Storage refuses the commit marker: retryable, and every host says so.
    ({"point": "before_commit", "action": "fail"}, contract.EXIT_CHECKPOINT_IO_ERROR,
     "CheckpointIOError", "injected storage fault at before_commit"),
    # A bug while committing is no storage outage: not retryable, whichever host reports it.
    ({"point": "before_commit", "action": "fail", "error": "bug"}, contract.EXIT_FAILED,
     "Failed", "RuntimeError: injected bug at before_commit"),
], ids=["commit-marker-write-fails", "bug-at-commit"])
def test_a_commit_failure_on_process_0_reaches_every_host_at_once(tmp_path, hook, code, reason,
                                                                  says):
    ckpt = tmp_path / "ckpt"
    # The default barrier timeout (600 s) stays: nobody may be waiting for it.
    gang = launch(tmp_path / "run", processes=2, checkpoint_path=str(ckpt), config=CONFIG,
                  interval_steps=10, hooks=[{**hook, "step": 20, "process": 0}])
    assert gang.wait(timeout=240) == [code, code], gang.describe()
    failed = [gang.events("checkpoint_failed", rank) for rank in (0, 1)]
    assert [[e["step"] for e in f] for f in failed] == [[20], [20]]
    assert says in failed[0][0]["error"]
    assert f"process 0: {failed[0][0]['error']}" in failed[1][0]["error"]
    for rank in (0, 1):
        message = gang.termination(rank)
        assert message is not None and message.reason == reason, message
        assert says in message.message
        assert message.checkpoint_step == 10  # the last commit, intact
    assert committed_steps(ckpt) == [10]
    # Rank 1 heard of it within seconds of rank 0's failure, not at a barrier timeout.
    assert failed[1][0]["time"] - failed[0][0]["time"] < 5
