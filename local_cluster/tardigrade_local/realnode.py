"""A real node: the real kubelet and containerd, registered with the local cluster.

`RealNode` starts, for one node name, everything a GKE node runs for its pods, built here
from the pinned modules (`gobuild.NODE_MODULES`), and stops it leaving nothing behind:
- a network namespace of its own (`ip netns add`), where the node's address lives on its
  loopback and the CNI bridge plugin puts each pod on a bridge in the node's pod range. Those
  private addresses exist only inside namespaces this module creates; the host gets none.
  The kubelet reaches kube-apiserver through `netnsproxy` (127.0.0.1:6443 inside the
  namespace leads to the API server on the host's loopback);
- containerd 2.4 with its own root, state and socket under the node's directory, the CRI
  configured for our machines (REAL_NODES.md): `restrict_oom_score_adj` (no
  CAP_SYS_RESOURCE here), runc from the build (its state under the node's directory too),
  the busybox image imported as the pinned sandbox image (`nodeimage.py`), pod network
  namespaces mounted under its state directory;
- the kubelet, with a client certificate for `system:node:NAME` in `system:nodes` signed by
  the cluster's CA (what the Node authorizer and NodeRestriction check), a serving
  certificate for the node's address, cgroup v1 with `failCgroupV1: false` under a
  `cgroupRoot` of this node's only;
- a system bus of its own with a logind stand-in on it (`nodepower.py`, `logind.py`), through
  which `shutdown` reaches the kubelet's graceful node shutdown as a VM's shutdown does;
  `halt` is the VM lost without one, `partition` the node cut off from the control plane.
On a cluster network (`network=`, `nodenet.py`) the node's address is on a veth pair to the
cluster's bridge instead of its loopback, kube-proxy runs beside the kubelet (`kubeproxy.py`)
and pods get the cluster's DNS (`clusterdns.py`); with `network_policies`, kube-router's
controller enforces NetworkPolicy there (`netpolicy.py`).

Needs root (namespaces, mounts, cgroups) and Linux.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, TextIO

import psutil

from tardigrade_local import (
    clusterdns,
    gobuild,
    identities,
    kubeproxy,
    netpolicy,
    nodeimage,
    nodepower,
    noderegistry,
    nodeshape,
)
from tardigrade_local.controlplane import SERVICE_CIDR
from tardigrade_local.gke.nodes import NodeConfig
from tardigrade_local.kubeconfig import write_kubeconfig
from tardigrade_local.lifetime import die_with_parent, orphan_records
from tardigrade_local.nodefootprint import NodeFootprint, cgroup_hierarchies
from tardigrade_local.nodenet import NODE_NETWORK, POD_NETWORK, ClusterNetwork
from tardigrade_local.pki import Authority

# Inside the node's namespace only (never on the host): the node's address is NODE_NETWORK's
# <index>th host, its pods get POD_NETWORK's <index>th /24 (nodenet.py).
API_PORT_IN_NODE = 6443
KUBELET_PORT = 10250
BRIDGE = "tdg0"
# One record per running real node, naming its directory and the process that started it, so
# a later process can tear down the nodes of one that was killed (`sweep_orphans`).
RECORDS_DIR = Path("/run/tardigrade-realnodes")
# A unix socket's path holds at most 107 bytes; the kubelet's longest under the node's
# directory is `/kubelet/device-plugins/kubelet.sock` (36).
MAX_DIRECTORY_CHARS = 107 - len("/kubelet/device-plugins/kubelet.sock")
START_TIMEOUT_SECONDS = 180.0
# A kubelet that ignores containers' restart rules, as one without the feature does: the rules'
# gate and the one gate that depends on it (pkg/features/kube_features.go: the kubelet refuses
# a dependent gate on over a gate off), both beta and on by default in 1.36.
KUBELET_WITHOUT_RESTART_RULES = {"ContainerRestartRules": False,
                                 "RestartAllContainersOnContainerExits": False}
# The kubelet's nodeLeaseDurationSeconds (its default): renewed every quarter of it.
NODE_LEASE_SECONDS = 40
# The nftables table of a partition (`partition`), in the node's namespace only.
PARTITION_TABLE = "tardigrade-partition"
STOP_TIMEOUT_SECONDS = 60.0


class RealNodeError(RuntimeError):
    pass


@dataclasses.dataclass(frozen=True)
class Addresses:
    node_ip: str
    pod_cidr: str
    gateway: str

    @classmethod
    def for_index(cls, index: int) -> Addresses:
        if not 1 <= index <= 250:
            raise ValueError(f"node index {index} is outside 1..250")
        pods = list(POD_NETWORK.subnets(new_prefix=24))[index]
        return cls(str(NODE_NETWORK[index]), str(pods), str(pods[1]))


class RealNode:
    """```
    with RealNode("real-node-1", tmp / "node", cluster.info["direct_api_url"],
                  Path(cluster.info["ca_file"]).parent) as node:
        ...  # pods bound to real-node-1 run as containers
    ```"""

    def __init__(self, name: str, directory: Path, api_url: str, pki_dir: Path,
                 index: int = 1, node_lease_seconds: int = NODE_LEASE_SECONDS,
                 egress_routes: Path | None = None, registry: str | None = None,
                 network: ClusterNetwork | None = None,
                 network_policies: bool = False,
                 feature_gates: Mapping[str, bool] | None = None,
                 config: NodeConfig | None = None) -> None:
        """`egress_routes`: the cluster's egress proxy's routes (`egressproxy.py`), without
        which kube-apiserver cannot reach this kubelet (no logs, exec or port-forward).
        `registry`: an image registry on this host's loopback (`Registry.host`,
        127.0.0.1:PORT), which the node pulls from under the same name (`noderegistry.py`).
        `network`: the cluster network the node joins (`nodenet.py`): its pods then reach
        other nodes' pods, Services (kube-proxy runs) and cluster DNS (`clusterdns.py`).
        `network_policies`: NetworkPolicies are enforced on the node (`netpolicy.py`); needs
        `network`. Off by default, as on a GKE cluster without Dataplane V2 or network policy
        enforcement: with it every new connection of a pod a policy selects waits on the
        enforcer in userspace.
        `feature_gates`: this kubelet's `featureGates` (its configuration file), over the
        release's defaults; kube-apiserver's are the cluster's (`ClusterConfig.feature_gates`).
        A gate another one depends on can be turned off only with its dependents
        (`ContainerRestartRules` with `RestartAllContainersOnContainerExits`): the kubelet
        refuses to start otherwise (`KUBELET_WITHOUT_RESTART_RULES`).
        `config`: the node as its GKE node pool makes it (`nodeshape.py`): its labels and
        pool label, taints, allocatable cpu/memory/pods and extended resources (its feature
        gates join `feature_gates`); NodeShapeError at once if this machine cannot be it.
        None: the kubelet's defaults, the whole machine allocatable."""
        if network_policies and network is None:
            raise ValueError("network_policies=True needs a cluster network (network=): "
                             "the enforcer filters traffic between nodes' pods")
        self.network_policies = network_policies
        if config is not None and config.name != name:
            raise ValueError(f"node {name}: its NodeConfig is named {config.name!r}")
        self.config = config
        self.shape = (nodeshape.shape(config, nodeshape.Machine.here())
                      if config is not None else None)
        self.feature_gates = {**(config.feature_gates if config else {}),
                              **(feature_gates or {})}
        self.name = name
        self.directory = directory.absolute()
        self.api_url = api_url
        self.pki_dir = pki_dir
        self.egress_routes = egress_routes
        self.registry = registry
        if registry is not None:
            noderegistry.split_host(registry)  # refused early, naming the form it needs
        self.network = network
        self.index = index
        self.addresses = Addresses.for_index(index)
        self.node_lease_seconds = node_lease_seconds
        # One id per node directory: two clusters' nodes of the same name never share a
        # namespace or a cgroup.
        self.id = "tdg-" + hashlib.sha256(str(self.directory).encode()).hexdigest()[:10]
        self.footprint = NodeFootprint(self.directory, self.id)
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self._logs: list[TextIO] = []

    @classmethod
    def for_cluster(cls, info: Mapping[str, Any], name: str, directory: Path,
                    index: int = 1, registry: str | None = None,
                    network: ClusterNetwork | None = None,
                    network_policies: bool = False,
                    feature_gates: Mapping[str, bool] | None = None,
                    node_lease_seconds: int = NODE_LEASE_SECONDS,
                    config: NodeConfig | None = None) -> RealNode:
        """A node of the local cluster whose `cluster.json` is `info` (`LocalCluster.info`);
        start it with `ClusterConfig(node_egress=True)` for the API server to reach it."""
        routes = info.get("egress_routes")
        return cls(name, directory, str(info["direct_api_url"]), Path(info["ca_file"]).parent,
                   index=index, egress_routes=Path(routes) if routes else None,
                   registry=registry, network=network, network_policies=network_policies,
                   feature_gates=feature_gates, node_lease_seconds=node_lease_seconds,
                   config=config)

    # --- where things are --------------------------------------------------------------------
    @property
    def netns_path(self) -> Path:
        return self.footprint.netns_path

    @property
    def cgroup_root(self) -> str:
        return self.footprint.cgroup_root

    @property
    def socket_dir(self) -> Path:
        """containerd's sockets, on a short path: a unix socket's path has a limit (104
        bytes for containerd's ttrpc one), which a node directory under a test's temporary
        folder can exceed on its own."""
        return RECORDS_DIR / self.id

    @property
    def containerd_socket(self) -> Path:
        return self.socket_dir / "containerd.sock"

    @property
    def logs_dir(self) -> Path:
        return self.directory / "logs"

    @property
    def pod_logs_dir(self) -> Path:
        return self.directory / "pod-logs"

    def crictl(self, *args: str, timeout: float = 60) -> str:
        """crictl against this node's containerd (e.g. `crictl("ps", "-a")`)."""
        done = subprocess.run(
            [str(gobuild.binary("crictl")), "--runtime-endpoint",
             f"unix://{self.containerd_socket}", "--timeout", "30s", *args],
            capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            raise RealNodeError(f"crictl {' '.join(args)}: {done.stderr.strip()}")
        return done.stdout

    # --- lifecycle ---------------------------------------------------------------------------
    def __enter__(self) -> RealNode:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def start(self, timeout: float = START_TIMEOUT_SECONDS) -> RealNode:
        if os.geteuid() != 0:
            raise RealNodeError("a real node needs root (network namespace, mounts, cgroups)")
        if len(str(self.directory)) > MAX_DIRECTORY_CHARS:
            raise RealNodeError(
                f"the node directory {self.directory} is {len(str(self.directory))} characters "
                f"long: the kubelet's sockets under it (kubelet/device-plugins/kubelet.sock) "
                f"would pass the 108-byte limit of a unix socket's path; give the node a "
                f"directory of at most {MAX_DIRECTORY_CHARS} characters")
        for program in ("kubelet", "containerd", "runc", "crictl", "bridge"):
            gobuild.binary(program)  # BuildError naming the fix if a program is not built
        if self.network_policies:
            gobuild.binary(netpolicy.NAME)
        if shutil.which("dbus-daemon") is None:
            raise RealNodeError("a real node's system bus needs dbus-daemon: apt-get install "
                                "dbus-daemon (scripts/setup does)")
        try:
            self._start(time.monotonic() + timeout)
        except BaseException:
            self.stop()
            raise
        return self

    @property
    def _record(self) -> Path:
        return RECORDS_DIR / f"{self.id}.json"

    def _write_record(self) -> None:
        RECORDS_DIR.mkdir(mode=0o700, exist_ok=True)
        me = psutil.Process()
        self._record.write_text(json.dumps({
            "name": self.name, "directory": str(self.directory), "index": self.index,
            "egress_routes": str(self.egress_routes) if self.egress_routes else None,
            "owner": me.pid, "owner_started": me.create_time()}))

    def _start(self, deadline: float) -> None:
        self._write_record()
        self.socket_dir.mkdir(mode=0o700, exist_ok=True)
        for sub in ("etc", "pki", "logs", "pod-logs", "kubelet", "containerd", "cni/conf",
                    "cni/ipam"):
            (self.directory / sub).mkdir(parents=True, exist_ok=True)
        self._make_netns()
        self._make_cgroups()
        self._write_pki()
        self._write_cni()
        self._spawn("netnsproxy", [sys.executable, "-m", "tardigrade_local.netnsproxy",
                                   str(self.netns_path), str(API_PORT_IN_NODE),
                                   self._api_host_port()], in_node=False)
        self._reach_registry()
        self._spawn("containerd", [str(gobuild.binary("containerd")), "--config",
                                   str(self._write_containerd_config())])
        self._wait(deadline, "containerd's socket", self._containerd_up)
        nodeimage.import_into(gobuild.binary("ctr"), str(self.containerd_socket))
        bus_env = self._start_system_bus(deadline)
        self._spawn("kubelet", [
            str(gobuild.binary("kubelet")), f"--config={self._write_kubelet_config()}",
            f"--kubeconfig={self.directory / 'etc' / 'kubelet.kubeconfig'}",
            f"--root-dir={self.directory / 'kubelet'}", f"--hostname-override={self.name}",
            f"--node-ip={self.addresses.node_ip}", "--v=2",
            *([f"--node-labels={self.shape.node_labels}"] if self.shape else [])],
            extra_env=bus_env)
        if self.network is not None:
            self._start_kube_proxy()
        self._wait(deadline, f"Node {self.name} Ready", self._ready)
        if self.shape is not None:
            self._take_shape(deadline)
        if self.network_policies:
            # After the Node exists (it reads its address there), as a DaemonSet's pod would.
            self._start_network_policies()
        # Its shutdown manager starts beside the node's registration: a shutdown before it
        # holds its lock would find no kubelet listening.
        self._wait(deadline, "the kubelet's shutdown delay lock on logind",
                   lambda: nodepower.KUBELET_LOCK_HOLDER in (self.logind.holders() or []))

    def _start_system_bus(self, deadline: float) -> dict[str, str]:
        """The node's system bus and logind on it; the kubelet's environment to reach them."""
        daemon, logind, env = nodepower.bus_commands(self.directory, self.socket_dir,
                                                     sys.executable)
        self._spawn("dbus", daemon)
        self._spawn("logind", logind)
        self._wait(deadline, "logind on the node's system bus",
                   lambda: self.logind.holders() is not None)
        return env

    @property
    def logind(self) -> nodepower.LogindControl:
        return nodepower.LogindControl(self.socket_dir / nodepower.CONTROL_SOCKET)

    @property
    def registry_config_path(self) -> Path:
        """containerd's registry host configurations (`config_path`, docs/hosts.md)."""
        return self.directory / "containerd" / "certs.d"

    def _reach_registry(self) -> None:
        if self.registry is None:
            return
        noderegistry.write_hosts(self.registry_config_path, self.registry)
        self._spawn(noderegistry.PROXY_NAME, noderegistry.proxy_argv(
            sys.executable, self.netns_path, self.registry), in_node=False)

    def _api_host_port(self) -> str:
        parsed = urllib.parse.urlsplit(self.api_url)
        return f"{parsed.hostname}:{parsed.port}"

    def _make_netns(self) -> None:
        _run("ip", "netns", "add", self.id)
        _run("ip", "-n", self.id, "link", "set", "lo", "up")
        if self.network is not None:
            self.network.join(self.id, self.addresses.node_ip, self.addresses.pod_cidr)
        else:
            # The kubelet refuses a loopback node address (validateNodeIP); this one is on
            # the namespace's loopback device but is not 127/8.
            _run("ip", "-n", self.id, "addr", "add", f"{self.addresses.node_ip}/32", "dev",
                 "lo")
        if self.egress_routes is not None:
            self.egress_routes.mkdir(parents=True, exist_ok=True)
            self._route_file.write_text(str(self.netns_path))

    @property
    def _route_file(self) -> Path:
        assert self.egress_routes is not None
        return self.egress_routes / self.addresses.node_ip

    def _make_cgroups(self) -> None:
        for hierarchy in cgroup_hierarchies(v2=False):
            path = hierarchy / self.id
            path.mkdir(exist_ok=True)
            if (hierarchy / "cpuset.cpus").exists():
                # A new cpuset cgroup starts empty, and no task can join it until set.
                for knob in ("cpuset.cpus", "cpuset.mems"):
                    (path / knob).write_text((hierarchy / knob).read_text())

    def _write_pki(self) -> None:
        authority = Authority.load(self.pki_dir)
        pki = self.directory / "pki"
        (pki / "ca.crt").write_bytes(authority.cert_pem)
        identity = identities.node_identity(self.name)
        client = authority.issue(identity.common_name, identity.organizations)
        serving = authority.issue(identity.common_name, identity.organizations, client=False,
                                  server=True, dns_names=(self.name,),
                                  ip_addresses=(self.addresses.node_ip,))
        serving.write(pki, "kubelet-serving")
        client.write(pki, "kubelet-client")
        write_kubeconfig(self.directory / "etc" / "kubelet.kubeconfig",
                         f"https://127.0.0.1:{API_PORT_IN_NODE}", user=identity.common_name,
                         ca_pem=authority.cert_pem, client_cert_pem=client.cert_pem,
                         client_key_pem=client.key_pem)

    def _write_cni(self) -> None:
        conflist = {
            "cniVersion": "1.0.0", "name": "tardigrade-pods",
            "plugins": [
                {"type": "bridge", "bridge": BRIDGE, "isGateway": True, "ipMasq": False,
                 "hairpinMode": True,
                 "ipam": {"type": "host-local", "ranges": [[{"subnet": self.addresses.pod_cidr,
                                                             "gateway": self.addresses.gateway}]],
                          # The pod's default route via its node (the bridge plugin adds
                          # only what IPAM returns): other nodes' pods, Services, DNS.
                          "routes": [{"dst": "0.0.0.0/0"}],
                          # Not /var/lib/cni: each node keeps its own leases.
                          "dataDir": str(self.directory / "cni" / "ipam")}},
                {"type": "portmap", "capabilities": {"portMappings": True}},
            ]}
        (self.directory / "cni" / "conf" / "10-pods.conflist").write_text(json.dumps(conflist))

    def _write_containerd_config(self) -> Path:
        c = self.directory / "containerd"
        runtime = 'plugins."io.containerd.cri.v1.runtime"'
        config = f"""\
version = 4
root = "{c / 'root'}"
state = "{c / 'state'}"
# Not the host's /etc/containerd/conf.d (the default): this node's settings are all here.
imports = []
# NRI would listen on the host-wide /var/run/nri/nri.sock; no NRI plugin runs here.
[plugins."io.containerd.nri.v1.nri"]
  disable = true
[plugins."io.containerd.server.v1.grpc"]
  address = "{self.containerd_socket}"
[plugins."io.containerd.server.v1.ttrpc"]
  address = "{self.socket_dir / 'containerd.sock.ttrpc'}"
[plugins."io.containerd.cri.v1.images"]
  snapshotter = "overlayfs"
  [plugins."io.containerd.cri.v1.images".pinned_images]
    sandbox = "{nodeimage.SANDBOX_IMAGE}"
  [plugins."io.containerd.cri.v1.images".registry]
    config_path = "{self.registry_config_path}"
[{runtime}]
  # Our machines lack CAP_SYS_RESOURCE: no container may get a lower OOM score than this.
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  [{runtime}.containerd]
    default_runtime_name = "runc"
    [{runtime}.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [{runtime}.containerd.runtimes.runc.options]
        SystemdCgroup = false
        BinaryName = "{gobuild.binary('runc')}"
        Root = "{c / 'runc'}"
  [{runtime}.cni]
    bin_dirs = ["{gobuild.binary('bridge').parent}"]
    conf_dir = "{self.directory / 'cni' / 'conf'}"
"""
        path = self.directory / "etc" / "containerd.toml"
        path.write_text(config)
        return path

    def _write_kubelet_config(self) -> Path:
        pki = self.directory / "pki"
        config: dict[str, Any] = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
            "containerRuntimeEndpoint": f"unix://{self.containerd_socket}",
            # Our machines are cgroup v1 (hybrid); see REAL_NODES.md.
            "failCgroupV1": False, "cgroupDriver": "cgroupfs", "cgroupRoot": self.cgroup_root,
            "failSwapOn": False,
            "address": self.addresses.node_ip, "port": KUBELET_PORT, "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1",
            "tlsCertFile": str(pki / "kubelet-serving.crt"),
            "tlsPrivateKeyFile": str(pki / "kubelet-serving.key"),
            "authentication": {"anonymous": {"enabled": False},
                               "webhook": {"enabled": True},
                               "x509": {"clientCAFile": str(pki / "ca.crt")}},
            "authorization": {"mode": "Webhook"},
            "podLogsDir": str(self.pod_logs_dir),
            # No cluster DNS yet: pods get an empty resolv.conf, not the host's.
            "resolvConf": "",
            # cadvisor finds no filesystem figures for this machine's disk: without these the
            # kubelet would account ephemeral storage and collect images from nothing.
            "localStorageCapacityIsolation": False,
            "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
            "nodeLeaseDurationSeconds": self.node_lease_seconds,
            "serializeImagePulls": False,
            # Taints, maxPods and the reservations of the node's NodeConfig (nodeshape.py).
            **(self.shape.config if self.shape else {}),
            # Graceful node shutdown with GKE's grace (nodepower.py).
            **nodepower.KUBELET_SHUTDOWN_CONFIG,
            **self._cluster_dns_config(),
            **({"featureGates": self.feature_gates} if self.feature_gates else {}),
        }
        path = self.directory / "etc" / "kubelet.json"
        path.write_text(json.dumps(config, indent=2))
        return path

    def _cluster_dns_config(self) -> dict[str, Any]:
        """On a cluster network, pods with `dnsPolicy: ClusterFirst` get the cluster's DNS
        (`clusterdns.py`) and its search path; `resolvConf` stays empty (no host DNS)."""
        if self.network is None:
            return {}
        return {"clusterDNS": [clusterdns.SERVICE_IP], "clusterDomain": clusterdns.DOMAIN}

    def _start_kube_proxy(self) -> None:
        self._spawn("kube-proxy", kubeproxy.command(
            self.directory / "etc", self.name, f"https://127.0.0.1:{API_PORT_IN_NODE}",
            self.pki_dir, str(POD_NETWORK)))

    def _start_network_policies(self) -> None:
        self._spawn(netpolicy.NAME, netpolicy.command(
            self.directory / "etc", self.name, f"https://127.0.0.1:{API_PORT_IN_NODE}",
            self.pki_dir, SERVICE_CIDR))

    def _spawn(self, name: str, argv: list[str], in_node: bool = True,
               extra_env: Mapping[str, str] | None = None) -> None:
        if in_node:
            argv = ["nsenter", f"--net={self.netns_path}", "--", *argv]
        log = open(self.logs_dir / f"{name}.log", "a")  # noqa: SIM115
        self._logs.append(log)
        env = {**os.environ,
               # containerd finds its shim on PATH.
               "PATH": os.pathsep.join([str(gobuild.binary("containerd").parent),
                                        os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")]),
               "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                              os.environ.get("PYTHONPATH", "")]),
               **(extra_env or {})}
        self._procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL, env=env,
                                             cwd=self.directory, preexec_fn=die_with_parent)

    def _wait(self, deadline: float, what: str, check: Any) -> None:
        while not check():
            for name, proc in self._procs.items():
                if proc.poll() is not None:
                    raise RealNodeError(f"{name} of node {self.name} exited ({proc.returncode})"
                                        f" while waiting for {what}:\n{self._tail(name)}")
            if time.monotonic() > deadline:
                raise RealNodeError(f"node {self.name}: no {what} in time:\n"
                                    f"{self._tail('kubelet')}")
            time.sleep(0.5)

    def _tail(self, name: str) -> str:
        with contextlib.suppress(OSError):
            return (self.logs_dir / f"{name}.log").read_text(errors="replace")[-3000:]
        return ""

    def _containerd_up(self) -> bool:
        if not self.containerd_socket.exists():
            return False
        done = subprocess.run([str(gobuild.binary("ctr")), "--address",
                               str(self.containerd_socket), "version"], capture_output=True)
        return done.returncode == 0

    def _node_request(self, method: str = "GET", body: Any = None,
                      content_type: str = "application/json-patch+json") -> dict[str, Any]:
        """A request about this node's Node object with the node's own credentials (the Node
        authorizer lets a node read it and write its status; NodeRestriction lets it change
        its status, not its labels or taints)."""
        pki = self.directory / "pki"
        context = ssl.create_default_context(cafile=str(pki / "ca.crt"))
        context.load_cert_chain(str(pki / "kubelet-client.crt"), str(pki / "kubelet-client.key"))
        path = f"{self.api_url}/api/v1/nodes/{self.name}" + ("/status" if body else "")
        request = urllib.request.Request(
            path, method=method, data=json.dumps(body).encode() if body else None,
            headers={"Content-Type": content_type} if body else {})
        with urllib.request.urlopen(request, context=context, timeout=10) as response:
            return dict(json.loads(response.read()))

    def _ready(self) -> bool:
        """The Node is Ready, read with the node's own credentials."""
        try:
            node = self._node_request()
        except (urllib.error.URLError, OSError, ValueError):
            return False
        return any(c["type"] == "Ready" and c["status"] == "True"
                   for c in node.get("status", {}).get("conditions", []))

    def _take_shape(self, deadline: float) -> None:
        """Advertise the config's extended resources (a PATCH of the Node's status capacity,
        as no device plugin runs here: nodeshape.py), then wait until the Node shows the
        config's allocatable: the kubelet derives the extended resources' allocatable in its
        next status update (every nodeStatusUpdateFrequency, 10 s), which also shows that it
        keeps them. Done on every start: a VM recreated under the name of a Node object that
        stayed gets a kubelet that may zero them (`reconcileExtendedResource`)."""
        assert self.shape is not None
        shape = self.shape
        if shape.extended:
            self._node_request("PATCH", nodeshape.capacity_patch(shape.extended))
        wrong: list[str] = []

        def shaped() -> bool:
            nonlocal wrong
            try:
                wrong = nodeshape.mismatches(shape, self._node_request())
            except (urllib.error.URLError, OSError, ValueError) as err:
                wrong = [str(err)]
            return not wrong

        try:
            self._wait(deadline, f"Node {self.name} with its config's allocatable", shaped)
        except RealNodeError as err:
            raise RealNodeError(f"node {self.name} does not show its NodeConfig: "
                                f"{'; '.join(wrong)}\n{err}") from err

    # --- power -------------------------------------------------------------------------------
    def shutdown(self) -> dict[str, Any]:
        """The VM shuts down (a spot reclaim, a maintenance event): logind emits
        PrepareForShutdown(true) and waits until the kubelet releases its delay lock (its
        graceful node shutdown: the Node Ready=False, the pods killed by priority group and
        marked with DisruptionTarget) or InhibitDelayMaxUSec passes; then the machine powers
        off (`halt`). Returns logind's account: `released`, `seconds`, `holders`."""
        try:
            account = self.logind.prepare_for_shutdown(
                timeout=nodepower.INHIBIT_DELAY_MAX_USEC / 1e6 + STOP_TIMEOUT_SECONDS)
        except (OSError, ValueError) as err:
            raise RealNodeError(f"node {self.name}: logind did not answer ({err}): is the "
                                f"node started?") from err
        self.halt()
        return account

    def halt(self) -> None:
        """The VM is lost without a shutdown: the kubelet, containerd, the containers and
        everything else of the node are killed at once, with no notice to anyone; then what
        the dead machine leaves on ours goes (`stop`). On a cluster network the node is
        unplugged from it first: a killed process's kernel closes its connections (FIN or
        RST), a VM that loses power sends nothing, so its pods' peers must see silence."""
        if self.network is not None:
            self.network.leave(self.id, self.addresses.pod_cidr)
        alive = [proc for proc in self._procs.values() if proc.poll() is None]
        first = [self._procs[name].pid for name in ("kubelet", "containerd")
                 if name in self._procs and self._procs[name] in alive]
        nodepower.kill_at_once([*first, *self.footprint.processes(),
                                *(proc.pid for proc in alive)])
        nodepower.reap(alive)
        self.stop()

    def partition(self) -> None:
        """The node and the control plane can no longer reach each other (a network
        partition), while everything on the node runs on: inside the node's namespace,
        what its kubelet and kube-proxy send to the API server (`API_PORT_IN_NODE`, the
        netnsproxy) and what the API server sends to the kubelet (its port: logs, exec) are
        dropped. Dropped, not refused: a partition is silence, so the kubelet's requests
        time out as across a real one. Its pods' traffic, to each other and to other
        nodes' pods, goes on. `heal` undoes it."""
        _nft(self.id, f"""
table inet {PARTITION_TABLE} {{
  chain out {{
    type filter hook output priority 0; policy accept;
    ip daddr 127.0.0.1 tcp dport {API_PORT_IN_NODE} drop
  }}
  chain in {{
    type filter hook input priority 0; policy accept;
    ip daddr {self.addresses.node_ip} tcp dport {KUBELET_PORT} drop
  }}
}}
""")

    def heal(self) -> None:
        """The partition is over (`partition`): the kubelet's retries get through again.
        Idempotent."""
        with contextlib.suppress(RealNodeError):
            _nft(self.id, f"delete table inet {PARTITION_TABLE}")

    # --- teardown ----------------------------------------------------------------------------
    def stop(self) -> None:
        """Stop the kubelet, then every pod (containerd tears down their networks and
        mounts), then containerd; kill whatever is left in the node's cgroups or network
        namespace; unmount everything under the node's directory; remove its cgroups and
        its network namespace. Idempotent."""
        self._terminate("kubelet")
        self._terminate("kube-proxy")
        self._terminate(netpolicy.NAME)
        if "containerd" in self._procs and self._procs["containerd"].poll() is None:
            with contextlib.suppress(RealNodeError, subprocess.TimeoutExpired):
                self.crictl("rmp", "--all", "--force", timeout=STOP_TIMEOUT_SECONDS)
        self._terminate("containerd")
        self._terminate("netnsproxy")
        self._terminate(noderegistry.PROXY_NAME)
        if self.egress_routes is not None:
            self._route_file.unlink(missing_ok=True)
        if self.network is not None:
            self.network.leave(self.id, self.addresses.pod_cidr)
        self.footprint.clear()
        self._discard_images()
        for log in self._logs:
            log.close()
        self._logs.clear()
        shutil.rmtree(self.socket_dir, ignore_errors=True)
        self._record.unlink(missing_ok=True)

    def _discard_images(self) -> None:
        """The VM's disk goes with it: containerd's content and snapshots (up to a few GB a
        node: the unpacked images) are removed; the logs stay. Only once nothing is mounted
        under the node any more, so that nothing reached through a mount is removed."""
        if not self.footprint.mounts():
            shutil.rmtree(self.directory / "containerd" / "root", ignore_errors=True)

    def _terminate(self, name: str) -> None:
        proc = self._procs.get(name)
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(STOP_TIMEOUT_SECONDS)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)

    def exits(self) -> dict[str, int | None]:
        """Each process this node started (kubelet, containerd, the system bus...) -> its exit
        status, None while it runs: what a VM's init would show of its services."""
        return {name: proc.poll() for name, proc in self._procs.items()}

    def leftovers(self) -> dict[str, list[str]]:
        """What of this node is still on the machine (all empty once stopped)."""
        return self.footprint.leftovers()


def sweep_orphans() -> list[str]:
    """Tear down the real nodes whose starting process is gone (a test run killed before its
    teardown): their containers, shims, mounts, cgroups and namespaces. Returns their names."""
    swept = []
    for record, data in orphan_records(RECORDS_DIR):
        routes = data.get("egress_routes")
        node = RealNode(data["name"], Path(data["directory"]), "", Path(),
                        index=data["index"], egress_routes=Path(routes) if routes else None)
        node.stop()
        record.unlink(missing_ok=True)
        swept.append(node.name)
    return swept


def _nft(netns: str, script: str) -> None:
    """An nftables script run in the network namespace `netns` (kube-proxy's own table there
    is left alone)."""
    done = subprocess.run(["ip", "netns", "exec", netns, "nft", "-f", "-"], input=script,
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise RealNodeError(f"nft in {netns} failed: {done.stderr.strip()}")


def _run(*argv: str) -> None:
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise RealNodeError(f"{' '.join(argv)} failed: {done.stderr.strip()}")
