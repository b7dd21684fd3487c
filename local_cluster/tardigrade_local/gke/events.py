"""core/v1 Events as the kubelet and scheduler record them (`kubectl describe` shows them).

Recording never blocks or fails the caller: events are best effort, as in Kubernetes.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import uuid
from collections.abc import Mapping
from typing import Any

from tardigrade_local.gke.client import ApiClient, ApiError, core_path


def now_rfc3339() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


log = logging.getLogger(__name__)


class EventRecorder:
    def __init__(self, client: ApiClient) -> None:
        self.client = client
        self._pending: set[asyncio.Task[Any]] = set()

    def pod(self, pod: Mapping[str, Any], reason: str, message: str, *, warning: bool = False,
            component: str = "kubelet", host: str | None = None,
            container: str | None = None) -> None:
        meta = pod["metadata"]
        ref = {"kind": "Pod", "apiVersion": "v1", "namespace": meta.get("namespace") or "default",
               "name": meta["name"], "uid": meta.get("uid", "")}
        if container:
            ref["fieldPath"] = f"spec.containers{{{container}}}"
        self._emit(ref, reason, message, warning, component, host)

    def about(self, obj: Mapping[str, Any], reason: str, message: str, component: str, *,
              warning: bool = False) -> None:
        """An event about any namespaced object, e.g. from a controller."""
        meta = obj["metadata"]
        ref = {"kind": obj.get("kind", ""), "apiVersion": obj.get("apiVersion", ""),
               "namespace": meta.get("namespace") or "default", "name": meta["name"],
               "uid": meta.get("uid", "")}
        self._emit(ref, reason, message, warning, component, None)

    def node(self, name: str, reason: str, message: str, *, warning: bool = False) -> None:
        ref = {"kind": "Node", "apiVersion": "v1", "name": name, "uid": name}
        self._emit(ref, reason, message, warning, "kubelet", name)

    def _emit(self, ref: dict[str, Any], reason: str, message: str, warning: bool,
              component: str, host: str | None) -> None:
        now = now_rfc3339()
        namespace = ref.get("namespace") or "default"
        event = {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"name": f"{ref['name']}.{uuid.uuid4().hex[:16]}", "namespace": namespace},
            "involvedObject": ref, "reason": reason, "message": message,
            "type": "Warning" if warning else "Normal",
            "source": {"component": component, **({"host": host} if host else {})},
            "firstTimestamp": now, "lastTimestamp": now, "count": 1,
            "reportingComponent": component, "reportingInstance": host or "",
        }
        task = asyncio.create_task(self._post(namespace, event))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _post(self, namespace: str, event: dict[str, Any]) -> None:
        try:
            await self.client.create(core_path("events", namespace), event)
        except (ApiError, OSError) as err:
            log.debug("event %s not recorded: %s", event["reason"], err)
