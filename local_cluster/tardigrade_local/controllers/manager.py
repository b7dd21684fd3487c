"""Runs the Deployment and ReplicaSet controllers: observe, decide (pure), act.

Level-triggered: every pass lists Deployments, ReplicaSets and (when there are any of
those) Pods afresh from the API server (one server on loopback, so a list is cheap and never
stale), decides with `decide_deployment` / `decide_replicaset`, and writes only what
differs. Watches only wake the loop early; a timer covers what time alone changes
(minReadySeconds, the progress deadline). Reading fresh lists replaces upstream's informer
caches and "expectations": a pass never acts on a view that misses its own previous writes,
so it never creates a pod twice.

Simplified against upstream kube-controller-manager (see also `deployment.py`): objects are
only managed through controller ownerReferences (no adoption or release of orphans), no
rate-limited work queues or slow-start batches, no ReplicaFailure condition.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
from collections.abc import Mapping
from typing import Any

import aiohttp

from tardigrade_local.controllers.deployment import DeploymentPlan, decide_deployment
from tardigrade_local.controllers.objects import Obj, owned
from tardigrade_local.controllers.replicaset import (
    ReplicaSetPlan,
    decide_replicaset,
    pod_from_template,
)
from tardigrade_local.kubelet.client import ApiClient, ApiError, Informer, group_path
from tardigrade_local.kubelet.events import EventRecorder

log = logging.getLogger(__name__)

RESYNC_SECONDS = 10.0
RETRY_SECONDS = 1.0
DEPLOYMENT_COMPONENT = "deployment-controller"
REPLICASET_COMPONENT = "replicaset-controller"


def status_patch(old: Mapping[str, Any] | None, new: Mapping[str, Any]) -> Obj:
    """A merge patch that makes the status exactly `new` (dropped keys are set to null)."""
    return {"status": {**{k: None for k in (old or {}) if k not in new}, **new}}


class WorkloadControllers:
    def __init__(self, api_url: str) -> None:
        self.client = ApiClient(api_url)
        self.events = EventRecorder(self.client)
        self._wake = asyncio.Event()
        self._informers = [
            Informer(self.client, group_path("apps/v1", "deployments"), self._on_change),
            Informer(self.client, group_path("apps/v1", "replicasets"), self._on_change),
            Informer(self.client, group_path("v1", "pods"), self._on_pod),
        ]
        self._tasks: list[asyncio.Task[Any]] = []

    async def start(self) -> None:
        self._tasks = [asyncio.create_task(i.run()) for i in self._informers]
        await asyncio.gather(*(i.synced.wait() for i in self._informers))
        self._tasks.append(asyncio.create_task(self._loop(), name="workload controllers"))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await self.client.close()

    def _on_change(self, kind: str, obj: Obj) -> None:
        self._wake.set()

    def _on_pod(self, kind: str, pod: Obj) -> None:
        # Only pods a ReplicaSet controls matter here (not, e.g., a trainer's progress).
        if any(ref.get("kind") == "ReplicaSet"
               for ref in pod["metadata"].get("ownerReferences") or []):
            self._wake.set()

    async def _loop(self) -> None:
        recheck = 0.0
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), recheck)
            self._wake.clear()
            try:
                recheck = await self.sync()
            except (ApiError, aiohttp.ClientError, OSError, TimeoutError) as err:
                log.warning("workload controllers: pass failed, retrying: %s", err)
                recheck = RETRY_SECONDS
            except Exception:
                # One odd object must not stop every Deployment in the cluster.
                log.exception("workload controllers: pass failed, retrying")
                recheck = RETRY_SECONDS

    async def _list(self, api_version: str, plural: str, kind: str) -> list[Obj]:
        listing = await self.client.request("GET", group_path(api_version, plural))
        items = list(listing.get("items") or [])
        for item in items:  # list items carry no kind; owner references need it
            item.setdefault("apiVersion", api_version)
            item.setdefault("kind", kind)
        return items

    async def sync(self) -> float:
        """One pass over every Deployment and ReplicaSet; seconds until the next timed check."""
        now = dt.datetime.now(dt.UTC)
        deployments = await self._list("apps/v1", "deployments", "Deployment")
        replicasets = await self._list("apps/v1", "replicasets", "ReplicaSet")
        # Pods matter only to ReplicaSets (a Deployment sees its pods through them). With
        # none, a pass skips listing every pod: at a thousand pods that list is megabytes,
        # every resync.
        pods = await self._list("v1", "pods", "Pod") if replicasets or deployments else []
        rechecks = [RESYNC_SECONDS]
        wrote = False
        for deploy in deployments:
            sets = owned(replicasets, deploy)
            pods_by_rs = {rs["metadata"]["name"]: owned(pods, rs) for rs in sets}
            plan = decide_deployment(deploy, sets, pods_by_rs, now)
            wrote |= await self._apply_deployment(deploy, plan)
            if plan.recheck_after is not None:
                rechecks.append(plan.recheck_after)
        if wrote:
            replicasets = await self._list("apps/v1", "replicasets", "ReplicaSet")
        for rs in replicasets:
            rs_plan = decide_replicaset(rs, owned(pods, rs), now)
            await self._apply_replicaset(rs, rs_plan)
            if rs_plan.recheck_after is not None:
                rechecks.append(rs_plan.recheck_after)
        return max(0.1, min(rechecks))

    async def _apply_deployment(self, deploy: Obj, plan: DeploymentPlan) -> bool:
        """Carry out the plan; True if a ReplicaSet was written."""
        ns, name = deploy["metadata"]["namespace"], deploy["metadata"]["name"]
        wrote = False
        for reason, message in plan.events:
            self.events.about(deploy, reason, message, DEPLOYMENT_COMPONENT)
        if plan.create is not None:
            try:
                await self.client.create(group_path("apps/v1", "replicasets", ns), plan.create)
            except ApiError as err:
                if err.status != 409:  # 409: created by an earlier pass; the next one sees it
                    raise
            wrote = True
        for rs_name, body in plan.patch.items():
            await self.client.patch(group_path("apps/v1", "replicasets", ns, rs_name), body)
            wrote = True
        for rs_name in plan.delete:
            with contextlib.suppress(ApiError):
                await self.client.request(
                    "DELETE", group_path("apps/v1", "replicasets", ns, rs_name),
                    {"kind": "DeleteOptions", "apiVersion": "v1",
                     "propagationPolicy": "Background"})
            wrote = True
        path = group_path("apps/v1", "deployments", ns, name)
        if plan.annotations:
            await self.client.patch(path, {"metadata": {"annotations": plan.annotations}})
        if plan.status is not None and plan.status != deploy.get("status"):
            await self.client.patch(path + "/status",
                                    status_patch(deploy.get("status"), plan.status))
        return wrote

    async def _apply_replicaset(self, rs: Obj, plan: ReplicaSetPlan) -> None:
        ns, name = rs["metadata"]["namespace"], rs["metadata"]["name"]
        for _ in range(plan.create):
            try:
                pod = await self.client.create(group_path("v1", "pods", ns), pod_from_template(rs))
            except ApiError as err:
                if err.status >= 500:
                    raise
                # A template the server rejects: say so where `kubectl describe rs` shows it.
                self.events.about(rs, "FailedCreate", f"Error creating: {err}",
                                  REPLICASET_COMPONENT, warning=True)
                break
            self.events.about(rs, "SuccessfulCreate", f"Created pod: {pod['metadata']['name']}",
                              REPLICASET_COMPONENT)
        for pod_name in plan.delete:
            await self.client.delete(group_path("v1", "pods", ns, pod_name))
            self.events.about(rs, "SuccessfulDelete", f"Deleted pod: {pod_name}",
                              REPLICASET_COMPONENT)
        if plan.status and plan.status != rs.get("status"):
            await self.client.patch(group_path("apps/v1", "replicasets", ns, name, "status"),
                                    status_patch(rs.get("status"), plan.status))
