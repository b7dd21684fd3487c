"""The memory tier's peer transport: each rank serves its memory directory to the gang.

    PUT /memory/<owner>/<step>   a peer's snapshot to keep (a replica)
    GET /memory/<owner>/<step>   a snapshot this rank holds, for a peer that restores it
    GET /memory/<owner>/<step>/manifest   its manifest alone (a resharding restore reads
                                 every owner's, then the data of those it needs)

Both need `Authorization: Bearer <token>`, a token derived from the job's replica key
(memory_tier.derived_keys; bearer.py compares in constant time). The body is a frame: 8 bytes
big-endian, the sealed manifest's length; the sealed manifest; the data. Nothing in a frame is
trusted on the sender's word: the holder keeps an upload only if its manifest's seal
(HMAC-SHA256 under another key derived from the replica key) checks out and the data has the
length the manifest says, and the restoring rank checks the seal and every piece's digest
(SHA-256) before it uses a download (tardigrade_checkpoint.memory_tier). Standard library
only, like the rest of the SDK's servers.
"""

from __future__ import annotations

import contextlib
import http.client
import http.server
import os
import re
import socket
import threading
from typing import Any

from tardigrade_checkpoint import memory_tier

from tardigrade_sdk import bearer

_PATH = re.compile(r"^/memory/(\d{1,9})/(\d{1,12})(/manifest)?$")
LENGTH_BYTES = 8
# A refused request's body is read (and dropped) up to this size before the answer.
DRAIN_BYTES = 1 << 20
# A sealed manifest lists every piece: ~200 bytes each.
MAX_MANIFEST_BYTES = 64 << 20
DEFAULT_TIMEOUT_SECONDS = 120.0


# The memory tier's threads run at the lowest CPU priority: their work (digests, copies into
# the memory volume, a peer's upload) can wait for idle cores, the training step's threads
# cannot (on a 2-core CPU host, at the default priority, the tier halved the loop's steps per
# second: docs/memory-tier.md).
BACKGROUND_NICENESS = 19


def lower_priority() -> None:
    """Make the calling thread yield the CPU to the loop's threads (Linux: a thread's own nice
    value); elsewhere nothing."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICENESS)


def frame(sealed: bytes, data: bytes | memoryview) -> list[bytes | memoryview]:
    return [len(sealed).to_bytes(LENGTH_BYTES, "big"), sealed, data]


def unframe(body: bytes) -> tuple[bytes, memoryview]:
    if len(body) < LENGTH_BYTES:
        raise memory_tier.MemoryTierError("frame shorter than its header")
    size = int.from_bytes(body[:LENGTH_BYTES], "big")
    if size > MAX_MANIFEST_BYTES or LENGTH_BYTES + size > len(body):
        raise memory_tier.MemoryTierError(f"frame names a manifest of {size} bytes")
    view = memoryview(body)
    return bytes(view[LENGTH_BYTES:LENGTH_BYTES + size]), view[LENGTH_BYTES + size:]


class ReplicaServer:
    """A threaded HTTP server over one rank's MemoryStore."""

    def __init__(self, store: memory_tier.MemoryStore, token: str, host: str, port: int,
                 max_body_bytes: int) -> None:
        self.store = store
        self.token = token
        self.max_body_bytes = max_body_bytes
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass  # the trainer's JSON log says what matters

            def _answer(self, code: int, body: bytes = b"",
                        content_type: str = "text/plain") -> None:
                self.send_response(code)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _target(self) -> tuple[int, int, bool] | None:
                if not bearer.matches(self.headers.get("Authorization"), server.token):
                    self._refuse_unread(401, b"the job's replica token is required")
                    return None
                match = _PATH.match(self.path)
                if match is None:
                    self._refuse_unread(404, b"")
                    return None
                return int(match.group(1)), int(match.group(2)), bool(match.group(3))

            def _refuse_unread(self, code: int, why: bytes) -> None:
                """Answer before the body is read: a small body is read and dropped first, so
                that the sender, still sending it, gets the answer rather than a reset
                connection; a larger one is left unread and the connection closed."""
                try:
                    length = int(self.headers.get("Content-Length") or 0)
                except ValueError:
                    length = -1
                if 0 < length <= DRAIN_BYTES:
                    self.rfile.read(length)
                elif length:
                    self.close_connection = True
                self._answer(code, why)

            def do_GET(self) -> None:
                lower_priority()
                target = self._target()
                if target is None:
                    return
                owner, step, manifest_only = target
                try:
                    if manifest_only:
                        sealed, data = server.store.read_manifest(owner, step), b""
                    else:
                        sealed, data = server.store.read(owner, step)
                except memory_tier.MemoryTierError as err:
                    self._answer(404, str(err).encode())
                    return
                parts = frame(sealed, data)
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(sum(len(p) for p in parts)))
                self.end_headers()
                for part in parts:
                    self.wfile.write(part)

            def do_PUT(self) -> None:
                lower_priority()  # a thread of its own per request (ThreadingHTTPServer)
                target = self._target()
                if target is None:
                    return
                if target[2]:
                    self._refuse_unread(405, b"a manifest is uploaded with its snapshot")
                    return
                try:
                    length = int(self.headers.get("Content-Length") or "")
                except ValueError:
                    self._answer(411)
                    return
                if not 0 <= length <= server.max_body_bytes:
                    self._refuse_unread(413, f"a replica of at most {server.max_body_bytes} bytes "
                                      "fits this rank's memory tier".encode())
                    return
                body = self.rfile.read(length)
                try:
                    sealed, data = unframe(body)
                    manifest = memory_tier.unseal(server.store.key, sealed)
                    if (manifest.owner, manifest.step) != target[:2]:
                        raise memory_tier.MemoryTierError(
                            f"sent to {self.path}, the manifest is owner {manifest.owner} "
                            f"step {manifest.step}")
                    if len(data) != manifest.data_bytes:
                        raise memory_tier.MemoryTierError(
                            f"{len(data)} bytes of data, the manifest says "
                            f"{manifest.data_bytes}")
                    # The pieces' digests are checked where they are used (a restore): a
                    # second pass over every byte here cost the sender's loop as much again.
                    server.store.write(sealed, [data])
                except memory_tier.MemoryTierError as err:
                    self._answer(400, str(err).encode())
                    return
                except OSError as err:  # the memory volume is full
                    self._answer(507, str(err).encode())
                    return
                self._answer(204)

        family = socket.AF_INET6 if ":" in host else socket.AF_INET

        class Server(http.server.ThreadingHTTPServer):
            address_family = family
            daemon_threads = True

        self._httpd = Server((host, port), Handler)
        self.port = int(self._httpd.server_address[1])
        self._thread = threading.Thread(target=self._httpd.serve_forever,
                                        name="replica-server", daemon=True)

    def start(self) -> ReplicaServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


def _connection(address: str, timeout: float) -> http.client.HTTPConnection:
    host, _, port = address.rpartition(":")
    return http.client.HTTPConnection(host.strip("[]"), int(port), timeout=timeout)


def send(address: str, token: str, sealed: bytes, data: list[bytes | memoryview] | bytes,
         owner: int, step: int, timeout: float = DEFAULT_TIMEOUT_SECONDS) -> None:
    """Hand a snapshot to the peer at `address` to keep; MemoryTierError if it would not."""
    parts = frame(sealed, b"")[:2] + (list(data) if isinstance(data, list) else [data])
    connection = _connection(address, timeout)
    try:
        connection.putrequest("PUT", f"/memory/{owner}/{step}")
        connection.putheader("Authorization", f"Bearer {token}")
        connection.putheader("Content-Type", "application/octet-stream")
        connection.putheader("Content-Length", str(sum(len(memoryview(p).cast("B"))
                                                       for p in parts)))
        connection.endheaders()
        for part in parts:
            connection.send(memoryview(part).cast("B"))
        answer = connection.getresponse()
        text = answer.read(4096)
        if answer.status != 204:
            raise memory_tier.MemoryTierError(
                f"peer {address} refused owner {owner} step {step}: HTTP {answer.status} "
                f"{text.decode(errors='replace')}")
    except (OSError, http.client.HTTPException) as err:
        raise memory_tier.MemoryTierError(f"peer {address}: {err}") from None
    finally:
        connection.close()


def fetch(address: str, token: str, owner: int, step: int, max_bytes: int,
          timeout: float = DEFAULT_TIMEOUT_SECONDS, manifest_only: bool = False
          ) -> tuple[bytes, bytes]:
    """(sealed manifest, data) of the snapshot the peer at `address` holds (data empty with
    `manifest_only`); unchecked here (the caller unseals and checks every piece)."""
    connection = _connection(address, timeout)
    try:
        connection.request("GET", f"/memory/{owner}/{step}"
                           + ("/manifest" if manifest_only else ""),
                           headers={"Authorization": f"Bearer {token}"})
        answer = connection.getresponse()
        length = int(answer.getheader("Content-Length") or -1)
        if answer.status != 200:
            raise memory_tier.MemoryTierError(
                f"peer {address} has no owner {owner} step {step}: HTTP {answer.status} "
                f"{answer.read(4096).decode(errors='replace')}")
        if not 0 <= length <= max_bytes:
            raise memory_tier.MemoryTierError(f"peer {address} answers {length} bytes for "
                                              f"owner {owner} step {step}")
        body = answer.read(length)
    except (OSError, http.client.HTTPException, ValueError) as err:
        raise memory_tier.MemoryTierError(f"peer {address}: {err}") from None
    finally:
        connection.close()
    sealed, data = unframe(body)
    return sealed, bytes(data)
