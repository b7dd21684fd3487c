"""The kubelet's projected service-account token volumes (kubelet/projected.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from tardigrade_local.kubelet import projected, volumes
from tardigrade_operator.api.parse import parse_trainingjob
from tardigrade_operator.render import GangLaunch, JobRef, build_pod
from tardigrade_trainer import contract

from tests.conftest import EXAMPLES, load_yaml

HOUR = 3600.0


def _trainer_pod() -> dict[str, Any]:
    job = parse_trainingjob(load_yaml(EXAMPLES / "trainingjob.yaml"))
    pod = build_pod(JobRef("tiny", "ml", "uid-1"), job.spec, GangLaunch(1, 2, "latest"), 1)
    pod["metadata"]["uid"] = "pod-uid-1"
    return pod


@pytest.mark.parametrize(("age", "ttl", "due"), [
    (0.5 * HOUR, HOUR, False),
    (0.79 * HOUR, HOUR, False),
    (0.81 * HOUR, HOUR, True),   # past 80% of its life
    (23 * HOUR, 48 * HOUR, False),
    (24.5 * HOUR, 48 * HOUR, True),  # older than a day, whatever its life
])
def test_refresh_rule_of_the_token_manager(age, ttl, due):
    issued = 1_000_000.0
    assert projected.requires_refresh(issued, issued + ttl, issued + age) is due


def test_the_rendered_trainer_pod_asks_for_a_rendezvous_token():
    files = projected.token_files(_trainer_pod()["spec"])
    assert files == [projected.TokenFile("tardigrade-rendezvous-token", "token",
                                         contract.RENDEZVOUS_AUDIENCE, 3600)]


def test_paths_under_the_mount_point_lead_to_the_written_volume(tmp_path: Path):
    pod = _trainer_pod()
    paths = volumes.set_up(pod, volumes.NodeDisk(tmp_path / "node"),
                           lambda name: projected.volume_dir(tmp_path, name))
    mounts = volumes.container_mounts(pod["spec"]["containers"][0], paths, {})
    written = tmp_path / "volumes" / "tardigrade-rendezvous-token"
    assert volumes.map_path(contract.RENDEZVOUS_TOKEN_FILE, mounts) == f"{written}/token"
    assert volumes.map_path("/var/run/secrets/tardigrade.dev/rendezvousX", mounts) == \
        "/var/run/secrets/tardigrade.dev/rendezvousX"


class FakeApi:
    def __init__(self) -> None:
        self.requests: list[tuple[str, dict[str, Any]]] = []

    async def create(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        self.requests.append((path, body))
        return {"status": {"token": f"token-{len(self.requests)}"}}


def test_tokens_are_requested_bound_to_the_pod_and_written(tmp_path: Path):
    api = FakeApi()
    pod = _trainer_pod()

    async def run() -> None:
        tokens = projected.ProjectedTokens(api, pod, tmp_path)  # type: ignore[arg-type]
        await tokens.write_all()
        await tokens.stop()

    asyncio.run(run())
    path, body = api.requests[0]
    assert path == "/api/v1/namespaces/ml/serviceaccounts/default/token"
    assert body["spec"] == {"expirationSeconds": 3600, "audiences": [contract.RENDEZVOUS_AUDIENCE],
                            "boundObjectRef": {"kind": "Pod", "apiVersion": "v1",
                                               "name": "tiny-a1-1", "uid": "pod-uid-1"}}
    token = tmp_path / "volumes" / "tardigrade-rendezvous-token" / "token"
    assert token.read_text() == "token-1"
