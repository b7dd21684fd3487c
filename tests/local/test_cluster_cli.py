"""`tardigrade local up/status/preempt/restart-apiserver/cut-watches/down` as a user runs
them, plus the GCS emulator."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import tardigrade_local
from kube_helpers import Kube, container_status, kubectl, python_pod, wait_for
from tardigrade_local import cli, gobuild, realcluster
from tardigrade_local.kueue import WaitForPodsReady
from typer.testing import CliRunner

pytestmark = pytest.mark.slow

REPO = Path(tardigrade_local.__file__).resolve().parents[2]


def tardigrade(*args: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    path = os.pathsep.join(str(REPO / d) for d in ("local_cluster", "operator", "trainer_image"))
    env = {**os.environ, "PYTHONPATH": path}
    env.pop("TARDIGRADE_LOCAL_STATE_DIR", None)
    return subprocess.run([sys.executable, "-m", "tardigrade_operator.cli", "local", *args],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_up_preempt_status_down(tmp_path):
    # --no-replace: the reclaimed VM never returns (the default recreates it: next test).
    up = tardigrade("up", "--nodes", "1", "--spot-nodes", "1", "--shutdown-grace", "2",
                    "--no-replace", cwd=tmp_path)
    assert up.returncode == 0, up.stderr
    state = tmp_path / ".tardigrade" / "local"
    assert up.stdout.strip() == f"export KUBECONFIG={state / 'kubeconfig'}"
    info = json.loads((state / "cluster.json").read_text())
    ours = [int(info["pid"]), *info["processes"].values()]
    try:
        env = {**os.environ, "KUBECONFIG": str(state / "kubeconfig")}
        nodes = kubectl("get", "nodes", "-o", "name", env=env).split()
        assert sorted(nodes) == ["node/local-node-1", "node/local-spot-1"]
        # The real control plane, at the pinned version, with a heartbeat per node.
        version = json.loads(kubectl("version", "-o", "json", env=env))
        assert version["serverVersion"]["gitVersion"] == gobuild.kubernetes_version()
        leases = kubectl("get", "leases", "-n", "kube-node-lease", "-o", "name", env=env).split()
        assert sorted(leases) == ["lease.coordination.k8s.io/local-node-1",
                                  "lease.coordination.k8s.io/local-spot-1"]
        # kube-apiserver's own built-in resources, plus our CRDs and kopf's.
        resources = set(kubectl("api-resources", "-o", "name", env=env).split())
        assert {"pods", "leases.coordination.k8s.io", "endpointslices.discovery.k8s.io",
                "tokenreviews.authentication.k8s.io", "validatingadmissionpolicies."
                "admissionregistration.k8s.io", "trainingjobs.tardigrade.dev",
                "kopfpeerings.kopf.dev"} <= resources
        spot = kubectl("get", "nodes", "-l", "cloud.google.com/gke-spot=true", "-o", "name",
                       env=env)
        assert spot.strip() == "node/local-spot-1"

        # Pods reach the GCS emulator through the environment the cluster gives them.
        script = """
            import json, os, urllib.request
            base = os.environ["STORAGE_EMULATOR_HOST"]
            assert os.environ["TENSORSTORE_GCS_HTTP_URL"] == base
            assert os.environ["GCE_METADATA_HOST"] == "127.0.0.1:1"
            req = urllib.request.Request(
                base + "/upload/storage/v1/b/tardigrade/o?uploadType=media&name=ckpt/x",
                data=b"state", method="POST")
            urllib.request.urlopen(req).read()
            with urllib.request.urlopen(base + "/storage/v1/b/tardigrade/o") as r:
                print(json.dumps([o["name"] for o in json.load(r)["items"]]))
        """
        kube = Kube(str(state / "kubeconfig"))
        kube.create_pod(python_pod("gcs", script, node="local-node-1"))
        pod = kube.wait_phase("gcs", ("Succeeded", "Failed"), timeout=60)
        assert pod["status"]["phase"] == "Succeeded", kubectl("logs", "gcs", env=env)
        assert kubectl("logs", "gcs", env=env).strip() == '["ckpt/x"]'

        kube.create_pod(python_pod("victim", "import time; time.sleep(60)",
                                   node="local-spot-1"))
        kube.wait_phase("victim", ("Running",))
        status = json.loads(tardigrade("status", "--json", cwd=tmp_path).stdout)
        spot_node = next(n for n in status["nodes"] if n["name"] == "local-spot-1")
        assert spot_node["pods"] == ["default/victim"]
        assert spot_node["pool"] == "spot-pool"

        preempt = tardigrade("preempt", "victim", cwd=tmp_path)
        assert preempt.returncode == 0, preempt.stderr
        assert "local-spot-1" in preempt.stdout
        assert "node/local-spot-1" not in kubectl("get", "nodes", "-o", "name", env=env)
        pod = kube.pod("victim")
        if pod is not None:  # pod GC may already have removed it
            assert pod["status"]["phase"] == "Failed"
            assert container_status(pod)["state"]["terminated"]["exitCode"] == 143

        # Control-plane faults: the state survives, and the kubelet watches again afterwards.
        restart = tardigrade("restart-apiserver", "--downtime", "0.5", cwd=tmp_path)
        assert restart.returncode == 0, restart.stderr
        assert kubectl("get", "nodes", "-o", "name", env=env).split() == ["node/local-node-1"]
        cut = tardigrade("cut-watches", "--expire-history", cwd=tmp_path)
        assert cut.returncode == 0 and cut.stdout.endswith("watch connections cut\n"), cut
        kube.create_pod(python_pod("after", "print('ran')", node="local-node-1"))
        assert kube.wait_phase("after", ("Succeeded", "Failed"), timeout=60)["status"][
            "phase"] == "Succeeded"
    finally:
        down = tardigrade("down", cwd=tmp_path)
    assert down.returncode == 0, down.stderr
    assert not state.exists()
    # No process left behind, and the API server's port is closed.
    assert [p for p in ours if psutil.pid_exists(p)
            and psutil.Process(p).status() != psutil.STATUS_ZOMBIE] == []
    port = int(info["direct_api_url"].rsplit(":", 1)[1])
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", port)) != 0
    again = tardigrade("status", cwd=tmp_path)
    assert again.returncode == 1 and "no local cluster" in again.stderr


def test_up_recreates_preempted_nodes_and_autoscales_by_default_pools(tmp_path):
    up = tardigrade("up", "--no-gcs", "--no-operator", "--replace-after", "1",
                    "--autoscale-max", "2", "--provision-seconds", "1", cwd=tmp_path)
    assert up.returncode == 0, up.stderr
    try:
        kubeconfig = str(tmp_path / ".tardigrade" / "local" / "kubeconfig")
        kube = Kube(kubeconfig)
        before = kube.core.read_node("local-node-1").metadata.uid
        preempt = tardigrade("preempt", "local-node-1", "--grace", "1", cwd=tmp_path)
        assert preempt.returncode == 0, preempt.stderr
        # Replaced a second after it went, which may be before this process reads the
        # nodes: the proof it went and came back is a new Node object of the same name.
        wait_for(lambda: any(n.metadata.name == "local-node-1" and n.metadata.uid != before
                             for n in kube.core.list_node().items), 30,
                 "local-node-1 recreated as a new Node")
        # Two pods of 6 cpus on 8-cpu nodes: the second needs a node the autoscaler adds.
        for name in ("first", "second"):
            kube.create_pod(python_pod(name, "import time; time.sleep(60)",
                                       container={"resources": {"requests": {"cpu": "6"}}}))
        nodes = {kube.wait_phase(n, ("Running",), timeout=60)["spec"]["nodeName"]
                 for n in ("first", "second")}
        assert len(nodes) == 2 and "local-node-1" in nodes
        status = json.loads(tardigrade("status", "--json", cwd=tmp_path).stdout)
        assert {n["pool"] for n in status["nodes"]} == {"default-pool"}
        reasons = [e.reason for e in kube.core.list_namespaced_event(
            "default", field_selector="involvedObject.kind=Pod").items]
        assert reasons.count("TriggeredScaleUp") == 1
    finally:
        assert tardigrade("down", cwd=tmp_path).returncode == 0


def test_up_with_an_image_map_runs_mapped_images(tmp_path):
    rules = tmp_path / "images.yaml"
    rules.write_text('- {pattern: "example.com/hello", entrypoint: [python, -c], '
                     'cmd: ["print(\'hello from the map\')"]}\n')
    up = tardigrade("up", "--no-gcs", "--image-map", str(rules), cwd=tmp_path)
    assert up.returncode == 0, up.stderr
    try:
        kubeconfig = str(tmp_path / ".tardigrade" / "local" / "kubeconfig")
        kube = Kube(kubeconfig)
        kube.create_pod({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "hello"},
                         "spec": {"restartPolicy": "Never", "containers": [
                             {"name": "main", "image": "example.com/hello:v2"}]}})
        assert kube.wait_phase("hello", ("Succeeded", "Failed"))["status"]["phase"] == "Succeeded"
        env = {**os.environ, "KUBECONFIG": kubeconfig}
        assert kubectl("logs", "hello", env=env) == "hello from the map\n"
    finally:
        assert tardigrade("down", cwd=tmp_path).returncode == 0


def test_down_without_a_cluster_is_harmless(tmp_path):
    done = tardigrade("down", "--state-dir", str(tmp_path / "nothing"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    wait_for(lambda: not (tmp_path / "nothing").exists())


def test_up_real_nodes_takes_kueue_and_still_refuses_what_real_nodes_lack(
        tmp_path, monkeypatch: pytest.MonkeyPatch):
    """`up --real-nodes --kueue --kueue-pods-ready-timeout` reaches the real-node cluster's
    configuration (the cluster itself starts in test_real_node_cli.py); the flags real nodes
    do not have yet are still refused, each named, before anything starts."""
    asked: list[realcluster.ServeConfig] = []

    def start_served(root: Path, config: realcluster.ServeConfig, timeout: float,
                     progress: object = None) -> dict[str, str]:
        asked.append(config)
        return {"kubeconfig": str(root / "kubeconfig")}

    monkeypatch.setattr(realcluster, "start_served", start_served)
    state = tmp_path / "s"
    runner = CliRunner()
    done = runner.invoke(cli.app, ["up", "--real-nodes", "--kueue",
                                   "--kueue-pods-ready-timeout", "90", "--state-dir", str(state)])
    assert done.exit_code == 0, done.output
    assert [(c.kueue, c.wait_for_pods_ready()) for c in asked] == [(True, WaitForPodsReady(90))]
    done = runner.invoke(cli.app, ["up", "--real-nodes", "--state-dir", str(state)])
    assert done.exit_code == 0, done.output
    assert (asked[-1].kueue, asked[-1].wait_for_pods_ready()) == (False, None)
    for flags in (["--simulated-nodes", "1"], ["--tpu-slices", "1"], ["--autoscale-max", "2"],
                  ["--operator-command", "true"]):
        done = runner.invoke(cli.app, ["up", "--real-nodes", "--kueue", *flags,
                                       "--state-dir", str(state)])
        assert done.exit_code == 2, done.output
        assert f"{flags[0]}: not with --real-nodes" in done.output
    assert len(asked) == 2
