"""The trainer's progress server against callers that misbehave (metrics.py): slow callers
cannot hold it, and /progress answers only whoever holds the job's progress token."""

from __future__ import annotations

import contextlib
import http.client
import json
import select
import socket
import threading
import time
from collections.abc import Iterator

import pytest
from tardigrade_contract import contract
from tardigrade_sdk import metrics as metrics_module
from tardigrade_sdk.metrics import (
    MAX_CONCURRENT_REQUESTS,
    MAX_REQUESTS_PER_CLIENT,
    Metrics,
    ProgressServer,
)

from tests.polling import wait_for

TOKEN = "the-job-s-progress-token"
DEADLINE_SECONDS = 2.0
# The slow callers' test tells a refused caller from a held one by when it is closed: its
# refusals must be seen before any held caller's deadline, even while a loaded machine keeps
# this test's thread off the CPU for seconds (CI's 2 cores, beside an end-to-end module).
HELD_DEADLINE_SECONDS = 8.0
# How late a cut-off may be seen: the timer thread's wake-up, and this test's own polling.
SLACK_SECONDS = 1.0
# The operator's address in these tests; the slow callers come from 127.0.0.1.
OPERATOR = "127.0.0.2"


@contextlib.contextmanager
def _serving(monkeypatch: pytest.MonkeyPatch, deadline: float) -> Iterator[ProgressServer]:
    monkeypatch.setattr(metrics_module, "REQUEST_TIMEOUT_SECONDS", deadline)
    metrics = Metrics()
    metrics.report(step=9, checkpoint_step=8, checkpoint_path="gs://bucket/job/8")
    running = ProgressServer(metrics, 0, "127.0.0.1", progress_token=TOKEN).start()
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch) -> Iterator[ProgressServer]:
    with _serving(monkeypatch, DEADLINE_SECONDS) as running:
        yield running


def _get(server: ProgressServer, path: str, authorization: str | None = None,
         source: str = OPERATOR) -> tuple[int, bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5,
                                            source_address=(source, 0))
    try:
        connection.request("GET", path, headers={"Authorization": authorization}
                           if authorization is not None else {})
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


@pytest.mark.parametrize(("authorization", "status"), [
    (None, 401), ("Bearer not-the-token", 401), (f"Basic {TOKEN}", 401), (f"Bearer {TOKEN}x", 401),
    ("Bearer \u00e9", 401), (f"Bearer {TOKEN}", 200), (f"bearer  {TOKEN}", 200)])
def test_progress_answers_only_the_job_s_token(server: ProgressServer, authorization: str | None,
                                               status: int) -> None:
    got, body = _get(server, "/progress", authorization)
    assert got == status
    if status == 200:
        assert contract.ProgressReport.from_json(body.decode()).checkpoint_path == \
            "gs://bucket/job/8"
    else:
        assert b"gs://" not in body


def test_metrics_stay_open_to_the_scraper_and_name_no_checkpoint_path(
        server: ProgressServer) -> None:
    status, body = _get(server, "/metrics")
    assert status == 200
    assert b"tardigrade_train_step" in body and b"gs://" not in body


def test_without_a_token_configured_progress_is_open() -> None:
    metrics = Metrics()
    metrics.report(step=4)
    running = ProgressServer(metrics, 0, "127.0.0.1").start()
    try:
        status, body = _get(running, "/progress")
    finally:
        running.stop()
    assert status == 200 and json.loads(body)["step"] == 4


def _closed(sock: socket.socket) -> bool:
    """Whether the server has closed this connection (without waiting)."""
    readable, _, _ = select.select([sock], [], [], 0)
    if not readable:
        return False
    try:
        return sock.recv(1, socket.MSG_PEEK) == b""
    except ConnectionResetError:
        return True


def test_slow_callers_cannot_hold_the_server_and_are_cut_off_at_the_deadline(
        monkeypatch: pytest.MonkeyPatch) -> None:
    with _serving(monkeypatch, HELD_DEADLINE_SECONDS) as server:
        _slow_callers_are_refused_or_cut_off(server, HELD_DEADLINE_SECONDS)


def _slow_callers_are_refused_or_cut_off(server: ProgressServer, deadline: float) -> None:
    callers = MAX_CONCURRENT_REQUESTS + 4
    stop = threading.Event()
    slow: list[socket.socket] = []
    try:
        connected = time.monotonic()
        for _ in range(callers):
            sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
            sock.sendall(b"GET /prog")  # half a request line
            slow.append(sock)

        def trickle() -> None:
            # One more byte of the request line every 0.2 s: a timeout per read never fires.
            while not stop.wait(0.2):
                for sock in slow:
                    with contextlib.suppress(OSError):  # cut off
                        sock.send(b"r")

        threading.Thread(target=trickle, daemon=True).start()
        # One address holds no more than its share; the rest are turned away at once.
        refused = wait_for(lambda: closed if len(
            closed := [s for s in slow if _closed(s)]) >= callers - MAX_REQUESTS_PER_CLIENT
            else None, deadline / 2, "the callers beyond one address's share to be refused")
        assert len(refused) == callers - MAX_REQUESTS_PER_CLIENT
        held = [s for s in slow if s not in refused]
        # The operator's poll gets through while they hold their slots, without waiting for
        # them to be cut off.
        asked = time.monotonic()
        status, body = _get(server, "/progress", f"Bearer {TOKEN}")
        assert status == 200 and json.loads(body)["step"] == 9
        assert time.monotonic() - asked < deadline / 2
        assert not any(map(_closed, held)), "a held caller was cut off before its deadline"
        # Still trickling, each held caller is cut off at its whole-request deadline.
        wait_for(lambda: all(map(_closed, held)), deadline + SLACK_SECONDS,
                 "the held callers to be cut off")
        assert time.monotonic() - connected >= deadline - 0.05
    finally:
        stop.set()
        for sock in slow:
            sock.close()


def test_a_restart_request_whose_body_trickles_past_the_deadline_is_not_taken(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(metrics_module, "REQUEST_TIMEOUT_SECONDS", DEADLINE_SECONDS)
    taken: list[bytes] = []

    def on_restart(authorization: str | None, query: str, body: bytes) -> tuple[int, str]:
        taken.append(body)
        return 202, ""

    running = ProgressServer(Metrics(), 0, "127.0.0.1", on_restart=on_restart).start()
    sock = socket.create_connection(("127.0.0.1", running.port), timeout=5)
    try:
        connected = time.monotonic()
        sock.sendall(f"POST {contract.RESTART_IN_PLACE_PATH}?attempt=2 HTTP/1.1\r\n"
                     f"Authorization: Bearer k\r\nContent-Length: 100\r\n\r\n".encode())
        cut = False
        while not cut:
            try:
                sock.send(b"x")  # the body, a byte at a time: the cut-off is what ends this
            except OSError:
                cut = True
            cut = cut or _closed(sock) or time.monotonic() - connected > 10
            time.sleep(0.2)  # the caller's pace
        took = time.monotonic() - connected
    finally:
        sock.close()
        running.stop()
    assert DEADLINE_SECONDS - 0.05 <= took <= DEADLINE_SECONDS + SLACK_SECONDS
    assert taken == []
