"""The local nodes' kubelets, the scheduler and pod GC, sharing one event loop and one watch
per resource.

Each local node has a `NodeAgent` (its kubelet): it registers the Node object and runs the
pods bound to it. The scheduler binds pending pods; pod GC cleans up after vanished nodes.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import signal
import time
from collections.abc import Mapping
from typing import Any

from aiohttp import web

from tardigrade_local import disruptions as d
from tardigrade_local.kubelet import admission, network, tpuslices
from tardigrade_local.kubelet.binder import Binder
from tardigrade_local.kubelet.client import ApiClient, ApiError, Informer, core_path
from tardigrade_local.kubelet.config import KubeletSettings, NodeConfig
from tardigrade_local.kubelet.events import EventRecorder
from tardigrade_local.kubelet.logs import log_app
from tardigrade_local.kubelet.node import node_object, node_status
from tardigrade_local.kubelet.nodelifecycle import NodeLifecycle
from tardigrade_local.kubelet.podgc import PodGC
from tardigrade_local.kubelet.podstatus import ContainerRecord
from tardigrade_local.kubelet.restartrules import KubeletGates
from tardigrade_local.kubelet.simulated import SimulatedRuntime
from tardigrade_local.kubelet.worker import DEFAULT_GRACE_SECONDS, PodWorker, Stop

log = logging.getLogger(__name__)

Obj = dict[str, Any]
SHUTDOWN_KILL_GRACE_SECONDS = 3.0
HOSTS_REFRESH_SECONDS = 1.0  # the shortest time between two rewrites of the hosts file
CONTAINER_STATUS_UNKNOWN = "ContainerStatusUnknown"  # kubecontainer.ContainerReasonStatusUnknown
CONTAINER_LOST_MESSAGE = "The container could not be located when the pod was terminated"
HOSTS_COALESCE_SECONDS = 0.2


@dataclasses.dataclass
class NodeAgent:
    config: NodeConfig
    ip: str
    state: str = "ready"  # ready | shutting-down | gone
    port: int = 0  # the kubelet endpoint (logs), on the node's own IP
    site: web.TCPSite | None = None
    workers: dict[tuple[str, str, str], PodWorker] = dataclasses.field(default_factory=dict)
    # time.monotonic() of the last heartbeat of a kubelet that stopped posting (VM halted
    # without a shutdown); None while it posts.
    silent_since: float | None = None
    # uids of pods whose containers died with a halted VM: its successor under the same
    # name reports them (`_report_lost`).
    lost_pods: set[str] = dataclasses.field(default_factory=set)


def _is_terminal(pod: Mapping[str, Any]) -> bool:
    return (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed")


class KubeletHost:
    def __init__(self, settings: KubeletSettings, nodes: list[NodeConfig]) -> None:
        self.settings = settings
        self.client = ApiClient(settings.api_url)
        self.events = EventRecorder(self.client)
        self.initial_nodes = list(nodes)
        self.agents: dict[str, NodeAgent] = {}
        # Reclaimed VMs their pool's managed instance group is recreating, by name: an
        # autoscaler counts them as upcoming nodes, as the cluster autoscaler counts a MIG's
        # instances being created.
        self.recreating: dict[str, NodeConfig] = {}
        self.ips = network.IpAllocator()
        # The container runtime of simulated nodes: one for all, so gangs span nodes.
        self.simulation = SimulatedRuntime(settings.simulated_start_seconds)
        self._node_index = 0
        self.pods = Informer(self.client, core_path("pods"), self._on_pod)
        self.nodes = Informer(self.client, core_path("nodes"), self._on_node)
        self.services = Informer(self.client, core_path("services"), self._on_service)
        self.binder = Binder(self.client, self.pods, self.nodes, self.events)
        self.pod_gc = PodGC(self.client, self.pods, self.nodes, settings.orphan_pod_gc_seconds)
        self.node_lifecycle = NodeLifecycle(self.client, self.pods, self.nodes,
                                            self._silent_since,
                                            settings.node_monitor_grace_seconds)
        self._hosts_dirty = asyncio.Event()
        self._finalizing: set[tuple[str, str, str]] = set()
        # Pods whose worker has ended never run again here, even if a stale event says Running.
        self._finished: set[str] = set()
        self._tasks: list[asyncio.Task[Any]] = []
        self._background: set[asyncio.Task[Any]] = set()
        self._runner: web.AppRunner | None = None

    # --- start / stop --------------------------------------------------------------------
    async def start(self) -> None:
        self.settings.layout.pods_dir.mkdir(parents=True, exist_ok=True)
        self._write_hosts()
        self._runner = web.AppRunner(log_app(self.settings.layout, self._record), access_log=None)
        await self._runner.setup()
        self._tasks = [asyncio.create_task(i.run()) for i in (self.nodes, self.services, self.pods)]
        await asyncio.gather(self.nodes.synced.wait(), self.services.synced.wait(),
                             self.pods.synced.wait())
        for config in self.initial_nodes:
            await self.add_node(config)
        self._tasks += [
            asyncio.create_task(self.binder.run()),
            asyncio.create_task(self._hosts_loop()),
            asyncio.create_task(self.pod_gc.run()),
            asyncio.create_task(self.node_lifecycle.run()),
        ]

    async def stop(self) -> None:
        """Cluster shutdown: pods get a short SIGTERM grace, no more API writes."""
        workers = [w for a in self.agents.values() for w in a.workers.values()]
        for worker in workers:
            worker.request_stop(Stop.REMOVED, SHUTDOWN_KILL_GRACE_SECONDS)
        if workers:
            await asyncio.wait([asyncio.create_task(w.done.wait()) for w in workers],
                               timeout=SHUTDOWN_KILL_GRACE_SECONDS + 5)
        for task in [*self._tasks, *self._background]:
            task.cancel()
        for task in [*self._tasks, *self._background]:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._runner is not None:
            await self._runner.cleanup()
        await self.simulation.stop()
        await self.client.close()

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    # --- nodes ---------------------------------------------------------------------------
    async def add_node(self, config: NodeConfig, lost_pods: set[str] | None = None) -> None:
        if config.name in self.agents and self.agents[config.name].state != "gone":
            raise ValueError(f"node {config.name} already exists")
        self._node_index += 1
        agent = NodeAgent(config, network.node_ip(self._node_index),
                          lost_pods=set(lost_pods or ()))
        assert self._runner is not None
        agent.site = web.TCPSite(self._runner, agent.ip, 0)
        await agent.site.start()
        agent.port = agent.site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.agents[config.name] = agent
        body = node_object(config, agent.ip, agent.port)
        path = core_path("nodes", name=config.name)
        try:
            await self.client.create(core_path("nodes"), body)
        except ApiError as err:
            if err.status != 409:
                raise
            # A leftover from an earlier run: take it over.
            await self.client.patch(path, {"metadata": body["metadata"], "spec": body["spec"]})
        # Some servers drop status on create; the kubelet reports it separately anyway.
        await self.client.patch(path + "/status", {"status": body["status"]})
        self.binder.dirty.set()
        self.events.node(config.name, "RegisteredNode", f"Node {config.name} event: Registered")
        # A kubelet starts by syncing the pods already bound to its node (a VM replaced under
        # the same name finds pods bound to its predecessor that never started there).
        for pod in list(self.pods.cache.values()):
            if pod["spec"].get("nodeName") == config.name:
                self._on_pod("MODIFIED", pod)

    async def preempt_node(self, name: str, grace_seconds: float | None = None,
                           replace_after_seconds: float | None = None,
                           why: str = "Node is shutting down (spot instance reclaimed)") -> None:
        """Spot reclaim: graceful node shutdown, then the Node object goes away; the node pool
        recreates the VM under the same name after `replace_after_seconds` (default: the
        cluster's setting; None there: never). A host of a multi-host TPU slice goes, and
        comes back, with every host of its slice (`tpuslices.py`)."""
        agent = self._agent(name)
        if agent.state != "ready":
            return
        ready = [a.config for a in self.agents.values() if a.state == "ready"]
        agents = [self.agents[c.name] for c in tpuslices.slice_of(agent.config, ready)]
        await asyncio.gather(*(self._shut_down(a, grace_seconds, why) for a in agents))
        if replace_after_seconds is None:
            replace_after_seconds = self.settings.replace_after_seconds
        if replace_after_seconds is not None:
            # In the background: a `wait`ing caller returns once the node is gone.
            for a in agents:
                self.recreating[a.config.name] = a.config
            self._spawn(self._recreate(agents, replace_after_seconds))

    async def _shut_down(self, agent: NodeAgent, grace_seconds: float | None, why: str) -> None:
        name = agent.config.name
        agent.state = "shutting-down"
        self.events.node(name, "Shutdown", why, warning=True)
        grace = self.settings.shutdown_grace_seconds if grace_seconds is None else grace_seconds
        path = core_path("nodes", name=name)
        with contextlib.suppress(ApiError):
            await self.client.patch(path + "/status", {"status": node_status(
                agent.config, agent.ip, agent.port, ready=False,
                message=d.NODE_SHUTDOWN_NODE_MESSAGE)})
        workers = list(agent.workers.values())
        for worker in workers:
            pod_grace = worker.pod["spec"].get("terminationGracePeriodSeconds")
            worker.request_stop(Stop.NODE_SHUTDOWN, d.node_shutdown_pod_grace(pod_grace, grace))
        await asyncio.gather(*(w.done.wait() for w in workers))
        await self._retire(agent)
        with contextlib.suppress(ApiError):
            await self.client.delete(path)
        self.binder.dirty.set()

    async def schedule_maintenance(self, name: str, in_seconds: float,
                                   back_after_seconds: float | None = None) -> float:
        """GKE host maintenance of a GPU/TPU node (disruptions.SCHEDULED_MAINTENANCE_LABEL):
        labelled now with the start (epoch seconds); performed at the start in the background.
        Returns the start."""
        agent = self._agent(name)
        if agent.state != "ready":
            raise ValueError(f"node {name} is {agent.state}: nothing to maintain")
        start = time.time() + in_seconds
        await self.client.patch(core_path("nodes", name=name), {"metadata": {"labels": {
            d.SCHEDULED_MAINTENANCE_LABEL: str(int(start))}}})
        self._spawn(self._perform_maintenance(agent, start, back_after_seconds))
        return start

    async def _perform_maintenance(self, agent: NodeAgent, start: float,
                                   back_after_seconds: float | None) -> None:
        await asyncio.sleep(max(0.0, start - time.time()))
        name = agent.config.name
        if self.agents.get(name) is not agent or agent.state != "ready":
            return  # the VM went away meanwhile: nothing left to maintain
        node = self.nodes.cache.get(("", name)) or {}
        taints = [t for t in (node.get("spec") or {}).get("taints") or []
                  if t.get("key") != d.IMPENDING_TERMINATION_TAINT]
        taints.append({"key": d.IMPENDING_TERMINATION_TAINT, "effect": "NoSchedule"})
        with contextlib.suppress(ApiError):
            await self.client.patch(core_path("nodes", name=name), {"spec": {"taints": taints}})
        # The VM is terminated with notice; the successor registers without the label.
        await self.preempt_node(name, d.MAINTENANCE_POD_GRACE_SECONDS, back_after_seconds,
                                why=d.MAINTENANCE_MESSAGE)

    async def _recreate(self, agents: list[NodeAgent], delay: float) -> None:
        """The pool's managed instance group recreates the VMs under their names (a slice's
        hosts all at once)."""
        try:
            await asyncio.sleep(delay)
            # Nobody took a name meanwhile.
            back = [a for a in agents if self.agents.get(a.config.name) is a]
            await asyncio.gather(*(self.add_node(a.config) for a in back))
        finally:
            for a in agents:
                self.recreating.pop(a.config.name, None)

    async def lose_node(self, name: str, delete_object: bool = True) -> None:
        """The machine vanished: processes die now, nothing more is reported."""
        agent = self._agent(name)
        if agent.state == "gone":
            return
        workers = list(agent.workers.values())
        for worker in workers:
            worker.request_stop(Stop.NODE_LOST, 0)
        await self._retire(agent)
        if delete_object:
            with contextlib.suppress(ApiError):
                await self.client.delete(core_path("nodes", name=name))
        await asyncio.gather(*(w.done.wait() for w in workers))
        self.binder.dirty.set()

    async def halt_node(self, name: str, back_after_seconds: float | None = None) -> None:
        """The VM stops without a shutdown (host error, a stop the kubelet never hears of):
        its processes freeze (SIGSTOP: a stopped VM closes no connection, so its peers see
        silence, not a reset), the kubelet goes silent, the Node object stays for the node
        lifecycle controller to mark Unknown. With `back_after_seconds` the VM boots again
        under the same name (the frozen processes are gone: SIGKILL) and its kubelet
        re-registers."""
        agent = self._agent(name)
        if agent.state == "gone":
            return
        workers = list(agent.workers.values())
        for worker in workers:
            worker.silent = True
            for proc in list(worker.processes.values()):
                proc.signal_group(signal.SIGSTOP)
        agent.lost_pods = {key[2] for key in agent.workers}
        agent.silent_since = time.monotonic()
        await self._retire(agent)
        self.binder.dirty.set()
        if back_after_seconds is None:
            return
        await asyncio.sleep(back_after_seconds)
        for worker in workers:
            worker.request_stop(Stop.NODE_LOST, 0)
        await asyncio.gather(*(w.done.wait() for w in workers))
        if self.agents.get(name) is agent:
            await self.add_node(agent.config, lost_pods=agent.lost_pods)

    async def partition_node(self, name: str, seconds: float) -> None:
        """The kubelet cannot reach the control plane for `seconds` (a network partition, a
        kubelet restart): it stops posting while its pods run on and reach each other. Then it
        posts its status again, Ready (its status setters move lastTransitionTime on the
        Unknown -> True change). Pod status writes in between are not held back."""
        agent = self._agent(name)
        if agent.state != "ready" or agent.silent_since is not None:
            return
        agent.silent_since = time.monotonic()
        try:
            await asyncio.sleep(seconds)
        finally:
            agent.silent_since = None
        if agent.state == "ready":
            with contextlib.suppress(ApiError):
                await self.client.patch(core_path("nodes", name=name) + "/status", {
                    "status": node_status(agent.config, agent.ip, agent.port)})

    def _silent_since(self, name: str) -> float | None:
        agent = self.agents.get(name)
        return None if agent is None else agent.silent_since

    async def _report_lost(self, pod: Obj) -> None:
        """A rebooted kubelet's first sync of a pod whose container it cannot find: the
        container used to run and, with restartPolicy Never, will not be restarted, so it is
        reported terminated, ContainerStatusUnknown, exit code 137, and the pod Failed
        (pkg/kubelet/kubelet_pods.go convertToAPIContainerStatuses, getPhase)."""
        meta = pod["metadata"]
        path = core_path("pods", meta.get("namespace") or "default", meta["name"])
        statuses = []
        for container in (pod.get("status") or {}).get("containerStatuses") or []:
            statuses.append({**container, "ready": False, "started": False, "state": {
                "terminated": {"exitCode": 137, "reason": CONTAINER_STATUS_UNKNOWN,
                               "message": CONTAINER_LOST_MESSAGE}}})
        try:
            await self.client.patch(path + "/status", {"status": {
                "phase": "Failed", "containerStatuses": statuses}})
        except ApiError as err:
            log.warning("reporting lost pod %s failed: %s", path, err)

    async def _retire(self, agent: NodeAgent) -> None:
        agent.state = "gone"
        if agent.site is not None:
            await agent.site.stop()
            agent.site = None

    def _record(self, namespace: str, pod: str, container: str) -> ContainerRecord | None:
        for agent in self.agents.values():
            for (ns, name, _), worker in agent.workers.items():
                if (ns, name) == (namespace, pod):
                    for record in [*worker.init_records, *worker.records]:
                        if record.name == container:
                            return record
        return None

    def _agent(self, name: str) -> NodeAgent:
        agent = self.agents.get(name)
        if agent is None:
            raise KeyError(f'node "{name}" is not a local node')
        return agent

    def node_of_pod(self, namespace: str, pod: str) -> str:
        obj = self.pods.cache.get((namespace, pod))
        node = (obj or {}).get("spec", {}).get("nodeName")
        if not node:
            raise KeyError(f'pod "{namespace}/{pod}" is not bound to a node')
        return str(node)

    def crash_pod(self, namespace: str, pod: str, container: str | None, sig: int) -> None:
        for agent in self.agents.values():
            for (ns, name, _), worker in agent.workers.items():
                if (ns, name) == (namespace, pod) and worker.crash(container, sig):
                    return
        raise KeyError(f'pod "{namespace}/{pod}" has no running container here')

    def status(self) -> dict[str, Any]:
        return {
            "nodes": [
                {"name": n, "state": a.state, "ip": a.ip, "pool": a.config.pool,
                 "simulated": a.config.simulated,
                 "pods": sorted(f"{k[0]}/{k[1]}" for k in a.workers)}
                for n, a in sorted(self.agents.items())
            ],
        }

    # --- watch handlers ------------------------------------------------------------------
    def _on_node(self, kind: str, node: Obj) -> None:
        self.binder.dirty.set()
        agent = self.agents.get(node["metadata"]["name"])
        if kind == "DELETED" and agent is not None and agent.state == "ready":
            # Someone deleted a live node's object (`kubectl delete node`): treat it as lost.
            self._spawn(self.lose_node(agent.config.name, delete_object=False))

    def _on_service(self, kind: str, svc: Obj) -> None:
        self._hosts_dirty.set()

    def _on_pod(self, kind: str, pod: Obj) -> None:
        meta, spec = pod["metadata"], pod["spec"]
        ns, name, uid = meta.get("namespace") or "default", meta["name"], meta.get("uid", "")
        key = (ns, name, uid)
        self._hosts_dirty.set()
        node_name = spec.get("nodeName")
        if not node_name:
            if kind != "DELETED":
                self.binder.dirty.set()
            return
        self.binder.observed_binding(key)
        agent = self.agents.get(node_name)
        if agent is None or agent.state == "gone":
            return
        worker = agent.workers.get(key)
        if kind == "DELETED":
            self._finished.discard(uid)
            if worker is not None:
                worker.request_stop(Stop.REMOVED,
                                    float(spec.get("terminationGracePeriodSeconds",
                                                   DEFAULT_GRACE_SECONDS)))
            self.binder.dirty.set()
            return
        if worker is not None:
            worker.update(pod)
            return
        if meta.get("deletionTimestamp"):
            # Nothing runs here for it (never started, or finished): finalize at once.
            if key not in self._finalizing:
                self._finalizing.add(key)
                self._spawn(self._finalize(key))
            return
        if uid in agent.lost_pods and agent.state == "ready" and not _is_terminal(pod):
            agent.lost_pods.discard(uid)
            self._spawn(self._report_lost(pod))
            return
        if agent.state != "ready" or _is_terminal(pod) or uid in self._finished:
            return
        active = [w.pod for w in agent.workers.values() if w.terminal_phase is None]
        rejection = admission.admit(pod, agent.config.capacity, active)
        if rejection is not None:
            self._finished.add(uid)
            self._spawn(self._reject(pod, rejection))
            return
        simulated = agent.config.simulated
        worker = PodWorker(self.settings, self.client, node_name, agent.ip,
                           self.ips.allocate(), pod, self.events,
                           runtime=self.simulation if simulated else None,
                           gates=KubeletGates.from_mapping(agent.config.feature_gates))
        agent.workers[key] = worker
        if simulated:
            # No process resolves names before it starts: the loop writes the file soon.
            self._hosts_dirty.set()
        else:
            self._write_hosts()
        worker.start()
        self._spawn(self._reap(agent, key, worker))

    async def _reject(self, pod: Obj, rejection: admission.Rejection) -> None:
        """Kubelet.rejectPod: a Warning event, then the pod Failed with the reason."""
        meta = pod["metadata"]
        path = core_path("pods", meta.get("namespace") or "default", meta["name"])
        self.events.pod(pod, rejection.reason, rejection.message, warning=True,
                        host=pod["spec"].get("nodeName"))
        try:
            await self.client.patch(path + "/status", {"status": rejection.pod_status()})
        except ApiError as err:
            log.warning("rejecting pod %s failed: %s", path, err)

    async def _finalize(self, key: tuple[str, str, str]) -> None:
        path = core_path("pods", key[0], key[1])
        try:
            pod = self.pods.cache.get(key[:2])
            if pod is not None and not _is_terminal(pod):
                # Like the kubelet since 1.27: a deleted pod reaches a terminal phase before it
                # goes, so controllers with a finalizer on it see it finish.
                await self.client.patch(path + "/status", {"status": {"phase": "Failed"}})
            await self.client.delete(path, 0)
        except ApiError as err:
            log.warning("finalizing pod %s/%s failed: %s", key[0], key[1], err)
        finally:
            self._finalizing.discard(key)

    async def _reap(self, agent: NodeAgent, key: tuple[str, str, str], worker: PodWorker) -> None:
        await worker.done.wait()
        self._finished.add(key[2])
        agent.workers.pop(key, None)
        self.ips.release(worker.pod_ip)
        self._hosts_dirty.set()
        self.binder.dirty.set()

    # --- names ---------------------------------------------------------------------------
    async def _hosts_loop(self) -> None:
        while True:
            await self._hosts_dirty.wait()
            # The file lists every pod: rewritten on each of a thousand pod events it would cost
            # the square of the pods. A burst of changes coalesces for a moment, and rewrites
            # come at most once a second; a process still gets the file written before it
            # starts (`_on_pod`). Cluster DNS lags more (the default Corefile's `ttl 30` and
            # `cache 30`).
            await asyncio.sleep(HOSTS_COALESCE_SECONDS)
            self._hosts_dirty.clear()
            self._write_hosts()
            await asyncio.sleep(HOSTS_REFRESH_SECONDS)

    def _write_hosts(self) -> None:
        if all(a.config.simulated for a in self.agents.values()):
            return  # no process on these nodes resolves a name: nobody reads the file
        path = self.settings.layout.hosts_file
        # Addresses of pods running here are known before their status says so.
        local_ips = {(k[0], k[1]): w.pod_ip for a in self.agents.values() if a.state != "gone"
                     for k, w in a.workers.items() if not w.done.is_set()}
        pods = []
        for (ns, name), pod in self.pods.cache.items():
            ip = local_ips.get((ns, name))
            if ip is not None:
                pod = {**pod, "status": {**(pod.get("status") or {}), "podIP": ip}}
            pods.append(pod)
        text = network.hosts_file(pods, self.services.cache.values())
        with contextlib.suppress(OSError):
            if path.read_text() == text:
                return
        tmp = path.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.replace(path)  # readers never see a half-written file
