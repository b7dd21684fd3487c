"""End-to-end: real trainer gangs on loopback (several processes, several CPU devices each)."""

from __future__ import annotations

import shutil
import signal
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from tardigrade_contract import contract
from trainer_harness import committed_steps, free_port, launch, step_dirs, wait_for

from tests.faults.sharedroot_trial import unshared_root_is_refused

pytestmark = pytest.mark.slow

STEPS = 20
BASE = {"steps": STEPS, "devices_per_process": 2, "debug_state_hash": True}


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory):
    """2 processes x 2 devices, 20 uninterrupted steps, checkpoints at 10 and 20."""
    work = tmp_path_factory.mktemp("straight")
    gang = launch(work, processes=2, checkpoint_path=str(work / "ckpt"), config=BASE,
                  interval_steps=10)
    assert gang.wait() == [0, 0], gang.describe()
    assert committed_steps(work / "ckpt") == [10, 20]
    return gang


def test_every_step_is_reported_once_in_order_and_before_its_save(straight_run):
    # The loop reads a step's loss once the next step is dispatched (train.py), except for a
    # step it saves: progress must say the step is done before its checkpoint starts.
    for rank in (0, 1):
        records = straight_run.records(rank)
        steps = [r["step"] for r in records if r.get("event") == "step"]
        assert steps == list(range(1, STEPS + 1)), (rank, steps)
        at = {(r["event"], r.get("step")): i for i, r in enumerate(records)}
        for saved in (10, 20):
            assert at[("step", saved)] < at[("checkpoint_started", saved)], rank
            if saved < STEPS:  # the save starts before the next step is reported
                assert at[("checkpoint_started", saved)] < at[("step", saved + 1)], rank


def _hash_at(gang, step: int) -> str:
    return next(e["hash"] for e in gang.events("state_hash") if e["step"] == step)


def test_every_host_writes_an_even_share_of_each_checkpoint(straight_run):
    # The whole state is replicated on both hosts (pure data parallelism), so any host may
    # write any piece. The plan gives this model 1.00x an even share; picking writers by
    # CRC32 of the leaf names gave 1.23x.
    shares = [[e["bytes_this_host"] for e in straight_run.events("checkpoint_committed", rank)]
              for rank in (0, 1)]
    assert len(shares[0]) == len(shares[1]) == 2
    for per_host in zip(*shares, strict=True):
        assert max(per_host) <= 1.1 * sum(per_host) / 2, shares


def test_resume_after_sigkill_is_bitwise_identical(straight_run, tmp_path):
    ckpt = tmp_path / "ckpt"
    # Both ranks stop dead at the end of step 12, after the step-10 checkpoint commits.
    first = launch(tmp_path / "first", processes=2, checkpoint_path=str(ckpt), config=BASE,
                   interval_steps=10, hooks=[{"point": "step_end", "step": 12, "action": "pause"}])
    wait_for(lambda: all((tmp_path / "first" / f"step_end-12-{r}").exists() for r in (0, 1))
             and committed_steps(ckpt) == [10], 180, "both ranks paused and step 10 committed")
    first.kill()
    second = launch(tmp_path / "second", processes=2, checkpoint_path=str(ckpt), config=BASE,
                    interval_steps=10)
    assert second.wait() == [0, 0], second.describe()
    assert [e["step"] for e in second.events("checkpoint_restored")] == [10]
    resumed = second.losses()
    assert min(resumed) == 11
    combined = {**{s: v for s, v in first.losses().items() if s <= 10}, **resumed}
    reference = straight_run.losses()
    assert sorted(combined) == list(range(1, STEPS + 1))
    assert combined == reference  # float equality: bitwise identical losses
    assert _hash_at(second, 20) == _hash_at(straight_run, 20)


@pytest.mark.parametrize(
    ("processes", "devices", "model_axis"),
    [(1, 2, 1), (3, 1, 1), (1, 4, 2)],
    ids=["1proc-data2", "3proc-data3", "1proc-data2-model2"],
)
def test_restore_reshards_onto_another_process_count(straight_run, tmp_path, processes, devices,
                                                     model_axis):
    source = straight_run.workdir / "ckpt" / "step_00000010"
    shutil.copytree(source, tmp_path / "ckpt" / source.name)
    config = {**BASE, "devices_per_process": devices, "model_axis_size": model_axis}
    gang = launch(tmp_path / "run", processes=processes, checkpoint_path=str(tmp_path / "ckpt"),
                  config=config, interval_steps=10)
    assert gang.wait() == [0] * processes, gang.describe()
    restored = gang.events("checkpoint_restored")[0]
    assert restored["step"] == 10 and restored["saved_process_count"] == 2
    assert restored["saved_mesh"] == {"data": 4, "model": 1}
    assert gang.events("start")[0]["mesh"] == {"data": processes * devices // model_axis,
                                               "model": model_axis}
    # The state read onto the new mesh is the saved state, bit for bit.
    assert _hash_at(gang, 10) == _hash_at(straight_run, 10)
    # Training continues; only the float reduction order differs from the reference.
    losses, reference = gang.losses(), straight_run.losses()
    assert sorted(losses) == list(range(11, STEPS + 1))
    np.testing.assert_allclose([losses[s] for s in losses], [reference[s] for s in losses],
                               rtol=1e-5, atol=1e-5)


def test_sigterm_saves_the_agreed_step_and_resume_loses_nothing(tmp_path):
    ckpt = tmp_path / "ckpt"
    port = free_port()
    config = {**BASE, "steps": 80, "debug_state_hash": False}
    gang = launch(tmp_path / "first", processes=2, checkpoint_path=str(ckpt), config=config,
                  progress_port=port, extra_env={contract.ENV_SHUTDOWN_WINDOW_SECONDS: "20"})

    def progressed() -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/progress", timeout=2) as r:
                return contract.ProgressReport.from_json(r.read().decode()).step >= 5
        except OSError:
            return False

    wait_for(progressed, 180, "rank 0 to report step 5 on /progress")
    gang.signal(signal.SIGTERM, ranks=[1])  # a notice on one host is enough for all
    assert gang.wait() == [contract.EXIT_PREEMPTED_SAVED] * 2, gang.describe()
    messages = [gang.termination(r) for r in (0, 1)]
    saved = messages[0].step
    assert all(m.reason == "PreemptedSaved" for m in messages)
    assert all(m.step == saved and m.checkpoint_step == saved for m in messages)
    assert 5 <= saved < 80
    assert committed_steps(ckpt) == [saved]
    assert max(gang.losses()) == saved
    for rank in (0, 1):
        (preempted,) = gang.events("preempted", rank)
        assert preempted["shutdown_window_seconds"] == 20
        # Committed inside the save's deadline (the window less a 2 s margin).
        assert 0 < preempted["seconds_since_notice"] < 18
        assert gang.events("shutdown_window_exceeded", rank) == []

    resumed = launch(tmp_path / "second", processes=2, checkpoint_path=str(ckpt), config=config)
    assert resumed.wait() == [0, 0], resumed.describe()
    assert min(resumed.losses()) == saved + 1 and max(resumed.losses()) == 80
    assert resumed.termination(0).reason == "Succeeded"


def test_sigterm_without_save_on_preemption_terminates_at_once(tmp_path):
    config = {**BASE, "steps": 100000, "debug_state_hash": False}
    gang = launch(tmp_path, processes=1, checkpoint_path=str(tmp_path / "ckpt"), config=config,
                  extra_env={contract.ENV_SAVE_ON_PREEMPTION: "false"})
    wait_for(lambda: len(gang.events("step")) >= 3, 180, "three training steps")
    gang.signal(signal.SIGTERM)
    assert gang.wait(timeout=60) == [-signal.SIGTERM], gang.describe()
    assert committed_steps(tmp_path / "ckpt") == []


def test_time_interval_saves_are_decided_once_for_all_hosts(tmp_path):
    ckpt = tmp_path / "ckpt"
    config = {**BASE, "steps": 60, "debug_state_hash": False}
    gang = launch(tmp_path / "run", processes=2, checkpoint_path=str(ckpt), config=config,
                  interval_seconds=0.2, keep_last=1000)
    assert gang.wait() == [0, 0], gang.describe()
    per_rank = [[e["step"] for e in gang.events("checkpoint_committed", r)] for r in (0, 1)]
    assert per_rank[0] == per_rank[1]
    assert len(per_rank[0]) >= 3 and per_rank[0][-1] == 60  # time-driven saves, then the last
    assert committed_steps(ckpt) == per_rank[0]


@pytest.mark.parametrize(
    ("point", "process"),
    [("after_prepare", 1), ("after_write", 0), ("before_commit", 0)],
)
def test_crash_during_save_keeps_previous_commit(tmp_path, point, process):
    ckpt = tmp_path / "ckpt"
    config = {**BASE, "debug_state_hash": False}
    hooks = [{"point": point, "step": 20, "process": process, "action": "kill"}]
    gang = launch(tmp_path / "first", processes=2, checkpoint_path=str(ckpt), config=config,
                  interval_steps=10, hooks=hooks)
    wait_for(lambda: gang.procs[process].poll() is not None, 180, f"rank {process} killed")
    assert gang.procs[process].returncode == -signal.SIGKILL
    gang.kill()  # the survivor waits at a barrier for the dead rank: the gang is lost
    assert committed_steps(ckpt) == [10]
    assert step_dirs(ckpt) == [10, 20]  # the half-written step 20 is there, uncommitted

    again = launch(tmp_path / "second", processes=2, checkpoint_path=str(ckpt), config=config,
                   interval_steps=10)
    assert again.wait() == [0, 0], again.describe()
    assert [e["step"] for e in again.events("checkpoint_restored")] == [10]
    assert [e["step"] for e in again.events("checkpoint_partial_removed")] == [20]
    assert min(again.losses()) == 11
    assert committed_steps(ckpt) == [10, 20]


@pytest.fixture(scope="module")
def gcs():
    from tardigrade_local.gcs import GcsEmulator

    with GcsEmulator() as emulator:
        emulator.create_bucket("tardigrade-test")
        yield emulator


def test_gs_paths_end_to_end(gcs, tmp_path):
    url = "gs://tardigrade-test/jobs/e2e"
    config = {**BASE, "steps": 12, "debug_state_hash": False}
    first = launch(tmp_path / "first", processes=2, checkpoint_path=url, config=config,
                   interval_steps=6, extra_env=gcs.client_env(),
                   hooks=[{"point": "step_end", "step": 8, "action": "pause"}])
    wait_for(lambda: all((tmp_path / "first" / f"step_end-8-{r}").exists() for r in (0, 1))
             and "jobs/e2e/step_00000006/metadata.json" in gcs.list_objects("tardigrade-test"),
             180, "step 6 committed to the emulator")
    first.kill()
    second = launch(tmp_path / "second", processes=2, checkpoint_path=url, config=config,
                    interval_steps=6, extra_env=gcs.client_env())
    assert second.wait() == [0, 0], second.describe()
    assert [e["path"] for e in second.events("checkpoint_restored")] == [f"{url}/step_00000006"]
    assert min(second.losses()) == 7
    objects = gcs.list_objects("tardigrade-test", "jobs/e2e/")
    assert "jobs/e2e/step_00000012/metadata.json" in objects
    assert any(o.startswith("jobs/e2e/step_00000012/arrays/model/") for o in objects)
    assert second.termination(0).checkpoint_path == f"{url}/step_00000012"


# --- bad input -------------------------------------------------------------------------------

def test_config_that_does_not_fit_the_devices_is_a_config_error(tmp_path):
    config = {**BASE, "global_batch_size": 6}  # a data axis of 4 devices cannot split 6
    gang = launch(tmp_path, processes=2, checkpoint_path=str(tmp_path / "ckpt"), config=config)
    assert gang.wait() == [contract.EXIT_CONFIG_ERROR] * 2, gang.describe()
    message = gang.termination(0)
    assert message.reason == "ConfigError" and "global_batch_size=6" in message.message
    assert not (tmp_path / "ckpt").exists()


def test_unwritable_checkpoint_path_fails_fast(tmp_path):
    (tmp_path / "not-a-dir").write_text("x")
    gang = launch(tmp_path, processes=1, checkpoint_path=str(tmp_path / "not-a-dir" / "ckpt"),
                  config={**BASE, "debug_state_hash": False})
    assert gang.wait() == [contract.EXIT_CHECKPOINT_IO_ERROR], gang.describe()
    message = gang.termination(0)
    assert message.reason == "CheckpointIOError" and "not writable" in message.message
    assert gang.events("step") == []


def test_a_root_each_host_sees_alone_is_refused_before_training(tmp_path):
    ok, what, _ = unshared_root_is_refused(tmp_path, BASE)
    assert ok, what


def test_corrupt_newest_checkpoint_is_reported_and_left_alone(straight_run, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(straight_run.workdir / "ckpt", ckpt)
    chunk = next(p for p in (ckpt / "step_00000020" / "arrays").rglob("c/*") if p.is_file())
    chunk.write_bytes(b"\0" * len(chunk.read_bytes()))

    def checkpoints() -> dict[Path, bytes]:
        # The root record is not a checkpoint: each start moves its fence.
        return {p: p.read_bytes() for p in ckpt.rglob("*")
                if p.is_file() and p.name != "tardigrade-root.json"}

    before = checkpoints()
    gang = launch(tmp_path / "run", processes=1, checkpoint_path=str(ckpt),
                  config={**BASE, "debug_state_hash": False, "steps": 30})
    assert gang.wait() == [contract.EXIT_CHECKPOINT_CORRUPT], gang.describe()
    message = gang.termination(0)
    assert message.reason == "CheckpointCorrupt" and "step_00000020" in message.message
    assert checkpoints() == before
    # An older committed checkpoint can still be chosen explicitly (spec.checkpoint.restoreStep).
    pinned = launch(tmp_path / "pinned", processes=1, checkpoint_path=str(ckpt),
                    config={**BASE, "debug_state_hash": False},
                    extra_env={contract.ENV_ROLLBACK_STEP: "10",
                               contract.ENV_ROLLBACK_REQUEST: "r1"})
    assert pinned.wait() == [0], pinned.describe()
    assert min(pinned.losses()) == 11
    assert (ckpt / "step_00000020" / "metadata.json").exists()


def test_initfrom_starts_from_another_root_and_leaves_it_alone(straight_run, tmp_path):
    source = tmp_path / "source"
    shutil.copytree(straight_run.workdir / "ckpt", source)
    before = {p: p.read_bytes() for p in source.rglob("*") if p.is_file()}
    gang = launch(tmp_path / "run", processes=1, checkpoint_path=str(tmp_path / "own"),
                  config={**BASE, "debug_state_hash": False, "steps": 25}, interval_steps=5,
                  extra_env={contract.ENV_INIT_FROM_PATH: str(source),
                             contract.ENV_JOB_NAME: "finetune"})
    assert gang.wait() == [0], gang.describe()
    assert min(gang.losses()) == 21  # resumed after the source's newest step, 20
    restored = gang.events("checkpoint_restored")
    assert [(e["step"], e["path"]) for e in restored] == [(20, f"{source}/step_00000020")]
    assert committed_steps(tmp_path / "own") == [25]
    assert {p: p.read_bytes() for p in source.rglob("*") if p.is_file()} == before


def test_every_rank_refuses_another_jobs_root_and_rank_0_says_why(straight_run, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(straight_run.workdir / "ckpt", ckpt)
    gang = launch(tmp_path / "run", processes=2, checkpoint_path=str(ckpt), config=BASE,
                  extra_env={contract.ENV_JOB_NAME: "intruder"})
    assert gang.wait() == [contract.EXIT_CONFIG_ERROR] * 2, gang.describe()
    message = gang.termination(0)
    assert message.reason == "CheckpointRootOwned"
    assert "default/test" in message.message and "default/intruder" in message.message
    # Rank 1 says why too: the operator reports whichever rank it sees stop first.
    peer = gang.termination(1)
    assert peer.reason == "CheckpointRootOwned" and "default/intruder" in peer.message
    assert gang.events("step") == []


def test_missing_peer_is_a_clear_timeout_not_an_abort(tmp_path):
    gang = launch(tmp_path, processes=2, checkpoint_path=str(tmp_path / "ckpt"), config=BASE,
                  init_timeout=3, ranks=[0])
    assert gang.wait(timeout=60) == [contract.EXIT_PEER_TIMEOUT], gang.describe()
    message = gang.termination(0)
    assert message.reason == "PeerTimeout" and "ranks [1] of 2" in message.message
