"""Rank 0's progress endpoint: `/progress` (ProgressReport JSON) and `/metrics` (Prometheus)."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import http.server
import socket
import sys
import threading
from collections.abc import Callable, Mapping

import prometheus_client
from tardigrade_contract.contract import MAX_WORLD_BYTES, RESTART_IN_PLACE_PATH, ProgressReport

from tardigrade_sdk import bearer

# The endpoint answers a poll a few times a second (operator, scraper): a handful of requests
# at once is plenty. One caller's address gets a few of them, so that whoever can reach the
# port (a peer that holds connections open, slowly) cannot take the operator's.
MAX_CONCURRENT_REQUESTS = 16
MAX_REQUESTS_PER_CLIENT = 4
# Each connection's whole exchange (request line, headers, body, answer) ends by then, however
# it trickles: one request per connection (HTTP/1.0), so one deadline per connection.
REQUEST_TIMEOUT_SECONDS = 5.0
# How often the server looks for a stop request while idle: the most a stop waits.
STOP_POLL_SECONDS = 0.02


class Metrics:
    def __init__(self) -> None:
        self.registry = prometheus_client.CollectorRegistry()
        r = self.registry
        self.step = prometheus_client.Gauge("tardigrade_train_step", "Last completed step",
                                            registry=r)
        self.loss = prometheus_client.Gauge("tardigrade_train_loss", "Loss of the last step",
                                            registry=r)
        # A counter, not a rate gauge: Prometheus derives any rate window from it, and a gauge
        # sampled between log steps misses the steps in between.
        self.tokens = prometheus_client.Counter(
            "tardigrade_train_tokens", "Tokens trained by the whole gang (global batch x "
            "sequence length per step) in this attempt", registry=r)
        self.checkpoint_step = prometheus_client.Gauge(
            "tardigrade_checkpoint_committed_step", "Newest committed checkpoint step", registry=r)
        self.checkpoint_blocked = prometheus_client.Histogram(
            "tardigrade_checkpoint_blocked_seconds",
            "Training-loop time blocked per checkpoint save (device-to-host copy)", registry=r)
        self.checkpoint_seconds = prometheus_client.Histogram(
            "tardigrade_checkpoint_save_seconds", "Background write+commit time per checkpoint",
            registry=r)
        self.checkpoint_failures = prometheus_client.Counter(
            "tardigrade_checkpoint_failures", "Checkpoint saves that failed (not committed)",
            registry=r)
        self._lock = threading.Lock()
        self._report = ProgressReport(step=0)
        # Fields measured when the report is served (phase_clock.PhaseClock.seconds).
        self.live: Callable[[], Mapping[str, float]] | None = None

    def report(self, **changes: object) -> ProgressReport:
        with self._lock:
            fields = {**self._report.__dict__, **changes}
            self._report = ProgressReport(**fields)  # type: ignore[arg-type]
            return self._report

    def current(self) -> ProgressReport:
        with self._lock:
            report = self._report
        live = self.live
        return report if live is None else dataclasses.replace(report, **live())


class _Deadline:
    """Shuts a connection's socket when its time is up, whatever its thread is waiting on: the
    socket's own timeout restarts with every byte, so a caller sending one byte a second would
    hold its slot for ever."""

    def __init__(self, connection: socket.socket, seconds: float) -> None:
        self._connection = connection
        self._lock = threading.Lock()
        self._ended = False
        self._timer = threading.Timer(seconds, self._cut)
        self._timer.daemon = True
        self._timer.start()

    def _cut(self) -> None:
        with self._lock:  # never after end(): the socket's number may belong to another by then
            if not self._ended:
                with contextlib.suppress(OSError):  # the caller closed it first
                    self._connection.shutdown(socket.SHUT_RDWR)

    def end(self) -> None:
        with self._lock:
            self._ended = True
        self._timer.cancel()


class _GuardedServer(http.server.HTTPServer):
    """A thread per connection, at most MAX_CONCURRENT_REQUESTS of them and
    MAX_REQUESTS_PER_CLIENT for one caller's address; a caller beyond either is disconnected at
    once instead of holding a thread (and memory) of the trainer. Each connection ends at its
    deadline (_Deadline)."""

    def __init__(self, address: tuple[str, int], handler: type, deadline_seconds: float
                 ) -> None:
        super().__init__(address, handler)
        self._deadline_seconds = deadline_seconds
        self._lock = threading.Lock()
        self._held: collections.Counter[str] = collections.Counter()

    def process_request(self, request: object, client_address: object) -> None:
        caller = str(client_address[0])  # type: ignore[index]
        if not self._take(caller):
            self.shutdown_request(request)  # type: ignore[arg-type]
            return
        deadline = _Deadline(request, self._deadline_seconds)  # type: ignore[arg-type]
        try:
            threading.Thread(target=self._serve, args=(request, client_address, caller,
                                                       deadline),
                             daemon=True, name="progress-request").start()
        except BaseException:
            self._done(request, caller, deadline)
            raise

    def _take(self, caller: str) -> bool:
        with self._lock:
            if (sum(self._held.values()) >= MAX_CONCURRENT_REQUESTS
                    or self._held[caller] >= MAX_REQUESTS_PER_CLIENT):
                return False
            self._held[caller] += 1
            return True

    def _serve(self, request: object, client_address: object, caller: str,
               deadline: _Deadline) -> None:
        try:
            self.finish_request(request, client_address)  # type: ignore[arg-type]
        except Exception:
            self.handle_error(request, client_address)  # type: ignore[arg-type]
        finally:
            self._done(request, caller, deadline)

    def _done(self, request: object, caller: str, deadline: _Deadline) -> None:
        deadline.end()
        self.shutdown_request(request)  # type: ignore[arg-type]
        with self._lock:
            self._held[caller] -= 1
            if not self._held[caller]:
                del self._held[caller]

    def handle_error(self, request: object, client_address: object) -> None:
        # A caller that hung up, or was cut off at its deadline, is routine; anything else is
        # a bug of ours, worth its traceback.
        if not isinstance(sys.exc_info()[1], OSError):
            super().handle_error(request, client_address)  # type: ignore[arg-type]


class ProgressServer:
    """A tiny threaded HTTP server; one per job on rank 0 (and on every rank with restart in
    place, for its POST)."""

    def __init__(self, metrics: Metrics, port: int, host: str = "",
                 on_restart: Callable[[str | None, str, bytes], tuple[int, str]] | None = None,
                 progress_token: str | None = None,
                 after_restart: Callable[[], None] | None = None,
                 ready: bool = True) -> None:
        """`on_restart(authorization header, query, body)`: the HTTP status and why for a POST
        to RESTART_IN_PLACE_PATH (inplace.RestartRequests.answer); without it the path is
        unknown. `progress_token` (contract.ENV_PROGRESS_TOKEN): GET /progress then answers
        only a caller that sends it as a bearer token; without it (a trainer run outside the
        operator) /progress is open. `after_restart()`: called once a POST's answer is sent
        (a rank that leaves at once must not leave its caller without one). `ready=False`: a
        server started before the gang met takes restart requests only, and answers GET with
        503 until `serve_progress()` (rank 0's report must mean that every rank met)."""
        metrics_ref = metrics
        self.progress_ready = threading.Event()
        if ready:
            self.progress_ready.set()
        progress_ready = self.progress_ready
        deadline_seconds = REQUEST_TIMEOUT_SECONDS

        class Handler(http.server.BaseHTTPRequestHandler):
            # Per read; the whole exchange's deadline is _Deadline's.
            timeout = deadline_seconds

            def do_GET(self) -> None:
                path = self.path.split("?")[0]
                if not progress_ready.is_set() and path in ("/progress", "/metrics"):
                    self._answer(503, b"starting: the gang has not met yet\n",
                                 "text/plain; charset=utf-8")
                    return
                if path == "/progress":
                    # The report names the checkpoint's path: the job's own business.
                    if progress_token and not bearer.matches(self.headers.get("Authorization"),
                                                             progress_token):
                        self._answer(401, b"the job's progress token is required\n",
                                     "text/plain; charset=utf-8",
                                     {"WWW-Authenticate": "Bearer"})
                        return
                    body = metrics_ref.current().to_json().encode()
                    ctype = "application/json"
                elif path == "/metrics":
                    # Open to the scraper the job's NetworkPolicy lets in: metrics are numbers
                    # (step, loss, tokens, save times) and carry no checkpoint path.
                    body = prometheus_client.generate_latest(metrics_ref.registry)
                    ctype = prometheus_client.CONTENT_TYPE_LATEST
                else:
                    self.send_error(404)
                    return
                self._answer(200, body, ctype)

            def do_POST(self) -> None:
                if on_restart is None or self.path.split("?")[0] != RESTART_IN_PLACE_PATH:
                    self.send_error(404)
                    return
                length = self.headers.get("Content-Length") or "0"
                if not length.isdigit() or int(length) > MAX_WORLD_BYTES:
                    # Refused unread: a body is a world of a few hundred bytes.
                    self.close_connection = True
                    code, why = 413, f"Content-Length: at most {MAX_WORLD_BYTES} bytes"
                else:
                    body = self.rfile.read(int(length))
                    if len(body) < int(length):
                        return  # cut off at its deadline, or the caller hung up: no request
                    code, why = on_restart(self.headers.get("Authorization"),
                                           self.path.partition("?")[2], body)
                self._answer(code, why.encode(), "text/plain; charset=utf-8")
                if after_restart is not None:
                    self.wfile.flush()
                    after_restart()

            def _answer(self, code: int, body: bytes, ctype: str,
                        headers: dict[str, str] | None = None) -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                for name, value in (headers or {}).items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                pass  # the operator polls often; access logs would drown the JSON log

        self._server = _GuardedServer((host, port), Handler, deadline_seconds)
        # A rank that leaves stops this server on its way out (a save on notice, a restart in
        # process): serve_forever's default poll of 0.5 s kept it waiting that long.
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        args=(STOP_POLL_SECONDS,), daemon=True,
                                        name="progress-server")

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def start(self) -> ProgressServer:
        self._thread.start()
        return self

    def serve_progress(self) -> None:
        self.progress_ready.set()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
