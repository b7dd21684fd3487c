"""Restart in place, the trainer's side: a restart on a stale world is refused, the operator's
request is taken only with the pod's key, and a rank stops with 77 when it is on."""

from __future__ import annotations

import dataclasses
import signal
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from tardigrade_trainer import contract, inplace
from tardigrade_trainer.metrics import Metrics, ProgressServer


def _env(tmp_path: Path | None, attempt: int = 1) -> contract.TrainerEnvironment:
    return contract.TrainerEnvironment(
        job_name="j", namespace="ns", attempt=attempt, coordinator_address="j-a1-0.j:8476",
        num_processes=2, process_id=0, checkpoint_path="gs://b/run",
        restart_in_place_dir=str(tmp_path) if tmp_path else None, restart_key="k" * 32)


def test_a_world_not_newer_than_the_last_one_run_in_the_pod_is_refused(tmp_path):
    inplace.enter_world(_env(tmp_path, attempt=1))
    with pytest.raises(inplace.StaleWorld, match="already ran attempt 1"):
        inplace.enter_world(_env(tmp_path, attempt=1))  # restarted before the new world came
    inplace.enter_world(_env(tmp_path, attempt=2))
    with pytest.raises(inplace.StaleWorld):
        inplace.enter_world(_env(tmp_path, attempt=2))
    # A stale restart repeats the save it stands on, so the pod's last state still names it.
    saved = contract.TerminationMessage(reason="RestartInPlace", step=31, checkpoint_step=31,
                                        attempt=2)
    inplace.remember_exit(_env(tmp_path, attempt=2), saved)
    with pytest.raises(inplace.StaleWorld) as stale:
        inplace.enter_world(_env(tmp_path, attempt=2))
    assert stale.value.termination(2) == saved
    # Off: nothing is kept, nothing refused.
    inplace.enter_world(_env(None))
    inplace.enter_world(_env(None))


def test_a_save_on_notice_ends_with_77_only_when_restart_in_place_is_on(tmp_path):
    assert inplace.stop_code(_env(tmp_path)) == (contract.EXIT_RESTART_IN_PLACE,
                                                 "RestartInPlace")
    assert inplace.stop_code(_env(None)) == (contract.EXIT_PREEMPTED_SAVED, "PreemptedSaved")


def _post(port: int, key: str | None, attempt: int = 2) -> int:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{contract.RESTART_IN_PLACE_PATH}?attempt={attempt}",
        data=b"", method="POST", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=5) as answer:
            return answer.status
    except urllib.error.HTTPError as err:
        return err.code


def test_a_rank_takes_the_request_only_with_its_key_then_gets_the_notice_once(monkeypatch):
    notices: list[tuple[int, int]] = []
    monkeypatch.setattr(inplace.os, "kill", lambda pid, sig: notices.append((pid, sig)))
    env = _env(None)
    requests = inplace.RestartRequests(env.restart_key, env.attempt)
    server = ProgressServer(Metrics(), 0, "127.0.0.1", on_restart=requests.handle).start()
    try:
        assert _post(server.port, None) == 401
        assert _post(server.port, "wrong") == 401
        # A world that is not newer than the one it runs is nothing to restart into.
        assert _post(server.port, env.restart_key, attempt=1) == 400
        assert notices == [] and not requests.wait_released(0)
        assert _post(server.port, env.restart_key) == 202
        assert notices == [(inplace.os.getpid(), signal.SIGTERM)]
        assert requests.wait_released(0)  # its world is written: it may exit 77
        assert _post(server.port, env.restart_key) == 202
        assert len(notices) == 1  # the notice is given once
    finally:
        server.stop()
    # A pod without a key (restart in place off) does not know the path.
    off = ProgressServer(Metrics(), 0, "127.0.0.1",
                         on_restart=inplace.RestartRequests(None).handle).start()
    try:
        assert _post(off.port, "anything") == 404
    finally:
        off.stop()


def test_the_termination_message_names_the_attempt_it_ran_as():
    message = contract.TerminationMessage(reason="RestartInPlace", step=31, checkpoint_step=31,
                                          attempt=2)
    assert contract.TerminationMessage.from_json(message.to_json()) == message
    older = dataclasses.replace(message, attempt=None)
    assert contract.TerminationMessage.from_json(older.to_json()) == older
