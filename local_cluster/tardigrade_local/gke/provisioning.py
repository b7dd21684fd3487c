"""GKE's queued provisioning (Dynamic Workload Scheduler) for the local node pools.

On GKE a node pool created with `--enable-queued-provisioning` gets nodes only through the
cluster autoscaler's ProvisioningRequest API (autoscaling.x-k8s.io/v1, class
`queued-provisioning.gke.io`): GKE allocates all the nodes a request asks for at the same
time, then reports `Provisioned=True`; Kueue's ProvisioningRequest admission check creates
the request for a Workload and admits the Workload once it is provisioned (GKE, "Run a
large-scale workload with flex-start with queued provisioning",
https://cloud.google.com/kubernetes-engine/docs/how-to/provisioningrequest).

What this models, as the cluster autoscaler with GKE's identity (`identities.CLOUD`):
- a request of that class is `Accepted=True` at once, then waits until every pod of its
  podSets (`podTemplateRef` x `count`) fits new nodes of one queued-provisioning pool below
  its max size (the same packing as the autoscaler's scale-up, `plan_scale_up`); while it
  does not, `Provisioned=False` says why;
- booked, `Provisioned=False` says how many nodes are coming; all its nodes are created
  together, after the pool's provisioning delay; once every one is Ready and untainted,
  `Provisioned=True` (Kueue copies the Provisioned message into its check's message while
  the request is Accepted, `controller.go`, so the job's status shows it);
- the request deleted (Kueue deletes it, or it goes with its Workload), its nodes go too,
  each once no pod runs on it (scale-down of an empty node; GKE's scale-down delay is not
  modelled): Kueue deletes an evicted Workload's request at once, while the gang still saves.
Not modelled: `BookingExpired` (GKE releases capacity no pod consumed within its booking
time), `CapacityRevoked`, `Failed` (a request GKE cannot ever serve), `maxRunDurationSeconds`
and the end of a run at it, and GKE's placement of only the consuming pods on the booked
nodes (here any pod that selects the pool may land there).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from typing import Any

from tardigrade_local.gke.autoscaler import (
    NOT_TRIGGER_SCALE_UP,
    NodePool,
    ProvisioningHost,
    is_schedulable,
    plan_scale_up,
)
from tardigrade_local.gke.client import ApiError, Informer, core_path, group_path

log = logging.getLogger(__name__)

Obj = Mapping[str, Any]
API_VERSION = "autoscaling.x-k8s.io/v1"
PLURAL = "provisioningrequests"
QUEUED_PROVISIONING_CLASS = "queued-provisioning.gke.io"
# Ours, not GKE's: which request a node was created for.
REQUEST_LABEL = "tardigrade.dev/provisioning-request"
RETRY_SECONDS = 2.0
EMPTY_POLL_SECONDS = 1.0
SCHEDULABLE_POLL_SECONDS = 0.2
# From the nodes' creation to every one schedulable: the cluster autoscaler's
# --max-node-provision-time (a real node boots in tens of seconds on a loaded machine).
MAX_NODE_PROVISION_SECONDS = 900.0


@dataclasses.dataclass(frozen=True)
class Booking:
    """The nodes one request needs: pool -> how many, or why none can be had now."""

    grow: dict[str, int]
    refusal: str | None


def plan_booking(pods: list[Obj], pools: Iterable[NodePool], sizes: Mapping[str, int]
                 ) -> Booking:
    """Every pod on new nodes of the queued-provisioning `pools`, all or nothing."""
    plan = plan_scale_up(pods, pools, sizes, [])
    refused = [v.message for v in plan.verdicts if v.reason == NOT_TRIGGER_SCALE_UP]
    if refused:
        return Booking({}, refused[0])
    return Booking(plan.grow, None)


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _condition(kind: str, status: str, reason: str, message: str, generation: int
               ) -> dict[str, Any]:
    return {"type": kind, "status": status, "reason": reason, "message": message,
            "observedGeneration": generation, "lastTransitionTime": _now()}


def is_true(request: Obj, kind: str) -> bool:
    return any(c.get("type") == kind and c.get("status") == "True"
               for c in (request.get("status") or {}).get("conditions") or [])


class QueuedProvisioner:
    """Serves ProvisioningRequests of GKE's queued-provisioning class from the local pools,
    on the nodes of `host`: the real nodes' `RealNodeCluster` (its loop's GKE client), or
    the benches' `simulator.SimulatedHost`."""

    def __init__(self, host: ProvisioningHost, pools: Iterable[NodePool]) -> None:
        self.host = host
        self.client = host.cloud.client
        self.pools = [p for p in pools if p.queued_provisioning]
        self.booked: dict[str, dict[str, str]] = {}  # request uid -> its nodes' pools
        self._serving: set[str] = set()
        self._names = itertools.count(1)
        self._tasks: set[asyncio.Task[Any]] = set()
        self.requests = Informer(self.client, group_path(API_VERSION, PLURAL), self._on_event)

    async def start(self) -> None:
        self._spawn(self.requests.run())
        await self.requests.synced.wait()

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _on_event(self, kind: str, request: Obj) -> None:
        if (request.get("spec") or {}).get("provisioningClassName") != QUEUED_PROVISIONING_CLASS:
            return
        uid = request["metadata"]["uid"]
        if kind == "DELETED":
            self._spawn(self._release(uid))
        elif uid not in self._serving and not is_true(request, "Provisioned"):
            self._serving.add(uid)
            self._spawn(self._serve(request))

    def _gone(self, request: Obj) -> bool:
        meta = request["metadata"]
        current = self.requests.cache.get((meta["namespace"], meta["name"]))
        return current is None or current["metadata"]["uid"] != meta["uid"]

    async def _serve(self, request: Obj) -> None:
        meta = request["metadata"]
        generation = int(meta.get("generation") or 1)
        try:
            accepted = _condition("Accepted", "True", "Accepted",
                                  "queued for capacity in a queued-provisioning node pool",
                                  generation)
            await self._set_conditions(request, [accepted])
            pods = await self._pods(request)
            told = None
            while True:
                if self._gone(request):
                    return
                booking = plan_booking(pods, self.pools, self._sizes())
                if booking.refusal is None:
                    break
                if told != booking.refusal:
                    told = booking.refusal
                    await self._set_conditions(request, [accepted, _condition(
                        "Provisioned", "False", "CapacityNotAvailable", booking.refusal,
                        generation)])
                await asyncio.sleep(RETRY_SECONDS)
            names = self._book(meta["uid"], booking)
            count = sum(booking.grow.values())
            pools = ", ".join(f"{n} in {pool}" for pool, n in sorted(booking.grow.items()))
            await self._set_conditions(request, [accepted, _condition(
                "Provisioned", "False", "Provisioning",
                f"provisioning {count} node(s) ({pools}), all at once", generation)])
            await self._create_nodes(meta["name"], names)
            if self._gone(request):
                await self._release(meta["uid"])
                return
            await self._set_conditions(request, [accepted, _condition(
                "Provisioned", "True", "Provisioned",
                f"{count} node(s) provisioned: {', '.join(sorted(names))}", generation)])
            log.info("queued provisioning: %s/%s provisioned on %s", meta["namespace"],
                     meta["name"], sorted(names))
        except Exception:
            log.exception("queued provisioning of %s/%s failed", meta["namespace"],
                          meta["name"])
            self._serving.discard(meta["uid"])

    def _book(self, uid: str, booking: Booking) -> dict[str, NodePool]:
        """Reserve the nodes' names at once, so a second request counts them in the pool."""
        names: dict[str, NodePool] = {}
        for pool in self.pools:
            for _ in range(booking.grow.get(pool.name, 0)):
                names[self._new_name(pool)] = pool
        self.booked[uid] = {name: pool.name for name, pool in names.items()}
        return names

    async def _create_nodes(self, request_name: str, names: Mapping[str, NodePool]) -> None:
        """All at once (GKE allocates the request's resources at the same time)."""
        delay = max((pool.provision_seconds for pool in names.values()), default=0.0)
        await asyncio.sleep(delay)
        configs = [dataclasses.replace(pool.node_config(name),
                                       labels={**pool.template.labels,
                                               REQUEST_LABEL: request_name})
                   for name, pool in names.items()]
        await asyncio.gather(*(self.host.add_node(config) for config in configs))
        await self._wait_schedulable(set(names))

    async def _wait_schedulable(self, names: set[str]) -> None:
        """Until every one of `names` is Ready and untainted (`is_schedulable`)."""
        deadline = time.monotonic() + MAX_NODE_PROVISION_SECONDS
        while names:
            listing = await self.client.request("GET", core_path("nodes"))
            names -= {node["metadata"]["name"] for node in listing.get("items") or []
                      if is_schedulable(node)}
            if names and time.monotonic() > deadline:
                raise TimeoutError(f"nodes not schedulable after "
                                   f"{MAX_NODE_PROVISION_SECONDS:g} s: "
                                   f"{', '.join(sorted(names))}")
            if names:
                await asyncio.sleep(SCHEDULABLE_POLL_SECONDS)

    async def _release(self, uid: str) -> None:
        """The request is gone: its nodes are scaled down, each once no pod runs on it (Kueue
        deletes an evicted Workload's request at once, while its pods still save)."""
        self._serving.discard(uid)
        nodes = self.booked.get(uid, {})
        await asyncio.gather(*(self._scale_down_when_empty(name) for name in nodes))
        self.booked.pop(uid, None)

    async def _scale_down_when_empty(self, name: str) -> None:
        while await self._pods_on(name):
            await asyncio.sleep(EMPTY_POLL_SECONDS)
        await self.host.remove_node(name)
        log.info("queued provisioning: node %s released", name)

    async def _pods_on(self, name: str) -> int:
        """Pods bound to the node that have not finished (a deleted one still counts until
        its kubelet reports it gone)."""
        listing = await self.client.request("GET", core_path("pods"), params={
            "fieldSelector": f"spec.nodeName={name}"})
        return sum(1 for pod in listing.get("items") or []
                   if (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed"))

    def _sizes(self) -> Counter[str]:
        sizes: Counter[str] = Counter(self.host.pool_sizes())
        for nodes in self.booked.values():
            for name, pool in nodes.items():
                if not self.host.has_node(name):  # booked, not created yet
                    sizes[pool] += 1
        return sizes

    def _new_name(self, pool: NodePool) -> str:
        taken = {n for names in self.booked.values() for n in names}
        while True:
            name = f"{pool.name}-{next(self._names)}"
            if not self.host.has_node(name) and name not in taken:
                return name

    async def _pods(self, request: Obj) -> list[Obj]:
        """The pods a request stands for: each podSet's PodTemplate, `count` times."""
        namespace = request["metadata"]["namespace"]
        pods: list[Obj] = []
        for pod_set in request["spec"].get("podSets") or []:
            name = pod_set["podTemplateRef"]["name"]
            template = await self.client.get(core_path("podtemplates", namespace, name))
            if template is None:
                raise ValueError(f"PodTemplate {namespace}/{name} of ProvisioningRequest "
                                 f"{request['metadata']['name']} not found")
            body = template.get("template") or {}
            pods += [{"metadata": {**(body.get("metadata") or {}), "namespace": namespace,
                                   "uid": f"{name}-{i}"},
                      "spec": body.get("spec") or {}}
                     for i in range(int(pod_set.get("count") or 0))]
        return pods

    async def _set_conditions(self, request: Obj, conditions: list[dict[str, Any]]) -> None:
        meta = request["metadata"]
        path = group_path(API_VERSION, PLURAL, meta["namespace"], meta["name"], "status")
        try:
            await self.client.patch(path, {"status": {"conditions": conditions}})
        except ApiError as err:
            if err.status != 404:
                raise

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
