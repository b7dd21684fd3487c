"""From the rendezvous to JAX's coordination service on the same port: a peer told "go" waits
for the service to listen instead of meeting gRPC's 1 s reconnect back-off."""

from __future__ import annotations

import json
import socket
import threading
import time

from tardigrade_sdk import distributed
from trainer_harness import free_port

from tests.polling import wait_for
from tests.rendezvous import coordinator_in_thread


def _hello(port: int) -> socket.socket:
    """Rank 1 of job "job", attempt 0, as a raw socket that stays open after "go"."""
    def attempt() -> socket.socket | None:
        try:
            return socket.create_connection(("127.0.0.1", port), timeout=5)
        except OSError:
            return None
    sock = wait_for(attempt, 30, "the coordinator to listen")
    sock.sendall(json.dumps({"job": "job", "attempt": 0, "num_processes": 2,
                             "process_id": 1}).encode() + b"\n")
    return sock


def test_the_rendezvous_stops_listening_before_it_says_go():
    port = free_port()
    thread, result = coordinator_in_thread(port, 2, 30)
    peer = _hello(port)
    try:
        assert peer.recv(16) == b"go\n"
        # Rank 0 still waits for this peer to hang up; its port must already be free for the
        # coordination service, so that a listener there can only be that service.
        try:
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
            accepted = True
        except ConnectionRefusedError:
            accepted = False
        assert not accepted, "the rendezvous still listened after it said go"
    finally:
        peer.close()
    thread.join(30)
    assert result == ["ok"]


def test_a_peer_waits_until_the_coordination_port_listens():
    port = free_port()
    found: list[bool] = []
    waiter = threading.Thread(target=lambda: found.append(distributed.wait_for_listener(
        f"127.0.0.1:{port}", time.monotonic() + 60)), daemon=True)
    waiter.start()
    waiter.join(0.5)
    assert waiter.is_alive() and not found  # nothing listens yet: still waiting
    with socket.create_server(("127.0.0.1", port)):
        waiter.join(30)
        assert found == [True]


def test_a_peer_gives_up_waiting_at_the_deadline():
    port = free_port()
    assert distributed.wait_for_listener(f"[127.0.0.1]:{port}", time.monotonic() + 0.2) is False
