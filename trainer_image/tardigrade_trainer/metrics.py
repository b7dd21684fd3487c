"""Rank 0's progress endpoint: `/progress` (ProgressReport JSON) and `/metrics` (Prometheus)."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Callable

import prometheus_client

from tardigrade_trainer.contract import MAX_WORLD_BYTES, RESTART_IN_PLACE_PATH, ProgressReport

# The endpoint answers a poll a few times a second (operator, scraper): a handful of requests
# at once is plenty, and each connection gets a few seconds to send its request.
MAX_CONCURRENT_REQUESTS = 8
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

    def report(self, **changes: object) -> ProgressReport:
        with self._lock:
            fields = {**self._report.__dict__, **changes}
            self._report = ProgressReport(**fields)  # type: ignore[arg-type]
            return self._report

    def current(self) -> ProgressReport:
        with self._lock:
            return self._report


class _BoundedThreadingServer(http.server.ThreadingHTTPServer):
    """A thread per request, but never more than MAX_CONCURRENT_REQUESTS: callers beyond that
    are disconnected at once instead of each holding a thread (and memory) of the trainer."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type) -> None:
        super().__init__(address, handler)
        self._slots = threading.BoundedSemaphore(MAX_CONCURRENT_REQUESTS)

    def process_request(self, request: object, client_address: object) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)  # type: ignore[arg-type]
            return
        try:
            super().process_request(request, client_address)  # type: ignore[arg-type]
        except Exception:
            self._slots.release()
            raise

    def process_request_thread(self, request: object, client_address: object) -> None:
        try:
            super().process_request_thread(request, client_address)  # type: ignore[arg-type]
        finally:
            self._slots.release()


class ProgressServer:
    """A tiny threaded HTTP server; one per job on rank 0."""

    def __init__(self, metrics: Metrics, port: int, host: str = "",
                 on_restart: Callable[[str | None, str, bytes], tuple[int, str]] | None = None
                 ) -> None:
        """`on_restart(authorization header, query, body)`: the HTTP status and why for a POST
        to RESTART_IN_PLACE_PATH (inplace.RestartRequests.answer); without it the path is
        unknown."""
        metrics_ref = metrics

        class Handler(http.server.BaseHTTPRequestHandler):
            # Socket timeout for the whole exchange: a caller that never finishes its request
            # (or never reads the answer) frees its slot after this.
            timeout = REQUEST_TIMEOUT_SECONDS

            def do_GET(self) -> None:
                if self.path.split("?")[0] == "/progress":
                    body = metrics_ref.current().to_json().encode()
                    ctype = "application/json"
                elif self.path.split("?")[0] == "/metrics":
                    body = prometheus_client.generate_latest(metrics_ref.registry)
                    ctype = prometheus_client.CONTENT_TYPE_LATEST
                else:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

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
                    code, why = on_restart(self.headers.get("Authorization"),
                                           self.path.partition("?")[2],
                                           self.rfile.read(int(length)))
                answer = why.encode()
                self.send_response(code)
                self.send_header("Content-Type", "text/plain; charset=utf-8")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, format: str, *args: object) -> None:
                pass  # the operator polls often; access logs would drown the JSON log

        self._server = _BoundedThreadingServer((host, port), Handler)
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

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
