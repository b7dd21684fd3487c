"""A notice in every phase of a rank's life, not only between two steps (sdk/notice.py).

Each test holds real trainer processes in one phase (injected_faults.py: `pause` blocks the
phase's thread until the process ends, `hold` until the test releases it), sends SIGTERM
there, and checks the end: a save of the newest step not yet committed where there is one
(never a torn one; a save in flight commits first, and a second save follows only where the
window has room for it), otherwise a clean exit 75 with a termination message that names the
phase and the committed step."""

from __future__ import annotations

import shutil
import signal
import sys
from pathlib import Path

import pytest
from tardigrade_contract import contract
from tardigrade_sdk.notice import another_save_fits
from trainer_harness import committed_steps, launch, step_dirs, wait_for

pytestmark = pytest.mark.slow

LOOP = Path(__file__).with_name("notice_loop.py")
SAVED = contract.EXIT_PREEMPTED_SAVED
# Generous under load; every end below comes well inside it.
WINDOW = {contract.ENV_SHUTDOWN_WINDOW_SECONDS: "30"}


def _markers(gang, names: list[str]) -> bool:
    return all((gang.workdir / name).exists() for name in names)


def _hold(gang, names: list[str], what: str) -> None:
    wait_for(lambda: _markers(gang, names) or any(p.poll() is not None for p in gang.procs),
             180, what)
    assert _markers(gang, names), gang.describe()


@pytest.fixture(scope="module")
def committed_at_4(tmp_path_factory) -> Path:
    """A root whose newest committed step is 4, written by one process of two devices."""
    work = tmp_path_factory.mktemp("first")
    gang = launch(work, processes=1, checkpoint_path=str(work / "ckpt"),
                  config={"steps": 4, "devices_per_process": 2}, interval_steps=4)
    assert gang.wait() == [0], gang.describe()
    assert committed_steps(work / "ckpt") == [4]
    return work / "ckpt"


def test_a_notice_during_start_up_ends_every_rank_cleanly(tmp_path):
    """Before jax.distributed starts: SIGTERM's default action killed the rank (143, no
    termination message)."""
    ckpt = tmp_path / "ckpt"
    gang = launch(tmp_path, processes=2, checkpoint_path=str(ckpt), config={"steps": 50},
                  hooks=[{"point": "start_up", "action": "pause"}], extra_env=WINDOW)
    _hold(gang, ["start_up-0-0", "start_up-0-1"], "both ranks in start-up")
    gang.signal(signal.SIGTERM)
    assert gang.wait(60) == [SAVED, SAVED], gang.describe()
    for rank in (0, 1):
        message = gang.termination(rank)
        assert message is not None and message.reason == "PreemptedSaved"
        assert message.checkpoint_step is None
        assert message.message == "notice during start-up: nothing trained to save"
        (record,) = gang.events("preempted_before_training", rank)
        assert record["phase"] == "start-up"
    assert step_dirs(ckpt) == []


def test_a_notice_while_jax_distributed_starts_ends_the_rank_cleanly(tmp_path):
    """Rank 1 alone: it waits for rank 0 at the rendezvous, inside `distributed.initialize`,
    until the notice comes (the marker says its session has started)."""
    gang = launch(tmp_path, processes=2, ranks=[1], checkpoint_path=str(tmp_path / "ckpt"),
                  config={"steps": 50}, hooks=[{"point": "start_up", "action": "mark"}],
                  extra_env=WINDOW)
    _hold(gang, ["start_up-0-1"], "rank 1 starting jax.distributed")
    gang.signal(signal.SIGTERM)
    assert gang.wait(60) == [SAVED], gang.describe()
    message = gang.termination(1)
    assert message is not None and message.reason == "PreemptedSaved"
    assert message.message == "notice during start-up: nothing trained to save"


def test_a_peer_notice_during_restore_stops_the_gang_without_saving(committed_at_4,
                                                                      tmp_path):
    """One rank's SIGTERM reaches the other through the coordination service; neither saves
    a step at or below the committed one, and the committed step is left as it was."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(committed_at_4, ckpt)
    gang = launch(tmp_path / "run", processes=2, checkpoint_path=str(ckpt),
                  config={"steps": 50, "devices_per_process": 1}, interval_steps=4,
                  hooks=[{"point": "restore", "action": "pause"}], extra_env=WINDOW)
    _hold(gang, ["restore-4-0", "restore-4-1"], "both ranks restoring step 4")
    gang.signal(signal.SIGTERM, ranks=[1])
    assert gang.wait(60) == [SAVED, SAVED], gang.describe()
    for rank in (0, 1):
        message = gang.termination(rank)
        assert message is not None and message.reason == "PreemptedSaved"
        assert message.checkpoint_step == 4
        assert message.message == ("notice during restore: nothing newer than the committed "
                                   "step 4 to save")
        assert gang.events("checkpoint_started", rank) == []
    assert step_dirs(ckpt) == committed_steps(ckpt) == [4]


def test_a_notice_while_the_step_compiles_stops_the_gang_at_once(tmp_path):
    """The step's compilation is held (on a big model it outlasts the window): the gang
    leaves without waiting for it, with nothing to save on a fresh start."""
    ckpt = tmp_path / "ckpt"
    gang = launch(tmp_path, processes=2, checkpoint_path=str(ckpt),
                  config={"steps": 50, "devices_per_process": 1}, interval_steps=4,
                  hooks=[{"point": "compile", "action": "pause"}], extra_env=WINDOW)
    _hold(gang, ["compile-0-0", "compile-0-1"], "both ranks compiling the step")
    gang.signal(signal.SIGTERM, ranks=[0])
    assert gang.wait(60) == [SAVED, SAVED], gang.describe()
    for rank in (0, 1):
        message = gang.termination(rank)
        assert message is not None and message.reason == "PreemptedSaved"
        assert message.checkpoint_step is None and "nothing trained to save" in message.message
        assert gang.events("step", rank) == []
    assert step_dirs(ckpt) == []


def test_a_notice_during_a_save_in_flight_commits_it_first_then_the_agreed_step(tmp_path):
    """The save in flight is committed before anything else; the agreed (newer) step is
    saved after it only because this window has room for a second save (the other branch:
    test_a_second_save_needs_room_in_the_window)."""
    ckpt = tmp_path / "ckpt"
    gang = launch(tmp_path, processes=2, checkpoint_path=str(ckpt), config={},
                  argv=[sys.executable, str(LOOP), "in_flight", str(tmp_path)],
                  extra_env=WINDOW)
    _hold(gang, ["after_write-4-0"], "process 0 holding the save of step 4 after its writes")
    gang.signal(signal.SIGTERM, ranks=[1])
    # The gang's agreed step comes while step 4's save is in flight: every rank waits for it.
    wait_for(lambda: all(gang.events("preemption_waits_for_save", r) for r in (0, 1))
             or any(p.poll() is not None for p in gang.procs), 60,
             "both ranks waiting for the save in flight")
    assert all(gang.events("checkpoint_committed", r) == [] for r in (0, 1))
    (tmp_path / "after_write-4-0.go").write_text("")
    assert gang.wait(60) == [SAVED, SAVED], gang.describe()
    agreed = gang.events("preemption_waits_for_save", 0)[0]["step"]
    assert agreed > 4
    for rank in (0, 1):
        message = gang.termination(rank)
        assert message is not None and message.reason == "PreemptedSaved"
        assert (message.step, message.checkpoint_step) == (agreed, agreed)
        records = gang.records(rank)
        at = {(r["event"], r.get("step")): i for i, r in enumerate(records)}
        assert at[("checkpoint_committed", 4)] < at[("checkpoint_started", agreed)]
        assert [e["step"] for e in gang.events("checkpoint_started", rank)] == [4, agreed]
        (second,) = gang.events("preemption_second_save", rank)
        assert second["saved"] and second["seconds_left"] > 1.5 * second["estimate_s"]
    assert step_dirs(ckpt) == committed_steps(ckpt) == [4, agreed]


def test_a_notice_during_an_evaluation_saves_the_last_step_and_stops(tmp_path):
    ckpt = tmp_path / "ckpt"
    gang = launch(tmp_path, processes=2, checkpoint_path=str(ckpt), config={},
                  argv=[sys.executable, str(LOOP), "evaluate", str(tmp_path)],
                  extra_env=WINDOW)
    _hold(gang, ["evaluating-0", "evaluating-1"], "both ranks evaluating after step 5")
    gang.signal(signal.SIGTERM, ranks=[0])
    assert gang.wait(60) == [SAVED, SAVED], gang.describe()
    for rank in (0, 1):
        message = gang.termination(rank)
        assert message is not None and message.reason == "PreemptedSaved"
        assert (message.step, message.checkpoint_step) == (5, 5)
    assert step_dirs(ckpt) == committed_steps(ckpt) == [5]


def test_a_second_save_needs_room_in_the_window():
    """Behind a save in flight, the agreed step is saved only with half again the time the
    committed save took left before the deadline; unknown, never."""
    assert another_save_fits(left_seconds=10.0, estimate_seconds=6.0)
    assert not another_save_fits(left_seconds=9.0, estimate_seconds=6.0)
    assert not another_save_fits(left_seconds=0.0, estimate_seconds=0.1)
    assert not another_save_fits(left_seconds=100.0, estimate_seconds=None)
    assert another_save_fits(left_seconds=None, estimate_seconds=30.0)  # no deadline


@pytest.mark.parametrize("lost", [False, True])
def test_a_kept_rank_waiting_for_its_peers_takes_its_next_world_and_restarts_in_its_pod(
        tmp_path, lost):
    """Rank 1 alone at the rendezvous (its peer lost, or a new pod that cannot be placed):
    the operator's restart request with a newer world reaches it there (the progress port is
    served from the start, progress itself only once the gang met) and it exits 77 for its
    kubelet to restart it in its pod, the world kept for the restarted container."""
    import json
    import urllib.request

    from trainer_harness import free_port

    keep_dir = tmp_path / "in-place"
    keep_dir.mkdir()
    port = free_port()
    key = "k" * 32
    gang = launch(tmp_path, processes=2, ranks=[1], checkpoint_path=str(tmp_path / "ckpt"),
                  config={"steps": 50}, hooks=[{"point": "start_up", "action": "mark"}],
                  extra_env={**WINDOW, contract.ENV_RESTART_IN_PLACE_DIR: str(keep_dir),
                             contract.ENV_RESTART_KEY: key,
                             contract.ENV_PROGRESS_PORT: str(port)})
    _hold(gang, ["start_up-0-1"], "rank 1 starting jax.distributed")
    world = {"attempt": 1, "numProcesses": 1, "processId": 0,
             "coordinatorAddress": "127.0.0.1:1", "restoreStep": "latest"}
    query = "attempt=1" + (f"&{contract.RESTART_LOST_RANKS_PARAM}=0" if lost else "")

    def ask() -> int | None:
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}{contract.RESTART_IN_PLACE_PATH}?{query}",
            data=json.dumps(world).encode(), method="POST",
            headers={"Authorization": f"Bearer {key}"})
        try:
            with urllib.request.urlopen(request, timeout=5) as answer:
                return answer.status
        except OSError:
            return None  # not listening yet

    assert wait_for(ask, 60, "the restart request taken") == 202
    assert gang.wait(60) == [contract.EXIT_RESTART_IN_PLACE], gang.describe()
    message = gang.termination(1)
    assert message is not None and message.reason == "RestartInPlace", message
    assert json.loads((keep_dir / "world.json").read_text()) == world
    event = "restart_for_lost_ranks" if lost else "preempted_before_training"
    assert gang.events(event, 1), gang.describe()
