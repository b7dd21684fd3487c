"""Pod GC: what the controller does to pods whose node no longer exists.

After a quarantine (real: 40 s) it marks a pod that is not yet terminal Failed with the
DisruptionTarget condition (DeletionByPodGC), then deletes it with no grace period.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from tardigrade_local import disruptions as d
from tardigrade_local.kubelet import podstatus as ps
from tardigrade_local.kubelet.client import ApiClient, ApiError, Informer, core_path

log = logging.getLogger(__name__)

Obj = dict[str, Any]
POD_GC_PERIOD_SECONDS = 0.5


def _is_terminal(pod: Obj) -> bool:
    return (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed")


class PodGC:
    def __init__(self, client: ApiClient, pods: Informer, nodes: Informer,
                 quarantine_seconds: float) -> None:
        self.client = client
        self.pods = pods
        self.nodes = nodes
        self.quarantine_seconds = quarantine_seconds
        self._orphans: dict[tuple[str, str, str], float] = {}

    async def run(self) -> None:
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
            if now - first >= self.quarantine_seconds:
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
