"""What one pass of the workload controllers reads from the API server."""

from __future__ import annotations

from typing import Any

from tardigrade_local.controllers.manager import WorkloadControllers

REPLICASET = {
    "metadata": {"name": "web-1", "namespace": "default", "uid": "rs-uid", "generation": 1},
    "spec": {"replicas": 0, "selector": {"matchLabels": {"app": "web"}},
             "template": {"metadata": {"labels": {"app": "web"}}, "spec": {"containers": []}}},
    "status": {"replicas": 0, "observedGeneration": 1},
}


class RecordingClient:
    def __init__(self, listings: dict[str, list[dict[str, Any]]]) -> None:
        self.listings = listings
        self.gets: list[str] = []

    async def request(self, method: str, path: str, *args: Any, **kwargs: Any) -> Any:
        assert method == "GET", f"a pass with nothing to change wrote: {method} {path}"
        self.gets.append(path)
        return {"items": [dict(item) for item in self.listings.get(path.rsplit("/", 1)[-1], [])]}


def controllers(listings: dict[str, list[dict[str, Any]]]) -> tuple[WorkloadControllers,
                                                                      RecordingClient]:
    manager = WorkloadControllers("http://127.0.0.1:1")
    client = RecordingClient(listings)
    manager.client = client  # type: ignore[assignment]
    return manager, client


async def test_a_cluster_without_replicasets_is_not_listed_pod_by_pod() -> None:
    manager, client = controllers({})
    await manager.sync()
    assert client.gets == ["/apis/apps/v1/deployments", "/apis/apps/v1/replicasets"]


async def test_a_replicaset_gets_its_pods_listed() -> None:
    manager, client = controllers({"replicasets": [REPLICASET]})
    await manager.sync()
    assert client.gets[-1] == "/api/v1/pods"
