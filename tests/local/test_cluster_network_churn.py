"""The cluster network's router keeps its address while nodes come and go, as a VPC's does.

Each reclaimed VM takes its port off the network's bridge and a recreated one adds a port. A
bridge whose address was never set takes its ports' lowest MAC; when that port went, every
node's neighbour entry for the router pointed nowhere and the node's traffic off the node
stopped for tens of seconds: a gang's save hung across a reclaim of another node and its save
on notice never came (bench/goodput.py, 49 and 50 steps lost with notice).

Needs root and Linux (network namespaces); no cluster."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from tardigrade_local import nodenet
from tardigrade_local.nodenet import NETWORK_BRIDGE, ROUTER_ADDRESS, ClusterNetwork, run_ip
from tardigrade_local.realnode import Addresses

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or os.geteuid() != 0,
    reason="network namespaces need Linux and root")

# A TCP connect to the router's address on a port nothing listens on: refused at once when the
# router is reachable, a timeout when the node's frames go to an address nobody has.
PROBE = f"""
import socket, sys
s = socket.socket()
s.settimeout(2)
try:
    s.connect(("{ROUTER_ADDRESS}", 9))
except ConnectionRefusedError:
    sys.exit(0)
except OSError:
    sys.exit(1)
"""


def bridge_address(network: ClusterNetwork) -> str:
    return nodenet.link_address(network.id, NETWORK_BRIDGE)


def router_reachable(node_ns: str) -> bool:
    done = subprocess.run(["ip", "netns", "exec", node_ns, sys.executable, "-c", PROBE],
                          capture_output=True, timeout=30)
    return done.returncode == 0


class Nodes:
    """Node namespaces joined to one network, each with its index's address and pod range,
    its port on the bridge given a MAC of the test's choosing."""

    def __init__(self, network: ClusterNetwork, prefix: str) -> None:
        self.network = network
        self.prefix = prefix
        self.joined: dict[int, str] = {}

    def join(self, index: int, port_mac: str) -> str:
        node_ns = f"{self.prefix}{index}"
        run_ip("netns", "add", node_ns)
        run_ip("-n", node_ns, "link", "set", "lo", "up")
        addresses = Addresses.for_index(index)
        self.network.join(node_ns, addresses.node_ip, addresses.pod_cidr)
        run_ip("-n", self.network.id, "link", "set", node_ns, "address", port_mac)
        self.joined[index] = node_ns
        return node_ns

    def leave(self, index: int) -> None:
        node_ns = self.joined.pop(index)
        self.network.leave(node_ns, Addresses.for_index(index).pod_cidr)
        run_ip("netns", "del", node_ns, check=False)

    def close(self) -> None:
        for index in list(self.joined):
            self.leave(index)


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[Nodes]:
    nodenet.sweep_orphans()
    with ClusterNetwork(tmp_path / "net") as network:
        # Short names: a namespace's name is also its port's link name (15 characters).
        made = Nodes(network, f"tdg-t{os.getpid() % 100000:05d}")
        try:
            yield made
        finally:
            made.close()


def random_mac(rng: random.Random) -> str:
    # Locally administered, unicast.
    return ":".join(f"{b:02x}" for b in (0x02, *(rng.randrange(256) for _ in range(5))))


def test_a_node_reaches_the_router_at_once_after_the_port_with_the_lowest_mac_left(nodes):
    pinned = bridge_address(nodes.network)
    # Below any MAC the kernel gives a veth (locally administered, 02:...): an unpinned bridge
    # takes it as its own.
    nodes.join(1, "02:00:00:00:00:01")
    kept = nodes.join(2, "02:ff:ff:ff:ff:fe")
    assert router_reachable(kept)  # its neighbour entry for the router is now cached
    nodes.leave(1)  # the reclaimed VM's port goes
    assert bridge_address(nodes.network) == pinned
    # Within the entry's lifetime (15-45 s): the cached address must still be the router's.
    assert router_reachable(kept)


def test_the_router_keeps_its_address_through_generated_churn(nodes):
    rng = random.Random(int.from_bytes(os.urandom(4), "big"))
    pinned = bridge_address(nodes.network)
    seen = {pinned}
    for _ in range(12):
        free = [i for i in range(1, 9) if i not in nodes.joined]
        if free and (not nodes.joined or rng.random() < 0.6):
            nodes.join(rng.choice(free), random_mac(rng))
        else:
            nodes.leave(rng.choice(sorted(nodes.joined)))
        seen.add(bridge_address(nodes.network))
    assert seen == {pinned}
