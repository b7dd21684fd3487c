"""A fault-injecting HTTP proxy on loopback, in front of the GCS emulator.

Clients point at `proxy.url` (e.g. `client_env(proxy.url)`) instead of the emulator; every
request is forwarded unless a rule matches it. A rule answers an error status (503, 429, ...),
stalls the request, or loses the answer of a request the emulator applied, for the first
`count` matching requests or for a `fraction` of them (drawn from a seeded generator, so a run
is reproducible), and only in one phase: reads (GET, HEAD) or writes (POST, PUT, PATCH,
DELETE). Rules change while clients run: `proxy.set_rules(...)` between the phases of a test,
`proxy.clear()` to heal. `proxy.statuses` counts what the emulator answered to the requests
forwarded, lost answers included.
"""

from __future__ import annotations

import dataclasses
import hashlib
import http.client
import http.server
import json
import random
import threading
import urllib.parse
from collections import Counter
from types import TracebackType
from typing import Literal

Phase = Literal["read", "write", "any"]
_WRITE_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
# Headers that describe one hop, not the message: the proxy sets its own.
_HOP_BY_HOP = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length",
                         "proxy-connection", "te", "trailer", "upgrade"})


@dataclasses.dataclass(frozen=True)
class FaultRule:
    """What to do to the requests of one phase.

    `count` (the first N matches) or `fraction` (each match with this probability) picks the
    victims; with neither, every match is one. A "stall" with `stall_seconds` is a slow
    server: the request is held that long, then forwarded. Without, it is a black hole: held
    until the rules change or the proxy stops, then dropped unanswered and never forwarded
    (a write the client gave up on must not land later).

    A "lose" is an answer lost on its way back (a reset connection, a load balancer's 5xx
    after the backend committed): the request is forwarded and applied, then the client gets
    `status` instead of the emulator's answer, or with `status=0` a connection closed without
    any answer. Clients retry both, so a conditional write comes back to a changed object.
    """

    phase: Phase
    action: Literal["error", "stall", "lose"] = "error"
    status: int = 503
    count: int | None = None
    fraction: float | None = None
    stall_seconds: float | None = None
    path_contains: str = ""  # only requests whose decoded path+query contains this
    # Hit each distinct request (method, target, body) once: a client's retry of it, which
    # repeats all three, goes through, so every write of a key meets the fault once.
    once_per_request: bool = False

    def matches(self, method: str, target: str) -> bool:
        phase = "write" if method in _WRITE_METHODS else "read"
        return self.phase in ("any", phase) and self.path_contains in target


class FaultProxy:
    """`with FaultProxy(emulator.url, seed=1) as proxy: proxy.set_rules([FaultRule("write")])`."""

    def __init__(self, upstream: str, *, seed: int = 0, host: str = "127.0.0.1") -> None:
        parsed = urllib.parse.urlsplit(upstream)
        if parsed.scheme != "http" or not parsed.hostname or not parsed.port:
            raise ValueError(f"upstream must be http://host:port, got {upstream!r}")
        self._upstream = (parsed.hostname, parsed.port)
        self._random = random.Random(seed)
        self._lock = threading.Lock()
        self._rules: list[FaultRule] = []
        self._used: Counter[int] = Counter()  # rule index -> victims so far
        self._hit: set[tuple[int, str, str, str]] = set()  # (rule index, request) hit so far
        self._heal = threading.Event()  # set: stalled requests go on
        self.requests: Counter[str] = Counter()  # "read"/"write" -> requests seen
        self.injected: Counter[str] = Counter()  # "error 503"/"stall" -> faults injected
        self.statuses: Counter[int] = Counter()  # the emulator's answers to forwarded requests
        self._server = http.server.ThreadingHTTPServer((host, 0), self._handler_class())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True,
                                        name="gcs-fault-proxy")

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def set_rules(self, rules: list[FaultRule]) -> None:
        """Replace the rules (victim counts start again); requests stalled so far go on."""
        with self._lock:
            self._heal.set()
            self._heal = threading.Event()
            self._rules = list(rules)
            self._used = Counter()
            self._hit = set()

    def clear(self) -> None:
        self.set_rules([])

    def _decide(self, method: str, target: str, body: bytes
                ) -> tuple[FaultRule | None, threading.Event]:
        request = (method, target, hashlib.sha256(body).hexdigest())
        with self._lock:
            self.requests["write" if method in _WRITE_METHODS else "read"] += 1
            for index, rule in enumerate(self._rules):
                if not rule.matches(method, target):
                    continue
                if rule.count is not None and self._used[index] >= rule.count:
                    continue
                if rule.once_per_request and (index, *request) in self._hit:
                    continue
                if rule.fraction is not None and self._random.random() >= rule.fraction:
                    continue
                self._used[index] += 1
                if rule.once_per_request:
                    self._hit.add((index, *request))
                self.injected[_label(rule)] += 1
                return rule, self._heal
            return None, self._heal

    def _forward(self, method: str, target: str, headers: dict[str, str],
                 body: bytes) -> tuple[int, list[tuple[str, str]], bytes]:
        conn = http.client.HTTPConnection(*self._upstream, timeout=120)
        try:
            conn.request(method, target, body=body or None, headers=headers)
            response = conn.getresponse()
            payload = response.read()
            kept = [(k, v) for k, v in response.getheaders() if k.lower() not in _HOP_BY_HOP]
            with self._lock:
                self.statuses[response.status] += 1
            return response.status, kept, payload
        finally:
            conn.close()

    def _handler_class(self) -> type[http.server.BaseHTTPRequestHandler]:
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _body(self) -> bytes:
                if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
                    parts = []
                    while True:
                        size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                        if size == 0:
                            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                                pass  # trailers
                            return b"".join(parts)
                        parts.append(self.rfile.read(size))
                        self.rfile.readline()
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _reply(self, status: int, headers: list[tuple[str, str]], body: bytes) -> None:
                self.send_response(status)
                for key, value in headers:
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def _handle(self) -> None:
                body = self._body()
                target = urllib.parse.unquote(self.path)
                rule, heal = proxy._decide(self.command, target, body)
                if rule is not None and rule.action == "stall":
                    heal.wait(rule.stall_seconds)
                    if rule.stall_seconds is None:
                        self.close_connection = True
                        return
                elif rule is not None and rule.action == "error":
                    self._error(rule.status)
                    return
                headers = {k: v for k, v in self.headers.items()
                           if k.lower() not in _HOP_BY_HOP and k.lower() != "host"}
                try:
                    status, kept, payload = proxy._forward(self.command, self.path, headers, body)
                except OSError as err:
                    self._reply(502, [("Content-Type", "text/plain")], str(err).encode())
                    return
                if rule is not None and rule.action == "lose":
                    if rule.status:
                        self._error(rule.status)
                    else:
                        self.close_connection = True  # closed without a status line
                    return
                self._reply(status, kept, payload)

            def _error(self, status: int) -> None:
                error = {"error": {"code": status, "message": "injected fault"}}
                self._reply(status, [("Content-Type", "application/json")],
                            json.dumps(error).encode())

            def handle_one_request(self) -> None:
                try:
                    super().handle_one_request()
                except (BrokenPipeError, ConnectionResetError):
                    self.close_connection = True  # the client gave up (e.g. its timeout)

            do_GET = do_HEAD = do_POST = do_PUT = do_PATCH = do_DELETE = _handle

            def log_message(self, format: str, *args: object) -> None:
                pass

        return Handler

    def start(self) -> FaultProxy:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._heal.set()
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


def _label(rule: FaultRule) -> str:
    if rule.action == "stall":
        return "stall"
    if rule.action == "lose":
        return f"lost answer ({rule.status or 'connection closed'})"
    return f"error {rule.status}"
