"""Restart in place, the trainer's side: a restart on a stale world is refused, the operator's
request is taken only with the pod's key, and a rank stops with 77 when it is on."""

from __future__ import annotations

import dataclasses
import json
import signal
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from tardigrade_contract import contract
from tardigrade_sdk import inplace
from tardigrade_sdk.metrics import Metrics, ProgressServer

from tests.polling import wait_for


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
    server = ProgressServer(Metrics(), 0, "127.0.0.1", on_restart=requests.answer).start()
    try:
        assert _post(server.port, None) == 401
        assert _post(server.port, "wrong") == 401
        # An older world is nothing to restart into; the one it runs already is done (the
        # operator's retry of a request whose answer it lost): neither is a notice.
        assert _post(server.port, env.restart_key, attempt=0) == 400
        assert _post(server.port, env.restart_key, attempt=1) == 200
        assert notices == [] and not requests.released.is_set()
        assert _post(server.port, env.restart_key) == 202
        assert notices == [(inplace.os.getpid(), signal.SIGTERM)]
        assert requests.released.is_set()  # its world is written: it may exit 77
        assert _post(server.port, env.restart_key) == 202
        assert len(notices) == 1  # the notice is given once
    finally:
        server.stop()
    # A pod without a key (restart in place off) does not know the path.
    off = ProgressServer(Metrics(), 0, "127.0.0.1",
                         on_restart=inplace.RestartRequests(None).answer).start()
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


def _world(attempt: int = 2, **changed: object) -> dict:
    return {"attempt": attempt, "numProcesses": 2, "processId": 1,
            "coordinatorAddress": "j-a1-0.j:8476", "restoreStep": "latest", **changed}


def _send(port: int, key: str, body: bytes, attempt: int = 2) -> tuple[int, str]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{contract.RESTART_IN_PLACE_PATH}?attempt={attempt}",
        data=body, method="POST", headers={"Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(request, timeout=5) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def test_the_request_carries_the_rank_s_world_which_the_rank_keeps_for_its_restart(tmp_path):
    env = _env(tmp_path)
    notices: list[str] = []
    requests = inplace.RestartRequests(env.restart_key, env.attempt, env.restart_in_place_dir)
    server = ProgressServer(
        Metrics(), 0, "127.0.0.1",
        on_restart=lambda auth, query, body: requests.answer(
            auth, query, body, notice=lambda: notices.append("SIGTERM"))).start()
    kept = tmp_path / inplace.WORLD_FILE
    try:
        good = json.dumps(_world()).encode()
        assert _send(server.port, "wrong", good)[0] == 401
        # A malformed world is refused, naming the field; nothing is kept, nobody released.
        code, why = _send(server.port, env.restart_key, json.dumps(
            _world(processId=[1])).encode())
        assert code == 400 and "world.processId" in why
        code, why = _send(server.port, env.restart_key, json.dumps(
            _world(rank=1)).encode())
        assert code == 400 and "'rank'" in why
        # A world for another attempt than the request's.
        code, why = _send(server.port, env.restart_key, json.dumps(_world(attempt=3)).encode())
        assert code == 400 and "attempt" in why
        # A body over the bound is refused unread.
        big = json.dumps(_world(coordinatorAddress="x" * contract.MAX_WORLD_BYTES)).encode()
        assert _send(server.port, env.restart_key, big)[0] == 413
        assert not kept.exists() and notices == [] and not requests.released.is_set()

        assert _send(server.port, env.restart_key, good) == (202, "")
        assert json.loads(kept.read_text()) == _world()
        assert notices == ["SIGTERM"] and requests.released.is_set()
    finally:
        server.stop()


def _environ(tmp_path: Path, attempt: int, world: dict | None) -> dict[str, str]:
    environ = {contract.ENV_ATTEMPT: str(attempt), contract.ENV_NUM_PROCESSES: "3",
               contract.ENV_PROCESS_ID: "1", contract.ENV_CHECKPOINT_PATH: "gs://b/run",
               contract.ENV_RESTART_IN_PLACE_DIR: str(tmp_path)}
    if world is not None:
        environ[contract.ENV_WORLD] = json.dumps(world)
    return environ


def test_a_restarted_rank_takes_the_newer_of_its_env_world_and_its_request_s(tmp_path):
    def started(environ: dict[str, str]) -> contract.TrainerEnvironment:
        return contract.TrainerEnvironment.from_env(inplace.newest_world(environ))

    # No request kept: the env's world.
    assert started(_environ(tmp_path, 1, None)).attempt == 1
    # The request's world is newer than the env's (the pod's patch has not reached it yet).
    (tmp_path / inplace.WORLD_FILE).write_text(json.dumps(_world(attempt=2)))
    env = started(_environ(tmp_path, 1, None))
    assert (env.attempt, env.num_processes, env.process_id) == (2, 2, 1)
    assert started(_environ(tmp_path, 1, _world(attempt=1))).attempt == 2
    # The env's world is newer (a later attempt whose request never came): the env's.
    env = started(_environ(tmp_path, 1, _world(attempt=3, numProcesses=4, processId=3)))
    assert (env.attempt, env.num_processes, env.process_id) == (3, 4, 3)
    # Neither newer than what this pod ran: still refused as stale.
    inplace.enter_world(started(_environ(tmp_path, 1, None)))
    with pytest.raises(inplace.StaleWorld):
        inplace.enter_world(started(_environ(tmp_path, 1, _world(attempt=2))))


def test_a_big_gang_waits_longer_for_its_word_but_not_past_the_shutdown_window() -> None:
    small = inplace.release_wait_seconds(2, shutdown_window_seconds=15, since_notice=1)
    big = inplace.release_wait_seconds(1024, shutdown_window_seconds=15, since_notice=1)
    roomy = inplace.release_wait_seconds(1024, shutdown_window_seconds=120, since_notice=1)
    assert small == pytest.approx(inplace.RELEASE_WAIT_SECONDS, abs=0.1)
    # The operator's requests to 1,023 ranks take longer than 5 s: wait for them, but leave
    # the pod the end of its window to exit with its termination message.
    assert inplace.RELEASE_WAIT_SECONDS < big == pytest.approx(15 - 1 - 1)
    assert roomy == pytest.approx(inplace.RELEASE_WAIT_SECONDS + 1024 * 0.02)
    # A save that used most of the window still gets the wait every rank had before.
    late = inplace.release_wait_seconds(1024, shutdown_window_seconds=15, since_notice=13)
    assert late == inplace.RELEASE_WAIT_SECONDS


def test_the_trainer_s_entry_point_starts_on_the_world_its_request_left(tmp_path, monkeypatch):
    # The kept pod's annotation (its env's world) is patched only once the gang runs again:
    # the restarted container must start on the world file, or it exits 77 as stale.
    from tardigrade_sdk import session as session_module
    from tardigrade_trainer import __main__ as entry

    (tmp_path / inplace.WORLD_FILE).write_text(json.dumps(_world(attempt=2)))
    for name, value in _environ(tmp_path, 1, None).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv(contract.ENV_TERMINATION_LOG, str(tmp_path / "termination-log"))
    started: list[contract.TrainerEnvironment] = []

    class Session:
        def __init__(self, env: contract.TrainerEnvironment, **_: object) -> None:
            started.append(env)

        def __enter__(self) -> Session:
            raise SystemExit(0)

        def __exit__(self, *_: object) -> None:
            pass

    monkeypatch.setattr(session_module, "TrainingSession", Session)
    with pytest.raises(SystemExit):
        entry.main([])
    assert [(e.attempt, e.num_processes, e.process_id) for e in started] == [(2, 2, 1)]


def test_a_rank_restarts_in_process_only_when_on_and_released_with_a_newer_world(tmp_path):
    on = dataclasses.replace(_env(tmp_path), restart_in_process=True)
    assert contract.TrainerEnvironment.from_env(on.to_env()).restart_in_process
    requests = inplace.RestartRequests(on.restart_key, on.attempt, on.restart_in_place_dir)
    assert not requests.restarts_in_process(on)  # not released yet
    # Released without a world (its pod goes away): it exits.
    assert requests.answer(f"Bearer {on.restart_key}", "attempt=2", b"", lambda: None)[0] == 202
    assert not requests.restarts_in_process(on)
    body = json.dumps(_world(attempt=2, processId=0)).encode()
    assert requests.answer(f"Bearer {on.restart_key}", "attempt=2", body, lambda: None)[0] == 202
    assert requests.restarts_in_process(on)
    # Off, the same request ends in exit 77 for the kubelet.
    assert not requests.restarts_in_process(_env(tmp_path))


def test_a_rank_told_by_a_peer_waits_longer_for_its_word_than_one_whose_pod_goes() -> None:
    """A kept rank's pod is not being stopped: a late operator's word still finds it. One
    that got its own SIGTERM keeps the window's rule, from the save or from the SIGTERM."""
    saved, notice = 100.0, 99.5
    peer = inplace.release_deadline(saved, notice, None, 3, shutdown_window_seconds=15)
    assert peer == saved + inplace.PEER_NOTICE_RELEASE_WAIT_SECONDS
    own = inplace.release_deadline(saved, notice, notice, 3, shutdown_window_seconds=15)
    assert own == pytest.approx(saved + inplace.release_wait_seconds(3, 15, 0.5))
    assert own < peer
    # Its own SIGTERM during the wait: the going pod's wait from then, never past the peer's.
    later = inplace.release_deadline(saved, notice, 110.0, 3, shutdown_window_seconds=15)
    assert later == pytest.approx(110.0 + inplace.release_wait_seconds(3, 15, 0.0))
    assert inplace.release_deadline(saved, notice, 128.0, 3, 15) == peer
    # A big gang in a long window waits at least what a going rank would.
    big = inplace.release_deadline(saved, notice, None, 2048, shutdown_window_seconds=120)
    assert big == pytest.approx(saved + inplace.release_wait_seconds(2048, 120, 0.5))


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_wait_for_the_word_follows_a_deadline_that_comes_nearer() -> None:
    requests = inplace.RestartRequests("k", attempt=1)
    clock = _Clock()
    deadlines = iter([30.0, 30.0, 2.0])
    waited: list[float] = []

    def deadline() -> float:
        return next(deadlines, 2.0)

    def tick(seconds: float | None = None) -> bool:
        waited.append(seconds or 0.0)
        clock.now += seconds or 0.0
        return False

    requests.released.wait = tick  # type: ignore[method-assign]
    assert requests.wait_released_until(deadline, clock=clock, poll_seconds=1.0) is False
    assert waited == [1.0, 1.0] and clock.now == 2.0


def test_the_wait_for_the_word_ends_when_the_request_comes() -> None:
    requests = inplace.RestartRequests("k", attempt=1)
    requests.released.set()
    assert requests.wait_released_until(lambda: 1e9, poll_seconds=0.01) is True
    assert inplace.RestartRequests("k").wait_released_until(lambda: 0.0) is False


def test_a_rank_told_of_lost_ranks_answers_then_leaves_without_a_notice(tmp_path):
    env = _env(tmp_path)
    notices: list[str] = []
    left: list[tuple[int, ...]] = []
    requests = inplace.RestartRequests(env.restart_key, env.attempt, env.restart_in_place_dir)
    answered: list[int] = []

    def leave(lost: tuple[int, ...]) -> None:
        # What the session does here ends the process: the caller has its answer by then.
        assert answered, "left before the answer was sent"
        left.append(lost)

    requests.on_lost_ranks = leave

    def answer(auth: str | None, query: str, body: bytes) -> tuple[int, str]:
        code, why = requests.answer(auth, query, body, notice=lambda: notices.append("SIGTERM"))
        return code, why

    finished: list[int] = []

    def after() -> None:
        answered.append(1)
        requests.after_answer()
        finished.append(1)

    server = ProgressServer(Metrics(), 0, "127.0.0.1", on_restart=answer,
                            after_restart=after).start()

    def send(query: str, body: bytes) -> tuple[int, str]:
        request = urllib.request.Request(
            f"http://127.0.0.1:{server.port}{contract.RESTART_IN_PLACE_PATH}?{query}",
            data=body, method="POST", headers={"Authorization": f"Bearer {env.restart_key}"})
        try:
            with urllib.request.urlopen(request, timeout=5) as reply:
                return reply.status, reply.read().decode()
        except urllib.error.HTTPError as err:
            return err.code, err.read().decode()

    world = json.dumps(_world()).encode()
    try:
        code, why = send(f"attempt=2&{contract.RESTART_LOST_RANKS_PARAM}=1,x", world)
        assert code == 400 and contract.RESTART_LOST_RANKS_PARAM in why
        assert left == [] and not requests.released.is_set()
        done = len(finished)
        code, why = send(f"attempt=2&{contract.RESTART_LOST_RANKS_PARAM}=3,1", world)
        assert code == 202 and "ranks 1, 3 lost" in why
        # No notice: a save cannot commit without the lost ranks. The world is kept for the
        # restarted container, and the rank left once, after its answer (the server's thread
        # acts once the reply is sent: the client may read the reply first).
        wait_for(lambda: len(finished) > done, 10, "the answer's aftermath in the server's thread")
        assert notices == [] and left == [(1, 3)] and requests.released.is_set()
        assert json.loads((tmp_path / inplace.WORLD_FILE).read_text()) == _world()
        done = len(finished)
        assert send(f"attempt=2&{contract.RESTART_LOST_RANKS_PARAM}=1", world)[0] == 202
        wait_for(lambda: len(finished) > done, 10, "the second answer's aftermath")
        assert left == [(1, 3)]
    finally:
        server.stop()
    assert inplace.parse_lost_ranks("attempt=2") == ()
    assert inplace.parse_lost_ranks(f"{contract.RESTART_LOST_RANKS_PARAM}=") == ()
    assert inplace.parse_lost_ranks(f"{contract.RESTART_LOST_RANKS_PARAM}=-1") is None


def test_a_rank_whose_pod_goes_is_not_told_to_leave_at_once_even_with_lost_ranks(tmp_path):
    env = _env(tmp_path)
    notices: list[str] = []
    left: list[tuple[int, ...]] = []
    requests = inplace.RestartRequests(env.restart_key, env.attempt, env.restart_in_place_dir)
    requests.on_lost_ranks = left.append
    # No world: its pod is being deleted; it saves with the gang if it can (the notice).
    code, _ = requests.answer(f"Bearer {env.restart_key}",
                              f"attempt=2&{contract.RESTART_LOST_RANKS_PARAM}=1", b"",
                              notice=lambda: notices.append("SIGTERM"))
    requests.after_answer()
    assert code == 202 and notices == ["SIGTERM"] and left == []


def test_a_server_started_before_the_gang_met_takes_requests_but_serves_no_progress_yet():
    env = _env(None)
    notices: list[str] = []
    requests = inplace.RestartRequests(env.restart_key, env.attempt)
    server = ProgressServer(Metrics(), 0, "127.0.0.1", ready=False, on_restart=lambda a, q, b:
                            requests.answer(a, q, b, notice=lambda: notices.append("SIGTERM"))
                            ).start()

    def get(path: str) -> int:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{server.port}{path}",
                                        timeout=5) as answer:
                return answer.status
        except urllib.error.HTTPError as err:
            return err.code

    try:
        # Rank 0's report means every rank met: not before.
        assert get("/progress") == 503 and get("/metrics") == 503
        assert _post(server.port, env.restart_key) == 202 and notices == ["SIGTERM"]
        server.serve_progress()
        assert get("/progress") == 200 and get("/metrics") == 200
    finally:
        server.stop()
