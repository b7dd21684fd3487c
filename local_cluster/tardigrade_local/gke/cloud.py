"""GKE as an actor of its own: what the cloud does to a cluster that no kubelet does.

On GKE these are the work of Google's controllers, each with its own identity (the cloud
node lifecycle controller deletes the Node of a VM that no longer exists; the node
maintenance handler labels and taints nodes due for host maintenance and deletes their pods
(`hostmaintenance.py`); the cluster
autoscaler records its verdicts as events on pods). Here they share one identity,
`identities.CLOUD`, whose ClusterRole grants exactly these verbs: no kubelet may do them
(NodeRestriction forbids a node to taint itself or delete another's object).
"""

from __future__ import annotations

import contextlib
from typing import Any

from tardigrade_local.gke.client import ApiClient, ApiError, Informer, core_path
from tardigrade_local.gke.events import EventRecorder


class GkeCloud:
    def __init__(self, client: ApiClient) -> None:
        self.client = client
        self.events = EventRecorder(client)
        self._nodes: Informer | None = None

    async def delete_node(self, name: str) -> None:
        """The VM is gone: its Node object goes too (cloud node lifecycle controller)."""
        with contextlib.suppress(ApiError):
            await self.client.delete(core_path("nodes", name=name))

    async def label_node(self, name: str, labels: dict[str, str | None]) -> None:
        await self.client.patch(core_path("nodes", name=name),
                                {"metadata": {"labels": labels}})

    async def taint_node(self, name: str, taint: dict[str, Any]) -> None:
        """Add `taint` (replacing one with the same key and effect)."""
        node = await self.client.get(core_path("nodes", name=name))
        if node is None:
            return
        taints = [t for t in (node.get("spec") or {}).get("taints") or []
                  if (t.get("key"), t.get("effect")) != (taint["key"], taint["effect"])]
        await self.client.patch(core_path("nodes", name=name), {
            "metadata": {"resourceVersion": node["metadata"]["resourceVersion"]},
            "spec": {"taints": [*taints, taint]}})

    async def close(self) -> None:
        await self.client.close()
