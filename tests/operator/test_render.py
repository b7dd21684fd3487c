"""Rendered children: valid Kubernetes manifests, placed and secured the way GKE expects."""

from __future__ import annotations

import kubernetes_validate
import pytest
from tardigrade_contract import contract
from tardigrade_operator.api.parse import parse_trainingjob
from tardigrade_operator.rendering.manifests import (
    GangLaunch,
    JobRef,
    build_gang,
    build_pod,
    build_service,
)

from tests.conftest import EXAMPLES, load_yaml
from tests.operator.fake_cluster import pod_env

JOB = JobRef(name="gpt", namespace="ml", uid="0d3c")
VERSION = kubernetes_validate.latest_version()


def _job(example: str):
    return parse_trainingjob(load_yaml(EXAMPLES / example)).spec


@pytest.mark.parametrize("example", sorted(p.name for p in EXAMPLES.glob("*.yaml")))
def test_children_are_valid_kubernetes_objects(example):
    spec = _job(example)
    launch = GangLaunch(attempt=3, replicas=spec.replicas, restore_step="40")
    for manifest in [build_service(JOB), *build_gang(JOB, spec, launch)]:
        kubernetes_validate.validate(manifest, VERSION, strict=True)


def test_pod_identity_owner_and_finalizer():
    pod = build_pod(JOB, _job("trainingjob.yaml"), GangLaunch(7, 2, "latest"), rank=1)
    meta = pod["metadata"]
    assert meta["name"] == "gpt-a7-1"
    assert meta["labels"]["tardigrade.dev/attempt"] == "7"
    assert meta["labels"]["tardigrade.dev/rank"] == "1"
    assert meta["ownerReferences"][0] | {} == {
        "apiVersion": "tardigrade.dev/v1alpha1", "kind": "TrainingJob", "name": "gpt",
        "uid": "0d3c", "controller": True, "blockOwnerDeletion": True,
    }
    assert meta["finalizers"] == ["tardigrade.dev/gang-tracking"]
    assert pod["spec"]["hostname"] == "gpt-a7-1"
    assert pod["spec"]["subdomain"] == "gpt"
    assert pod["spec"]["restartPolicy"] == "Never"


def test_pod_security_context():
    pod = build_pod(JOB, _job("trainingjob.yaml"), GangLaunch(1, 2, "latest"), rank=0)
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    assert pod["spec"]["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    container = pod["spec"]["containers"][0]["securityContext"]
    assert container["allowPrivilegeEscalation"] is False
    assert container["capabilities"] == {"drop": ["ALL"]}


@pytest.mark.parametrize(("example", "kind"), [
    ("trainingjob.yaml", "cpu"), ("gke-gpu-spot.yaml", "nvidia-gpu"), ("gke-tpu-v5e.yaml", "tpu")])
def test_every_rank_is_told_the_accelerator_it_must_run_on(example, kind):
    # The trainer refuses any other JAX backend (accelerator.py): a GPU job never trains on the
    # CPU its driver-less container would fall back to.
    spec = _job(example)
    for pod in build_gang(JOB, spec, GangLaunch(1, spec.replicas, "latest")):
        assert pod_env(pod)[contract.ENV_ACCELERATOR] == kind


def test_tpu_pods_run_as_gke_s_tpu_samples_do():
    # No GKE document or public sample runs libtpu as another user or with every capability
    # dropped; GKE's samples run as root with the runtime's defaults (manifests.runs_as_root).
    pod = build_pod(JOB, _job("gke-tpu-v5e.yaml"), GangLaunch(1, 2, "latest"), rank=0)
    assert pod["spec"]["securityContext"] == {
        "runAsUser": 0, "runAsGroup": 0, "seccompProfile": {"type": "RuntimeDefault"}}
    assert pod["spec"]["containers"][0]["securityContext"] == {"allowPrivilegeEscalation": False}
    gpu = build_pod(JOB, _job("gke-gpu-spot.yaml"), GangLaunch(1, 4, "latest"), rank=0)
    assert gpu["spec"]["securityContext"]["runAsNonRoot"] is True
    assert gpu["spec"]["containers"][0]["securityContext"]["capabilities"] == {"drop": ["ALL"]}


def test_environment_contract_round_trips_from_the_pod():
    spec = _job("trainingjob.yaml")
    pod = build_pod(JOB, spec, GangLaunch(2, 2, "40"), rank=1)
    env = contract.TrainerEnvironment.from_env(pod_env(pod))
    assert (env.process_id, env.num_processes, env.attempt) == (1, 2, 2)
    assert env.restore_step == "40"
    assert env.coordinator_address == "gpt-a2-0.gpt:8476"
    assert env.checkpoint_path == spec.checkpoint.path
    assert env.checkpoint_interval_steps == 25
    assert env.trainer_config == spec.trainer
    pod_ip = [e for e in pod["spec"]["containers"][0]["env"] if e["name"] == contract.ENV_POD_IP]
    assert pod_ip[0]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert pod["spec"]["terminationGracePeriodSeconds"] == 30


@pytest.mark.parametrize("save", [True, False])
def test_save_on_preemption_reaches_the_trainer(save):
    manifest = load_yaml(EXAMPLES / "trainingjob.yaml")
    manifest["spec"]["checkpoint"]["saveOnPreemption"] = save
    pod = build_pod(JOB, parse_trainingjob(manifest).spec, GangLaunch(1, 2, "latest"), rank=0)
    assert contract.TrainerEnvironment.from_env(pod_env(pod)).save_on_preemption is save


def test_gpu_spot_placement():
    pod = build_pod(JOB, _job("gke-gpu-spot.yaml"), GangLaunch(1, 4, "latest"), rank=0)
    spec = pod["spec"]
    assert spec["nodeSelector"] == {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb",
                                    "cloud.google.com/gke-spot": "true"}
    assert spec["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert {"key": "cloud.google.com/gke-spot", "operator": "Equal", "value": "true",
            "effect": "NoSchedule"} in spec["tolerations"]
    assert spec["serviceAccountName"] == "trainer"
    assert spec["volumes"][0]["name"] == "dshm"


def test_tpu_slice_placement_and_worker_env():
    pod = build_pod(JOB, _job("gke-tpu-v5e.yaml"), GangLaunch(1, 2, "latest"), rank=1)
    spec = pod["spec"]
    assert spec["nodeSelector"]["cloud.google.com/gke-tpu-accelerator"] == "tpu-v5-lite-podslice"
    assert spec["nodeSelector"]["cloud.google.com/gke-tpu-topology"] == "2x4"
    assert spec["containers"][0]["resources"]["limits"]["google.com/tpu"] == "4"
    env = pod_env(pod)
    assert env["TPU_WORKER_ID"] == "1"
    assert env["TPU_WORKER_HOSTNAMES"] == "gpt-a1-0.gpt,gpt-a1-1.gpt"


def test_service_is_headless_and_publishes_unready_ranks():
    service = build_service(JOB)
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["selector"] == {"tardigrade.dev/job": "gpt"}


@pytest.mark.parametrize(
    ("preemption", "grace", "window"),
    [
        (None, None, 15),  # defaults: GKE spot's regular-pod share of the 30 s notice
        ({"shutdownWindowSeconds": 105}, 150, 105),  # a node pool opted in to 120 s
        ({"shutdownWindowSeconds": 105}, 30, 30),  # the pod's own grace is smaller
        (None, 10, 10),
    ],
)
def test_the_shutdown_window_reaches_the_trainer_as_the_kubelet_computes_it(
        preemption, grace, window):
    manifest = load_yaml(EXAMPLES / "trainingjob.yaml")
    if preemption is not None:
        manifest["spec"]["preemption"] = preemption
    if grace is not None:
        manifest["spec"].setdefault("podTemplate", {})["terminationGracePeriodSeconds"] = grace
    pod = build_pod(JOB, parse_trainingjob(manifest).spec, GangLaunch(1, 2, "latest"), rank=0)
    assert pod_env(pod)[contract.ENV_SHUTDOWN_WINDOW_SECONDS] == str(window)
    assert contract.TrainerEnvironment.from_env(pod_env(pod)).shutdown_window_seconds == window


def test_every_rank_mounts_a_rendezvous_token_for_its_own_audience():
    pod = build_pod(JOB, _job("gke-gpu-spot.yaml"), GangLaunch(1, 4, "latest"), rank=2)
    spec = pod["spec"]
    # The user's volumes keep their indexes; the token volume comes after them.
    assert [v["name"] for v in spec["volumes"]] == ["dshm", "tardigrade-rendezvous-token"]
    source = spec["volumes"][1]["projected"]["sources"][0]["serviceAccountToken"]
    assert source == {"audience": "tardigrade.dev/rendezvous", "expirationSeconds": 3600,
                      "path": "token"}
    mount = spec["containers"][0]["volumeMounts"][-1]
    assert mount == {"name": "tardigrade-rendezvous-token", "readOnly": True,
                     "mountPath": contract.RENDEZVOUS_TOKEN_DIR}
    env = contract.TrainerEnvironment.from_env(pod_env(pod))
    assert env.rendezvous_token_file == f"{mount['mountPath']}/token"
    assert not env.rendezvous_insecure


@pytest.mark.parametrize("example", ["gke-tpu-v5e.yaml", "gke-gpu-spot.yaml"])
def test_accelerator_pods_pass_the_kubernetes_clients_own_model(example):
    # The operator creates pods through the client, whose models refuse integer quantities.
    from kubernetes.client import V1Pod

    spec = _job(example)
    for pod in build_gang(JOB, spec, GangLaunch(1, spec.replicas, "latest")):
        V1Pod.model_validate(pod)
