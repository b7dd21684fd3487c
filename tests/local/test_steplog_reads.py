"""StepLog's reads through the API are bounded: a log read the API server never answers (its
node gone mid-read, silently) costs one `collect` a timeout, not the caller's life."""

from __future__ import annotations

import http.server
import json
import threading
import time
from collections.abc import Iterator

import kubernetes
import pytest
from tardigrade_local import steplog
from tardigrade_local.steplog import StepLog

POD = "job-a1-0"
LINE = json.dumps({"event": "step", "step": 1, "loss": 2.0}) + "\n"


class _ApiServer(http.server.ThreadingHTTPServer):
    """Lists rank 0's pod; its log read hangs until `answer` is set, then serves one step."""
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.answer = threading.Event()
        self.stop = threading.Event()


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _ApiServer

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        if self.path.startswith(f"/api/v1/namespaces/default/pods/{POD}/log"):
            while not self.server.answer.is_set():
                if self.server.stop.wait(0.1):
                    return
            body = LINE.encode()
            content_type = "text/plain"
        else:
            body = json.dumps({"kind": "PodList", "apiVersion": "v1", "metadata": {}, "items": [
                {"metadata": {"name": POD, "labels": {steplog.ATTEMPT_LABEL: "1"}},
                 "status": {}}]}).encode()
            content_type = "application/json"
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def server() -> Iterator[_ApiServer]:
    server = _ApiServer()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.stop.set()
        server.shutdown()
        server.server_close()


def test_a_log_read_never_answered_is_cut_off_and_made_again(server, monkeypatch):
    monkeypatch.setattr(steplog, "READ_TIMEOUT_SECONDS", 0.5)
    config = kubernetes.client.Configuration()
    config.host = f"http://127.0.0.1:{server.server_address[1]}"
    config.retries = False
    with kubernetes.client.ApiClient(config) as api:
        log = StepLog(kubernetes.client.CoreV1Api(api), "default", "job")
        started = time.monotonic()
        log.collect()
        assert time.monotonic() - started < 10
        assert log.last_step == 0
        server.answer.set()
        log.collect()
        assert log.last_step == 1
