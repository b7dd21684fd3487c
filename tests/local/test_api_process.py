"""The API server as a process: start, serve, stop on SIGTERM, restart with its state."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from api_helpers import widget, widget_crd
from kubernetes import client, config, watch
from kubernetes.client.rest import ApiException

REPO = Path(__file__).resolve().parents[2]


def start(state: Path, kubeconfig: Path, *extra: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        str(REPO / p) for p in ("local_cluster", "operator", "trainer_image"))}
    proc = subprocess.Popen([sys.executable, "-m", "tardigrade_local.apiserver", "--port", "0",
                             "--state-dir", str(state), "--kubeconfig", str(kubeconfig),
                             *extra], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("listening on http://127.0.0.1:"), line or proc.stderr.read()
    return proc


def stop(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(10) == 0


@pytest.fixture
def crd_dir(tmp_path):
    d = tmp_path / "crds"
    d.mkdir()
    (d / "widget.yaml").write_text(yaml.safe_dump(widget_crd()))
    return d


def test_restart_keeps_objects_and_resource_versions(tmp_path, crd_dir):
    state, kc = tmp_path / "state", tmp_path / "kubeconfig"
    proc = start(state, kc, "--crds", str(crd_dir))
    try:
        api = config.new_client_from_config(config_file=str(kc))
        custom = client.CustomObjectsApi(api)
        core = client.CoreV1Api(api)
        created = custom.create_namespaced_custom_object("example.dev", "v1", "default",
                                                         "widgets", widget("keep", replicas=3))
        core.create_namespaced_config_map("default", {"metadata": {"name": "cfg"},
                                                      "data": {"a": "1"}})
        rv_before = int(core.list_namespaced_config_map("default").metadata.resource_version)
    finally:
        stop(proc)
    assert (state / "apiserver-state.json").exists()

    # The CRD file changed while the server was down: the new schema applies after restart.
    changed = widget_crd()
    changed["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"][
        "properties"]["maxReplicas"]["maximum"] = 5
    (crd_dir / "widget.yaml").write_text(yaml.safe_dump(changed))
    proc = start(state, kc, "--crds", str(crd_dir))
    try:
        api = config.new_client_from_config(config_file=str(kc))
        custom = client.CustomObjectsApi(api)
        core = client.CoreV1Api(api)
        with pytest.raises(ApiException) as exc:
            custom.create_namespaced_custom_object("example.dev", "v1", "default", "widgets",
                                                   widget("capped", maxReplicas=6))
        assert "should be less than or equal to 5" in exc.value.body
        again = custom.get_namespaced_custom_object("example.dev", "v1", "default", "widgets",
                                                    "keep")
        assert again["metadata"]["uid"] == created["metadata"]["uid"]
        assert again["spec"]["replicas"] == 3
        assert core.read_namespaced_config_map("cfg", "default").data == {"a": "1"}
        updated = core.patch_namespaced_config_map("cfg", "default", {"data": {"a": "2"}})
        assert int(updated.metadata.resource_version) > rv_before
        # Watches cannot resume across the restart: 410 Gone, as after an etcd compaction.
        with pytest.raises(ApiException) as exc:
            list(watch.Watch().stream(core.list_namespaced_config_map, "default",
                                      resource_version=str(rv_before - 1), timeout_seconds=2))
        assert exc.value.status == 410
        # Schema enforcement is back too.
        with pytest.raises(ApiException) as exc:
            custom.create_namespaced_custom_object("example.dev", "v1", "default", "widgets",
                                                   widget("bad", replicas=0))
        assert exc.value.status == 422
        assert json.loads(exc.value.body)["details"]["causes"][0]["field"] == "spec.replicas"
    finally:
        stop(proc)
