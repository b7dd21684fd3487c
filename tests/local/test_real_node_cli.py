"""`tardigrade local up --real-nodes`, as a user runs it: real nodes, the operator installed
with helm, a TrainingJob that checkpoints to the shared claim, a spot reclaim through the
real kubelet's graceful node shutdown, then `tardigrade local down` leaves nothing on the
machine: no process, mount, network namespace, host interface or firewall rule."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest
import tardigrade_local
import yaml
from kube_helpers import kubectl, wait_for
from tardigrade_local.nodenet import ClusterNetwork
from tardigrade_local.realcluster import CHECKPOINT_CLAIM, SPOT_LABEL
from tardigrade_local.realnode import RealNode

from tests.conftest import EXAMPLES, load_yaml

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux") or os.geteuid() != 0,
                       reason="real nodes need Linux and root (namespaces, mounts, cgroups)"),
]

REPO = Path(tardigrade_local.__file__).resolve().parents[2]
JOB = "cli-run"
CHECKPOINTS = "/mnt/checkpoints"
# A cold start builds the images (many minutes, the e2e tests build the same ones); a warm
# one starts the control plane, pushes the images and starts two nodes.
UP_TIMEOUT_SECONDS = 3000
# The 1 GB trainer image pulled on the spot node, JAX's start and compile, on a shared machine.
CHECKPOINT_TIMEOUT_SECONDS = 600.0
NODE_GONE_TIMEOUT_SECONDS = 180.0


def tardigrade(*args: str, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    path = os.pathsep.join(str(REPO / d) for d in ("local_cluster", "operator", "trainer_image"))
    env = {**os.environ, "PYTHONPATH": path}
    env.pop("TARDIGRADE_LOCAL_STATE_DIR", None)
    return subprocess.run([sys.executable, "-m", "tardigrade_operator.cli", "local", *args],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def training_job(image: str) -> dict[str, Any]:
    """The example, one rank on the spot node, checkpointing to the shared claim every few
    steps; long enough to be training when its node is reclaimed."""
    body = load_yaml(EXAMPLES / "trainingjob.yaml")
    body["metadata"] = {"name": JOB, "namespace": "default"}
    spec = body["spec"]
    spec.update(replicas=1, minReplicas=1, maxReplicas=1, image=image,
                resources={"requests": {"cpu": "300m", "memory": "512Mi"},
                           "limits": {"memory": "3Gi"}})
    spec["trainer"].update(steps=100_000, global_batch_size=8, seq_len=16,
                           devices_per_process=1)
    spec["checkpoint"].update(path=f"{CHECKPOINTS}/{JOB}", interval={"steps": 10})
    spec["podTemplate"] = {
        "terminationGracePeriodSeconds": 30, "nodeSelector": {SPOT_LABEL: "true"},
        "volumes": [{"name": "checkpoints",
                     "persistentVolumeClaim": {"claimName": CHECKPOINT_CLAIM}}],
        "volumeMounts": [{"name": "checkpoints", "mountPath": CHECKPOINTS}]}
    return body


def alive(proc: psutil.Process) -> bool:
    """The same process (not a later one with its pid) still runs."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def mounts_under(directory: Path) -> list[str]:
    return [line for line in Path("/proc/self/mountinfo").read_text().splitlines()
            if str(directory) in line]


def netns_names() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def test_up_real_nodes_trains_to_a_checkpoint_and_down_leaves_nothing(tmp_path_factory):
    # Short: a node's directory under it must keep the kubelet's socket paths within limits.
    work = tmp_path_factory.mktemp("rcli")
    state = work / "s"
    up = tardigrade("up", "--real-nodes", "--nodes", "1", "--spot-nodes", "1",
                    "--state-dir", str(state), cwd=work, timeout=UP_TIMEOUT_SECONDS)
    try:
        assert up.returncode == 0, up.stderr[-5000:]
        kubeconfig = state / "kubeconfig"
        assert up.stdout.strip() == f"export KUBECONFIG={kubeconfig}"
        info = json.loads((state / "realcluster.json").read_text())
        served = psutil.Process(info["pid"])
        ours = [served, *served.children(recursive=True)]
        env = {**os.environ, "KUBECONFIG": str(kubeconfig)}

        nodes = kubectl("get", "nodes", "-o", "name", env=env).split()
        assert sorted(nodes) == ["node/real-1", "node/real-2"]
        spot = kubectl("get", "nodes", "-l", f"{SPOT_LABEL}=true", "-o", "name", env=env)
        assert spot.split() == ["node/real-2"]
        status = tardigrade("status", "--json", "--state-dir", str(state), cwd=work)
        assert status.returncode == 0, status.stderr
        report = json.loads(status.stdout)
        assert [(n["name"], n["state"], n["spot"]) for n in report["nodes"]] == [
            ("real-1", "Ready", False), ("real-2", "Ready", True)]
        # The operator runs as a pod of the registry's image, on the on-demand node.
        operator = json.loads(kubectl("get", "pods", "-n", "tardigrade-system", "-o", "json",
                                      env=env))["items"]
        assert [p["spec"]["nodeName"] for p in operator] == ["real-1"]
        assert operator[0]["spec"]["containers"][0]["image"] == info["images"]["operator"]

        manifest = work / "job.yaml"
        manifest.write_text(yaml.safe_dump(training_job(info["images"]["trainer-cpu"])))
        kubectl("apply", "-f", str(manifest), env=env)
        shared = Path(info["checkpoints"])

        def committed() -> dict[str, Any] | None:
            job = json.loads(kubectl("get", "trainingjob", JOB, "-o", "json", env=env))
            status = job.get("status") or {}
            assert status.get("phase") != "Failed", status
            return status if status.get("lastCheckpoint") else None

        status = wait_for(committed, CHECKPOINT_TIMEOUT_SECONDS, what="a committed checkpoint")
        # The commit the operator reports is in the shared directory, written from the node.
        assert status["lastCheckpoint"]["step"] >= 10, status
        assert (shared / JOB).is_dir() and any((shared / JOB).iterdir())

        # A spot reclaim of the trainer's node, through its kubelet's graceful shutdown.
        preempt = tardigrade("preempt", "real-2", "--state-dir", str(state), cwd=work)
        assert preempt.returncode == 0, preempt.stderr
        assert preempt.stdout.strip() == "node/real-2 preempted"
        wait_for(lambda: "node/real-2" not in kubectl("get", "nodes", "-o", "name", env=env),
                 NODE_GONE_TIMEOUT_SECONDS, what="real-2's Node gone")
    finally:
        down = tardigrade("down", "--state-dir", str(state), cwd=work)
    assert down.returncode == 0, down.stderr
    assert not state.exists()
    # Nothing of it is left: processes, mounts, namespaces, cgroups, host links, addresses,
    # firewall rules.
    assert [p.pid for p in ours if alive(p)] == []
    assert mounts_under(state) == []
    left = {kind: items for node in info["nodes"]
            for kind, items in RealNode(node["name"], Path(node["directory"]), "", Path())
            .leftovers().items() if items}
    left |= {kind: items for kind, items in ClusterNetwork(state / "net").leftovers().items()
             if items}
    assert left == {}
    assert info["network"] not in netns_names()
