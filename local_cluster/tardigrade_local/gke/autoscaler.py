"""A node autoscaler for the local node pools, after the Kubernetes cluster autoscaler.

What it copies (kubernetes/autoscaler, cluster-autoscaler):
- every scan (`--scan-interval`, 10 s) it looks at pods the scheduler marked
  `PodScheduled=False, reason Unschedulable`; a pod that fits an existing node, or a node
  already on its way, is left alone (core/podlistprocessor/filter_out_schedulable.go;
  core/static_autoscaler.go: upcoming nodes take part in the simulation);
- a pod that fits an empty node of a pool below its max size makes that pool grow; the pod
  gets the Event `TriggeredScaleUp`, "pod triggered scale-up: [{<pool> <from>-><to> (max:
  <max>)}]" (processors/status/eventing_scale_up_processor.go, `Process`, and
  nodegroupset.ScaleUpInfo's String);
- a pod no pool can take gets `NotTriggerScaleUp`, "pod didn't trigger scale-up: " and the
  aggregated reasons per pool, e.g. "1 max node group size reached" (core/scaleup/orchestrator
  skippedreasons.go) or the scheduler's "1 Insufficient cpu" (`ReasonsMessage`);
- the new node registers after a provisioning delay (the cloud creates the VM; GPU/TPU nodes
  take minutes), up to `--max-node-provision-time` (15 min) before the autoscaler gives up.

`plan_scale_up` is the pure decision; `NodeAutoscaler` runs it against the nodes of a
`NodePoolHost`: the real nodes' `RealNodeCluster`, or the benches' simulated nodes
(`simulator.SimulatedHost`); both are also `ProvisioningHost`s, which GKE's queued
provisioning drives.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

from tardigrade_local.gke import fitcheck
from tardigrade_local.gke.client import Informer, core_path
from tardigrade_local.gke.cloud import GkeCloud
from tardigrade_local.gke.disruptions import TAINT_NOT_READY, TAINT_UNREACHABLE
from tardigrade_local.gke.nodes import NodeConfig, node_object

log = logging.getLogger(__name__)

Obj = Mapping[str, Any]
TRIGGERED_SCALE_UP = "TriggeredScaleUp"
NOT_TRIGGER_SCALE_UP = "NotTriggerScaleUp"
MAX_SIZE_REACHED = "max node group size reached"
SCAN_INTERVAL_SECONDS = 10.0
COMPONENT = "cluster-autoscaler"


@dataclasses.dataclass(frozen=True)
class NodePool:
    """A pool the autoscaler may grow: new nodes look like `template` (its name is unused).

    `queued_provisioning`: GKE's `--enable-queued-provisioning` (the API's
    `NodePool.queuedProvisioning.enabled`: nodes "can be only obtained through queuing via
    the Cluster Autoscaler ProvisioningRequest API"): no ordinary scale-up grows it, only a
    ProvisioningRequest does (gke/provisioning.py)."""

    name: str
    max_size: int
    template: NodeConfig = dataclasses.field(default_factory=lambda: NodeConfig("template"))
    provision_seconds: float = 30.0
    queued_provisioning: bool = False

    def __post_init__(self) -> None:
        if self.max_size < 0:
            raise ValueError(f"node pool {self.name}: max_size must be >= 0, "
                             f"got {self.max_size}")
        if self.provision_seconds < 0:
            raise ValueError(f"node pool {self.name}: provision_seconds must be >= 0, "
                             f"got {self.provision_seconds}")

    def node_config(self, name: str) -> NodeConfig:
        return dataclasses.replace(self.template, name=name, pool=self.name)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> NodePool:
        template = NodeConfig.from_dict({"name": "template", **(data.get("template") or {})})
        return cls(name=str(data["name"]), max_size=int(data["maxSize"]), template=template,
                   provision_seconds=float(data.get("provisionSeconds", 30.0)),
                   queued_provisioning=bool(data.get("queuedProvisioning", False)))

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "maxSize": self.max_size,
                "template": self.template.to_dict(), "provisionSeconds": self.provision_seconds,
                "queuedProvisioning": self.queued_provisioning}


@dataclasses.dataclass(frozen=True)
class Verdict:
    pod: Obj
    reason: str  # TRIGGERED_SCALE_UP | NOT_TRIGGER_SCALE_UP
    message: str


@dataclasses.dataclass(frozen=True)
class ScaleUpPlan:
    verdicts: list[Verdict]
    grow: dict[str, int]  # pool -> nodes to add now


def is_unschedulable(pod: Obj) -> bool:
    if pod["spec"].get("nodeName") or pod["metadata"].get("deletionTimestamp"):
        return False
    status = pod.get("status") or {}
    if status.get("phase") not in (None, "Pending"):
        return False
    return any(c.get("type") == "PodScheduled" and c.get("status") == "False"
               and c.get("reason") == "Unschedulable" for c in status.get("conditions") or [])


def plan_scale_up(pending: Iterable[Obj], pools: Iterable[NodePool], sizes: Mapping[str, int],
                  upcoming: Sequence[NodeConfig]) -> ScaleUpPlan:
    """Which pools grow for the unschedulable `pending` pods, and what each pod is told.

    `sizes`: nodes each pool has now; `upcoming`: nodes on their way, of any pool (being
    provisioned, or recreated by their pool's instance group). Pods are packed onto upcoming
    nodes first, then onto new ones, in order.
    """
    pools = sorted(pools, key=lambda p: p.name)
    # Simulated nodes: (node object, pods placed on it).
    simulated: list[tuple[Obj, list[Obj]]] = [
        (node_object(config), []) for config in upcoming]
    coming = Counter(config.pool for config in upcoming)
    grow: Counter[str] = Counter()
    triggered: list[tuple[Obj, str]] = []
    refused: list[Verdict] = []
    for pod in pending:
        if _place_on_simulated(pod, simulated):
            continue
        reasons: Counter[str] = Counter()
        chosen = None
        for pool in pools:
            template = node_object(pool.node_config(f"{pool.name}-template"))
            why = fitcheck.unfit_reason(pod, template)
            if why is not None:
                reasons[why] += 1
            elif sizes.get(pool.name, 0) + coming[pool.name] + grow[pool.name] \
                    >= pool.max_size:
                reasons[MAX_SIZE_REACHED] += 1
            else:
                chosen = pool
                break
        if chosen is None:
            text = ", ".join(f"{n} {why}" for why, n in sorted(reasons.items()))
            refused.append(Verdict(pod, NOT_TRIGGER_SCALE_UP,
                                   f"pod didn't trigger scale-up: {text}"))
            continue
        grow[chosen.name] += 1
        node = node_object(chosen.node_config(f"{chosen.name}-new-{grow[chosen.name]}"))
        simulated.append((node, [_on(pod, node)]))
        triggered.append((pod, chosen.name))
    infos = " ".join(
        f"{{{pool.name} {current}->{current + grow[pool.name]} (max: {pool.max_size})}}"
        for pool in pools if grow[pool.name]
        for current in [sizes.get(pool.name, 0) + coming[pool.name]])
    verdicts = [Verdict(pod, TRIGGERED_SCALE_UP, f"pod triggered scale-up: [{infos}]")
                for pod, _ in triggered]
    return ScaleUpPlan(verdicts + refused, dict(grow))


def _on(pod: Obj, node: Obj) -> Obj:
    return {**pod, "spec": {**pod["spec"], "nodeName": node["metadata"]["name"]}}


def _place_on_simulated(pod: Obj, simulated: list[tuple[Obj, list[Obj]]]) -> bool:
    for node, placed in simulated:
        if fitcheck.unfit_reason(pod, node, placed) is None:
            placed.append(_on(pod, node))
            return True
    return False


class NodePoolHost(Protocol):
    """The nodes an autoscaler grows: what the cloud's node pools (managed instance groups)
    hold, and a way to add a VM to one."""

    @property
    def cloud(self) -> GkeCloud:
        """GKE's client, on the loop the autoscaler runs on."""
        ...

    def pool_sizes(self) -> Mapping[str, int]:
        """Nodes running in each pool."""
        ...

    def upcoming_nodes(self) -> Sequence[NodeConfig]:
        """Nodes on their way that the autoscaler did not ask for: VMs their pool's instance
        group is recreating."""
        ...

    def has_node(self, name: str) -> bool:
        """Whether `name` is taken (a node that runs, ran, or is on its way)."""
        ...

    async def add_node(self, config: NodeConfig) -> None:
        """A VM of `config` boots and its kubelet registers."""
        ...


class ProvisioningHost(NodePoolHost, Protocol):
    """The nodes GKE's queued provisioning books (gke/provisioning.py): a pool's nodes are
    added as the autoscaler adds them, and each goes once its request is released."""

    async def remove_node(self, name: str) -> None:
        """Node `name`'s VM is deleted and its Node object goes (the node is empty: its
        request's pods are gone). Nothing happens to a node already gone."""
        ...


def is_schedulable(node: Obj) -> bool:
    """Free of the taints of a node that is not (yet) Ready: kube-apiserver's
    `node.kubernetes.io/not-ready` on a new Node (TaintNodesByCondition) and the node
    lifecycle controller's; the scheduler can place pods there."""
    taints = {t.get("key") for t in (node.get("spec") or {}).get("taints") or []}
    return not taints & {TAINT_NOT_READY, TAINT_UNREACHABLE}


class NodeAutoscaler:
    """Grows the local node pools for unschedulable pods, as the cluster autoscaler does."""

    def __init__(self, host: NodePoolHost, pools: Iterable[NodePool],
                 scan_interval_seconds: float = SCAN_INTERVAL_SECONDS) -> None:
        self.host = host
        # A queued-provisioning pool grows only for a ProvisioningRequest.
        self.pools = [p for p in pools if not p.queued_provisioning]
        self.scan_interval_seconds = scan_interval_seconds
        self.provisioning: dict[str, NodeConfig] = {}  # nodes being created, by name
        self._told: dict[str, str] = {}  # pod uid -> the last verdict's message
        self._names = itertools.count(1)
        self._tasks: set[asyncio.Task[Any]] = set()
        # What the cluster autoscaler watches, with the cloud's identity.
        self.pods = Informer(host.cloud.client, core_path("pods"), lambda kind, obj: None)
        self.nodes = Informer(host.cloud.client, core_path("nodes"), lambda kind, obj: None)

    async def start(self) -> None:
        for informer in (self.pods, self.nodes):
            self._spawn(informer.run())
        await asyncio.gather(self.pods.synced.wait(), self.nodes.synced.wait())
        self._spawn(self.run())

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.scan_interval_seconds)
            try:
                self.scan()
            except Exception:
                log.exception("autoscaler scan failed")

    def scan(self) -> ScaleUpPlan:
        pods = list(self.pods.cache.values())
        nodes = list(self.nodes.cache.values())
        bound = [p for p in pods if p["spec"].get("nodeName")]
        # Pods the scheduler can place now (a node registered since it marked them) need no
        # node: the cluster autoscaler filters them out the same way (filter_out_schedulable).
        pending = sorted((p for p in pods if is_unschedulable(p)
                          and fitcheck.schedule(p, nodes, bound).node is None),
                         key=lambda p: p["metadata"].get("creationTimestamp") or "")
        sizes = self.host.pool_sizes()
        upcoming = [*self.provisioning.values(), *self.host.upcoming_nodes()]
        plan = plan_scale_up(pending, self.pools, sizes, upcoming)
        for verdict in plan.verdicts:
            uid = verdict.pod["metadata"].get("uid", "")
            # The real one records an event every scan; the event recorder folds repeats into
            # a count. One event per change says the same to a reader.
            if self._told.get(uid) != verdict.message:
                self._told[uid] = verdict.message
                self.host.cloud.events.pod(verdict.pod, verdict.reason, verdict.message,
                                           component=COMPONENT)
        for pool in self.pools:
            for _ in range(plan.grow.get(pool.name, 0)):
                config = pool.node_config(self._new_name(pool))
                self.provisioning[config.name] = config
                self._spawn(self._provision(pool, config))
        return plan

    async def _provision(self, pool: NodePool, config: NodeConfig) -> None:
        """The cloud creates the VM; its kubelet registers. The node stays upcoming until it
        is Ready and untainted, as the cluster autoscaler counts a registered node that is
        not ready yet among the upcoming ones (clusterstate `GetUpcomingNodes`): meanwhile
        the scheduler cannot place a pod there either."""
        try:
            await asyncio.sleep(pool.provision_seconds)
            await self.host.add_node(config)
            log.info("autoscaler: node %s added to pool %s", config.name, pool.name)
            while not self._schedulable(config.name):
                await asyncio.sleep(0.2)
        finally:
            self.provisioning.pop(config.name, None)

    def _schedulable(self, name: str) -> bool:
        node = self.nodes.cache.get(("", name))
        return node is not None and is_schedulable(node)

    def _new_name(self, pool: NodePool) -> str:
        while True:
            name = f"{pool.name}-{next(self._names)}"
            if not self.host.has_node(name) and name not in self.provisioning:
                return name

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
