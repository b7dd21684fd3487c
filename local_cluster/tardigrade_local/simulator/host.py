"""The simulated nodes' agents, and the cloud they run in, sharing one event loop (benches
only: see `__init__.py`).

Each simulated node has a `NodeAgent` against the real kube-apiserver: it registers its Node,
renews its Lease and writes the status of the pods bound to it, whose containers are
simulated (`simulated.py`). The agents share one identity and one pod watch, as kwok's
controller does. Scheduling, node lifecycle (Unknown, taints, eviction), pod GC and the
workload controllers are the real kube-scheduler and kube-controller-manager.

`SimulatedHost` also plays the parts that are not a kubelet's: the VMs (spot reclaim, a halt,
host maintenance, a lost machine) and GKE's own controllers (`cloud.py`), which act through
the API as GKE does.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime as dt
import logging
import signal
import time
from collections import Counter
from collections.abc import Mapping
from typing import Any

from tardigrade_local import identities
from tardigrade_local.gke import disruptions as d
from tardigrade_local.gke import hostmaintenance, tpuslices
from tardigrade_local.gke.client import ApiClient, ApiError, Informer, core_path, group_path
from tardigrade_local.gke.cloud import GkeCloud
from tardigrade_local.gke.events import EventRecorder
from tardigrade_local.gke.nodes import NodeConfig
from tardigrade_local.simulator import admission, network
from tardigrade_local.simulator.config import LEASE_RENEW_FRACTION, SimulatorSettings
from tardigrade_local.simulator.node import kubelet_gates, node_object, node_status
from tardigrade_local.simulator.simulated import SimulatedRuntime
from tardigrade_local.simulator.worker import DEFAULT_GRACE_SECONDS, PodWorker, Stop

log = logging.getLogger(__name__)

Obj = dict[str, Any]
SHUTDOWN_KILL_GRACE_SECONDS = 3.0
CONTAINER_STATUS_UNKNOWN = "ContainerStatusUnknown"  # kubecontainer.ContainerReasonStatusUnknown
CONTAINER_LOST_MESSAGE = "The container could not be located when the pod was terminated"
NODE_LEASE_NAMESPACE = "kube-node-lease"

# The kubelet's status loop (`nodeStatusUpdateFrequency`, 10 s): it reads its Node and posts
# its status when what it would say differs from what the API holds (`tryUpdateNodeStatus`),
# which is how a node marked Unknown by the controller manager turns Ready again.
NODE_STATUS_UPDATE_SECONDS = 10.0


def _micro_time() -> str:
    """A metav1.MicroTime."""
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclasses.dataclass(eq=False)
class NodeAgent:
    """One node's kubelet."""

    config: NodeConfig
    ip: str
    client: ApiClient
    events: EventRecorder
    state: str = "ready"  # ready | shutting-down | gone
    workers: dict[tuple[str, str, str], PodWorker] = dataclasses.field(default_factory=dict)
    # time.monotonic() since the kubelet stopped posting (a halted VM, a partition); None
    # while it posts.
    silent_since: float | None = None
    # uids of pods whose containers died with a halted VM: its successor under the same
    # name reports them (`_report_lost`).
    lost_pods: set[str] = dataclasses.field(default_factory=set)
    tasks: list[asyncio.Task[Any]] = dataclasses.field(default_factory=list)
    node_uid: str = ""
    lease: Obj | None = None

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def path(self) -> str:
        return core_path("nodes", name=self.name)


def refuse_unsimulated(config: NodeConfig) -> None:
    """The simulator runs simulated nodes only: pods that run processes run on real nodes."""
    if not config.simulated:
        raise ValueError(
            f"node {config.name}: not simulated; the simulator (benches only) runs simulated "
            f"nodes only (`cluster.simulated_nodes`, NodeConfig(simulated=True)); pods that "
            f"run run on real nodes (`realcluster.RealNodeCluster`, `tardigrade local up`)")


def _is_terminal(pod: Mapping[str, Any]) -> bool:
    return (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed")


class SimulatedHost:
    def __init__(self, settings: SimulatorSettings, nodes: list[NodeConfig]) -> None:
        if settings.access is None:
            raise ValueError("the node agents need the control plane's credentials (access)")
        for config in nodes:
            refuse_unsimulated(config)
        self.settings = settings
        self.access = settings.access
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
        self.cloud = GkeCloud(self._client(identities.CLOUD))
        # Simulated nodes' shared identity and pod watch (kwok's controller watches all pods).
        self._simulated_client: ApiClient | None = None
        self._simulated_events: EventRecorder | None = None
        self._simulated_pods: Informer | None = None
        self._simulated_task: asyncio.Task[None] | None = None
        self._finalizing: set[tuple[str, str, str]] = set()
        # Pods whose worker has ended never run again here, even if a stale event says Running.
        self._finished: set[str] = set()
        self._background: set[asyncio.Task[Any]] = set()

    def _client(self, identity: identities.Identity) -> ApiClient:
        return ApiClient(self.settings.api_url, self.access.ssl_context(identity.name),
                         identity.common_name)

    # --- start / stop --------------------------------------------------------------------
    async def start(self) -> None:
        self.settings.layout.pods_dir.mkdir(parents=True, exist_ok=True)
        for config in self.initial_nodes:
            await self.add_node(config)

    async def wait_schedulable(self, timeout: float | None = None,
                               names: set[str] | None = None) -> None:
        """Until every node that runs (or those `names`) is Ready and free of the taints
        kube-apiserver (TaintNodesByCondition admission: `node.kubernetes.io/not-ready` on a
        new Node) and the node lifecycle controller put on a node that is not (yet) Ready:
        the moment the scheduler can place pods on all of them."""
        if names is None:
            names = {n for n, a in self.agents.items() if a.state == "ready"}
        names = set(names)
        if timeout is None:
            # The node lifecycle controller lifts the taints at its client's rate (20 QPS by
            # default, a GET and a PATCH a node): a thousand new nodes take it a while.
            timeout = 60.0 + 0.2 * len(names)
        deadline = time.monotonic() + timeout
        while names:
            listing = await self.cloud.client.request("GET", core_path("nodes"))
            for node in listing.get("items") or []:
                taints = {t.get("key") for t in (node.get("spec") or {}).get("taints") or []}
                if not taints & {d.TAINT_NOT_READY, d.TAINT_UNREACHABLE}:
                    names.discard(node["metadata"]["name"])
            if names and time.monotonic() > deadline:
                raise TimeoutError(f"nodes not schedulable after {timeout:g} s: "
                                   f"{', '.join(sorted(names))}")
            if names:
                await asyncio.sleep(0.1)

    async def stop(self) -> None:
        """Cluster shutdown: pods get a short SIGTERM grace, no more API writes."""
        workers = [w for a in self.agents.values() for w in a.workers.values()]
        for worker in workers:
            worker.request_stop(Stop.REMOVED, SHUTDOWN_KILL_GRACE_SECONDS)
        if workers:
            await asyncio.wait([asyncio.create_task(w.done.wait()) for w in workers],
                               timeout=SHUTDOWN_KILL_GRACE_SECONDS + 5)
        for agent in self.agents.values():
            await self._retire(agent)
        for task in list(self._background):
            task.cancel()
        for task in list(self._background):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._simulated_task is not None:
            await self._cancel([self._simulated_task])
        await self.simulation.stop()
        for agent in self.agents.values():
            await agent.client.close()
        await self.cloud.close()

    @staticmethod
    async def _cancel(tasks: list[asyncio.Task[Any]]) -> None:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    # --- nodes ---------------------------------------------------------------------------
    # --- node pools (gke/autoscaler.py's `ProvisioningHost`) ---------------------------------
    def pool_sizes(self) -> Counter[str]:
        return Counter(a.config.pool for a in self.agents.values() if a.state != "gone")

    def upcoming_nodes(self) -> list[NodeConfig]:
        return list(self.recreating.values())

    def has_node(self, name: str) -> bool:
        return name in self.agents

    async def add_node(self, config: NodeConfig, lost_pods: set[str] | None = None) -> None:
        """A VM boots and its kubelet registers (a new node, or a VM recreated under its
        name, which finds the pods bound to its predecessor)."""
        old = self.agents.get(config.name)
        if old is not None and old.state != "gone":
            raise ValueError(f"node {config.name} already exists")
        refuse_unsimulated(config)
        self._node_index += 1
        ip = network.node_ip(self._node_index)
        client, events = await self._simulated_identity()
        agent = NodeAgent(config, ip, client, events, lost_pods=set(lost_pods or ()))
        self.agents[config.name] = agent
        await self._register(agent)
        agent.tasks.append(asyncio.create_task(self._lease_loop(agent)))
        # A kubelet starts by syncing the pods already bound to its node.
        assert self._simulated_pods is not None
        for pod in list(self._simulated_pods.cache.values()):
            if pod["spec"].get("nodeName") == config.name:
                self._on_pod(agent, "MODIFIED", pod)

    async def _simulated_identity(self) -> tuple[ApiClient, EventRecorder]:
        if self._simulated_client is None:
            self._simulated_client = self._client(identities.SIMULATED_KUBELET)
            self._simulated_events = EventRecorder(self._simulated_client)
            self._simulated_pods = Informer(self._simulated_client, core_path("pods"),
                                            self._on_simulated_pod)
            self._simulated_task = asyncio.create_task(self._simulated_pods.run())
            await self._simulated_pods.synced.wait()
        assert self._simulated_events is not None
        return self._simulated_client, self._simulated_events

    async def _register(self, agent: NodeAgent) -> None:
        """`registerWithAPIServer`: create the Node, or take over the one a predecessor
        under the same name left (labels and annotations; NodeRestriction leaves a node's
        taints to others once it exists)."""
        body = node_object(agent.config, agent.ip, 0)
        try:
            node = await agent.client.create(core_path("nodes"), body)
        except ApiError as err:
            if err.status != 409:
                raise
            node = await agent.client.patch(agent.path, {"metadata": {
                "labels": body["metadata"]["labels"],
                "annotations": body["metadata"]["annotations"]}})
        agent.node_uid = node["metadata"].get("uid", "")
        # The status of a create is dropped (nodeStrategy.PrepareForCreate); it is posted.
        await agent.client.patch(agent.path + "/status", {"status": body["status"]})
        agent.events.node(agent.name, "RegisteredNode", f"Node {agent.name} event: Registered")

    async def _lease_loop(self, agent: NodeAgent) -> None:
        """The node's heartbeat: its Lease in kube-node-lease, renewed every quarter of its
        duration (pkg/kubelet/nodelease, `controller.sync`), while the kubelet posts."""
        interval = self.settings.node_lease_seconds * LEASE_RENEW_FRACTION
        while agent.state != "gone":
            if agent.silent_since is None:
                try:
                    await self._renew_lease(agent)
                except (ApiError, OSError) as err:
                    log.debug("node %s: lease renewal failed: %s", agent.name, err)
                    agent.lease = None
            await asyncio.sleep(interval)

    async def _renew_lease(self, agent: NodeAgent) -> None:
        base = group_path("coordination.k8s.io/v1", "leases", NODE_LEASE_NAMESPACE)
        if agent.lease is None:
            agent.lease = await agent.client.get(f"{base}/{agent.name}")
        if agent.lease is None:
            agent.lease = await agent.client.create(base, {
                "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                "metadata": {"name": agent.name, "namespace": NODE_LEASE_NAMESPACE,
                             "ownerReferences": [{"apiVersion": "v1", "kind": "Node",
                                                  "name": agent.name, "uid": agent.node_uid}]},
                "spec": {"holderIdentity": agent.name,
                         "leaseDurationSeconds": int(self.settings.node_lease_seconds),
                         "renewTime": _micro_time()}})
            return
        lease = {**agent.lease, "spec": {**agent.lease["spec"], "renewTime": _micro_time()}}
        try:
            agent.lease = await agent.client.request("PUT", f"{base}/{agent.name}", lease)
        except ApiError as err:
            agent.lease = None  # 409 or 404: read it again next time
            raise err

    async def _sync_node_status(self, agent: NodeAgent) -> None:
        """Post Ready unless the API already says so (a node marked Unknown while its
        kubelet was silent turns Ready again)."""
        node = await agent.client.get(agent.path)
        if node is None:
            return
        ready = [c for c in (node.get("status") or {}).get("conditions") or []
                 if c.get("type") == "Ready"]
        if not ready or ready[0].get("status") != "True":
            await agent.client.patch(agent.path + "/status", {
                "status": node_status(agent.config, agent.ip, 0)})

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
                self.recreating[a.name] = a.config
            self._spawn(self._recreate(agents, replace_after_seconds))

    async def _shut_down(self, agent: NodeAgent, grace_seconds: float | None, why: str) -> None:
        """The kubelet's graceful node shutdown (nodeshutdown_manager_linux.go): the Node
        turns Ready=False while every pod is stopped with its grace; then the VM is gone and
        the cloud deletes its Node object."""
        agent.state = "shutting-down"
        agent.events.node(agent.name, "Shutdown", why, warning=True)
        grace = self.settings.shutdown_grace_seconds if grace_seconds is None else grace_seconds
        with contextlib.suppress(ApiError):
            await agent.client.patch(agent.path + "/status", {"status": node_status(
                agent.config, agent.ip, 0, ready=False,
                message=d.NODE_SHUTDOWN_NODE_MESSAGE)})
        workers = list(agent.workers.values())
        for worker in workers:
            pod_grace = worker.pod["spec"].get("terminationGracePeriodSeconds")
            worker.request_stop(Stop.NODE_SHUTDOWN, d.node_shutdown_pod_grace(pod_grace, grace))
        await asyncio.gather(*(w.done.wait() for w in workers))
        await self._retire(agent)
        await self.cloud.delete_node(agent.name)

    async def schedule_maintenance(self, name: str, in_seconds: float,
                                   back_after_seconds: float | None = None) -> float:
        """GKE host maintenance of a GPU/TPU node (disruptions.SCHEDULED_MAINTENANCE_LABEL):
        labelled now with the start (epoch seconds); performed at the start in the background.
        Returns the start."""
        agent = self._agent(name)
        if agent.state != "ready":
            raise ValueError(f"node {name} is {agent.state}: nothing to maintain")
        start = await hostmaintenance.announce(self.cloud, name, in_seconds)
        self._spawn(self._perform_maintenance(agent, start, back_after_seconds))
        return start

    async def _perform_maintenance(self, agent: NodeAgent, start: float,
                                   back_after_seconds: float | None) -> None:
        await hostmaintenance.wait_for_start(start)
        if self.agents.get(agent.name) is not agent or agent.state != "ready":
            return  # the VM went away meanwhile: nothing left to maintain
        with contextlib.suppress(ApiError):
            await hostmaintenance.begin(self.cloud, agent.name)
        # The VM is terminated with notice, the node agent's shutdown giving the pods the
        # handler's grace (here the kubelet's path, where real nodes get the handler's
        # deletions first: `hostmaintenance.drain`); the successor registers without the label.
        await self.preempt_node(agent.name, d.MAINTENANCE_POD_GRACE_SECONDS, back_after_seconds,
                                why=d.MAINTENANCE_MESSAGE)

    async def _recreate(self, agents: list[NodeAgent], delay: float) -> None:
        """The pool's managed instance group recreates the VMs under their names (a slice's
        hosts all at once)."""
        try:
            await asyncio.sleep(delay)
            # Nobody took a name meanwhile.
            back = [a for a in agents if self.agents.get(a.name) is a]
            await asyncio.gather(*(self.add_node(a.config) for a in back))
            # Upcoming for the cluster autoscaler until schedulable (autoscaler._provision).
            await self.wait_schedulable(names={a.name for a in back})
        finally:
            for a in agents:
                self.recreating.pop(a.name, None)

    async def remove_node(self, name: str) -> None:
        """GKE's queued provisioning gives a released request's empty node back
        (gke/autoscaler.py's `ProvisioningHost`): the VM goes, the cloud deletes its Node."""
        agent = self.agents.get(name)
        if agent is not None and agent.state != "gone":
            await self.lose_node(name)

    async def lose_node(self, name: str) -> None:
        """The machine vanished: processes die now, nothing more is reported, and the cloud
        deletes the Node object; pod GC fails and deletes its pods after its quarantine."""
        agent = self._agent(name)
        if agent.state == "gone":
            return
        workers = list(agent.workers.values())
        for worker in workers:
            worker.request_stop(Stop.NODE_LOST, 0)
        await self._retire(agent)
        await self.cloud.delete_node(name)
        await asyncio.gather(*(w.done.wait() for w in workers))

    async def halt_node(self, name: str, back_after_seconds: float | None = None) -> None:
        """The VM stops without a shutdown (host error, a stop the kubelet never hears of):
        its processes freeze (SIGSTOP: a stopped VM closes no connection, so its peers see
        silence, not a reset), the kubelet goes silent, the Node object stays for
        kube-controller-manager to mark Unknown and taint. With `back_after_seconds` the VM
        boots again under the same name (the frozen processes are gone: SIGKILL) and its
        kubelet re-registers."""
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
        kubelet restart): it renews no Lease while its pods run on and reach each other.
        Then it posts its status again: Ready, if the controller manager marked it Unknown
        meanwhile. Pod status writes in between are not held back."""
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
                await self._renew_lease(agent)
                await self._sync_node_status(agent)

    async def _report_lost(self, agent: NodeAgent, pod: Obj) -> None:
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
            await agent.client.patch(path + "/status", {"status": {
                "phase": "Failed", "containerStatuses": statuses}})
        except ApiError as err:
            log.warning("reporting lost pod %s failed: %s", path, err)

    async def _retire(self, agent: NodeAgent) -> None:
        agent.state = "gone"
        tasks, agent.tasks = agent.tasks, []
        await self._cancel([t for t in tasks if t is not asyncio.current_task()])

    def _agent(self, name: str) -> NodeAgent:
        agent = self.agents.get(name)
        if agent is None:
            raise KeyError(f'node "{name}" is not a local node')
        return agent

    async def node_of_pod(self, namespace: str, pod: str) -> str:
        obj = await self.cloud.client.get(core_path("pods", namespace, pod))
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

    # --- pods ----------------------------------------------------------------------------
    def _on_simulated_pod(self, kind: str, pod: Obj) -> None:
        agent = self.agents.get(pod["spec"].get("nodeName") or "")
        if agent is not None:
            self._on_pod(agent, kind, pod)

    def _on_pod(self, agent: NodeAgent, kind: str, pod: Obj) -> None:
        meta, spec = pod["metadata"], pod["spec"]
        ns, name, uid = meta.get("namespace") or "default", meta["name"], meta.get("uid", "")
        key = (ns, name, uid)
        if agent.state == "gone" or self.agents.get(agent.name) is not agent:
            return
        worker = agent.workers.get(key)
        if kind == "DELETED":
            self._finished.discard(uid)
            if worker is not None:
                worker.request_stop(Stop.REMOVED,
                                    float(spec.get("terminationGracePeriodSeconds",
                                                   DEFAULT_GRACE_SECONDS)))
            return
        if worker is not None:
            worker.update(pod)
            return
        if meta.get("deletionTimestamp"):
            # Nothing runs here for it (never started, or finished): finalize at once.
            if key not in self._finalizing:
                self._finalizing.add(key)
                self._spawn(self._finalize(agent, key, pod))
            return
        if uid in agent.lost_pods and agent.state == "ready" and not _is_terminal(pod):
            agent.lost_pods.discard(uid)
            self._spawn(self._report_lost(agent, pod))
            return
        if agent.state != "ready" or _is_terminal(pod) or uid in self._finished:
            return
        active = [w.pod for w in agent.workers.values() if w.counts_for_admission()]
        rejection = admission.admit(pod, agent.config.capacity, active)
        if rejection is not None:
            self._finished.add(uid)
            self._spawn(self._reject(agent, pod, rejection))
            return
        worker = PodWorker(self.settings, agent.client, agent.name, agent.ip,
                           self.ips.allocate(), pod, self.simulation, agent.events,
                           gates=kubelet_gates(agent.config))
        agent.workers[key] = worker
        worker.start()
        self._spawn(self._reap(agent, key, worker))

    async def _reject(self, agent: NodeAgent, pod: Obj, rejection: admission.Rejection) -> None:
        """Kubelet.rejectPod: a Warning event, then the pod Failed with the reason."""
        meta = pod["metadata"]
        path = core_path("pods", meta.get("namespace") or "default", meta["name"])
        agent.events.pod(pod, rejection.reason, rejection.message, warning=True,
                         host=agent.name)
        try:
            await agent.client.patch(path + "/status", {"status": rejection.pod_status()})
        except ApiError as err:
            log.warning("rejecting pod %s failed: %s", path, err)

    async def _finalize(self, agent: NodeAgent, key: tuple[str, str, str], pod: Obj) -> None:
        path = core_path("pods", key[0], key[1])
        try:
            if not _is_terminal(pod):
                # Like the kubelet since 1.27: a deleted pod reaches a terminal phase before it
                # goes, so controllers with a finalizer on it see it finish.
                await agent.client.patch(path + "/status", {"status": {"phase": "Failed"}})
            await agent.client.delete(path, 0)
        except ApiError as err:
            log.warning("finalizing pod %s/%s failed: %s", key[0], key[1], err)
        finally:
            self._finalizing.discard(key)

    async def _reap(self, agent: NodeAgent, key: tuple[str, str, str], worker: PodWorker) -> None:
        await worker.done.wait()
        self._finished.add(key[2])
        agent.workers.pop(key, None)
        self.ips.release(worker.pod_ip)
