"""Distributed start-up from the operator contract, with a clear error when a peer is missing.

`jax.distributed.initialize` aborts the whole process (SIGABRT) when a peer does not arrive in
time, which would leave the operator with an opaque crash. So before handing the coordinator
port to JAX, the ranks meet in a plain-TCP rendezvous on that same port: rank 0 listens, every
other rank says hello (job, attempt, rank), and rank 0 answers "go" once all are present. A
missing peer then surfaces as `PeerTimeoutError` (exit EXIT_PEER_TIMEOUT) naming who is
missing, and ranks of a stale attempt are turned away instead of joining the wrong gang.

The port is reachable by any pod the network lets through, and job name, attempt and process
count are guessable: so every hello carries the rank's projected service-account token, which
rank 0 has the API server review (peerauth.py) before the rank counts as present. What a
caller can make rank 0 hold is bounded: a hello's size, the time to send it, and the number of
connections waiting to say it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import selectors
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, cast

from tardigrade_checkpoint import coordination
from tardigrade_contract import boundedjson, contract
from tardigrade_contract.contract import (
    ENV_COORDINATOR_ADDRESS,
    ENV_POD_IP,
    ENV_RENDEZVOUS_INSECURE,
    ENV_RENDEZVOUS_TOKEN_FILE,
    ConfigError,
    TrainerEnvironment,
)

from tardigrade_sdk import peerauth, phases

log = logging.getLogger(__name__)

_GO = b"go\n"
_RETRY_SECONDS = 0.2
# How often a peer looks for rank 0's coordination service after the rendezvous: it starts in
# milliseconds once rank 0 has said "go".
_LISTEN_POLL_SECONDS = 0.01
# A hello is a small JSON line plus a token (1-2 KB); a caller gets this many bytes and
# seconds to send one, and at most this many connections wait to be heard, per rank.
MAX_HELLO_BYTES = 16384
HELLO_SECONDS = 10.0
PENDING_PER_RANK = 4
# Hellos reviewed at once (a TokenReview each, peerauth.py).
REVIEW_CONCURRENCY = 16
# Every blocking send or receive on an accepted connection gives up after this.
IO_SECONDS = 5.0
MAX_ANSWER_BYTES = 4096

Checker = Callable[[dict[str, Any], int], "str | None"]


class PeerTimeoutError(RuntimeError):
    """Not every rank of the gang arrived before the deadline."""


class CoordinatorBindError(ConfigError):
    """Rank 0 cannot listen where the gang's coordinator must (exit EXIT_CONFIG_ERROR).

    Raised before JAX is handed the address: gRPC, asked to bind where it cannot, logs
    "Failed to add port to server" and the process dies of a segfault (jax 0.10.2)."""


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _can_bind(family: socket.AddressFamily, host: str, port: int) -> OSError | None:
    """None when a listening socket of `family` can bind (host, port) now; else why not."""
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6 and not host.strip("[]"):
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            probe.bind((host, port))
        return None
    except OSError as err:
        return err


def listen_address(port: int) -> tuple[socket.AddressFamily, str]:
    """Where rank 0 listens, for the rendezvous and then JAX's coordination service: the
    pod's IP when the operator gave it (pods sharing a network namespace may use the same
    port), else every address of a family this host has: IPv6 with IPv4 mapped (dual stack)
    where IPv6 exists, else IPv4. JAX's own default, "[::]", fails on a host without IPv6.

    The bind is tried here, so a coordinator that cannot listen (an address that is not
    this host's, a port taken, a sandbox without internet sockets) fails as a config error
    that names the address, before anything is handed to JAX."""
    pod_ip = os.environ.get(ENV_POD_IP)
    if pod_ip:
        family = socket.AF_INET6 if ":" in pod_ip else socket.AF_INET
        candidates = [(family, pod_ip)]
    else:
        candidates = [(socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")]
        if not socket.has_ipv6:
            candidates = candidates[1:]
    failures = []
    for family, host in candidates:
        err = _can_bind(family, host, port)
        if err is None:
            return family, host
        failures.append(f"{_address(host, port)} ({err.strerror or err})")
    where = f"{ENV_POD_IP}={pod_ip}" if pod_ip else f"{ENV_POD_IP} unset, so every address"
    raise CoordinatorBindError(
        f"rank 0 cannot listen for the gang's coordinator on {' nor '.join(failures)} "
        f"({where}): give the pod an address and port it can bind (the coordinator port "
        f"comes from {ENV_COORDINATOR_ADDRESS}), or run one process, which needs no "
        "coordinator")


def configure_host_devices(devices_per_process: int | None) -> None:
    """Ask XLA's CPU backend for several devices; must run before jax is imported."""
    if not devices_per_process:
        return
    flag = f"--xla_force_host_platform_device_count={devices_per_process}"
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    os.environ["XLA_FLAGS"] = " ".join([*flags, flag])


def configure_compilation_cache(directory: str | None) -> None:
    """Keep compiled programs across restarts; must run before the first compilation."""
    if not directory:
        return
    import jax

    jax.config.update("jax_compilation_cache_dir", directory)
    # The train step compiles in seconds on small hosts: cache it whatever it cost.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def open_devices_early() -> None:
    """Start JAX's backend in a thread now, while the trainer's own modules import: opening an
    accelerator takes seconds (about 8 s for a TPU v5e chip in our sandbox, more than the
    imports). Only for a gang of one process: a gang's backend must start after
    `jax.distributed.initialize`, which needs the rendezvous first."""
    import jax

    def open_devices() -> None:
        try:
            jax.devices()
            phases.mark("devices_open")
        except Exception:  # the main thread's own first call raises it again, where it counts
            log.debug("opening the devices early failed", exc_info=True)

    threading.Thread(target=open_devices, name="open-devices", daemon=True).start()


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"coordinator address {address!r} is not host:port")
    return host.strip("[]"), int(port)


def grpc_addresses(env: TrainerEnvironment) -> tuple[str, str | None]:
    """The coordinator address for JAX's gRPC client, and where rank 0's service binds
    (`listen_address`; CoordinatorBindError where it cannot).

    The name is resolved here, by Python's resolver, so gRPC gets an IP: the same answer as
    cluster DNS gives, and the only one where names come from a hosts table that only Python
    sees (the local cluster).
    """
    host, port = split_address(env.coordinator_address)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        ip = str(infos[0][4][0])
        coordinator = f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"
    except OSError:
        coordinator = env.coordinator_address  # let gRPC try, and report, its own way
    bind = None
    if env.process_id == 0:
        bind = _address(listen_address(port)[1], port)
    return coordinator, bind


def rendezvous(env: TrainerEnvironment, timeout: float) -> None:
    """Return once all `env.num_processes` ranks are present, else raise PeerTimeoutError."""
    if env.num_processes == 1:
        return
    deadline = time.monotonic() + timeout
    host, port = split_address(env.coordinator_address)
    hello = {"job": env.job_name, "attempt": env.attempt, "num_processes": env.num_processes}
    if env.rendezvous_insecure:
        log.warning("rendezvous authentication is off (%s): any caller that knows the job "
                    "can join this gang", ENV_RENDEZVOUS_INSECURE)
    elif not env.rendezvous_token_file:
        raise peerauth.PeerAuthError(
            f"{ENV_RENDEZVOUS_TOKEN_FILE} is not set: the operator mounts a projected "
            f"service-account token for the rendezvous; a trainer run outside a cluster sets "
            f"{ENV_RENDEZVOUS_INSECURE}=true instead")
    if env.process_id == 0:
        checker = None if env.rendezvous_insecure else peerauth.TokenReviewer(
            env.namespace, env.job_name).check
        _serve_rendezvous(port, hello, env.num_processes, deadline, checker)
    else:
        token_file = None if env.rendezvous_insecure else env.rendezvous_token_file
        _join_rendezvous(host, port, {**hello, "process_id": env.process_id}, deadline,
                         token_file)


def _serve_rendezvous(port: int, expect: dict[str, Any], n: int, deadline: float,
                      check: Checker | None = None) -> None:
    # Every rank of a gang restarted together knocks within milliseconds: with the default
    # backlog (128) the kernel drops the SYNs past it, and each such rank waits out TCP's
    # 1 s retransmission before it is heard (bench/rendezvous_scale.py at 1,024 ranks).
    backlog = max(128, n)
    family, host = listen_address(port)
    try:
        server = socket.create_server(
            (host, port), family=family, backlog=backlog,
            dualstack_ipv6=family == socket.AF_INET6 and host == "::")
    except OSError as err:  # taken between the check and now
        raise CoordinatorBindError(f"rank 0 cannot listen for the gang's rendezvous on "
                                   f"{_address(host, port)}: {err}") from None
    peers: dict[int, socket.socket] = {}
    pending: dict[socket.socket, bytes] = {}
    heard_by: dict[socket.socket, float] = {}  # when a pending connection must have said hello
    max_pending = min(PENDING_PER_RANK * n, 512)
    reviews = _Reviews(check, max_pending) if check is not None else None
    # epoll, not select(2): select cannot watch a descriptor numbered 1024 or more, and rank 0
    # of a thousand-host gang holds a thousand connections besides its own files ("filedescriptor
    # out of range in select()" at 1,024 ranks, bench/rendezvous_scale.py).
    watched = selectors.DefaultSelector()
    watched.register(server, selectors.EVENT_READ)
    if reviews is not None:
        watched.register(reviews.wake, selectors.EVENT_READ)

    def unwatch(sock: socket.socket) -> None:
        with contextlib.suppress(KeyError, ValueError):
            watched.unregister(sock)

    def drop(sock: socket.socket) -> None:
        pending.pop(sock, None)
        heard_by.pop(sock, None)
        unwatch(sock)
        sock.close()

    try:
        while len(peers) < n - 1:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(1, n)) - set(peers))
                raise PeerTimeoutError(
                    f"ranks {missing} of {n} did not reach the coordinator on port {port} "
                    f"in time (job {expect['job']!r}, attempt {expect['attempt']})"
                )
            readable = [cast(socket.socket, key.fileobj)
                        for key, _ in watched.select(min(remaining, 1.0))]
            now = time.monotonic()
            for sock in [s for s, due in heard_by.items() if due < now]:
                drop(sock)  # connected, but never said hello in time
            for sock in readable:
                if sock is server:
                    conn, _ = server.accept()
                    conn.settimeout(IO_SECONDS)
                    if len(pending) >= max_pending:
                        drop(min(heard_by, key=heard_by.__getitem__))  # the oldest waiter
                    pending[conn] = b""
                    heard_by[conn] = now + HELLO_SECONDS
                    watched.register(conn, selectors.EVENT_READ)
                    continue
                if reviews is not None and sock is reviews.wake:
                    continue  # the reviews that finished are taken below
                if sock.fileno() < 0:
                    continue  # dropped earlier in this pass
                try:
                    data = sock.recv(4096)
                except OSError:
                    data = b""
                if sock in pending:
                    if not data:
                        drop(sock)  # the peer gave up before saying hello
                        continue
                    pending[sock] += data
                    if b"\n" in pending[sock]:
                        raw = pending.pop(sock)
                        heard_by.pop(sock, None)
                        unwatch(sock)
                        if _accept_hello(sock, raw, expect, n, peers, reviews):
                            watched.register(sock, selectors.EVENT_READ)  # to see it leave
                    elif len(pending[sock]) > MAX_HELLO_BYTES:
                        log.warning("rendezvous: dropped a connection that sent %d bytes "
                                    "without a hello", len(pending[sock]))
                        drop(sock)
                elif not data:
                    # A peer that said hello and then died is no longer present.
                    rank = next(r for r, s in peers.items() if s is sock)
                    log.warning("rank %d left the rendezvous before it completed", rank)
                    unwatch(sock)
                    peers.pop(rank).close()
            for sock, hello, rank, refused in reviews.finished() if reviews is not None else ():
                if _admit(sock, hello, rank, refused, peers):
                    watched.register(sock, selectors.EVENT_READ)
        # The port is the coordination service's from now on: a peer told "go" waits until
        # something listens on it again (wait_for_listener), which must not be this socket.
        watched.close()
        server.close()
        for sock in peers.values():
            sock.sendall(_GO)
        # Let peers close first so the coordinator port is not left in TIME_WAIT on our side.
        for sock in peers.values():
            sock.settimeout(max(0.1, deadline - time.monotonic()))
            with contextlib.suppress(OSError):
                sock.recv(1)
    finally:
        watched.close()
        if reviews is not None:
            reviews.close()
        for sock in [*peers.values(), *pending]:
            sock.close()
        server.close()


class _Reviews:
    """Hellos being checked (a TokenReview each) in worker threads, REVIEW_CONCURRENCY at a
    time, while the rendezvous goes on serving; their sockets wait outside its select. One
    after the other, a thousand ranks' reviews held rank 0 for a thousand round trips to the
    API server at every start. Several hellos may claim one rank at once (a hostile one among
    them): the first that passes takes it."""

    def __init__(self, check: Checker, limit: int) -> None:
        self._check = check
        self._limit = limit
        self._pool = ThreadPoolExecutor(REVIEW_CONCURRENCY,
                                        thread_name_prefix="rendezvous-review")
        # A finished review writes a byte here, which wakes the rendezvous's select.
        self.wake, self._waker = socket.socketpair()
        self.wake.setblocking(False)
        self._running: dict[Future[str | None], tuple[socket.socket, dict[str, Any], int]] = {}

    def submit(self, sock: socket.socket, hello: dict[str, Any], rank: int) -> bool:
        """False when too many are under review already (the caller drops the connection,
        and a genuine rank connects again)."""
        if len(self._running) >= self._limit:
            return False
        future = self._pool.submit(self._check, hello, rank)
        self._running[future] = (sock, hello, rank)
        future.add_done_callback(self._wake_up)
        return True

    def _wake_up(self, _: Future[str | None]) -> None:
        with contextlib.suppress(OSError):
            self._waker.send(b"x")

    def finished(self) -> list[tuple[socket.socket, dict[str, Any], int, str | None]]:
        """The reviews done since the last call, with their verdicts; a checker's exception
        (rank 0 may not review tokens at all) is raised."""
        with contextlib.suppress(BlockingIOError):
            while self.wake.recv(4096):
                pass
        done = [future for future in self._running if future.done()]
        return [(*self._running.pop(future), future.result()) for future in done]

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        for sock, _, _ in self._running.values():
            sock.close()
        self.wake.close()
        self._waker.close()


def _accept_hello(
    sock: socket.socket, raw: bytes, expect: dict[str, Any], n: int,
    peers: dict[int, socket.socket], reviews: _Reviews | None = None,
) -> bool:
    """True when the hello took its rank now; otherwise it was refused (and closed) or is
    under review."""
    try:
        hello = boundedjson.loads(raw.split(b"\n", 1)[0][:MAX_HELLO_BYTES],
                                  contract.FLAT_RECORD_LIMIT)
        rank = int(hello["process_id"])
    except (ValueError, KeyError, TypeError):
        sock.close()
        return False
    mismatch = [k for k, v in expect.items() if hello.get(k) != v]
    refused = str(mismatch) if mismatch else None
    if refused is None and not 0 < rank < n:
        refused = "duplicate or out-of-range rank"
    if refused is not None or rank in peers or reviews is None:
        return _admit(sock, hello, rank, refused, peers)
    if not reviews.submit(sock, hello, rank):
        sock.close()
    return False


def _admit(sock: socket.socket, hello: Any, rank: int, refused: str | None,
           peers: dict[int, socket.socket]) -> bool:
    """Give `rank` to the hello's connection (True), or answer why not and close it."""
    if refused is None and rank in peers:
        refused = "duplicate or out-of-range rank"
    if refused is None:
        peers[rank] = sock
        return True
    shown = {k: v for k, v in hello.items() if k != "token"} if isinstance(hello, dict) \
        else hello
    log.warning("rendezvous rejected: %s from rank %s (%s)", refused, rank, shown)
    try:
        sock.sendall(f"rejected: {refused}".encode() + b"\n")
    except OSError:
        pass  # a caller that does not read its refusal
    finally:
        sock.close()
    return False


def _join_rendezvous(host: str, port: int, hello: dict[str, Any], deadline: float,
                     token_file: str | None = None) -> None:
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=_RETRY_SECONDS * 5) as sock:
                # Read at every try: the kubelet rotates the token, pods may be kept long.
                said = {**hello, "token": peerauth.read_token(token_file)} if token_file \
                    else hello
                sock.sendall(json.dumps(said).encode() + b"\n")
                sock.settimeout(max(0.1, deadline - time.monotonic()))
                answer = b""
                while not answer.endswith(b"\n") and len(answer) <= MAX_ANSWER_BYTES:
                    chunk = sock.recv(4096)
                    if not chunk:
                        break
                    answer += chunk
                if answer == _GO:
                    return
                last_error = RuntimeError(answer.decode(errors="replace").strip() or "closed")
                if answer.startswith(b"rejected"):
                    raise PeerTimeoutError(f"coordinator {host}:{port} {last_error}")
        except (TimeoutError, OSError) as err:
            last_error = err
        time.sleep(_RETRY_SECONDS)
    raise PeerTimeoutError(
        f"rank {hello['process_id']} could not meet the coordinator {host}:{port} in time "
        f"(job {hello['job']!r}, attempt {hello['attempt']}): {last_error}"
    )


def wait_for_listener(address: str, deadline: float) -> bool:
    """Return True once something accepts connections at `address` (host:port, [v6]:port),
    False at `deadline` (monotonic).

    After the rendezvous, rank 0 starts JAX's coordination service on the same port. A peer
    whose gRPC client connects before that service listens is refused, and gRPC tries again
    only after its initial reconnect back-off, 1 s (grpc/grpc doc/connection-backoff.md,
    INITIAL_BACKOFF): a second of every relaunch. Probing with plain TCP first costs
    milliseconds."""
    host, port = split_address(address)
    host = host.strip("[]")
    while True:
        try:
            with socket.create_connection((host, port), timeout=IO_SECONDS):
                return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(_LISTEN_POLL_SECONDS)


def initialize(env: TrainerEnvironment, timeout: float | None = None) -> None:
    """Rendezvous, then `jax.distributed.initialize` for the gang described by `env`.

    A gang of one process starts neither: its barriers and gathers are trivial (the
    collectives above answer them without a service), its preemption notice is its own
    SIGTERM (preemption.py), and it then runs where no socket can be opened at all (a
    sandboxed accelerator host) and never waits for a port.
    """
    if env.num_processes == 1:
        phases.mark("distributed_skipped")
        log.info("one process: no rendezvous and no coordination service")
        return
    timeout = env.init_timeout_seconds if timeout is None else timeout
    started = time.monotonic()
    phases.mark("rendezvous_started")
    rendezvous(env, timeout)
    phases.mark("rendezvous_done")
    import jax  # late: callers may need to set XLA_FLAGS first

    # JAX's preemption service swallows SIGTERM to turn it into a sync point; a job that
    # does not save on preemption must keep the default (terminate at once).
    jax.config.update("jax_enable_preemption_service", env.save_on_preemption)
    remaining = max(30.0, timeout - (time.monotonic() - started))
    coordinator, bind = grpc_addresses(env)
    if env.process_id != 0:
        # Not met in time: jax.distributed.initialize below reports it its own way.
        wait_for_listener(coordinator, started + timeout)
    jax.distributed.initialize(
        coordinator_address=coordinator,
        num_processes=env.num_processes,
        process_id=env.process_id,
        initialization_timeout=int(remaining),
        coordinator_bind_address=bind,
        **({"heartbeat_timeout_seconds": env.heartbeat_timeout_seconds}
           if env.heartbeat_timeout_seconds is not None else {}),
    )
    phases.mark("distributed_initialized")
    # No device count here: the first backend call belongs to the accelerator check
    # (accelerator.verify), which turns a backend that cannot start into a clear reason.
    log.info("jax.distributed initialized: process %d of %d", env.process_id,
             env.num_processes)


def barrier(name: str, timeout_seconds: float) -> None:
    """Wait until every process reaches `name`; a no-op outside a distributed run.

    Uses the coordination service's key-value barrier rather than a device collective, so it
    is safe to call from a background thread while the training loop keeps running.
    """
    gang = coordination.current()
    if gang is not None:
        gang.barrier(name, timeout_seconds)


def text_from_root(name: str, value: str | None, timeout_seconds: float) -> str:
    """Every process gets process 0's `value` (which only process 0 passes), through the
    coordination service's key-value store like `barrier`: safe from a background thread."""
    gang = coordination.current()
    return value or "" if gang is None else gang.from_root(name, value, timeout_seconds)


def gather_to_root(name: str, value: str, timeout_seconds: float) -> list[str] | None:
    """Process 0 gets every process's `value` in process order, the others None, once every
    process has set its own (coordination.Coordination.gather_to_root); [value] outside a
    distributed run."""
    gang = coordination.current()
    return [value] if gang is None else gang.gather_to_root(name, value, timeout_seconds)
