"""A port for a server that binds it later, in this process or another one.

Asking the kernel for port 0 and closing the socket hands back a port from the ephemeral
range, which the kernel then also gives to the next outgoing connection of any process on the
machine; a server binding it a second later fails with EADDRINUSE. So the port is picked at
random outside that range (Linux: `net.ipv4.ip_local_port_range`, default 32768-60999), where
the kernel never assigns one on its own, and checked free on every address.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_DEFAULT_EPHEMERAL = (32768, 60999)
# Below this sit registered services a developer may be running (databases, dev servers).
_LOWEST = 20000
_ATTEMPTS = 200


def ephemeral_range() -> tuple[int, int]:
    try:
        low, high = (int(part) for part in _RANGE_FILE.read_text().split())
    except (OSError, ValueError):
        return _DEFAULT_EPHEMERAL
    return low, high


def candidate_ports() -> list[int]:
    """Every port this module may hand out: [20000, 65535] less the ephemeral range."""
    low, high = ephemeral_range()
    return [port for port in range(_LOWEST, 65536) if not low <= port <= high]


def _bindable(port: int) -> bool:
    # The wildcard address conflicts with a socket on any address, so a port that binds here
    # binds on 127.0.0.1, a pod's 127.x address and a dual-stack wildcard too.
    try:
        with socket.socket() as sock:
            sock.bind(("0.0.0.0", port))
        return True
    except OSError:
        return False


def free_port(rng: random.Random | None = None) -> int:
    """A port free right now that no outgoing connection will take in the meantime."""
    choose = rng or random.SystemRandom()
    candidates = candidate_ports()
    if not candidates:  # an ephemeral range that spans everything: only the kernel can pick
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            return int(sock.getsockname()[1])
    for _ in range(_ATTEMPTS):
        port = choose.choice(candidates)
        if _bindable(port):
            return port
    raise RuntimeError(
        f"no free port in [{_LOWEST}, 65535] outside the ephemeral range {ephemeral_range()} "
        f"after {_ATTEMPTS} tries")
