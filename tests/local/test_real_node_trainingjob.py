"""Tardigrade on real nodes, installed the way a user installs it: `helm install` of the chart
with the operator image from the local registry, so the operator runs as a pod on a real node
(real kubelet, containerd) under the chart's own RBAC and reaches kube-apiserver through the
`kubernetes` Service; a 2-replica TrainingJob of the trainer-cpu image on two spot nodes
forms its gang through the headless Service's names (CoreDNS), trains and checkpoints; a spot
reclaim of one trainer's node goes through the kubelet's graceful node shutdown, the trainer
saves on SIGTERM, the operator (restart in place on, as the chart offers it) keeps the other
rank's pod, whose trainer the real kubelet restarts by its container restart rule, relaunches
the lost rank on what is left, and the job resumes with no step lost, then succeeds; `helm
uninstall` takes the operator away.

Checkpoints go to a directory every node sees: one host directory, offered as a hostPath
PersistentVolume bound to a ReadWriteMany claim, standing for a shared filesystem (Filestore
over NFS on GKE); a claim is a volume type the chart's admission allows (an inline hostPath is
not, nor is it allowed by Pod Security baseline); the admin's PersistentVolume is where the
machine shows. (`gs://` checkpoints on the GCS emulator, through its Service, are
test_real_node_cli.py's.)

One cluster, network, DNS, registry and three real nodes for the module; the tests run in
order and build on each other.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kube_helpers import Kube, PodRecorder, condition, container_status, wait_for
from kubernetes import client
from tardigrade_local import crilog, nodeimage
from tardigrade_local.cluster import LocalCluster
from tardigrade_local.gke.disruptions import (
    DISRUPTION_TARGET,
    REASON_TERMINATION_BY_KUBELET,
    Disruptor,
)
from tardigrade_local.realcluster import (
    CHECKPOINT_CLAIM,
    OPERATOR_NAMESPACE,
    OPERATOR_RELEASE,
    SPOT_LABEL,
    RealNodeCluster,
    plan_nodes,
)
from tardigrade_local.realnode import RealNode
from tardigrade_local.registry import Registry
from tardigrade_local.steplog import StepLog
from tardigrade_operator.api import types

from tests.conftest import EXAMPLES, load_yaml

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux") or os.geteuid() != 0,
                       reason="real nodes need Linux and root (namespaces, mounts, cgroups)"),
]

RELEASE, SYSTEM = OPERATOR_RELEASE, OPERATOR_NAMESPACE
NAMESPACE = "default"
JOB = "real-run"
# Node 1 is on-demand (the chart keeps the operator off spot nodes); 2 and 3 are spot, where
# the job asks to run.
SYSTEM_NODE, SPOT_NODES = "real-1", ("real-2", "real-3")
CHECKPOINTS = "/mnt/checkpoints"
CLAIM = CHECKPOINT_CLAIM
STEPS = 300
INTERVAL_STEPS = 25
# The reclaim comes after the first commit, well before the end.
RECLAIM_AFTER_STEP = INTERVAL_STEPS + 5
# Pulls of the 1 GB trainer image on each node, JAX's start and compile, on a machine other
# test runs share.
TRAIN_TIMEOUT_SECONDS = 600.0
FINISH_TIMEOUT_SECONDS = 600.0
POD_TIMEOUT_SECONDS = 180.0
NAME_RETRY = "(for i in $(seq 60); do nslookup {name} && exit 0; sleep 1; done; exit 1)"
PULL_FAILURES = ("ErrImagePull", "ImagePullBackOff", "InvalidImageName")


@pytest.fixture(scope="module")
def real(tmp_path_factory) -> Iterator[RealNodeCluster]:
    """The cluster, the registry with our images, the network, DNS, the `kubernetes`
    Service, the real nodes and the shared checkpoint claim, as `tardigrade local up` starts
    them."""
    with RealNodeCluster(tmp_path_factory.mktemp("real"), plan_nodes(1, len(SPOT_NODES))
                         ) as running:
        yield running


@pytest.fixture(scope="module")
def registry(real) -> Registry:
    return real.registry


@pytest.fixture(scope="module")
def images(real) -> dict[str, str]:
    """Reference of each image in the registry (a lookup of the build when its inputs are
    unchanged, then a push)."""
    return real.images


@pytest.fixture(scope="module")
def cluster(real) -> LocalCluster:
    return real.cluster


@pytest.fixture(scope="module")
def kube(cluster) -> Kube:
    return Kube(str(cluster.kubeconfig))


@pytest.fixture(scope="module")
def nodes(real) -> dict[str, RealNode]:
    assert list(real.nodes) == [SYSTEM_NODE, *SPOT_NODES]
    return real.nodes


@pytest.fixture(scope="module")
def shared_checkpoints(real) -> Path:
    """One host directory every node mounts, offered as a ReadWriteMany PersistentVolume
    bound to the claim CLAIM of the job's namespace."""
    return real.checkpoints


def operator_pods(kube: Kube) -> list[dict[str, Any]]:
    return [kube.plain(p) for p in kube.core.list_namespaced_pod(
        SYSTEM, label_selector="app.kubernetes.io/name=tardigrade-operator").items]


def registry_digest(registry: Registry, reference: str) -> str:
    """`<registry>/<repository>@<digest>`: the imageID the kubelet reports for a pull."""
    repository, tag = reference.removeprefix(f"{registry.host}/").rsplit(":", 1)
    _, digest = registry.manifest(repository, tag)
    return f"{registry.host}/{repository}@{digest}"


def job_pods(kube: Kube, attempt: int | None = None) -> list[dict[str, Any]]:
    selector = f"tardigrade.dev/job={JOB}"
    if attempt is not None:
        selector += f",tardigrade.dev/attempt={attempt}"
    return [kube.plain(p) for p in
            kube.core.list_namespaced_pod(NAMESPACE, label_selector=selector).items]


def trainer_records(node: RealNode, pod: str) -> list[dict[str, Any]]:
    """The trainer's JSON-lines records, from the log files the node's kubelet wrote."""
    files = sorted(node.pod_logs_dir.glob(f"{NAMESPACE}_{pod}_*/trainer/*.log"))
    assert files, f"no log of {pod} under {node.pod_logs_dir}"
    records = []
    for line in crilog.text(files[-1].read_bytes()).splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and "event" in record:
            records.append(record)
    return records


def job_status(kube: Kube) -> dict[str, Any]:
    found = client.CustomObjectsApi(kube.api).get_namespaced_custom_object(
        types.GROUP, types.VERSION, NAMESPACE, types.PLURAL, JOB)
    return found.get("status") or {}


def training_job(image: str) -> dict[str, Any]:
    """The example, on the spot nodes, short, checkpointing to the shared claim."""
    body = copy.deepcopy(load_yaml(EXAMPLES / "trainingjob.yaml"))
    body["metadata"] = {"name": JOB, "namespace": NAMESPACE}
    spec = body["spec"]
    spec.update(replicas=2, minReplicas=1, maxReplicas=2, image=image,
                resources={"requests": {"cpu": "300m", "memory": "512Mi"},
                           "limits": {"memory": "3Gi"}})
    spec["trainer"].update(steps=STEPS, global_batch_size=8, seq_len=16,
                           devices_per_process=1)
    spec["checkpoint"].update(path=f"{CHECKPOINTS}/{JOB}", interval={"steps": INTERVAL_STEPS})
    spec["podTemplate"] = {
        "terminationGracePeriodSeconds": 30, "nodeSelector": {SPOT_LABEL: "true"},
        "volumes": [{"name": "checkpoints", "persistentVolumeClaim": {"claimName": CLAIM}}],
        "volumeMounts": [{"name": "checkpoints", "mountPath": CHECKPOINTS}]}
    return body


@pytest.fixture(scope="module")
def installed(real, kube) -> dict[str, Any]:
    real.install_operator(
        "--set", "operator.restartInPlace=true",
        # Rank 0's progress read every 2 s (resyncSeconds), not backed off up to 60 s: the
        # test waits for the operator's account of a checkpoint before the reclaim, and the
        # steps take hundredths of a second.
        "--set", "operator.progressMaxIntervalSeconds=2")
    pods = operator_pods(kube)
    assert len(pods) == 1, pods
    return pods[0]


def test_helm_installs_the_operator_as_a_pod_of_our_image_on_a_real_node(
        installed, registry, images):
    pod = installed
    # Off the spot nodes, by the chart's own affinity.
    assert pod["spec"]["nodeName"] == SYSTEM_NODE
    status = container_status(pod)
    assert status["containerID"].startswith("containerd://")
    assert status["imageID"] == registry_digest(registry, images["operator"])
    assert status["ready"] is True
    assert condition(pod, "Ready")["status"] == "True"


def test_a_training_job_forms_its_gang_on_real_nodes_and_checkpoints(
        installed, kube, cluster, nodes, registry, images, shared_checkpoints):
    client.CustomObjectsApi(kube.api).create_namespaced_custom_object(
        types.GROUP, types.VERSION, NAMESPACE, types.PLURAL, training_job(images["trainer-cpu"]))

    def running() -> list[dict[str, Any]] | None:
        pods = job_pods(kube)
        states = [c.get("state") or {} for p in pods
                  for c in p["status"].get("containerStatuses") or []]
        for state in states:
            waiting = state.get("waiting") or {}
            assert waiting.get("reason") not in PULL_FAILURES, waiting
        return pods if len(pods) == 2 and sum("running" in s for s in states) == 2 else None

    # The names are checked while JAX starts and compiles, so that the reclaim (next test)
    # follows the first commit closely: steps take a few hundredths of a second.
    pods = wait_for(running, TRAIN_TIMEOUT_SECONDS, what="both trainers running")
    # The trainers run on the two spot nodes, as containers of our image from the registry.
    assert sorted(p["spec"]["nodeName"] for p in pods) == sorted(SPOT_NODES)
    digest = registry_digest(registry, images["trainer-cpu"])
    for pod in pods:
        status = container_status(pod)
        assert status["containerID"].startswith("containerd://"), status
        assert status["imageID"] == digest, status
    # The gang meets through the headless Service's names: each rank's name resolves, from a
    # pod on the third node, to that rank's pod IP.
    service = pods[0]["spec"]["subdomain"]
    names = {f"{p['spec']['hostname']}.{service}.{NAMESPACE}.svc.cluster.local":
             p["status"]["podIP"] for p in pods}
    # A name is served once the EndpointSlice controller has published the pod's address and
    # CoreDNS has seen it, which can come after the container runs: each lookup is retried
    # until it answers (NXDOMAIN is cached for CoreDNS's 5 s TTL), for at most a minute.
    lookups = " && ".join(NAME_RETRY.format(name=name) for name in names)
    kube.create_pod({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "resolve"},
                     "spec": {"restartPolicy": "Never",
                              "nodeSelector": {"kubernetes.io/hostname": SYSTEM_NODE},
                              "containers": [{"name": "main", "image": nodeimage.BUSYBOX_IMAGE,
                                              "imagePullPolicy": "Never",
                                              "command": ["sh", "-c", lookups]}]}})
    resolved = kube.wait_phase("resolve", ("Succeeded", "Failed"), timeout=POD_TIMEOUT_SECONDS)
    answer = kube.core.read_namespaced_pod_log("resolve", NAMESPACE)
    assert resolved["status"]["phase"] == "Succeeded", answer
    for name, ip in names.items():
        assert name in answer and ip in answer, answer

    log = StepLog(kube.core, NAMESPACE, JOB)

    def trained() -> bool:
        log.collect()
        status = job_status(kube)
        assert status.get("phase") != "Failed", status
        # The operator, in its pod, read rank 0's progress over the cluster network.
        told = bool(status.get("step")) and bool(status.get("lastCheckpoint"))
        return told and bool(log.committed) and log.last_step >= RECLAIM_AFTER_STEP

    wait_for(trained, TRAIN_TIMEOUT_SECONDS, what="training past a committed checkpoint")
    assert job_status(kube)["phase"] == "Running"
    # The commit is in the shared directory, written from the node.
    assert (shared_checkpoints / JOB).is_dir() and any((shared_checkpoints / JOB).iterdir())


def test_a_spot_reclaim_of_a_trainers_node_loses_no_step(installed, kube, cluster, nodes):
    status = job_status(kube)
    attempt = status["attempt"]
    before = {p["metadata"]["labels"]["tardigrade.dev/rank"]: p for p in job_pods(kube, attempt)}
    # Rank 1's node: rank 0's log stays readable through the API server.
    victim = before["1"]["spec"]["nodeName"]
    survivor = before["0"]["spec"]["nodeName"]
    log = StepLog(kube.core, NAMESPACE, JOB)
    with PodRecorder(kube, NAMESPACE, f"tardigrade.dev/job={JOB}",
                     timeout_seconds=900) as recorder:
        Disruptor(cluster.info["control_url"]).preempt_node(victim, wait=True)
        assert victim not in kube.node_names()

        def resumed() -> bool:
            log.collect()
            current = job_status(kube)
            assert current.get("phase") != "Failed", current
            return current.get("attempt", 0) > attempt and any(
                r.get("attempt", 0) > attempt and r.get("event") == "step"
                for r in log.records)

        wait_for(resumed, TRAIN_TIMEOUT_SECONDS, what="the relaunched gang training")
    # The reclaimed pod went through the kubelet's graceful node shutdown.
    reclaimed = before["1"]["metadata"]["name"]
    target = [condition(p, DISRUPTION_TARGET) for p in recorder.seen.get(reclaimed, [])]
    assert any(t and t["reason"] == REASON_TERMINATION_BY_KUBELET for t in target), \
        (recorder.error, recorder.seen.get(reclaimed))
    # Restart in place (the chart's operator.restartInPlace): rank 0's pod on the healthy
    # node is kept, the same pod, and its trainer restarted by the real kubelet's container
    # restart rule once the operator's restart request (POST to the pod's restart port, over
    # the cluster network) told it the new world; only the lost rank gets a new pod, on what
    # is left: the survivor spot node.
    after = {p["metadata"]["name"]: p for p in job_pods(kube)
             if not p["metadata"].get("deletionTimestamp")}
    kept = before["0"]["metadata"]["name"]
    assert after[kept]["metadata"]["uid"] == before["0"]["metadata"]["uid"], after.keys()
    assert container_status(after[kept])["restartCount"] >= 1, after[kept]["status"]
    assert reclaimed not in after
    assert {p["spec"]["nodeName"] for p in after.values()} == {survivor}
    assert len(after) == 2

    def finished() -> dict[str, Any] | None:
        log.collect()
        current = job_status(kube)
        assert current.get("phase") != "Failed", current
        return current if current.get("phase") == "Succeeded" else None

    final = wait_for(finished, FINISH_TIMEOUT_SECONDS, what=f"{JOB} Succeeded")
    recovery = final["recoveries"][-1]
    assert recovery["cause"] == "Preemption", recovery
    assert recovery["keptPods"] == 1, recovery
    assert final["restarts"]["preemptions"] == 1 and final["restarts"]["failures"] == 0
    assert recovery["stepsLost"] == 0, final["recoveries"]
    # The reclaimed trainer saved on SIGTERM: its log, as its kubelet wrote it under the node's
    # directory (the node is gone, and so is the API's way to it), ends with the save of the
    # step it was on, which the new gang restored.
    victim_log = trainer_records(nodes[victim], reclaimed)
    preempted = [r for r in victim_log if r.get("event") == "preempted"]
    assert preempted, victim_log[-10:]
    last_step = max(r["step"] for r in victim_log if r.get("event") == "step")
    assert preempted[-1]["step"] == preempted[-1]["checkpoint_step"] == last_step
    assert recovery["restoreStep"] == last_step
    assert log.restored[-1] == last_step
    # Every step trained once: up to the save in attempt 1, after it in attempt 2. The
    # operator deletes a finished job's pods, so rank 0's last lines may be gone before the
    # test reads them: attempt 2's steps are checked as far as they were read.
    first = sorted(r["step"] for r in victim_log if r.get("event") == "step")
    second = sorted(r["step"] for r in log.records
                    if r.get("event") == "step" and r["attempt"] > attempt)
    assert first == list(range(1, last_step + 1))
    assert second and second == list(range(last_step + 1, last_step + 1 + len(second)))


def test_helm_uninstall_takes_the_operator_away(installed, kube, real):
    out = real.helm("uninstall", RELEASE, "-n", SYSTEM, "--wait", "--timeout", "180s")
    assert "uninstalled" in out
    wait_for(lambda: not operator_pods(kube), POD_TIMEOUT_SECONDS, what="the operator pod gone")
    apps = client.AppsV1Api(kube.api)
    assert not apps.list_namespaced_deployment(SYSTEM).items
    # The CRD stays (crds.keep), and so does the finished job.
    assert job_status(kube)["phase"] == "Succeeded"
