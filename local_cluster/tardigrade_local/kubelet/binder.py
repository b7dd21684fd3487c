"""The default scheduler's loop: bind pending pods to local nodes (`scheduler.py` decides).

Like the real scheduler it assumes a binding at once, so the next pod in the same pass sees
the capacity taken before the watch reports it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from tardigrade_local.kubelet import podstatus as ps
from tardigrade_local.kubelet import scheduler
from tardigrade_local.kubelet.client import ApiClient, ApiError, Informer, core_path
from tardigrade_local.kubelet.events import EventRecorder

log = logging.getLogger(__name__)

Obj = dict[str, Any]
Key = tuple[str, str, str]


def _is_terminal(pod: Obj) -> bool:
    return (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed")


class Binder:
    def __init__(self, client: ApiClient, pods: Informer, nodes: Informer,
                 events: EventRecorder) -> None:
        self.client = client
        self.pods = pods
        self.nodes = nodes
        self.events = events
        self.dirty = asyncio.Event()  # set on any change that may let a pod fit
        self._assumed: dict[Key, str] = {}
        self._unschedulable: dict[Key, str] = {}

    def observed_binding(self, key: Key) -> None:
        """The watch shows the pod bound: the assumption is no longer needed."""
        self._assumed.pop(key, None)

    async def run(self) -> None:
        while True:
            await self.dirty.wait()
            self.dirty.clear()
            try:
                await self._schedule_pending()
            except Exception:
                log.exception("scheduling pass failed")
                await asyncio.sleep(1)
                self.dirty.set()

    def _waiting(self, pod: Obj) -> bool:
        """Whether the pod waits for this scheduler to place it."""
        meta, spec = pod["metadata"], pod["spec"]
        key = (meta.get("namespace") or "default", meta["name"], meta.get("uid", ""))
        return not (spec.get("nodeName") or key in self._assumed or meta.get("deletionTimestamp")
                    or _is_terminal(pod)
                    or spec.get("schedulerName", "default-scheduler") != "default-scheduler")

    async def _schedule_pending(self) -> None:
        # Most passes follow a status write of a pod already bound: with nothing waiting,
        # adding up what every node holds would be wasted (it grows with the cluster).
        pending = [p for p in self.pods.cache.values() if self._waiting(p)]
        if not pending:
            return
        nodes = list(self.nodes.cache.values())
        bound = [p for p in self.pods.cache.values() if p["spec"].get("nodeName")]
        bound += [self._assumed_pod(p, self._assumed[k]) for k, p in self._pending_assumed()]
        usage = scheduler.NodeUsage(bound)
        for pod in sorted(pending, key=lambda p: p["metadata"].get("creationTimestamp") or ""):
            meta = pod["metadata"]
            key = (meta.get("namespace") or "default", meta["name"], meta.get("uid", ""))
            if not self._waiting(pod):
                continue
            decision = scheduler.schedule(pod, nodes, bound, usage=usage)
            if decision.node is None:
                if self._unschedulable.get(key) != decision.message:
                    self._unschedulable[key] = decision.message
                    await self._mark_unschedulable(pod, decision.message)
                    self.events.pod(pod, "FailedScheduling", decision.message, warning=True,
                                    component="default-scheduler")
                continue
            self._unschedulable.pop(key, None)
            self._assumed[key] = decision.node
            assumed = self._assumed_pod(pod, decision.node)
            usage.add(assumed)
            bound.append(assumed)
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
