"""The network between real nodes: a namespace the cluster makes, standing for GKE's VPC.

A `ClusterNetwork` is a network namespace (`tdgnet-<hash of its directory>`) holding a bridge
(`NETWORK_BRIDGE`) with the router's address (`ROUTER_ADDRESS`, the last usable address of
`NODE_NETWORK`). A real node joins it (`join`, called by `RealNode` when given a network)
through a veth pair: `eth0` in the node's namespace, carrying the node's address
(`10.250.0.N/16`, as a GKE node's primary address is on its VPC subnet) with a default route
via the router, and its peer on the bridge, named after the node's id. The router gets a
route to the node's pod range via the node's address: what a VPC-native GKE cluster's VPC
does for each node's alias IP range (GKE docs, "VPC-native clusters": pod ranges are routed
by the VPC, not by routes on the nodes), so a pod on one node reaches a pod on another by its
pod IP, without NAT, and no node needs to know the others.

Every private address lives inside the namespaces this module and `realnode.py` create: the
host gets no address, route, interface or firewall rule. Deleting a node's namespace deletes
its veth pair (a veth pair goes when either end's namespace goes); `leave` removes its route;
`destroy` removes the cluster's namespace with its bridge.

Needs root and Linux.
"""

from __future__ import annotations

import contextlib
import hashlib
import ipaddress
import json
import secrets
import subprocess
from pathlib import Path
from types import TracebackType

import psutil

from tardigrade_local.lifetime import orphan_records

# Inside namespaces of ours only: a real node's address is NODE_NETWORK's <index>th host,
# its pods get POD_NETWORK's <index>th /24 (realnode.Addresses).
NODE_NETWORK = ipaddress.ip_network("10.250.0.0/16")
POD_NETWORK = ipaddress.ip_network("10.251.0.0/16")
# The cluster network's own addresses, at the end of the node range (nodes count from 1).
ROUTER_ADDRESS = str(NODE_NETWORK[-2])  # 10.250.255.254
DNS_ADDRESS = str(NODE_NETWORK[-3])  # 10.250.255.253, CoreDNS (clusterdns.py)
API_ADDRESS = str(NODE_NETWORK[-4])  # 10.250.255.252, kube-apiserver for pods (clusterapi.py)
GCS_ADDRESS = str(NODE_NETWORK[-5])  # 10.250.255.251, the GCS emulator for pods (clustergcs.py)
NETWORK_BRIDGE = "tdgnet0"
NODE_INTERFACE = "eth0"
# One record per cluster network (its directory, the process that made it), so a later
# process can remove the network of one that was killed (`sweep_orphans`); beside the real
# nodes' records (`realnode.RECORDS_DIR`), in a folder of their own.
RECORDS_DIR = Path("/run/tardigrade-realnodes/networks")


class NetworkError(RuntimeError):
    pass


def run_ip(*args: str, check: bool = True) -> str:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and done.returncode != 0:
        raise NetworkError(f"ip {' '.join(args)} failed: {done.stderr.strip()}")
    return done.stdout


def _sysctl(netns: str, key: str, value: str) -> None:
    """Inside `netns`: `net.ipv4.*` sysctls are each namespace's own (a new namespace starts
    with forwarding off), so this never changes the host's."""
    path = "/proc/sys/" + key.replace(".", "/")
    done = subprocess.run(["ip", "netns", "exec", netns, "sh", "-c", f"echo {value} > {path}"],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise NetworkError(f"sysctl {key}={value} in {netns}: {done.stderr.strip()}")


def link_address(netns: str, link: str) -> str:
    """The MAC address of `link` in `netns` ("" when it has none)."""
    return json.loads(run_ip("-n", netns, "-j", "link", "show", link))[0].get("address", "")


def pin_bridge_address(netns: str, bridge: str) -> str:
    """Set the bridge's MAC address to the one it has, explicitly, and return it.

    A bridge whose address was never set takes the lowest MAC among its ports and changes it
    as ports come and go. Here a port goes with every reclaimed VM, and when it was the one
    whose address the bridge had taken, every node's neighbour entry for the router (and for
    the DNS, API and GCS addresses on the bridge) points at an address nobody answers: each
    node's traffic off the node, collectives and saves included, stops until its entry
    expires and is resolved again (tens of seconds). A VPC's router keeps its address. The
    CNI bridge plugin pins its bridge for the same reason (`plugins/main/bridge/bridge.go`,
    `ensureBridge`)."""
    address = link_address(netns, bridge)
    if not address or address == "00:00:00:00:00:00":
        # Older kernels leave a new bridge's address zero until a port joins.
        address = ":".join(f"{b:02x}" for b in (0x02, *secrets.token_bytes(5)))
    run_ip("-n", netns, "link", "set", bridge, "address", address)
    return address


class ClusterNetwork:
    """```
    with ClusterNetwork(tmp / "net") as network:
        RealNode.for_cluster(info, "real-node-1", dir1, index=1, network=network).start()
    ```"""

    def __init__(self, directory: Path) -> None:
        self.directory = directory.absolute()
        self.id = "tdgnet-" + hashlib.sha256(str(self.directory).encode()).hexdigest()[:8]

    @property
    def netns_path(self) -> Path:
        return Path("/run/netns") / self.id

    @property
    def _record(self) -> Path:
        return RECORDS_DIR / f"{self.id}.json"

    def __enter__(self) -> ClusterNetwork:
        return self.create()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.destroy()

    def create(self) -> ClusterNetwork:
        self.directory.mkdir(parents=True, exist_ok=True)
        RECORDS_DIR.mkdir(mode=0o700, parents=True, exist_ok=True)
        me = psutil.Process()
        self._record.write_text(json.dumps({"directory": str(self.directory), "owner": me.pid,
                                            "owner_started": me.create_time()}))
        try:
            run_ip("netns", "add", self.id)
            run_ip("-n", self.id, "link", "set", "lo", "up")
            run_ip("-n", self.id, "link", "add", NETWORK_BRIDGE, "type", "bridge")
            pin_bridge_address(self.id, NETWORK_BRIDGE)
            run_ip("-n", self.id, "addr", "add",
                   f"{ROUTER_ADDRESS}/{NODE_NETWORK.prefixlen}", "dev", NETWORK_BRIDGE)
            for address in (DNS_ADDRESS, API_ADDRESS, GCS_ADDRESS):
                run_ip("-n", self.id, "addr", "add",
                       f"{address}/{NODE_NETWORK.prefixlen}", "dev", NETWORK_BRIDGE)
            run_ip("-n", self.id, "link", "set", NETWORK_BRIDGE, "up")
            _sysctl(self.id, "net.ipv4.ip_forward", "1")
        except BaseException:
            self.destroy()
            raise
        return self

    def join(self, node_id: str, node_ip: str, pod_cidr: str) -> None:
        """Wire the node namespace `node_id` (made by the caller, loopback up) to the bridge,
        its address on `eth0`, and route its pod range via it."""
        peer = node_id  # "tdg-" + 10 hex digits: within the 15 characters of a link name
        run_ip("-n", self.id, "link", "add", peer, "type", "veth", "peer", "name",
               NODE_INTERFACE, "netns", node_id)
        run_ip("-n", self.id, "link", "set", peer, "master", NETWORK_BRIDGE, "up")
        run_ip("-n", node_id, "addr", "add", f"{node_ip}/{NODE_NETWORK.prefixlen}", "dev",
               NODE_INTERFACE)
        run_ip("-n", node_id, "link", "set", NODE_INTERFACE, "up")
        run_ip("-n", node_id, "route", "add", "default", "via", ROUTER_ADDRESS)
        # The node forwards between its pods' bridge and eth0 (the bridge CNI plugin turns
        # this on too, with isGateway, but only once the first pod starts).
        _sysctl(node_id, "net.ipv4.ip_forward", "1")
        run_ip("-n", self.id, "route", "replace", pod_cidr, "via", node_ip)

    def leave(self, node_id: str, pod_cidr: str) -> None:
        """Remove the node's route and link (they also go with its namespace). Idempotent."""
        if not self.netns_path.exists():
            return
        run_ip("-n", self.id, "route", "del", pod_cidr, check=False)
        run_ip("-n", self.id, "link", "del", node_id, check=False)

    def routes(self) -> list[str]:
        """The router's routes to pod ranges (`10.251.N.0/24 via 10.250.0.N`)."""
        if not self.netns_path.exists():
            return []
        return [line for line in run_ip("-n", self.id, "route", "show").splitlines()
                if " via " in line]

    def links(self) -> list[str]:
        """The nodes' veth ends on the bridge."""
        if not self.netns_path.exists():
            return []
        out = run_ip("-n", self.id, "-o", "link", "show", "master", NETWORK_BRIDGE)
        return [line.split(":")[1].strip().split("@")[0] for line in out.splitlines()]

    def destroy(self) -> None:
        """Kill what still runs in the namespace (clusterdns.py stops its own first), remove
        it with its bridge. Idempotent."""
        for pid in self.processes():
            with contextlib.suppress(psutil.Error):
                psutil.Process(pid).kill()
        if self.netns_path.exists():
            run_ip("netns", "del", self.id, check=False)
        self._record.unlink(missing_ok=True)

    def processes(self) -> list[int]:
        try:
            inode = self.netns_path.stat().st_ino
        except OSError:
            return []
        found = []
        for proc in psutil.process_iter():
            with contextlib.suppress(psutil.Error, OSError):
                if Path(f"/proc/{proc.pid}/ns/net").stat().st_ino == inode:
                    found.append(proc.pid)
        return found

    def leftovers(self) -> dict[str, list[str]]:
        """What of this network is still on the machine (all empty once destroyed)."""
        netns = run_ip("netns", "list")
        return {"netns": [line for line in netns.splitlines() if line.split()[:1] == [self.id]],
                "processes": [str(p) for p in self.processes()],
                "host_links": host_links(), "host_addresses": host_addresses(),
                "host_firewall": host_firewall_rules()}


def host_links() -> list[str]:
    """Links of the host's own namespace named as ours (a veth end left on the host)."""
    out = run_ip("-o", "link", "show")
    names = [line.split(":")[1].strip().split("@")[0] for line in out.splitlines()]
    return [n for n in names if n.startswith(("tdg-", "tdgnet", "tdg0")) or n == NETWORK_BRIDGE]


def host_addresses() -> list[str]:
    """The host's addresses and routes in our ranges (there must be none)."""
    found = []
    for kind in ("addr", "route"):
        for line in run_ip("-o", kind, "show").splitlines():
            if any(_mentions(line, net) for net in (NODE_NETWORK, POD_NETWORK)):
                found.append(line.strip())
    return found


def host_firewall_rules() -> list[str]:
    """Rules of the host's own namespace that name our ranges, kube-proxy's table, or the
    NetworkPolicy enforcer's chains or ipsets (there must be none: they and the kubelet write
    only in their node's namespace).
    Not any `KUBE-` chain: a kubelet run in the host's namespace leaves its canary and
    firewall chains there (`pkg/kubelet/kubelet_network_linux.go`), which are not ours."""
    found = []
    for argv in (["nft", "list", "ruleset"], ["iptables-legacy-save"], ["ipset", "list", "-n"]):
        with contextlib.suppress(OSError):
            out = subprocess.run(argv, capture_output=True, text=True).stdout
            found += [line.strip() for line in out.splitlines()
                      if _names_a_node_table(line)
                      or any(_mentions(line, net) for net in (NODE_NETWORK, POD_NETWORK))]
    return found


# What real nodes' daemons write in their own namespace only: kube-proxy's nftables table, the
# NetworkPolicy enforcer's iptables chains and ipsets (`netpolicy.py`).
NODE_TABLES = ("kube-proxy",)
ENFORCER_NAMES = ("KUBE-ROUTER-", "KUBE-POD-FW-", "KUBE-NWPLCY-", "KUBE-SRC-", "KUBE-DST-")


def _names_a_node_table(line: str) -> bool:
    words = line.split()
    return (len(words) >= 3 and words[0] == "table" and words[2] in NODE_TABLES) or any(
        name in line for name in ENFORCER_NAMES)


def _mentions(line: str, network: ipaddress.IPv4Network) -> bool:
    prefix = ".".join(str(network.network_address).split(".")[:2]) + "."
    return any(word.startswith(prefix) for word in line.replace("/", " ").split())


def sweep_orphans() -> list[str]:
    """Remove the cluster networks whose making process is gone (a killed test run)."""
    swept = []
    for _, data in orphan_records(RECORDS_DIR):
        network = ClusterNetwork(Path(data["directory"]))
        network.destroy()
        swept.append(network.id)
    return swept
