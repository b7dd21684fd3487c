"""The kubelet's API-backed volumes (kubelet/projected.py): projected tokens, ConfigMaps and
the downward API, as in the `kube-api-access-*` volume kube-apiserver adds to every pod."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from tardigrade_contract import contract
from tardigrade_local.kubelet import projected, volumes
from tardigrade_local.kubelet.env import EnvError
from tardigrade_operator.api.parse import parse_trainingjob
from tardigrade_operator.rendering.manifests import GangLaunch, JobRef, build_pod

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
        self.objects = {"/api/v1/namespaces/ml/configmaps/kube-root-ca.crt": {
            "data": {"ca.crt": "-----BEGIN CERTIFICATE-----"}}}

    async def create(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        self.requests.append((path, body))
        return {"status": {"token": f"token-{len(self.requests)}"}}

    async def get(self, path: str) -> dict[str, Any] | None:
        return self.objects.get(path)


# What the ServiceAccount admission plugin adds (plugin/pkg/admission/serviceaccount,
# `TokenVolumeSource`).
API_ACCESS = {"name": "kube-api-access-abcde", "projected": {"defaultMode": 420, "sources": [
    {"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}},
    {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
    {"downwardAPI": {"items": [{"path": "namespace", "fieldRef": {
        "apiVersion": "v1", "fieldPath": "metadata.namespace"}}]}}]}}


def test_tokens_are_requested_bound_to_the_pod_and_written(tmp_path: Path):
    api = FakeApi()
    pod = _trainer_pod()

    pod["spec"]["volumes"].append(API_ACCESS)

    async def run() -> None:
        written = projected.ApiVolumes(api, pod, tmp_path)  # type: ignore[arg-type]
        await written.write_all()
        await written.stop()

    asyncio.run(run())
    path, body = api.requests[0]
    assert path == "/api/v1/namespaces/ml/serviceaccounts/default/token"
    assert body["spec"] == {"expirationSeconds": 3600, "audiences": [contract.RENDEZVOUS_AUDIENCE],
                            "boundObjectRef": {"kind": "Pod", "apiVersion": "v1",
                                               "name": "tiny-a1-1", "uid": "pod-uid-1"}}
    token = tmp_path / "volumes" / "tardigrade-rendezvous-token" / "token"
    assert token.read_text() == "token-1"
    access = tmp_path / "volumes" / "kube-api-access-abcde"
    path, body = api.requests[1]
    assert body["spec"]["expirationSeconds"] == 3607 and "audiences" not in body["spec"]
    assert (access / "token").read_text() == "token-2"
    assert (access / "ca.crt").read_text() == "-----BEGIN CERTIFICATE-----"
    assert (access / "namespace").read_text() == "ml"


def test_a_missing_configmap_fails_the_volume_unless_optional(tmp_path: Path):
    pod = _trainer_pod()
    pod["spec"]["volumes"] = [{"name": "cfg", "configMap": {"name": "absent"}}]
    with pytest.raises(EnvError, match='configmap "absent" not found'):
        asyncio.run(projected.ApiVolumes(FakeApi(), pod, tmp_path).write_all())  # type: ignore[arg-type]
    pod["spec"]["volumes"] = [{"name": "cfg", "configMap": {"name": "absent", "optional": True}}]
    asyncio.run(projected.ApiVolumes(FakeApi(), pod, tmp_path).write_all())  # type: ignore[arg-type]
    assert (tmp_path / "volumes" / "cfg").is_dir()
