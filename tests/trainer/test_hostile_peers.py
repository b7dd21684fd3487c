"""The trainer's open ports against hostile callers: the rendezvous (8476) and the progress
endpoint (8477) bound what a caller can make them hold, and time out every wait."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.request

import pytest
from tardigrade_contract import contract
from tardigrade_sdk import distributed, peerauth
from tardigrade_sdk.metrics import Metrics, ProgressServer
from trainer_harness import free_port

from tests.polling import wait_for
from tests.rendezvous import coordinator_in_thread


def _env(rank: int, n: int, port: int, **extra: object) -> contract.TrainerEnvironment:
    fields: dict[str, object] = dict(
        job_name="job", namespace="ns", attempt=0, coordinator_address=f"127.0.0.1:{port}",
        num_processes=n, process_id=rank, checkpoint_path="/unused")
    fields.update(extra)
    return contract.TrainerEnvironment(**fields)  # type: ignore[arg-type]


def _coordinator(port: int, n: int, timeout: float, check: distributed.Checker | None = None
                 ) -> tuple[threading.Thread, list[object]]:
    return coordinator_in_thread(port, n, timeout, check=check)


def _connect(port: int) -> socket.socket:
    def attempt() -> socket.socket | None:
        try:
            return socket.create_connection(("127.0.0.1", port), timeout=1)
        except OSError:
            return None
    return wait_for(attempt, 30, "the coordinator to listen")


def _closed_by_peer(sock: socket.socket, within: float) -> bool:
    sock.settimeout(within)
    try:
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                return True
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def test_a_hello_that_never_ends_is_cut_off():
    port = free_port()
    _coordinator(port, 2, 10)
    sock = _connect(port)
    try:
        sock.sendall(b"x" * 65536)  # far beyond any hello, and no newline, ever
        assert _closed_by_peer(sock, 5), "the coordinator kept buffering a hello without end"
    finally:
        sock.close()


def test_a_caller_that_never_says_hello_is_dropped(monkeypatch):
    monkeypatch.setattr(distributed, "HELLO_SECONDS", 0.5, raising=False)
    port = free_port()
    _coordinator(port, 2, 10)
    sock = _connect(port)
    try:
        assert _closed_by_peer(sock, 5), "a silent connection was held past HELLO_SECONDS"
    finally:
        sock.close()


def test_a_hello_the_checker_refuses_does_not_take_the_rank():
    port = free_port()
    valid = {"good-token"}

    def check(hello: dict, rank: int) -> str | None:
        return None if hello.get("token") in valid else "token not valid"

    thread, result = _coordinator(port, 2, 15, check)
    outsider = _connect(port)
    outsider.sendall(json.dumps({"job": "job", "attempt": 0, "num_processes": 2,
                                 "process_id": 1, "token": "forged"}).encode() + b"\n")
    outsider.settimeout(5)
    assert outsider.recv(4096).startswith(b"rejected: token not valid")
    outsider.close()
    distributed._join_rendezvous("127.0.0.1", port, {"job": "job", "attempt": 0,
                                                     "num_processes": 2, "process_id": 1,
                                                     "token": "good-token"},
                                 time.monotonic() + 10)
    thread.join(10)
    assert result == ["ok"]


def test_without_a_token_or_the_opt_out_the_rendezvous_refuses_to_start():
    with pytest.raises(peerauth.PeerAuthError, match="TARDIGRADE_RENDEZVOUS_INSECURE=true"):
        distributed.rendezvous(_env(1, 2, free_port()), 1)


def test_the_opt_out_round_trips_through_the_environment():
    env = _env(1, 2, 1, rendezvous_insecure=True, rendezvous_token_file="/t/token")
    assert contract.TrainerEnvironment.from_env(env.to_env()) == env
    assert contract.ENV_RENDEZVOUS_INSECURE not in _env(1, 2, 1).to_env()


@pytest.mark.parametrize(("status", "says"), [
    ({"authenticated": False, "error": "expired"}, "token not valid (expired)"),
    ({"authenticated": True, "audiences": ["https://kubernetes.default.svc"],
      "user": {"username": "system:serviceaccount:ns:default"}}, "not issued for audience"),
    ({"authenticated": True, "audiences": [contract.RENDEZVOUS_AUDIENCE],
      "user": {"username": "system:serviceaccount:other:default",
               "extra": {peerauth.POD_NAME_EXTRA: ["job-a0-1"]}}}, "not of a ServiceAccount"),
    ({"authenticated": True, "audiences": [contract.RENDEZVOUS_AUDIENCE],
      "user": {"username": "system:serviceaccount:ns:default",
               "extra": {peerauth.POD_NAME_EXTRA: ["job-a0-2"]}}}, "not to the pod of rank 1"),
    ({"authenticated": True, "audiences": [contract.RENDEZVOUS_AUDIENCE],
      "user": {"username": "system:serviceaccount:ns:default",
               "extra": {peerauth.POD_NAME_EXTRA: ["jobx-a0-1"]}}}, "not to the pod of rank 1"),
    ({"authenticated": True, "audiences": [contract.RENDEZVOUS_AUDIENCE],
      "user": {"username": "system:serviceaccount:ns:default"}}, "bound to pod None"),
])
def test_review_verdicts_that_refuse_a_rank(status, says):
    assert says in (peerauth.rejection(status, "ns", "job", 1) or "")


def test_a_kept_pod_of_an_older_attempt_may_hold_its_rank():
    status = {"authenticated": True, "audiences": [contract.RENDEZVOUS_AUDIENCE],
              "user": {"username": "system:serviceaccount:ns:trainer",
                       "extra": {peerauth.POD_NAME_EXTRA: ["job-a3-1"]}}}
    assert peerauth.rejection(status, "ns", "job", 1) is None


def test_progress_server_bounds_threads_and_times_out_idle_callers(monkeypatch):
    from tardigrade_sdk import metrics as metrics_module

    monkeypatch.setattr(metrics_module, "REQUEST_TIMEOUT_SECONDS", 0.5, raising=False)
    metrics = Metrics()
    metrics.report(step=3)
    server = ProgressServer(metrics, 0, host="127.0.0.1").start()
    idle: list[socket.socket] = []
    try:
        # Callers that connect and never send a request (slowloris).
        idle = [socket.create_connection(("127.0.0.1", server.port), timeout=5)
                for _ in range(32)]
        closed = [s for s in idle if _closed_by_peer(s, 3)]
        assert len(closed) == len(idle), f"{len(idle) - len(closed)} idle callers still held"
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/progress",
                                    timeout=5) as response:
            assert json.loads(response.read())["step"] == 3
    finally:
        for sock in idle:
            sock.close()
        server.stop()
