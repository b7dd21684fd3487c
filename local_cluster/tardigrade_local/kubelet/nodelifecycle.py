"""What the control plane does about a node whose kubelet went silent (VM stopped without a
shutdown, partition): the node lifecycle controller, taint eviction, and pod GC's
out-of-service pass. Sources in local_cluster/README.md, "Ungraceful node loss".

- Node lifecycle controller (pkg/controller/nodelifecycle/node_lifecycle_controller.go,
  tryUpdateNodeHealth): no heartbeat for the node monitor grace period -> every node condition
  becomes Unknown, reason NodeStatusUnknown, "Kubelet stopped posting node status.";
  doNoExecuteTaintingPass / doNoScheduleTaintingPass taint the node
  node.kubernetes.io/unreachable (NoExecute and NoSchedule), and remove the taints once the
  node is Ready again (markNodeAsReachable).
- Taint eviction (pkg/controller/tainteviction/taint_eviction.go): a pod on a node with a
  NoExecute taint it does not tolerate is deleted at once; one that tolerates it for
  tolerationSeconds (300 s, from the DefaultTolerationSeconds admission plugin) is deleted
  that long after the taint's timeAdded; before the delete, the DisruptionTarget condition
  (DeletionByTaintManager) is added. No kubelet confirms the kill: the pod stays Terminating.
- Pod GC (pkg/controller/podgc/gc_controller.go, gcTerminating): terminating pods on a node
  that is not Ready and is tainted node.kubernetes.io/out-of-service are marked Failed and
  force-deleted.

The kubelet's heartbeat (its Lease in kube-node-lease) is not emulated: the controller asks
the local host when each kubelet went silent; what reaches the API is the controller's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from datetime import UTC, datetime
from typing import Any

from tardigrade_local import disruptions as d
from tardigrade_local.kubelet import podstatus as ps
from tardigrade_local.kubelet.client import ApiClient, ApiError, Informer, core_path

log = logging.getLogger(__name__)

Obj = dict[str, Any]

# --node-monitor-grace-period: 40 s until 1.31, 50 s since 1.32 (kubernetes/kubernetes#126287,
# pkg/controller/nodelifecycle/config/v1alpha1/defaults.go).
NODE_MONITOR_GRACE_SECONDS = 50.0
# --node-monitor-period: how often the controller looks.
NODE_MONITOR_PERIOD_SECONDS = 0.5  # real: 5 s; a pass here is cheap and tests are short
# DefaultTolerationSeconds admission plugin: --default-not-ready-toleration-seconds and
# --default-unreachable-toleration-seconds.
DEFAULT_TOLERATION_SECONDS = 300

TAINT_UNREACHABLE = "node.kubernetes.io/unreachable"
TAINT_NOT_READY = "node.kubernetes.io/not-ready"
TAINT_OUT_OF_SERVICE = "node.kubernetes.io/out-of-service"
NODE_STATUS_UNKNOWN = "NodeStatusUnknown"
NODE_STATUS_UNKNOWN_MESSAGE = "Kubelet stopped posting node status."
TAINT_MANAGER_MESSAGE = "Taint manager: deleting due to NoExecute taint"
OUT_OF_SERVICE_MESSAGE = "PodGC: node is out-of-service"


def rfc3339(when: float) -> str:
    return datetime.fromtimestamp(when, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _epoch(value: str | None) -> float | None:
    if not value:
        return None
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


def unknown_conditions(conditions: Iterable[Mapping[str, Any]], now: str) -> list[Obj]:
    """tryUpdateNodeHealth: every condition the kubelet posts becomes Unknown; the heartbeat
    stays the kubelet's last, the transition time is now."""
    result = []
    for cond in conditions:
        if cond.get("status") == "Unknown":
            result.append(dict(cond))
            continue
        result.append({**cond, "status": "Unknown", "reason": NODE_STATUS_UNKNOWN,
                       "message": NODE_STATUS_UNKNOWN_MESSAGE, "lastTransitionTime": now})
    return result


def unreachable_taints(taints: Iterable[Mapping[str, Any]], now: str) -> list[Obj]:
    """The node's taints with unreachable NoExecute and NoSchedule (each once)."""
    current = [dict(t) for t in taints]
    for effect in ("NoExecute", "NoSchedule"):
        if not any(t.get("key") == TAINT_UNREACHABLE and t.get("effect") == effect
                   for t in current):
            taint: Obj = {"key": TAINT_UNREACHABLE, "effect": effect}
            if effect == "NoExecute":
                taint["timeAdded"] = now
            current.append(taint)
    return current


def without_unreachable(taints: Iterable[Mapping[str, Any]]) -> list[Obj]:
    return [dict(t) for t in taints if t.get("key") != TAINT_UNREACHABLE]


def _tolerates(toleration: Mapping[str, Any], taint: Mapping[str, Any]) -> bool:
    """core/v1 Toleration.ToleratesTaint."""
    effect = toleration.get("effect") or ""
    if effect and effect != taint.get("effect"):
        return False
    key = toleration.get("key") or ""
    if key and key != taint.get("key"):
        return False
    if (toleration.get("operator") or "Equal") == "Exists":
        return True
    return (toleration.get("value") or "") == (taint.get("value") or "")


def eviction_time(pod: Mapping[str, Any], taints: Iterable[Mapping[str, Any]]) -> float | None:
    """When taint eviction deletes this pod (epoch seconds); None: never.

    taint_eviction.go processPodOnNode: a NoExecute taint no toleration matches -> now (the
    taint's timeAdded); otherwise the smallest tolerationSeconds of the matching tolerations
    (getMinTolerationTime), counted from the taint's timeAdded; no tolerationSeconds: never.
    """
    tolerations = (pod.get("spec") or {}).get("tolerations") or []
    due: float | None = None
    for taint in taints:
        if taint.get("effect") != "NoExecute":
            continue
        added = _epoch(taint.get("timeAdded")) or 0.0
        matching = [t for t in tolerations if _tolerates(t, taint)]
        if not matching:
            return added
        seconds = [float(t["tolerationSeconds"]) for t in matching
                   if t.get("tolerationSeconds") is not None]
        if not seconds:
            continue
        when = added + max(0.0, min(seconds))
        due = when if due is None else min(due, when)
    return due


def _ready(node: Mapping[str, Any]) -> str:
    for cond in (node.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Ready":
            return str(cond.get("status"))
    return "Unknown"


def _is_terminal(pod: Mapping[str, Any]) -> bool:
    return (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed")


class NodeLifecycle:
    """The three controllers, one pass every NODE_MONITOR_PERIOD_SECONDS."""

    def __init__(self, client: ApiClient, pods: Informer, nodes: Informer,
                 silent_since: Callable[[str], float | None], grace_seconds: float) -> None:
        self.client = client
        self.pods = pods
        self.nodes = nodes
        # Node name -> time.monotonic() of its kubelet's last heartbeat, None while posting.
        self.silent_since = silent_since
        self.grace_seconds = grace_seconds
        self._deleting: set[str] = set()

    async def run(self) -> None:
        while True:
            await asyncio.sleep(NODE_MONITOR_PERIOD_SECONDS)
            if not (self.nodes.synced.is_set() and self.pods.synced.is_set()):
                continue
            try:
                await self.monitor_nodes()
                await self.evict_pods()
            except Exception:
                log.exception("node lifecycle pass failed")

    async def monitor_nodes(self) -> None:
        now = rfc3339(time.time())
        for node in list(self.nodes.cache.values()):
            name = node["metadata"]["name"]
            path = core_path("nodes", name=name)
            silent = self.silent_since(name)
            taints = (node.get("spec") or {}).get("taints") or []
            unreachable = any(t.get("key") == TAINT_UNREACHABLE for t in taints)
            with contextlib.suppress(ApiError):
                if silent is not None and time.monotonic() - silent >= self.grace_seconds:
                    if _ready(node) != "Unknown":
                        conditions = (node.get("status") or {}).get("conditions") or []
                        await self.client.patch(path + "/status", {"status": {
                            "conditions": unknown_conditions(conditions, now)}})
                    if not unreachable:
                        await self.client.patch(path, {"spec": {
                            "taints": unreachable_taints(taints, now)}})
                elif silent is None and unreachable and _ready(node) == "True":
                    await self.client.patch(path, {"spec": {
                        "taints": without_unreachable(taints)}})

    async def evict_pods(self) -> None:
        nodes = {n["metadata"]["name"]: n for n in self.nodes.cache.values()}
        now = time.time()
        for pod in list(self.pods.cache.values()):
            node = nodes.get((pod.get("spec") or {}).get("nodeName") or "")
            if node is None or _is_terminal(pod):
                continue
            taints = (node.get("spec") or {}).get("taints") or []
            meta = pod["metadata"]
            if meta.get("deletionTimestamp"):
                if _ready(node) != "True" and any(
                        t.get("key") == TAINT_OUT_OF_SERVICE for t in taints):
                    await self._gc_out_of_service(pod)
                continue
            due = eviction_time(pod, taints)
            if due is not None and now >= due and meta.get("uid") not in self._deleting:
                await self._taint_evict(pod)

    async def _taint_evict(self, pod: Obj) -> None:
        meta = pod["metadata"]
        path = core_path("pods", meta.get("namespace") or "default", meta["name"])
        self._deleting.add(meta.get("uid", ""))
        existing = (pod.get("status") or {}).get("conditions") or []
        cond = ps.condition(d.DISRUPTION_TARGET, True, d.REASON_DELETION_BY_TAINT_MANAGER,
                            TAINT_MANAGER_MESSAGE)
        with contextlib.suppress(ApiError):
            await self.client.patch(path + "/status", {"status": {
                "conditions": ps.merge_conditions(existing, [cond])}})
            await self.client.delete(path)  # the pod's own grace: nobody will honour it

    async def _gc_out_of_service(self, pod: Obj) -> None:
        meta = pod["metadata"]
        path = core_path("pods", meta.get("namespace") or "default", meta["name"])
        existing = (pod.get("status") or {}).get("conditions") or []
        cond = ps.condition(d.DISRUPTION_TARGET, True, d.REASON_DELETION_BY_POD_GC,
                            OUT_OF_SERVICE_MESSAGE)
        with contextlib.suppress(ApiError):
            await self.client.patch(path + "/status", {"status": {
                "phase": "Failed", "conditions": ps.merge_conditions(existing, [cond])}})
            await self.client.delete(path, 0)
