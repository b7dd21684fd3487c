"""The local control plane: the real etcd, kube-apiserver, kube-controller-manager and
kube-scheduler, GKE's part, a GCS emulator and optionally Kueue and the operator, under one
state directory. Nodes join it from elsewhere: real nodes (`realcluster.RealNodeCluster`,
`tardigrade local up`), or, for benches only, the simulator's nodes (`simulator/`,
`simulated_nodes`).

Two halves:
- `serve(config)` supervises everything from one process (`python -m tardigrade_local.cluster
  STATE`): the control plane's components are its child processes (`controlplane.py`), the
  simulated nodes (if any) run on its event loop (`simulator/host.py`); it writes
  `cluster.json` (see `paths.StateLayout`) when ready and stops on SIGTERM/SIGINT;
- `LocalCluster` starts that process in the background and drives it: the API for tests,
  benches and the CLI. Disruptions go through the process's loopback control endpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import shutil
import signal
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import Awaitable, Iterable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import psutil
from aiohttp import web

import tardigrade_local
from tardigrade_local import gcs, gobuild, identities
from tardigrade_local.apiproxy import ApiProxy
from tardigrade_local.controlplane import (
    NODE_MONITOR_GRACE_SECONDS,
    NODE_MONITOR_PERIOD_SECONDS,
    ControlPlane,
    ControlPlaneSettings,
)
from tardigrade_local.gke import hostmaintenance, realreclaim
from tardigrade_local.gke.autoscaler import SCAN_INTERVAL_SECONDS, NodeAutoscaler, NodePool
from tardigrade_local.gke.client import ApiClient, core_path
from tardigrade_local.gke.cloud import GkeCloud
from tardigrade_local.gke.disruptions import REGULAR_POD_SHUTDOWN_GRACE_SECONDS, Disruptor
from tardigrade_local.gke.nodes import DEFAULT_NODE_CAPACITY, NodeConfig
from tardigrade_local.gke.provisioning import QueuedProvisioner
from tardigrade_local.kubeconfig import write_kubeconfig
from tardigrade_local.kueue import WaitForPodsReady
from tardigrade_local.lifetime import die_with_parent
from tardigrade_local.paths import StateLayout, project_python_path
from tardigrade_local.simulator import SimulatedHost, SimulatorSettings
from tardigrade_local.simulator.config import NODE_LEASE_SECONDS

log = logging.getLogger(__name__)

CONFIG_FILE = "cluster-config.json"
# A cold start builds nothing (scripts/setup did), but a busy CI machine starts the
# components slowly: the control plane's own readiness waits are longer.
READY_TIMEOUT_SECONDS = 180.0
# On top, per node: with the controller manager's default client rate (20 QPS), the node
# lifecycle controller lifts each new Node's not-ready taint at about 10 nodes a second.
READY_SECONDS_PER_NODE = 0.25
STOP_TIMEOUT_SECONDS = 30.0


def repo_root() -> Path:
    return Path(tardigrade_local.__file__).resolve().parents[2]


TRAINER_TOKEN_REVIEW = "tardigrade-trainer-tokenreview"


def trainer_token_review_objects() -> list[tuple[str, dict[str, Any]]]:
    """What the chart grants trainers (values trainerTokenReview): rank 0 reviews its peers'
    rendezvous tokens. A cluster that starts the operator itself grants it too."""
    rbac = "rbac.authorization.k8s.io/v1"
    return [
        ("clusterroles", {
            "apiVersion": rbac, "kind": "ClusterRole", "metadata": {"name": TRAINER_TOKEN_REVIEW},
            "rules": [{"apiGroups": ["authentication.k8s.io"], "resources": ["tokenreviews"],
                       "verbs": ["create"]}]}),
        ("clusterrolebindings", {
            "apiVersion": rbac, "kind": "ClusterRoleBinding",
            "metadata": {"name": TRAINER_TOKEN_REVIEW},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                        "name": TRAINER_TOKEN_REVIEW},
            "subjects": [{"kind": "Group", "apiGroup": "rbac.authorization.k8s.io",
                          "name": "system:serviceaccounts"}]}),
    ]


async def _grant_trainer_token_review(plane: ControlPlane) -> None:
    async with plane.admin_session() as session:
        for plural, body in trainer_token_review_objects():
            url = f"{plane.api_url}/apis/rbac.authorization.k8s.io/v1/{plural}"
            async with session.post(url, json=body) as resp:
                if resp.status not in (201, 409):  # 409: a cluster restarted on its state
                    raise RuntimeError(f"cannot grant {plural}: {await resp.text()}")


def simulated_nodes(count: int, capacity: Mapping[str, str] | None = None,
                    prefix: str = "sim-node") -> list[NodeConfig]:
    """Simulated nodes, whose pods run without processes (`simulator/`): for benches only."""
    extra = dict(capacity or {})
    return [NodeConfig(f"{prefix}-{i}", capacity={**DEFAULT_NODE_CAPACITY, **extra},
                       simulated=True) for i in range(1, count + 1)]


@dataclasses.dataclass
class ClusterConfig:
    """How a local cluster is made. `local_cluster/README.md` ("The control plane") tables
    each field that sets a component's flag, and the upstream timings no flag sets."""

    state_dir: Path
    # Simulated nodes (benches only: `simulator/`); none: the control plane alone, which
    # real nodes join (`realcluster.RealNodeCluster`).
    nodes: list[NodeConfig] = dataclasses.field(default_factory=list)
    with_gcs: bool = True
    buckets: list[str] = dataclasses.field(default_factory=lambda: ["tardigrade"])
    crd_files: list[Path] = dataclasses.field(default_factory=list)
    load_repo_crds: bool = True
    pod_env: dict[str, str] = dataclasses.field(default_factory=dict)
    # What regular pods get on a node shutdown (GKE spot: 15 s of the 30 s notice).
    shutdown_grace_seconds: float = REGULAR_POD_SHUTDOWN_GRACE_SECONDS
    # kube-controller-manager --node-monitor-grace-period (50 s since 1.32) and
    # --node-monitor-period (5 s): a node whose Lease went unrenewed that long turns Unknown
    # and is tainted unreachable. The kubelets' Lease lasts `node_lease_seconds` (40 s) and
    # is renewed every quarter of it; the grace must exceed the renew interval.
    node_monitor_grace_seconds: float = NODE_MONITOR_GRACE_SECONDS
    node_monitor_period_seconds: float = NODE_MONITOR_PERIOD_SECONDS
    node_lease_seconds: float = NODE_LEASE_SECONDS
    # kube-apiserver --default-not-ready-toleration-seconds and
    # --default-unreachable-toleration-seconds: how long pods stay on an Unknown node.
    default_toleration_seconds: int = 300
    backoff_base_seconds: float = 10.0
    # Simulated nodes: seconds a container takes from ContainerCreating to Running.
    simulated_start_seconds: float = 0.0
    # A reclaimed spot VM comes back under its name after this many seconds, as its node
    # pool's managed instance group recreates it; None: never. `tardigrade local up` turns it
    # on (disruptions.DEFAULT_REPLACE_AFTER_SECONDS); tests choose per preemption.
    replace_after_seconds: float | None = None
    # Pools a cluster autoscaler may grow for unschedulable pods (none: no autoscaler); those
    # with `queued_provisioning` grow only for ProvisioningRequests (needs `kueue`).
    node_pools: list[NodePool] = dataclasses.field(default_factory=list)
    autoscaler_scan_seconds: float = SCAN_INTERVAL_SECONDS
    # A command to run with KUBECONFIG set once the cluster is up (e.g. the operator).
    operator_command: list[str] | None = None
    # --feature-gates of kube-apiserver, kube-controller-manager and kube-scheduler
    # (`Name=true,...`), passed as given; each simulated node has its own (NodeConfig).
    feature_gates: str = ""
    # Put users' kubeconfig through a TCP proxy whose connections a test can cut
    # (`apiproxy.py`, `LocalCluster.cut_watches`).
    api_proxy: bool = True
    # The controller manager's and scheduler's client QPS and burst (benches at scale).
    component_qps: float | None = None
    component_burst: int | None = None
    # Start Kueue's manager (`kueue.py`), built from its pinned module on first use.
    kueue: bool = False
    # Kueue's waitForPodsReady (`kueue.WaitForPodsReady`); None: Kueue's default (on, 30 min,
    # from v0.19).
    kueue_wait_for_pods_ready: WaitForPodsReady | None = None
    # Real nodes may join (`realnode.py`): kube-apiserver reaches kubelets and webhooks
    # through the egress proxy (`egressproxy.py`), which enters their network namespaces.
    node_egress: bool = False
    # kube-controller-manager runs the endpoint controllers (off while pods have loopback
    # addresses, which EndpointSlices refuse): for real nodes, whose Services kube-proxy and
    # CoreDNS serve (`nodenet.py`, `clusterdns.py`).
    endpoint_controllers: bool = False

    def control_plane_settings(self) -> ControlPlaneSettings:
        return ControlPlaneSettings(
            feature_gates=self.feature_gates,
            node_monitor_period_seconds=self.node_monitor_period_seconds,
            node_monitor_grace_seconds=self.node_monitor_grace_seconds,
            default_toleration_seconds=self.default_toleration_seconds,
            component_qps=self.component_qps, component_burst=self.component_burst,
            node_egress=self.node_egress, endpoint_controllers=self.endpoint_controllers)

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["state_dir"] = str(self.state_dir)
        data["nodes"] = [n.to_dict() for n in self.nodes]
        data["crd_files"] = [str(p) for p in self.crd_files]
        data["node_pools"] = [p.to_dict() for p in self.node_pools]
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ClusterConfig:
        fields = dict(data)
        fields["state_dir"] = Path(data["state_dir"])
        fields["nodes"] = [NodeConfig.from_dict(n) for n in data.get("nodes") or []]
        fields["crd_files"] = [Path(p) for p in data.get("crd_files") or []]
        fields["node_pools"] = [NodePool.from_dict(p) for p in data.get("node_pools") or []]
        fields["kueue_wait_for_pods_ready"] = WaitForPodsReady.from_dict(
            data.get("kueue_wait_for_pods_ready"))
        return cls(**fields)


# --- the cluster process ---------------------------------------------------------------------
def crd_files(config: ClusterConfig) -> list[Path]:
    files = list(config.crd_files)
    crd_dir = repo_root() / "crds"
    if config.load_repo_crds and crd_dir.is_dir():
        files += sorted([*crd_dir.glob("*.yaml"), *crd_dir.glob("*.yml")])
    return files


async def _together(acts: Iterable[Awaitable[Any]]) -> None:
    """Every one of `acts` at once (the hosts of a slice go together)."""
    await asyncio.gather(*acts)


def _control_app(host: SimulatedHost | None, cloud: GkeCloud, plane: ControlPlane,
                 proxy: ApiProxy | None) -> web.Application:
    """The 'cloud console': node lifecycle and faults, which no Kubernetes API expresses.
    `host`: the simulated nodes (benches only), if the cluster has any."""
    background: set[asyncio.Task[Any]] = set()

    def real_node(name: str) -> realreclaim.RealNode | None:
        """A real node of this cluster (`realnode.py`): its kubelet is the real one, so GKE
        acts on its machine, not on a simulated node's agent."""
        if host is not None and name in host.agents:
            return None
        return realreclaim.recorded_node(name, plane.egress_routes)

    async def slice_of(name: str, real: realreclaim.RealNode) -> list[realreclaim.RealNode]:
        """Real node `real` (Node `name`) and the other running hosts of its multi-host TPU
        slice, which the cloud stops and maintains with it."""
        listed = await cloud.client.get(core_path("nodes")) or {}
        mates = [found for host in realreclaim.slice_hosts(listed.get("items") or [], name)
                 if host != name and (found := real_node(host)) is not None]
        return [real, *mates]

    def simulator(what: str) -> SimulatedHost:
        """The simulated nodes, for what only they do; KeyError (404) without them."""
        if host is None:
            raise KeyError(f"{what}: this cluster has no simulated nodes (real nodes are "
                           f"driven by the RealNodeCluster that started them)")
        return host

    def refuse_for_real_node(name: str, body: dict[str, Any], *fields: str) -> None:
        given = [f for f in fields if body.get(f) is not None]
        if given:
            raise web.HTTPBadRequest(text=(
                f"{', '.join(given)}: not for {name}, a real node: its grace is its kubelet's "
                f"shutdownGracePeriod, and the process that started it would have to start "
                f"it again; leave {' and '.join(given)} out"))

    async def run(coro: Any, wait: bool) -> None:
        task = asyncio.create_task(coro)
        background.add(task)
        task.add_done_callback(background.discard)
        if wait:
            await task

    async def node_of_pod(namespace: str, pod: str) -> str:
        obj = await cloud.client.get(core_path("pods", namespace, pod))
        node = (obj or {}).get("spec", {}).get("nodeName")
        if not node:
            raise KeyError(f'pod "{namespace}/{pod}" is not bound to a node')
        return str(node)

    async def preempt(request: web.Request) -> web.Response:
        body = await request.json()
        if "namespace" in request.match_info:
            node = await node_of_pod(request.match_info["namespace"], request.match_info["pod"])
        else:
            node = request.match_info["node"]
        if (real := real_node(node)) is not None:
            refuse_for_real_node(node, body, "graceSeconds", "replaceAfterSeconds")
            hosts = await slice_of(node, real)
            await run(_together(realreclaim.reclaim(cloud, host) for host in hosts),
                      bool(body.get("wait")))
            return web.json_response({"node": node, "nodes": [host.name for host in hosts]})
        sim = simulator(node)
        sim._agent(node)  # unknown node -> KeyError -> 404
        await run(sim.preempt_node(node, body.get("graceSeconds"),
                                   body.get("replaceAfterSeconds")), bool(body.get("wait")))
        return web.json_response({"node": node})

    async def halt(request: web.Request) -> web.Response:
        body = await request.json()
        node = request.match_info["node"]
        if (real := real_node(node)) is not None:
            refuse_for_real_node(node, body, "backAfterSeconds")
            hosts = await slice_of(node, real)
            await run(realreclaim.lose(real, hosts[1:]), bool(body.get("wait")))
            return web.json_response({"node": node, "nodes": [host.name for host in hosts]})
        sim = simulator(node)
        sim._agent(node)  # unknown node -> KeyError -> 404
        await run(sim.halt_node(node, body.get("backAfterSeconds")), bool(body.get("wait")))
        return web.json_response({"node": node})

    async def maintenance(request: web.Request) -> web.Response:
        body = await request.json()
        node = request.match_info["node"]
        if (real := real_node(node)) is not None:
            refuse_for_real_node(node, body, "backAfterSeconds")
            hosts = await slice_of(node, real)
            start = hostmaintenance.start_after(float(body["inSeconds"]))
            for host in hosts:
                await hostmaintenance.announce_at(cloud, host.name, start)
            await run(_together(realreclaim.maintain(cloud, host, start) for host in hosts),
                      False)
            return web.json_response({"node": node, "start": start,
                                      "nodes": [host.name for host in hosts]})
        start = await simulator(node).schedule_maintenance(node, float(body["inSeconds"]),
                                                           body.get("backAfterSeconds"))
        return web.json_response({"node": node, "start": start})

    async def partition(request: web.Request) -> web.Response:
        body = await request.json()
        node = request.match_info["node"]
        sim = simulator(node)
        sim._agent(node)
        await run(sim.partition_node(node, float(body["seconds"])), bool(body.get("wait")))
        return web.json_response({"node": node})

    async def delete_node(request: web.Request) -> web.Response:
        await simulator(request.match_info["node"]).lose_node(request.match_info["node"])
        return web.json_response({"node": request.match_info["node"]})

    async def add_node(request: web.Request) -> web.Response:
        # A node added here is one more of the simulator's: real nodes are started by the
        # RealNodeCluster that runs them.
        config = dataclasses.replace(NodeConfig.from_dict(await request.json()), simulated=True)
        await simulator(config.name).add_node(config)
        return web.json_response(config.to_dict())

    async def crash(request: web.Request) -> web.Response:
        body = await request.json()
        pod = f"{request.match_info['namespace']}/{request.match_info['pod']}"
        simulator(pod).crash_pod(request.match_info["namespace"], request.match_info["pod"],
                                 body.get("container"),
                                 int(body.get("signal") or signal.SIGKILL))
        return web.json_response({})

    async def status(request: web.Request) -> web.Response:
        nodes = host.status() if host is not None else {"nodes": []}
        return web.json_response({**nodes, "processes": plane.pids()})

    async def restart_apiserver(request: web.Request) -> web.Response:
        """kube-apiserver's process stops, stays down `downtimeSeconds`, starts again; with
        `expireHistory`, etcd's history is compacted meanwhile, so watches resumed from
        before the restart get 410 Gone."""
        body = await request.json()
        await plane.restart_apiserver(float(body.get("downtimeSeconds") or 0),
                                      compact=bool(body.get("expireHistory", True)))
        return web.json_response({"url": plane.api_url})

    async def cut_watches(request: web.Request) -> web.Response:
        body = await request.json()
        if proxy is None:
            raise ValueError("this cluster has no API proxy to cut (ClusterConfig.api_proxy)")
        if body.get("expireHistory"):
            await plane.compact()
        return web.json_response({"cut": proxy.cut()})

    @web.middleware
    async def errors(request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            return await handler(request)
        except KeyError as err:
            return web.json_response({"error": str(err.args[0])}, status=404)
        except ValueError as err:
            return web.json_response({"error": str(err)}, status=400)

    app = web.Application(middlewares=[errors])
    app.add_routes([
        web.post("/nodes/{node}/preempt", preempt),
        web.post("/pods/{namespace}/{pod}/preempt", preempt),
        web.post("/nodes/{node}/halt", halt),
        web.post("/nodes/{node}/partition", partition),
        web.post("/nodes/{node}/maintenance", maintenance),
        web.delete("/nodes/{node}", delete_node),
        web.post("/nodes", add_node),
        web.post("/pods/{namespace}/{pod}/crash", crash),
        web.get("/status", status),
        web.post("/apiserver/restart", restart_apiserver),
        web.post("/apiserver/cut-watches", cut_watches),
    ])
    return app


def _simulator_settings(config: ClusterConfig, layout: StateLayout, plane: ControlPlane,
                        pod_env: Mapping[str, str]) -> SimulatorSettings:
    return SimulatorSettings(
        layout=layout, api_url=plane.api_url, access=plane, cluster_env=pod_env,
        backoff_base_seconds=config.backoff_base_seconds,
        shutdown_grace_seconds=config.shutdown_grace_seconds,
        replace_after_seconds=config.replace_after_seconds,
        node_lease_seconds=config.node_lease_seconds,
        simulated_start_seconds=config.simulated_start_seconds,
    )


async def serve(config: ClusterConfig) -> None:
    """Run the whole cluster until SIGTERM/SIGINT."""
    layout = StateLayout(config.state_dir.absolute())
    layout.root.mkdir(parents=True, exist_ok=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with contextlib.AsyncExitStack() as stack:
        crds = crd_files(config)
        plane = await stack.enter_async_context(
            ControlPlane(layout.root, config.control_plane_settings(), crds,
                         kueue=config.kueue,
                         kueue_wait_for_pods_ready=config.kueue_wait_for_pods_ready))
        if config.kueue:
            await plane.start_kueue()
        proxy = None
        if config.api_proxy:
            proxy = ApiProxy(plane.api_port)
            await proxy.start()
            stack.push_async_callback(proxy.stop)
            admin_cert, admin_key = plane.identity("admin")
            write_kubeconfig(layout.kubeconfig, proxy.url, user="tardigrade-admin",
                             ca_pem=plane.ca_pem, client_cert_pem=admin_cert.read_bytes(),
                             client_key_pem=admin_key.read_bytes())
        pod_env = dict(gcs.offline_google_env())
        gcs_url = None
        if config.with_gcs:
            emulator = gcs.GcsEmulator(log_path=layout.root / "gcs.log")
            # Spawned from the loop's thread, which lives as long as the cluster: the server
            # dies with the thread that started it.
            emulator.spawn()
            await asyncio.to_thread(emulator.wait_ready)
            stack.callback(emulator.stop)
            for bucket in config.buckets:
                await asyncio.to_thread(emulator.create_bucket, bucket)
            gcs_url = emulator.url
            pod_env.update(emulator.client_env())
        pod_env.update(config.pod_env)
        host: SimulatedHost | None = None
        if config.nodes or config.node_pools:
            # Simulated nodes (benches only): their agents, and pools that grow with more.
            host = SimulatedHost(_simulator_settings(config, layout, plane, pod_env),
                                 config.nodes)
            await host.start()
            stack.push_async_callback(host.stop)
            await host.wait_schedulable()
            cloud = host.cloud
        else:
            cloud = GkeCloud(ApiClient(plane.api_url, plane.ssl_context(identities.CLOUD.name),
                                       identities.CLOUD.common_name))
            stack.push_async_callback(cloud.close)
        if host is not None and config.node_pools:
            autoscaler = NodeAutoscaler(host, config.node_pools, config.autoscaler_scan_seconds)
            await autoscaler.start()
            stack.push_async_callback(autoscaler.stop)
        if host is not None and config.kueue and any(p.queued_provisioning
                                                     for p in config.node_pools):
            # The ProvisioningRequest CRD comes with Kueue here (kueue.py).
            provisioner = QueuedProvisioner(host, config.node_pools)
            await provisioner.start()
            stack.push_async_callback(provisioner.stop)
        runner = web.AppRunner(_control_app(host, cloud, plane, proxy), access_log=None)
        await runner.setup()
        stack.push_async_callback(runner.cleanup)
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        control_port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        if config.operator_command:
            # Installing the operator here stands for `helm install`: with it come the chart's
            # trainer grants (templates/rbac.yaml, trainerTokenReview), or no gang could
            # authenticate its ranks.
            await _grant_trainer_token_review(plane)
            operator = await asyncio.create_subprocess_exec(
                *config.operator_command, env=_client_env(layout, pod_env),
                stdout=open(layout.root / "operator.log", "ab"),  # noqa: SIM115
                stderr=asyncio.subprocess.STDOUT, start_new_session=True,
                preexec_fn=die_with_parent)
            stack.push_async_callback(_stop_process, operator)
        info = {
            "pid": os.getpid(), "api_url": proxy.url if proxy else plane.api_url,
            "direct_api_url": plane.api_url, "kubeconfig": str(layout.kubeconfig),
            "ca_file": str(plane.ca_file), "etcd_url": plane.etcd_url,
            "control_url": f"http://127.0.0.1:{control_port}", "gcs_url": gcs_url,
            "crd_files": [str(p) for p in crds], "pod_env": pod_env,
            "processes": plane.pids(),
            "egress_routes": str(plane.egress_routes) if config.node_egress else None,
        }
        tmp = layout.cluster_info.with_suffix(".tmp")
        tmp.write_text(json.dumps(info, indent=2))
        tmp.replace(layout.cluster_info)
        log.info("local cluster ready: %s", plane.api_url)
        await stop.wait()
        layout.cluster_info.unlink(missing_ok=True)


async def _stop_process(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        await asyncio.wait_for(proc.wait(), 10)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()


def _client_env(layout: StateLayout, pod_env: Mapping[str, str]) -> dict[str, str]:
    """Environment for a process beside the cluster (operator, kubectl, tests): it finds the
    API server and the GCS emulator, and imports this checkout."""
    path = os.pathsep.join([*project_python_path(), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, **pod_env, "KUBECONFIG": str(layout.kubeconfig), "PYTHONPATH": path}


# Set by a LocalCluster that is not detached: the pid of the process the cluster dies with.
ENV_DIE_WITH = "TARDIGRADE_LOCAL_DIE_WITH"


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    owner = os.environ.pop(ENV_DIE_WITH, None)
    if owner is not None:
        # Here rather than in a preexec_fn of the owner: a fork in a multi-threaded owner (a
        # test process with JAX loaded) must run nothing between fork and exec.
        die_with_parent()
        if os.getppid() != int(owner):
            sys.exit("the process that started the local cluster is gone")
    layout = StateLayout(Path(args[0]).absolute())
    config = ClusterConfig.from_json(json.loads((layout.root / CONFIG_FILE).read_text()))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    asyncio.run(serve(config))


# --- driving it from outside -----------------------------------------------------------------
class ClusterError(RuntimeError):
    pass


def _simulated_only(nodes: int | Sequence[NodeConfig], pools: Sequence[NodePool]
                    ) -> list[NodeConfig]:
    """The nodes of a LocalCluster: simulated ones or none. Pods that run processes run on
    real nodes, which a LocalCluster does not start."""
    if isinstance(nodes, int):
        if nodes:
            raise ClusterError(
                f"nodes={nodes}: a LocalCluster starts no nodes that run pods; for real nodes "
                f"use realcluster.RealNodeCluster (or `tardigrade local up`), for a bench's "
                f"simulated ones nodes=simulated_nodes({nodes})")
        return []
    unsimulated = [n.name for n in [*nodes, *(p.template for p in pools)] if not n.simulated]
    if unsimulated:
        raise ClusterError(
            f"nodes {', '.join(unsimulated)}: not simulated; a LocalCluster runs only the "
            f"simulator's nodes (benches: simulated_nodes(N), NodeConfig(simulated=True)); "
            f"for nodes that run pods use realcluster.RealNodeCluster (or `tardigrade local "
            f"up`)")
    return list(nodes)


class LocalCluster:
    """A local control plane in a background process: the one real nodes join
    (`realcluster.RealNodeCluster`), or, for benches only, with simulated nodes.

    ```
    with LocalCluster(tmp_path / "cluster", nodes=[]) as cluster:
        subprocess.run(["kubectl", "get", "namespaces"], env=cluster.client_env())
    ```
    """

    def __init__(self, state_dir: Path | str | None = None,
                 nodes: int | Sequence[NodeConfig] = (), with_gcs: bool = True,
                 remove_on_exit: bool = True, detach: bool = False, **options: Any) -> None:
        """`nodes`: none (0 or []), or simulated nodes (`simulated_nodes`, benches only).
        `detach`: the cluster outlives this process; otherwise it dies with it, however it
        dies, so a killed test run leaves no cluster behind."""
        layout = (StateLayout.default() if state_dir is None
                  else StateLayout(Path(state_dir).absolute()))
        self.layout = layout
        node_configs = _simulated_only(nodes, options.get("node_pools") or ())
        self.config = ClusterConfig(state_dir=layout.root, nodes=node_configs,
                                    with_gcs=with_gcs, **options)
        self.remove_on_exit = remove_on_exit
        self.detach = detach
        self._proc: subprocess.Popen[bytes] | None = None
        self._info: dict[str, Any] | None = None

    # --- lifecycle ---------------------------------------------------------------------------
    @classmethod
    def attach(cls, state_dir: Path | str | None = None) -> LocalCluster:
        """A handle on a cluster that is already running there (e.g. from `tardigrade local up`)."""
        cluster = cls(state_dir)
        info = cluster.read_info()
        if info is None or not psutil.pid_exists(int(info["pid"])):
            raise ClusterError(f"no local cluster is running in {cluster.layout.root}")
        cluster._info = info
        return cluster

    def read_info(self) -> dict[str, Any] | None:
        try:
            return json.loads(self.layout.cluster_info.read_text())
        except (OSError, ValueError):
            return None

    def start(self) -> LocalCluster:
        existing = self.read_info()
        if existing and psutil.pid_exists(int(existing["pid"])):
            raise ClusterError(f"a local cluster is already running in {self.layout.root} "
                               f"(pid {existing['pid']}); run `tardigrade local down` first")
        if self.layout.root.exists():
            shutil.rmtree(self.layout.root)
        self.layout.root.mkdir(parents=True)
        (self.layout.root / CONFIG_FILE).write_text(json.dumps(self.config.to_json(), indent=2))
        if self.config.kueue:
            # Built only for a cluster that asks for it (minutes cold, with progress).
            try:
                gobuild.ensure(gobuild.kueue_module())
            except gobuild.BuildError as err:
                raise ClusterError(f"cannot build Kueue: {err}") from err
        env = {**os.environ,
               "PYTHONPATH": os.pathsep.join([*project_python_path(),
                                              os.environ.get("PYTHONPATH", "")])}
        if not self.detach:
            env[ENV_DIE_WITH] = str(os.getpid())
        with open(self.layout.cluster_log, "ab") as log_file:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "tardigrade_local.cluster", str(self.layout.root)],
                stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                start_new_session=True)
        deadline = (time.monotonic() + READY_TIMEOUT_SECONDS
                    + READY_SECONDS_PER_NODE * len(self.config.nodes))
        while (info := self.read_info()) is None:
            if self._proc.poll() is not None or time.monotonic() > deadline:
                tail = self.layout.cluster_log.read_text(errors="replace")[-3000:]
                self._kill_daemon()
                raise ClusterError(f"local cluster did not start:\n{tail}")
            time.sleep(0.1)
        self._info = info
        return self

    def stop(self, remove: bool | None = None) -> None:
        """Stop the cluster process; remove the state dir."""
        info = self._info or self.read_info()
        pid = int(info["pid"]) if info else (self._proc.pid if self._proc else None)
        if pid is not None:
            _terminate_pid(pid, STOP_TIMEOUT_SECONDS)
        if self._proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(1)
        self._info = None
        if self.remove_on_exit if remove is None else remove:
            shutil.rmtree(self.layout.root, ignore_errors=True)

    def _kill_daemon(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            _terminate_pid(self._proc.pid, 5)

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    # --- facts -------------------------------------------------------------------------------
    @property
    def info(self) -> dict[str, Any]:
        if self._info is None:
            raise ClusterError("the local cluster is not running")
        return self._info

    @property
    def kubeconfig(self) -> Path:
        return Path(self.info["kubeconfig"])

    @property
    def api_url(self) -> str:
        return str(self.info["api_url"])

    @property
    def gcs_url(self) -> str | None:
        return self.info.get("gcs_url")

    def service_account_kubeconfig(self, namespace: str, name: str, path: Path,
                                   cluster_role: str = "cluster-admin") -> Path:
        """A kubeconfig for ServiceAccount `namespace/name` (created, bound to `cluster_role`)
        on the TLS port: its requests are authorized with RBAC and written to the audit log,
        as an operator's in a pod are, unlike those of the admin kubeconfig."""
        from kubernetes import client, config

        api = config.new_client_from_config(config_file=str(self.kubeconfig))
        core, rbac = client.CoreV1Api(api), client.RbacAuthorizationV1Api(api)
        core.create_namespaced_service_account(namespace, {"metadata": {"name": name}})
        rbac.create_cluster_role_binding({
            "metadata": {"name": f"{namespace}-{name}"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                        "name": cluster_role},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": namespace}]})
        token = core.create_namespaced_service_account_token(
            name, namespace, {"spec": {"audiences": [], "expirationSeconds": 86400}}).status.token
        ca = Path(self.info["ca_file"]).read_bytes()
        return write_kubeconfig(path, self.api_url, namespace=namespace,
                                user=f"system:serviceaccount:{namespace}:{name}", token=token,
                                ca_pem=ca)

    def admin_ssl_context(self) -> ssl.SSLContext:
        """TLS for a raw client of kube-apiserver: the cluster's CA, the administrator's
        certificate (what the admin kubeconfig holds)."""
        return self.identity_ssl_context(identities.ADMIN)

    def identity_ssl_context(self, identity: identities.Identity) -> ssl.SSLContext:
        """TLS for a raw client of kube-apiserver as one of the cluster's identities
        (`identities.CLIENTS`), e.g. GKE's (`identities.CLOUD`)."""
        pki = Path(self.info["ca_file"]).parent
        context = ssl.create_default_context(cafile=str(pki / "ca.crt"))
        context.load_cert_chain(str(pki / f"{identity.name}.crt"),
                                str(pki / f"{identity.name}.key"))
        return context

    def api_metrics(self) -> str:
        """kube-apiserver's /metrics, read with the administrator's certificate (the
        endpoint needs `get` on the non-resource URL /metrics)."""
        with urllib.request.urlopen(f"{self.info['direct_api_url']}/metrics", timeout=30,
                                    context=self.admin_ssl_context()) as response:
            return str(response.read().decode())

    def processes(self) -> dict[str, int]:
        """The cluster's own processes by name (the supervisor and each component), for CPU
        and memory accounting."""
        return {"supervisor": int(self.info["pid"]), **self.info.get("processes", {})}

    def client_env(self) -> dict[str, str]:
        """os.environ plus KUBECONFIG, the GCS emulator variables and this checkout on
        PYTHONPATH, for kubectl, an operator or test subprocesses."""
        return _client_env(self.layout, self.info.get("pod_env", {}))

    # --- disruptions -------------------------------------------------------------------------
    @property
    def disruptor(self) -> Disruptor:
        return Disruptor(self.info["control_url"])

    def preempt_node(self, name: str, grace_seconds: float | None = None,
                     replace_after_seconds: float | None = None, wait: bool = False) -> None:
        self.disruptor.preempt_node(name, grace_seconds, replace_after_seconds, wait)

    def preempt_pod(self, namespace: str, name: str, grace_seconds: float | None = None,
                    replace_after_seconds: float | None = None, wait: bool = False) -> str:
        return str(self.disruptor.preempt_pod(namespace, name, grace_seconds,
                                              replace_after_seconds, wait)["node"])

    def delete_node(self, name: str) -> None:
        self.disruptor.delete_node(name)

    def halt_node(self, name: str, back_after_seconds: float | None = None,
                  wait: bool = False) -> None:
        self.disruptor.halt_node(name, back_after_seconds, wait)

    def schedule_maintenance(self, name: str, in_seconds: float,
                             back_after_seconds: float | None = None) -> float:
        """Host maintenance on `name` in `in_seconds`; returns its start (epoch seconds)."""
        return float(self.disruptor.schedule_maintenance(name, in_seconds,
                                                         back_after_seconds)["start"])

    def partition_node(self, name: str, seconds: float, wait: bool = False) -> None:
        self.disruptor.partition_node(name, seconds, wait)

    def add_node(self, name: str, labels: dict[str, str] | None = None,
                 taints: list[dict[str, str]] | None = None,
                 capacity: dict[str, str] | None = None) -> None:
        self.disruptor.add_node(name, labels, taints, capacity)

    def crash_pod(self, namespace: str, name: str, container: str | None = None,
                  sig: int = signal.SIGKILL) -> None:
        self.disruptor.crash_pod(namespace, name, container, sig)

    def restart_apiserver(self, downtime_seconds: float = 0.0,
                          expire_history: bool = True) -> None:
        self.disruptor.restart_apiserver(downtime_seconds, expire_history)

    def cut_watches(self, expire_history: bool = False) -> int:
        return int(self.disruptor.cut_watches(expire_history)["cut"])

    def status(self) -> dict[str, Any]:
        return dict(self.disruptor.status())


def _terminate_pid(pid: int, timeout: float) -> None:
    try:
        proc = psutil.Process(pid)
        proc.terminate()
        proc.wait(timeout)
    except psutil.TimeoutExpired:
        with contextlib.suppress(psutil.Error):
            proc.kill()
            proc.wait(5)
    except psutil.Error:
        pass


if __name__ == "__main__":
    main()
