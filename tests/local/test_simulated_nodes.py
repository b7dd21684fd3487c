"""The simulator (benches only): simulated nodes in the local cluster, whose pods without
processes get the status a kubelet writes, and the disruptions the benches use (here: a spot
reclaim, a deletion). It tests the bench's tool, not Tardigrade's behaviour."""

from __future__ import annotations

import json

import pytest
from kube_helpers import Kube, condition, container_status, wait_for
from tardigrade_contract import contract
from tardigrade_local.cluster import LocalCluster, simulated_nodes
from tardigrade_local.gke import disruptions as d
from tardigrade_local.simulator.config import SIMULATED_ANNOTATION, SIMULATED_RUNTIME_VERSION

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    state = tmp_path_factory.mktemp("simulated") / "state"
    with LocalCluster(state, nodes=simulated_nodes(3), with_gcs=False,
                      shutdown_grace_seconds=30) as running:
        yield running


@pytest.fixture(scope="module")
def kube(cluster):
    return Kube(str(cluster.kubeconfig))


def rank_pod(name: str, rank: int, size: int, checkpoints: str, node: str) -> dict:
    env = contract.TrainerEnvironment(
        job_name="gang", namespace="default", attempt=0, coordinator_address="x:1",
        num_processes=size, process_id=rank, checkpoint_path=checkpoints,
        checkpoint_interval_steps=10, progress_port=contract.DEFAULT_PROGRESS_PORT,
        trainer_config={"steps": 100_000, "step_seconds": 0.02},
        termination_log="/dev/termination-log").to_env()
    return {"metadata": {"name": name}, "spec": {
        "nodeName": node, "restartPolicy": "Never", "terminationGracePeriodSeconds": 30,
        "containers": [{"name": "trainer", "image": "ghcr.io/x/tardigrade-trainer:1",
                        "env": [{"name": k, "value": v} for k, v in env.items()]}]}}


def test_simulated_nodes_are_marked_and_report_their_runtime(kube):
    for node in kube.core.list_node().items:
        assert node.metadata.annotations[SIMULATED_ANNOTATION] == "true"
        assert node.status.node_info.container_runtime_version == SIMULATED_RUNTIME_VERSION


def test_a_preempted_simulated_host_ends_its_gang_the_way_real_trainers_do(
        kube, cluster, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    kube.create_pod(rank_pod("r0", 0, 2, ckpt, "sim-node-1"))
    kube.create_pod(rank_pod("r1", 1, 2, ckpt, "sim-node-2"))
    for name in ("r0", "r1"):
        pod = kube.wait_phase(name, ("Running",))
        status = container_status(pod)
        assert status["containerID"].startswith("simulated://")
        assert status["ready"] and status["started"] and "running" in status["state"]
        assert condition(pod, "Ready")["status"] == "True"
        assert pod["status"]["podIP"].startswith("127.")
    cluster.preempt_node("sim-node-2")
    for name in ("r0", "r1"):
        pod = kube.wait_phase(name, ("Failed",))
        terminated = container_status(pod)["state"]["terminated"]
        assert terminated["exitCode"] == contract.EXIT_PREEMPTED_SAVED
        message = json.loads(terminated["message"])
        assert message["reason"] == "PreemptedSaved"
    r1 = kube.pod("r1")
    assert r1["status"]["reason"] == d.NODE_SHUTDOWN_REASON
    assert condition(r1, d.DISRUPTION_TARGET)["reason"] == d.REASON_TERMINATION_BY_KUBELET
    # The peer on the surviving host saved the same step (the gang's sync point).
    messages = [json.loads(container_status(kube.pod(n))["state"]["terminated"]["message"])
                for n in ("r0", "r1")]
    assert messages[0]["checkpoint_step"] == messages[1]["checkpoint_step"] > 0
    wait_for(lambda: "sim-node-2" not in kube.node_names(), what="node deleted")


def test_deleting_an_idle_simulated_pod_terminates_it_and_the_object_goes(kube):
    kube.create_pod({"metadata": {"name": "idle"}, "spec": {
        "nodeName": "sim-node-3", "containers": [{"name": "c", "image": "python"}]}})
    kube.wait_phase("idle", ("Running",))
    kube.core.delete_namespaced_pod("idle", "default")
    kube.wait_gone("idle")
