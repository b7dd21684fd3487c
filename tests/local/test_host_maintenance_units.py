"""GKE's part of a scheduled host maintenance (`gke/hostmaintenance.py`), which real nodes
(and the benches' simulated ones) go through, without a cluster: the start, the handler's
grace and order, its drain."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from tardigrade_local.gke import hostmaintenance
from tardigrade_local.gke.client import ApiError
from tardigrade_local.gke.cloud import GkeCloud
from tardigrade_local.gke.disruptions import (
    IMPENDING_TERMINATION_TAINT,
    SCHEDULED_MAINTENANCE_LABEL,
)


def _pod(namespace: str, name: str, grace: int | None = None, phase: str = "Running",
         deleting: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"namespace": namespace, "name": name}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    spec = {} if grace is None else {"terminationGracePeriodSeconds": grace}
    return {"metadata": meta, "spec": spec, "status": {"phase": phase}}


def test_the_start_is_whole_epoch_seconds_ahead_and_never_in_the_past():
    start = hostmaintenance.start_after(75.0, now=1_000.5)
    assert start == 1_075.5
    assert hostmaintenance.label_value(start) == "1075"
    with pytest.raises(ValueError, match="inSeconds"):
        hostmaintenance.start_after(-1.0)


def test_the_handler_gives_a_pod_its_own_grace_up_to_an_hour():
    assert hostmaintenance.handler_grace(_pod("default", "a", grace=10)) == 10
    assert hostmaintenance.handler_grace(_pod("default", "a")) == 30  # Kubernetes' default
    assert hostmaintenance.handler_grace(_pod("default", "a", grace=7200)) == 3600
    assert hostmaintenance.handler_grace(_pod("default", "a", grace=0)) == 0


def test_the_handler_deletes_kube_system_last_and_leaves_finished_or_deleting_pods():
    pods = [_pod("kube-system", "dns"), _pod("default", "trainer"),
            _pod("default", "done", phase="Succeeded"), _pod("default", "going", deleting=True),
            _pod("jobs", "other")]
    order = [p["metadata"]["name"] for p in hostmaintenance.drain_order(pods)]
    assert order == ["trainer", "other", "dns"]


class FakeClient:
    """The pods of one node; a deleted pod stays listed for `lingers` more lists (the kubelet
    stopping it with its grace)."""

    def __init__(self, pods: list[dict[str, Any]], lingers: int = 2) -> None:
        self.pods = {p["metadata"]["name"]: p for p in pods}
        self.lingering: dict[str, int] = {}
        self.lingers = lingers
        self.deleted: list[tuple[str, int | None]] = []
        self.patches: list[tuple[str, dict[str, Any]]] = []
        self.node: dict[str, Any] | None = {"metadata": {"resourceVersion": "7"},
                                            "spec": {"taints": [
                                                {"key": "other", "effect": "NoSchedule"}]}}

    async def request(self, method: str, path: str, params: dict[str, str]) -> dict[str, Any]:
        assert (method, path, params) == ("GET", "/api/v1/pods",
                                          {"fieldSelector": "spec.nodeName=gpu-1"})
        for name in list(self.lingering):
            self.lingering[name] -= 1
            if self.lingering[name] < 0:
                del self.lingering[name]
                del self.pods[name]
        return {"items": list(self.pods.values())}

    async def delete(self, path: str, grace_seconds: int | None = None) -> None:
        name = path.rsplit("/", 1)[1]
        self.deleted.append((name, grace_seconds))
        self.lingering[name] = self.lingers

    async def get(self, path: str) -> dict[str, Any] | None:
        if self.node is None:
            return None
        return self.node

    async def patch(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        if self.node is None:
            raise ApiError(404, {})
        self.patches.append((path, body))
        return {}


class FakeCloud:
    def __init__(self, client: FakeClient) -> None:
        self.client = client

    # GKE's own calls, over the fake client.
    label_node = GkeCloud.label_node
    taint_node = GkeCloud.taint_node


def test_the_drain_deletes_with_the_handlers_grace_and_waits_until_the_pods_are_gone(
        monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(hostmaintenance, "DRAIN_POLL_SECONDS", 0.0)
    client = FakeClient([_pod("kube-system", "dns", grace=5), _pod("default", "trainer",
                                                                    grace=600)])
    cloud: Any = FakeCloud(client)
    deleted = asyncio.run(hostmaintenance.drain(cloud, "gpu-1"))
    assert deleted == ["default/trainer", "kube-system/dns"]
    assert client.deleted == [("trainer", 600), ("dns", 5)]
    assert client.pods == {}  # it returned only once they were gone


def test_the_start_labels_then_taints_and_a_node_already_gone_is_left_alone():
    client = FakeClient([])
    cloud: Any = FakeCloud(client)
    start = asyncio.run(hostmaintenance.announce(cloud, "gpu-1", 60.0))
    asyncio.run(hostmaintenance.begin(cloud, "gpu-1"))
    (label_path, label), (taint_path, taint) = client.patches
    assert label_path == taint_path == "/api/v1/nodes/gpu-1"
    assert label == {"metadata": {"labels": {SCHEDULED_MAINTENANCE_LABEL: str(int(start))}}}
    assert taint["spec"]["taints"] == [{"key": "other", "effect": "NoSchedule"},
                                       {"key": IMPENDING_TERMINATION_TAINT,
                                        "effect": "NoSchedule"}]
    assert taint["metadata"]["resourceVersion"] == "7"
    client.node = None
    asyncio.run(hostmaintenance.begin(cloud, "gpu-1"))  # no error: the VM went first
