"""Rank 0 reviews the ranks' hellos concurrently, over kept connections to the API server
(distributed._Reviews, peerauth.KeptConnections): a gang of 1,024 ranks asks 1,023 reviews at
every start, which one after the other held the rendezvous for as many round trips."""

from __future__ import annotations

import http.server
import json
import resource
import threading
import time
from collections.abc import Iterator

import pytest
from tardigrade_contract import contract
from tardigrade_sdk import distributed, peerauth
from trainer_harness import free_port

from tests.rendezvous import coordinator_in_thread


def _hello(rank: int, n: int, token: str) -> dict:
    return {"job": "job", "attempt": 0, "num_processes": n, "process_id": rank,
            "token": token}


def _join(port: int, rank: int, n: int, token: str, answers: dict[int, object],
          seconds: float = 20) -> None:
    try:
        distributed._join_rendezvous("127.0.0.1", port, _hello(rank, n, token),
                                     time.monotonic() + seconds)
        answers[rank] = "go"
    except Exception as err:
        answers[rank] = err


def test_hellos_are_reviewed_at_the_same_time():
    # Each review waits until four are under way: one after the other, the first would wait
    # forever (here: until the barrier's timeout breaks it and the rendezvous fails).
    meeting = threading.Barrier(4, timeout=10)

    def check(hello: dict, rank: int) -> str | None:
        meeting.wait()
        return None

    port = free_port()
    thread, result = coordinator_in_thread(port, 5, 20, check=check)
    answers: dict[int, object] = {}
    joiners = [threading.Thread(target=_join, args=(port, rank, 5, "t", answers))
               for rank in range(1, 5)]
    for joiner in joiners:
        joiner.start()
    for joiner in [*joiners, thread]:
        joiner.join(30)
    assert result == ["ok"] and answers == {1: "go", 2: "go", 3: "go", 4: "go"}


def test_a_hostile_hello_under_review_does_not_keep_the_rank_from_its_pod():
    # The forged hello for rank 1 comes first and its review is slow; the genuine one passes
    # meanwhile and takes the rank; the forged one is then refused.
    forged_in, genuine_in = threading.Event(), threading.Event()

    def check(hello: dict, rank: int) -> str | None:
        if hello["token"] == "forged":
            forged_in.set()
            genuine_in.wait(10)
            return "token not valid"
        if rank == 1:
            genuine_in.set()
        return None

    port = free_port()
    thread, result = coordinator_in_thread(port, 3, 20, check=check)
    forged: dict[int, object] = {}
    answers: dict[int, object] = {}
    forger = threading.Thread(target=_join, args=(port, 1, 3, "forged", forged, 3))
    forger.start()
    assert forged_in.wait(10)  # under review before the genuine hello comes
    ranks = [threading.Thread(target=_join, args=(port, rank, 3, "good", answers))
             for rank in (1, 2)]
    for joiner in ranks:
        joiner.start()
    for joiner in [forger, *ranks, thread]:
        joiner.join(20)
    assert result == ["ok"] and answers == {1: "go", 2: "go"}
    # Refused, or cut off unanswered when the gang met before its verdict was taken.
    assert isinstance(forged[1], distributed.PeerTimeoutError)


class _ApiServer(http.server.ThreadingHTTPServer):
    """Answers TokenReviews as a valid token of `job-a0-<rank>`, counting connections."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.connections: list[int] = []


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive

    def setup(self) -> None:
        super().setup()
        self.server.connections.append(self.client_address[1])  # type: ignore[attr-defined]

    def do_POST(self) -> None:
        length = int(self.headers["Content-Length"])
        self.rfile.read(length)
        body = json.dumps({"status": {
            "authenticated": True, "audiences": [contract.RENDEZVOUS_AUDIENCE],
            "user": {"username": "system:serviceaccount:ns:trainer",
                     "extra": {peerauth.POD_NAME_EXTRA: ["job-a0-1"]}}}}).encode()
        self.send_response(201)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_: object) -> None:
        pass


@pytest.fixture
def api_server() -> Iterator[_ApiServer]:
    server = _ApiServer()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def test_reviews_from_one_thread_share_one_connection_and_survive_its_close(api_server):
    access = peerauth.ApiAccess(f"http://127.0.0.1:{api_server.server_address[1]}", "rank-0")
    reviewer = peerauth.TokenReviewer("ns", "job", access)
    for _ in range(5):
        assert reviewer.check({"token": "t"}, 1) is None
    assert len(api_server.connections) == 1
    # The API server closed the kept connection meanwhile (idle timeout, restart): the next
    # review opens another instead of refusing a genuine rank.
    reviewer._connections._local.connection.sock.close()
    assert reviewer.check({"token": "t"}, 1) is None
    assert len(api_server.connections) == 2


def test_rank_0_meets_a_gang_of_more_ranks_than_select_can_watch():
    # select(2) cannot watch a descriptor numbered 1,024 or more: rank 0 of a 1,024-rank gang
    # failed with "filedescriptor out of range in select()". Both ends of every connection
    # are in this process, hence the descriptor limit.
    n = 1100
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 3 * n:
        pytest.skip(f"this machine allows {hard} open files, under the {3 * n} needed")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 3 * n), hard))
    try:
        port = free_port()
        thread, result = coordinator_in_thread(port, n, 120, check=lambda hello, rank: None)
        answers: dict[int, object] = {}
        joiners = [threading.Thread(target=_join, args=(port, rank, n, "t", answers, 120))
                   for rank in range(1, n)]
        for joiner in joiners:
            joiner.start()
        for joiner in [*joiners, thread]:
            joiner.join(180)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert result == ["ok"]
    assert sum(answer == "go" for answer in answers.values()) == n - 1


ACCESS = peerauth.ApiAccess("https://api.invalid", "rank-0-token", None)
VERDICT = json.dumps({"status": {"authenticated": True, "audiences": ["a"]}}).encode()


class _Answers:
    """The API server's answers to successive reviews: an exception raised or (code, body)."""

    def __init__(self, *answers: object) -> None:
        self.answers = list(answers)
        self.asked = 0

    def post(self, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
        answer = self.answers[min(self.asked, len(self.answers) - 1)]
        self.asked += 1
        if isinstance(answer, BaseException):
            raise answer
        return answer  # type: ignore[return-value]


@pytest.fixture
def no_retry_pause(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(peerauth, "REVIEW_RETRY_SECONDS", 0.0)


@pytest.mark.parametrize("failure", [TimeoutError("timed out"), (429, b"{}"), (503, b"{}"),
                                     ConnectionResetError("reset")])
def test_a_review_the_api_server_did_not_answer_is_asked_again(failure, no_retry_pause):
    server = _Answers(failure, failure, (201, VERDICT))
    status = peerauth.review(ACCESS, "t", post=server.post)
    assert status == {"authenticated": True, "audiences": ["a"]}
    assert server.asked == 3


def test_a_review_never_answered_refuses_the_hello_saying_how_often_it_was_asked(
        no_retry_pause):
    server = _Answers(TimeoutError("timed out"))
    status = peerauth.review(ACCESS, "t", post=server.post, attempts=4)
    assert server.asked == 4
    assert status["authenticated"] is False
    assert status["error"] == "TokenReview failed: timed out (4 attempts)"


@pytest.mark.parametrize("code", [400, 404, 422])
def test_a_review_answered_with_a_client_error_is_not_asked_again(code, no_retry_pause):
    server = _Answers((code, b"{}"), (201, VERDICT))
    status = peerauth.review(ACCESS, "t", post=server.post)
    assert server.asked == 1
    assert status == {"authenticated": False, "error": f"TokenReview failed: HTTP {code}"}
