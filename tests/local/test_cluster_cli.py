"""`tardigrade local up/status/preempt/restart-apiserver/cut-watches/down` as a user runs
them. `up` starts real nodes (the cluster itself starts in test_real_node_cli.py; here its
configuration is checked); `up --simulated-nodes` is the benches' cluster, whose commands run
here on the real control plane."""

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
from kube_helpers import Kube, kubectl, wait_for
from tardigrade_local import cli, gobuild, realcluster
from tardigrade_local.gke import tpuslices
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


def idle_pod(name: str, node: str) -> dict:
    """A pod that is no Tardigrade rank: on a simulated node it idles until signalled."""
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"nodeName": node, "restartPolicy": "Never",
                     "terminationGracePeriodSeconds": 1,
                     "containers": [{"name": "main", "image": "local/idle"}]}}


def test_up_simulated_preempt_status_control_plane_faults_down(tmp_path):
    up = tardigrade("up", "--simulated-nodes", "2", "--no-operator", cwd=tmp_path)
    assert up.returncode == 0, up.stderr
    state = tmp_path / ".tardigrade" / "local"
    assert up.stdout.strip() == f"export KUBECONFIG={state / 'kubeconfig'}"
    info = json.loads((state / "cluster.json").read_text())
    ours = [int(info["pid"]), *info["processes"].values()]
    try:
        env = {**os.environ, "KUBECONFIG": str(state / "kubeconfig")}
        nodes = kubectl("get", "nodes", "-o", "name", env=env).split()
        assert sorted(nodes) == ["node/sim-node-1", "node/sim-node-2"]
        # The real control plane, at the pinned version, with a heartbeat per node.
        version = json.loads(kubectl("version", "-o", "json", env=env))
        assert version["serverVersion"]["gitVersion"] == gobuild.kubernetes_version()
        leases = kubectl("get", "leases", "-n", "kube-node-lease", "-o", "name", env=env).split()
        assert sorted(leases) == ["lease.coordination.k8s.io/sim-node-1",
                                  "lease.coordination.k8s.io/sim-node-2"]
        # kube-apiserver's own built-in resources, plus our CRDs and kopf's.
        resources = set(kubectl("api-resources", "-o", "name", env=env).split())
        assert {"pods", "leases.coordination.k8s.io", "trainingjobs.tardigrade.dev",
                "kopfpeerings.kopf.dev"} <= resources

        kube = Kube(str(state / "kubeconfig"))
        kube.create_pod(idle_pod("victim", "sim-node-2"))
        kube.wait_phase("victim", ("Running",))
        status = json.loads(tardigrade("status", "--json", cwd=tmp_path).stdout)
        node = next(n for n in status["nodes"] if n["name"] == "sim-node-2")
        assert node["pods"] == ["default/victim"]

        preempt = tardigrade("preempt", "victim", "--no-wait", cwd=tmp_path)
        assert preempt.returncode == 0, preempt.stderr
        assert "sim-node-2" in preempt.stdout
        wait_for(lambda: "node/sim-node-2" not in kubectl("get", "nodes", "-o", "name",
                                                          env=env), 60, "sim-node-2 gone")

        # Control-plane faults: the state survives, and the simulated nodes watch again.
        restart = tardigrade("restart-apiserver", "--downtime", "0.5", cwd=tmp_path)
        assert restart.returncode == 0, restart.stderr
        assert "node/sim-node-1" in kubectl("get", "nodes", "-o", "name", env=env).split()
        cut = tardigrade("cut-watches", "--expire-history", cwd=tmp_path)
        assert cut.returncode == 0 and cut.stdout.endswith("watch connections cut\n"), cut
        kube.create_pod(idle_pod("after", "sim-node-1"))
        kube.wait_phase("after", ("Running",), timeout=60)
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


def test_down_without_a_cluster_is_harmless(tmp_path):
    done = tardigrade("down", "--state-dir", str(tmp_path / "nothing"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    wait_for(lambda: not (tmp_path / "nothing").exists())


def test_up_starts_real_nodes_with_kueue_and_refuses_real_node_flags_with_simulated_ones(
        tmp_path, monkeypatch: pytest.MonkeyPatch):
    """`up --kueue --kueue-pods-ready-timeout` reaches the real-node cluster's configuration;
    a bench's cluster (`--simulated-nodes`) refuses the real nodes' flags, each named, before
    anything starts; the flags of the former process node agent are gone."""
    asked: list[realcluster.ServeConfig] = []

    def start_served(root: Path, config: realcluster.ServeConfig, timeout: float,
                     progress: object = None) -> dict[str, str]:
        asked.append(config)
        return {"kubeconfig": str(root / "kubeconfig")}

    monkeypatch.setattr(realcluster, "start_served", start_served)
    state = tmp_path / "s"
    runner = CliRunner()
    done = runner.invoke(cli.app, ["up", "--kueue", "--kueue-pods-ready-timeout", "90",
                                   "--state-dir", str(state)])
    assert done.exit_code == 0, done.output
    assert [(c.nodes, c.spot_nodes, c.kueue, c.wait_for_pods_ready()) for c in asked] == [
        (1, 0, True, WaitForPodsReady(90))]
    done = runner.invoke(cli.app, ["up", "--nodes", "2", "--spot-nodes", "1",
                                   "--state-dir", str(state)])
    assert done.exit_code == 0, done.output
    assert (asked[-1].nodes, asked[-1].spot_nodes, asked[-1].kueue,
            asked[-1].wait_for_pods_ready()) == (2, 1, False, None)
    for flags in (["--nodes", "1"], ["--spot-nodes", "1"], ["--operator-set", "a=b"],
                  ["--tpu-slices", "1"]):
        done = runner.invoke(cli.app, ["up", "--simulated-nodes", "1", *flags,
                                       "--state-dir", str(state)])
        assert done.exit_code == 2, done.output
        assert f"{flags[0]}: not with --simulated-nodes" in done.output
    for flags in (["--real-nodes"], ["--image-map", "x.yaml"],
                  ["--operator-command", "true"]):
        done = runner.invoke(cli.app, ["up", *flags, "--state-dir", str(state)])
        assert done.exit_code == 2, done.output
        assert f"No such option: {flags[0]}" in done.output
    assert len(asked) == 2


def test_up_with_tpu_slices_plans_a_real_node_for_every_host_of_every_slice(
        tmp_path, monkeypatch: pytest.MonkeyPatch):
    """`up --tpu-slices N --tpu-slice-shape A:T:C`: the ordinary node, then N spot slice pools
    of topology-over-chips hosts each, with GKE's TPU labels, taint and chips; a bad shape is
    refused before anything starts, naming the flag."""
    asked: list[realcluster.ServeConfig] = []
    monkeypatch.setattr(realcluster, "start_served",
                        lambda root, config, timeout, progress=None: asked.append(config)
                        or {"kubeconfig": str(root / "kubeconfig")})
    runner = CliRunner()
    state = ["--state-dir", str(tmp_path / "s")]
    done = runner.invoke(cli.app, ["up", "--tpu-slices", "2", "--tpu-slice-shape",
                                   "tpu-v5p-slice:2x2x2:4", *state])
    assert done.exit_code == 0, done.output
    plan = asked[-1].plan()
    assert [p.name for p in plan] == ["real-1", "tpu-slice-1-0", "tpu-slice-1-1",
                                      "tpu-slice-2-0", "tpu-slice-2-1"]
    assert not plan[0].spot and all(p.spot for p in plan[1:])
    for host in plan[1:]:
        config = host.node_config()
        assert config.pool == host.name.rsplit("-", 1)[0]
        assert config.labels[tpuslices.TPU_TOPOLOGY_LABEL] == "2x2x2"
        assert config.labels[tpuslices.TPU_ACCELERATOR_LABEL] == "tpu-v5p-slice"
        assert config.capacity[tpuslices.TPU_RESOURCE] == "4"
        assert config.taints == (tpuslices.TPU_TAINT,)
    for shape, error in (("tpu-v5p-slice:2x2x2", "expected ACCELERATOR:TOPOLOGY:CHIPS"),
                         ("tpu-v5p-slice:2x3:4", "not whole hosts of 4")):
        done = runner.invoke(cli.app, ["up", "--tpu-slices", "1", "--tpu-slice-shape", shape,
                                       *state])
        assert done.exit_code == 2, done.output
        assert "--tpu-slice-shape" in done.output and error in done.output
    done = runner.invoke(cli.app, ["up", "--nodes", "0", "--no-operator", *state])
    assert done.exit_code == 2 and "needs at least one node" in done.output
    assert len(asked) == 1
