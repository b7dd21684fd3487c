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
import time
from collections.abc import Mapping
from typing import Any

from aiohttp import web

from tardigrade_local import disruptions as d
from tardigrade_local.kubelet import network, scheduler
from tardigrade_local.kubelet import podstatus as ps
from tardigrade_local.kubelet.client import ApiClient, ApiError, Informer, core_path
from tardigrade_local.kubelet.config import KubeletSettings, NodeConfig
from tardigrade_local.kubelet.events import EventRecorder
from tardigrade_local.kubelet.logs import log_app
from tardigrade_local.kubelet.node import node_object, node_status
from tardigrade_local.kubelet.podstatus import ContainerRecord
from tardigrade_local.kubelet.worker import DEFAULT_GRACE_SECONDS, PodWorker, Stop

log = logging.getLogger(__name__)

Obj = dict[str, Any]
POD_GC_PERIOD_SECONDS = 0.5
SHUTDOWN_KILL_GRACE_SECONDS = 3.0


@dataclasses.dataclass
class NodeAgent:
    config: NodeConfig
    ip: str
    state: str = "ready"  # ready | shutting-down | gone
    port: int = 0  # the kubelet endpoint (logs), on the node's own IP
    site: web.TCPSite | None = None
    workers: dict[tuple[str, str, str], PodWorker] = dataclasses.field(default_factory=dict)


def _is_terminal(pod: Mapping[str, Any]) -> bool:
    return (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed")


class KubeletHost:
    def __init__(self, settings: KubeletSettings, nodes: list[NodeConfig]) -> None:
        self.settings = settings
        self.client = ApiClient(settings.api_url)
        self.events = EventRecorder(self.client)
        self.initial_nodes = list(nodes)
        self.agents: dict[str, NodeAgent] = {}
        self.ips = network.IpAllocator()
        self._node_index = 0
        self.pods = Informer(self.client, core_path("pods"), self._on_pod)
        self.nodes = Informer(self.client, core_path("nodes"), self._on_node)
        self.services = Informer(self.client, core_path("services"), self._on_service)
        self._schedule_dirty = asyncio.Event()
        self._hosts_dirty = asyncio.Event()
        self._assumed: dict[tuple[str, str, str], str] = {}
        self._unschedulable: dict[tuple[str, str, str], str] = {}
        self._orphans: dict[tuple[str, str, str], float] = {}
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
            asyncio.create_task(self._schedule_loop()),
            asyncio.create_task(self._hosts_loop()),
            asyncio.create_task(self._pod_gc_loop()),
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
        await self.client.close()

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    # --- nodes ---------------------------------------------------------------------------
    async def add_node(self, config: NodeConfig) -> None:
        if config.name in self.agents and self.agents[config.name].state != "gone":
            raise ValueError(f"node {config.name} already exists")
        self._node_index += 1
        agent = NodeAgent(config, network.node_ip(self._node_index))
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
        self._schedule_dirty.set()
        self.events.node(config.name, "RegisteredNode", f"Node {config.name} event: Registered")

    async def preempt_node(self, name: str, grace_seconds: float | None = None,
                           replace_after_seconds: float | None = None) -> None:
        """Spot reclaim: graceful node shutdown, then the Node object goes away."""
        agent = self._agent(name)
        if agent.state != "ready":
            return
        agent.state = "shutting-down"
        self.events.node(name, "Shutdown", "Node is shutting down (spot instance reclaimed)",
                         warning=True)
        grace = self.settings.shutdown_grace_seconds if grace_seconds is None else grace_seconds
        path = core_path("nodes", name=name)
        with contextlib.suppress(ApiError):
            await self.client.patch(path + "/status", {"status": node_status(
                agent.config, agent.ip, agent.port, ready=False,
                message=d.NODE_SHUTDOWN_NODE_MESSAGE)})
        workers = list(agent.workers.values())
        for worker in workers:
            pod_grace = worker.pod["spec"].get("terminationGracePeriodSeconds",
                                               DEFAULT_GRACE_SECONDS)
            worker.request_stop(Stop.NODE_SHUTDOWN, min(float(pod_grace), grace))
        await asyncio.gather(*(w.done.wait() for w in workers))
        await self._retire(agent)
        with contextlib.suppress(ApiError):
            await self.client.delete(path)
        self._schedule_dirty.set()
        if replace_after_seconds is not None:
            await asyncio.sleep(replace_after_seconds)
            await self.add_node(agent.config)

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
        self._schedule_dirty.set()

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
                {"name": n, "state": a.state, "ip": a.ip,
                 "pods": sorted(f"{k[0]}/{k[1]}" for k in a.workers)}
                for n, a in sorted(self.agents.items())
            ],
        }

    # --- watch handlers ------------------------------------------------------------------
    def _on_node(self, kind: str, node: Obj) -> None:
        self._schedule_dirty.set()
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
                self._schedule_dirty.set()
            return
        self._assumed.pop(key, None)
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
            self._schedule_dirty.set()
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
        if agent.state != "ready" or _is_terminal(pod) or uid in self._finished:
            return
        worker = PodWorker(self.settings, self.client, node_name, agent.ip,
                           self.ips.allocate(), pod, self.events)
        agent.workers[key] = worker
        self._write_hosts()
        worker.start()
        self._spawn(self._reap(agent, key, worker))

    async def _finalize(self, key: tuple[str, str, str]) -> None:
        try:
            await self.client.delete(core_path("pods", key[0], key[1]), 0)
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
        self._schedule_dirty.set()

    # --- scheduler -----------------------------------------------------------------------
    async def _schedule_loop(self) -> None:
        while True:
            await self._schedule_dirty.wait()
            self._schedule_dirty.clear()
            try:
                await self._schedule_pending()
            except Exception:
                log.exception("scheduling pass failed")
                await asyncio.sleep(1)
                self._schedule_dirty.set()

    async def _schedule_pending(self) -> None:
        nodes = list(self.nodes.cache.values())
        bound = [p for p in self.pods.cache.values() if p["spec"].get("nodeName")]
        bound += [self._assumed_pod(p, self._assumed[k]) for k, p in self._pending_assumed()]
        for pod in sorted(self.pods.cache.values(),
                          key=lambda p: p["metadata"].get("creationTimestamp") or ""):
            meta, spec = pod["metadata"], pod["spec"]
            key = (meta.get("namespace") or "default", meta["name"], meta.get("uid", ""))
            if (spec.get("nodeName") or key in self._assumed or meta.get("deletionTimestamp")
                    or _is_terminal(pod)
                    or spec.get("schedulerName", "default-scheduler") != "default-scheduler"):
                continue
            decision = scheduler.schedule(pod, nodes, bound)
            if decision.node is None:
                if self._unschedulable.get(key) != decision.message:
                    self._unschedulable[key] = decision.message
                    await self._mark_unschedulable(pod, decision.message)
                    self.events.pod(pod, "FailedScheduling", decision.message, warning=True,
                                    component="default-scheduler")
                continue
            self._unschedulable.pop(key, None)
            self._assumed[key] = decision.node
            bound.append(self._assumed_pod(pod, decision.node))
            try:
                await self._bind(key, decision.node)
                self.events.pod(pod, "Scheduled", f"Successfully assigned {key[0]}/{key[1]} "
                                f"to {decision.node}", component="default-scheduler")
            except ApiError as err:
                self._assumed.pop(key, None)
                log.warning("binding %s/%s to %s failed: %s", key[0], key[1], decision.node, err)

    def _pending_assumed(self) -> list[tuple[tuple[str, str, str], Obj]]:
        found = []
        for key in self._assumed:
            pod = self.pods.cache.get(key[:2])
            if pod is not None and not pod["spec"].get("nodeName"):
                found.append((key, pod))
        return found

    @staticmethod
    def _assumed_pod(pod: Obj, node: str) -> Obj:
        return {**pod, "spec": {**pod["spec"], "nodeName": node}}

    async def _bind(self, key: tuple[str, str, str], node: str) -> None:
        ns, name, uid = key
        binding = {
            "apiVersion": "v1", "kind": "Binding",
            "metadata": {"name": name, "namespace": ns, "uid": uid},
            "target": {"apiVersion": "v1", "kind": "Node", "name": node},
        }
        try:
            await self.client.create(core_path("pods", ns, name, "binding"), binding)
        except ApiError as err:
            if err.status not in (404, 405) or not await self._pod_exists(ns, name):
                raise
            # No binding subresource on this server: set the field directly.
            await self.client.patch(core_path("pods", ns, name), {"spec": {"nodeName": node}})

    async def _pod_exists(self, ns: str, name: str) -> bool:
        return await self.client.get(core_path("pods", ns, name)) is not None

    async def _mark_unschedulable(self, pod: Obj, message: str) -> None:
        meta = pod["metadata"]
        path = core_path("pods", meta.get("namespace") or "default", meta["name"])
        existing = (pod.get("status") or {}).get("conditions") or []
        cond = ps.condition("PodScheduled", False, "Unschedulable", message)
        with contextlib.suppress(ApiError):
            await self.client.patch(path + "/status", {"status": {
                "phase": "Pending", "conditions": ps.merge_conditions(existing, [cond])}})

    # --- pod GC --------------------------------------------------------------------------
    async def _pod_gc_loop(self) -> None:
        while True:
            await asyncio.sleep(POD_GC_PERIOD_SECONDS)
            try:
                await self._collect_orphans()
            except Exception:
                log.exception("pod GC pass failed")

    async def _collect_orphans(self) -> None:
        if not self.nodes.synced.is_set():
            return
        existing = {n["metadata"]["name"] for n in self.nodes.cache.values()}
        now = time.monotonic()
        seen: set[tuple[str, str, str]] = set()
        for pod in list(self.pods.cache.values()):
            meta = pod["metadata"]
            node = pod["spec"].get("nodeName")
            if not node or node in existing:
                continue
            key = (meta.get("namespace") or "default", meta["name"], meta.get("uid", ""))
            seen.add(key)
            first = self._orphans.setdefault(key, now)
            if now - first >= self.settings.orphan_pod_gc_seconds:
                await self._gc_orphan(pod)
        for key in list(self._orphans):
            if key not in seen:
                del self._orphans[key]

    async def _gc_orphan(self, pod: Obj) -> None:
        """What the pod GC controller does to a pod whose node no longer exists."""
        meta = pod["metadata"]
        path = core_path("pods", meta.get("namespace") or "default", meta["name"])
        with contextlib.suppress(ApiError):
            if not _is_terminal(pod):
                existing = (pod.get("status") or {}).get("conditions") or []
                cond = ps.condition(d.DISRUPTION_TARGET, True, d.REASON_DELETION_BY_POD_GC,
                                    d.POD_GC_MESSAGE)
                await self.client.patch(path + "/status", {"status": {
                    "phase": "Failed", "conditions": ps.merge_conditions(existing, [cond])}})
            await self.client.delete(path, 0)

    # --- names ---------------------------------------------------------------------------
    async def _hosts_loop(self) -> None:
        while True:
            await self._hosts_dirty.wait()
            self._hosts_dirty.clear()
            self._write_hosts()

    def _write_hosts(self) -> None:
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
