"""Simulated pods' and nodes' addresses on a shared loopback.

Every pod gets its own 127.x.y.z address (Linux routes all of 127/8 to the loopback device),
so two simulated rank 0s can serve progress on the same port (`simulated.ProgressEndpoints`).
Simulated pods have no names to resolve: the operator reaches them by IP.
"""

from __future__ import annotations

import functools
import ipaddress
import random
import socket

POD_NETWORK = ipaddress.ip_network("127.16.0.0/12")
NODE_NETWORK = ipaddress.ip_network("127.8.0.0/16")


@functools.cache
def loopback_aliases_work() -> bool:
    """Linux routes all of 127/8 to loopback; macOS has only 127.0.0.1 unless aliased."""
    try:
        with socket.socket() as sock:
            sock.bind(("127.8.0.1", 0))
        return True
    except OSError:
        return False


class IpAllocator:
    """Hands out pod IPs round-robin, so a fresh pod rarely reuses a just-released address.

    Where only 127.0.0.1 exists, every pod gets it (pods then share one port space).
    """

    def __init__(self, network: ipaddress.IPv4Network = POD_NETWORK) -> None:
        self._shared = not loopback_aliases_work()
        self._network = network
        # A random start keeps two clusters on one machine (e.g. parallel test runs) apart.
        self._next = random.randrange(1, network.num_addresses - 1)
        self._used: set[str] = set()

    def allocate(self) -> str:
        if self._shared:
            return "127.0.0.1"
        size = self._network.num_addresses
        for _ in range(size):
            candidate = self._network[self._next]
            self._next = self._next + 1 if self._next + 2 < size else 1
            text = str(candidate)
            if text.endswith((".0", ".255")) or text in self._used:
                continue
            self._used.add(text)
            return text
        raise RuntimeError("pod address range exhausted")

    def release(self, ip: str | None) -> None:
        self._used.discard(ip or "")


def node_ip(index: int) -> str:
    return str(NODE_NETWORK[index + 1]) if loopback_aliases_work() else "127.0.0.1"
