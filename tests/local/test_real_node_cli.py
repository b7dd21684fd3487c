"""`tardigrade local up --kueue`, as a user runs it: real nodes, Kueue's manager
with its PodsReady timeout, the operator installed with helm, a TrainingJob that checkpoints
to `gs://` on the GCS emulator (reached from its pod through the Service `kube-system/fake-gcs`,
the emulator's variables in the job's `env`), the committed checkpoint read back from the
emulator on the host, a spot reclaim through the real kubelet's graceful node shutdown, then
`tardigrade local down` leaves nothing on the machine: no process (the emulator, its relay and
Kueue among them), mount, network namespace, host interface or firewall rule. (TrainingJobs
under Kueue on real nodes are test_real_node_kueue.py's.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import psutil
import pytest
import tardigrade_local
import yaml
from kube_helpers import kubectl, wait_for
from tardigrade_local.clustergcs import env_vars
from tardigrade_local.gke.disruptions import SCHEDULED_MAINTENANCE_LABEL
from tardigrade_local.gke.tpuslices import TPU_TOPOLOGY_LABEL
from tardigrade_local.nodenet import ClusterNetwork
from tardigrade_local.realcluster import SPOT_LABEL
from tardigrade_local.realnode import RealNode

from tests.conftest import EXAMPLES, load_yaml

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux") or os.geteuid() != 0,
                       reason="real nodes need Linux and root (namespaces, mounts, cgroups)"),
]

REPO = Path(tardigrade_local.__file__).resolve().parents[2]
JOB = "cli-run"
PREFIX = f"checkpoints/{JOB}"
# A cold start builds the images (many minutes, the e2e tests build the same ones); a warm
# one starts the control plane, pushes the images and starts two nodes.
UP_TIMEOUT_SECONDS = 3000
# The 1 GB trainer image pulled on the spot node, JAX's start and compile, on a shared machine.
CHECKPOINT_TIMEOUT_SECONDS = 600.0
NODE_GONE_TIMEOUT_SECONDS = 180.0
# The operator's pod's grace, which GKE's maintenance handler gives it (the chart sets none:
# Kubernetes' default).
OPERATOR_GRACE_SECONDS = 30.0
# `up --kueue --kueue-pods-ready-timeout`: Kueue's waitForPodsReady, in whole seconds.
PODS_READY_TIMEOUT_SECONDS = 600


def tardigrade(*args: str, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    path = os.pathsep.join(str(REPO / d) for d in ("local_cluster", "operator", "trainer_image"))
    env = {**os.environ, "PYTHONPATH": path}
    env.pop("TARDIGRADE_LOCAL_STATE_DIR", None)
    return subprocess.run([sys.executable, "-m", "tardigrade_operator.cli", "local", *args],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def training_job(image: str, bucket: str, gcs_env: dict[str, str]) -> dict[str, Any]:
    """The example, one rank on the spot node, checkpointing to the emulator's bucket every
    few steps; long enough to be training when its node is reclaimed. A real kubelet adds
    nothing to a pod's environment: the emulator's client variables are the job's `env`."""
    body = load_yaml(EXAMPLES / "trainingjob.yaml")
    body["metadata"] = {"name": JOB, "namespace": "default"}
    spec = body["spec"]
    spec.update(replicas=1, minReplicas=1, maxReplicas=1, image=image,
                resources={"requests": {"cpu": "300m", "memory": "512Mi"},
                           "limits": {"memory": "3Gi"}})
    spec["trainer"].update(steps=100_000, global_batch_size=8, seq_len=16,
                           devices_per_process=1)
    # Every commit kept (each step a multiple of 10): the one the operator reports is still
    # there when the test reads it, however many came after it.
    spec["checkpoint"].update(path=f"gs://{bucket}/{PREFIX}", interval={"steps": 10},
                              keep={"last": 3, "every": 10})
    spec["env"] = env_vars(gcs_env)
    spec["podTemplate"] = {
        "terminationGracePeriodSeconds": 30, "nodeSelector": {SPOT_LABEL: "true"}}
    return body


def gcs_object(url: str, bucket: str, name: str) -> bytes:
    """An object's bytes, read from the emulator on the host."""
    quoted = urllib.parse.quote(name, safe="")
    with urllib.request.urlopen(f"{url}/storage/v1/b/{bucket}/o/{quoted}?alt=media",
                                timeout=10) as response:
        return bytes(response.read())


def gcs_names(url: str, bucket: str, prefix: str) -> list[str]:
    query = urllib.parse.urlencode({"prefix": prefix})
    with urllib.request.urlopen(f"{url}/storage/v1/b/{bucket}/o?{query}", timeout=10) as got:
        return [item["name"] for item in json.load(got).get("items", [])]


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
    up = tardigrade("up", "--nodes", "1", "--spot-nodes", "1", "--tpu-slices", "1", "--kueue",
                    "--kueue-pods-ready-timeout", str(PODS_READY_TIMEOUT_SECONDS),
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
        slice_hosts = ["node/tpu-slice-1-0", "node/tpu-slice-1-1"]
        assert sorted(nodes) == ["node/real-1", "node/real-2", *slice_hosts]
        spot = kubectl("get", "nodes", "-l", f"{SPOT_LABEL}=true", "-o", "name", env=env)
        assert sorted(spot.split()) == ["node/real-2", *slice_hosts]
        tpu = kubectl("get", "nodes", "-l", f"{TPU_TOPOLOGY_LABEL}=2x4", "-o", "name", env=env)
        assert sorted(tpu.split()) == slice_hosts
        status = tardigrade("status", "--json", "--state-dir", str(state), cwd=work)
        assert status.returncode == 0, status.stderr
        report = json.loads(status.stdout)
        assert sorted((n["name"], n["state"], n["spot"]) for n in report["nodes"]) == [
            ("real-1", "Ready", False), ("real-2", "Ready", True),
            ("tpu-slice-1-0", "Ready", True), ("tpu-slice-1-1", "Ready", True)]
        assert report["kueue"] is True
        # The operator runs as a pod of the registry's image, on the on-demand node.
        operator = json.loads(kubectl("get", "pods", "-n", "tardigrade-system", "-o", "json",
                                      env=env))["items"]
        assert [p["spec"]["nodeName"] for p in operator] == ["real-1"]
        assert operator[0]["spec"]["containers"][0]["image"] == info["images"]["operator"]
        # Kueue runs beside the control plane (installed before the chart, whose objects went
        # through its webhooks), with the PodsReady timeout asked for; its API is served.
        kueue_config = yaml.safe_load((state / "control" / "kueue" / "config.yaml").read_text())
        assert kueue_config["waitForPodsReady"]["timeout"] == f"{PODS_READY_TIMEOUT_SECONDS}s"
        assert kubectl("get", "clusterqueues", "-o", "name", env=env).strip() == ""

        manifest = work / "job.yaml"
        gcs_url, bucket = info["gcs_url"], info["gcs_bucket"]
        # The pods' URL is the Service's name, never the host's loopback.
        assert "127.0.0.1" not in info["gcs_pod_url"]
        assert info["gcs_pod_env"]["TENSORSTORE_GCS_HTTP_URL"] == info["gcs_pod_url"]
        manifest.write_text(yaml.safe_dump(training_job(info["images"]["trainer-cpu"], bucket,
                                                        info["gcs_pod_env"])))
        kubectl("apply", "-f", str(manifest), env=env)

        def committed() -> dict[str, Any] | None:
            job = json.loads(kubectl("get", "trainingjob", JOB, "-o", "json", env=env))
            status = job.get("status") or {}
            assert status.get("phase") != "Failed", status
            return status if status.get("lastCheckpoint") else None

        status = wait_for(committed, CHECKPOINT_TIMEOUT_SECONDS, what="a committed checkpoint")
        # The commit the operator reports is in the emulator's bucket, written from the pod
        # through the Service: its commit marker names the step, and every array it lists has
        # its objects there.
        step = status["lastCheckpoint"]["step"]
        assert step >= 10, status
        directory = f"{PREFIX}/step_{step:08d}"
        marker = json.loads(gcs_object(gcs_url, bucket, f"{directory}/metadata.json"))
        assert marker["step"] == step and marker["format"].startswith("tardigrade-checkpoint/")
        stored = gcs_names(gcs_url, bucket, f"{directory}/arrays/")
        assert marker["arrays"], marker
        for name in marker["arrays"]:
            assert any(n.startswith(f"{directory}/arrays/{name}/") for n in stored), name

        # A spot reclaim of the trainer's node, through its kubelet's graceful shutdown.
        preempt = tardigrade("preempt", "real-2", "--state-dir", str(state), cwd=work)
        assert preempt.returncode == 0, preempt.stderr
        assert preempt.stdout.strip() == "node/real-2 preempted"
        wait_for(lambda: "node/real-2" not in kubectl("get", "nodes", "-o", "name", env=env),
                 NODE_GONE_TIMEOUT_SECONDS, what="real-2's Node gone")
        # A reclaim of one host of a multi-host TPU slice takes every host of the slice.
        preempt = tardigrade("preempt", "tpu-slice-1-0", "--wait", "--state-dir", str(state),
                             cwd=work)
        assert preempt.returncode == 0, preempt.stderr
        left = kubectl("get", "nodes", "-o", "name", env=env).split()
        assert not set(slice_hosts) & set(left), left

        # GKE's host maintenance of the other node: announced at once with its start; at the
        # start GKE's handler drains it (the operator's pod, with its own grace) and its VM
        # shuts down through logind. A real node is not brought back from here.
        refused = tardigrade("maintenance", "real-1", "--in", "1", "--back-after", "5",
                             "--state-dir", str(state), cwd=work)
        assert refused.returncode == 2 and "--back-after" in refused.stderr, refused.stderr
        maintenance = tardigrade("maintenance", "real-1", "--in", "3", "--state-dir", str(state),
                                 cwd=work)
        assert maintenance.returncode == 0, maintenance.stderr
        start = maintenance.stdout.split(" at ")[1].split()[0]
        labels = json.loads(kubectl("get", "node", "real-1", "-o", "json", env=env))[
            "metadata"]["labels"]
        assert labels[SCHEDULED_MAINTENANCE_LABEL] == start
        wait_for(lambda: "node/real-1" not in kubectl("get", "nodes", "-o", "name", env=env),
                 NODE_GONE_TIMEOUT_SECONDS + OPERATOR_GRACE_SECONDS,
                 what="real-1's Node gone after its maintenance")
        assert time.time() >= int(start)
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
