"""Our images on a real node: built from the Dockerfiles (`imagebuild`), pushed to the local
registry (distribution), and pulled by the node's kubelet through the CRI, as a GKE node pulls
from Artifact Registry. The trainer runs in a pod the operator's own renderer made, as the
rendered security context says; the operator image answers `tardigrade --help` as its user.

Warm (images already built; each module start pushes both to a fresh registry): about 2-3
minutes on a loaded 2-core machine, most of it the trainer image's pull and unpack (1 GB) and
JAX's start; local_cluster/REAL_NODES.md has the figures.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import sys
from collections.abc import Iterator
from typing import Any

import psutil
import pytest
from kube_helpers import Kube, container_status, kubectl, wait_for
from kubernetes import client
from tardigrade_contract import contract
from tardigrade_local import imagebuild
from tardigrade_local.cluster import LocalCluster
from tardigrade_local.realnode import RealNode, sweep_orphans
from tardigrade_local.registry import Registry
from tardigrade_operator.api import types
from tardigrade_operator.api.parse import parse_trainingjob
from tardigrade_operator.rendering.keys import JobKeys, build_keys_secret
from tardigrade_operator.rendering.manifests import GangLaunch, JobRef, build_pod

from tests.conftest import EXAMPLES, load_yaml

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux") or os.geteuid() != 0,
                       reason="a real node needs Linux and root (namespaces, mounts, cgroups)"),
]

NODE = "image-node-1"
NAMESPACE = "default"
VERSION = "0.1.0"
# Pull and unpack of the 1 GB trainer image through the node's proxy, then JAX's start and
# a few compiled steps, on a machine other test runs share.
TRAIN_TIMEOUT_SECONDS = 480.0
POD_TIMEOUT_SECONDS = 240.0
PULL_FAILURES = ("ErrImagePull", "ImagePullBackOff", "InvalidImageName")
CHECKPOINT_DIR = "/mnt/checkpoints"
STEPS = 4
INTERVAL_STEPS = 2


@dataclasses.dataclass(frozen=True)
class Pushed:
    reference: str  # <registry>/tardigrade-dev/<title>:<tag>
    repository: str
    tag: str
    digest: str  # of the manifest, as the registry serves it
    config: dict[str, Any]  # the image config's `config` (User, Entrypoint, ...)


@pytest.fixture(scope="module")
def registry(tmp_path_factory) -> Iterator[Registry]:
    root = tmp_path_factory.mktemp("registry")
    with Registry(root / "storage", log_path=root / "registry.log") as running:
        yield running


def _push(registry: Registry, name: str) -> Pushed:
    built = imagebuild.build(name)  # a lookup when the inputs are unchanged
    reference = imagebuild.push(built, registry.host, VERSION)
    repository, tag = reference.removeprefix(f"{registry.host}/").rsplit(":", 1)
    manifest, digest = registry.manifest(repository, tag)
    config = json.loads(registry.blob(repository, manifest["config"]["digest"]))["config"]
    return Pushed(reference, repository, tag, digest, config)


@pytest.fixture(scope="module")
def images(registry) -> dict[str, Pushed]:
    return {name: _push(registry, name) for name in ("trainer-cpu", "operator")}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[LocalCluster]:
    sweep_orphans()  # what a killed earlier run left on this machine
    state = tmp_path_factory.mktemp("imagenode") / "state"
    with LocalCluster(state, nodes=[], with_gcs=False, node_egress=True) as running:
        yield running


@pytest.fixture(scope="module")
def node(cluster, registry, images, tmp_path_factory) -> Iterator[RealNode]:
    real = RealNode.for_cluster(cluster.info, NODE, tmp_path_factory.mktemp("node"),
                                registry=registry.host)
    with real:
        yield real


@pytest.fixture(scope="module")
def kube(cluster) -> Kube:
    return Kube(str(cluster.kubeconfig))


def _finished(kube: Kube, name: str, timeout: float) -> dict[str, Any]:
    """The pod once Succeeded or Failed; a failed pull fails at once, with its message."""
    def check() -> dict[str, Any] | None:
        pod = kube.pod(name, NAMESPACE)
        if pod is None:
            return None
        for status in pod["status"].get("containerStatuses") or []:
            waiting = (status.get("state") or {}).get("waiting") or {}
            if waiting.get("reason") in PULL_FAILURES:
                pytest.fail(f"{name}: {waiting['reason']}: {waiting.get('message')}")
        return pod if pod["status"].get("phase") in ("Succeeded", "Failed") else None

    return wait_for(check, timeout, what=f"pod {name} finished")


def _runtime_spec(node: RealNode, status: dict[str, Any]) -> dict[str, Any]:
    """The OCI runtime spec containerd gave runc for the container (`crictl inspect`)."""
    container_id = status["containerID"].removeprefix("containerd://")
    return json.loads(node.crictl("inspect", container_id))["info"]["runtimeSpec"]


def _node_has_image(node: RealNode, repository: str) -> bool:
    listed = json.loads(node.crictl("images", "-o", "json"))["images"]
    return any(repository in ref for image in listed
               for ref in [*image.get("repoTags", []), *image.get("repoDigests", [])])


def _training_job(image: str) -> dict[str, Any]:
    """The example job, for one CPU host with a short run and a checkpoint directory on a
    volume of the pod (the node has no GCS)."""
    body = copy.deepcopy(load_yaml(EXAMPLES / "trainingjob.yaml"))
    body["metadata"] = {"name": "image-run", "namespace": NAMESPACE}
    spec = body["spec"]
    spec.update(replicas=1, minReplicas=1, maxReplicas=1, image=image,
                resources={"requests": {"cpu": "100m", "memory": "512Mi"},
                           "limits": {"memory": "3Gi"}})
    spec["trainer"] = {"steps": STEPS, "seed": 0, "global_batch_size": 8, "seq_len": 16,
                       "devices_per_process": 1, "log_every": 1}
    spec["checkpoint"] = {"path": f"{CHECKPOINT_DIR}/image-run",
                          "interval": {"steps": INTERVAL_STEPS}, "keep": {"last": 2}}
    spec["podTemplate"] = {"terminationGracePeriodSeconds": 30,
                           "volumes": [{"name": "checkpoints", "emptyDir": {}}],
                           "volumeMounts": [{"name": "checkpoints",
                                             "mountPath": CHECKPOINT_DIR}]}
    return body


def _events(log: str) -> list[dict[str, Any]]:
    found = []
    for line in log.splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and "event" in event:
            found.append(event)
    return found


def test_a_rendered_trainer_pod_pulls_our_image_from_the_registry_and_trains(
        node, kube, cluster, registry, images):
    trainer = images["trainer-cpu"]
    # Nothing of ours is on the node before the pod: the kubelet pulls it.
    assert not _node_has_image(node, trainer.repository)
    body = _training_job(trainer.reference)
    job = parse_trainingjob(body)
    created = client.CustomObjectsApi(kube.api).create_namespaced_custom_object(
        types.GROUP, types.VERSION, NAMESPACE, types.PLURAL, body)
    ref = JobRef(job.metadata.name, NAMESPACE, created["metadata"]["uid"])
    kube.core.create_namespaced_secret(NAMESPACE, build_keys_secret(ref, JobKeys.fresh()))
    rendered = build_pod(ref, job.spec, GangLaunch(1, 1, contract.RESTORE_LATEST), 0)
    kube.create_pod(rendered, NAMESPACE)
    name = rendered["metadata"]["name"]

    pod = _finished(kube, name, TRAIN_TIMEOUT_SECONDS)
    log = kubectl("logs", "-n", NAMESPACE, name, env=cluster.client_env())
    assert pod["status"]["phase"] == "Succeeded", (json.dumps(pod["status"], indent=2)
                                                   + log[-3000:])
    assert pod["spec"]["nodeName"] == NODE
    status = container_status(pod)
    assert status["containerID"].startswith("containerd://")
    # The kubelet reports the digest it pulled from our registry: the pushed tag's manifest.
    assert status["imageID"] == f"{registry.host}/{trainer.repository}@{trainer.digest}"
    assert pod["spec"]["containers"][0]["imagePullPolicy"] == "IfNotPresent"
    assert _node_has_image(node, trainer.repository)
    # containerd took the node's hosts.toml: plain HTTP at once. Without it, it guesses for a
    # loopback host and logs that it tries HTTPS first.
    assert "try HTTPS first" not in (node.logs_dir / "containerd.log").read_text()

    # It trained and committed checkpoints, on the node, from the image's own install.
    events = _events(log)
    steps = [e["step"] for e in events if e["event"] == "step"]
    committed = [e["step"] for e in events if e["event"] == "checkpoint_committed"]
    assert steps == list(range(1, STEPS + 1)), log[-3000:]
    assert committed == list(range(INTERVAL_STEPS, STEPS + 1, INTERVAL_STEPS)), log[-3000:]
    # The trainer's last word, through the rendered terminationMessagePath.
    message = json.loads(status["state"]["terminated"]["message"])
    assert (message["reason"], message["checkpoint_step"]) == ("Succeeded", STEPS)

    # runc was told what the rendered security context says.
    pod_security = rendered["spec"]["securityContext"]
    container_security = rendered["spec"]["containers"][0]["securityContext"]
    assert pod_security["runAsNonRoot"] and container_security["runAsNonRoot"]
    runtime = _runtime_spec(node, status)
    process = runtime["process"]
    assert process["user"]["uid"] == pod_security["runAsUser"] != 0
    assert process["user"]["gid"] == pod_security["runAsGroup"]
    assert pod_security["fsGroup"] in process["user"]["additionalGids"]
    # ...and the kubelet reports the identity the container ran with.
    assert status["user"]["linux"]["uid"] == pod_security["runAsUser"]
    assert process["noNewPrivileges"] is True
    assert container_security["capabilities"] == {"drop": ["ALL"]}
    assert not any(process["capabilities"].values()), process["capabilities"]
    assert pod_security["seccompProfile"] == {"type": "RuntimeDefault"}
    # containerd's default profile: refuse what it does not list.
    assert runtime["linux"]["seccomp"]["defaultAction"] == "SCMP_ACT_ERRNO"
    assert runtime["linux"]["seccomp"]["syscalls"]


def test_the_operator_image_answers_help_on_the_node_as_its_user(node, kube, cluster,
                                                                  registry, images):
    operator = images["operator"]
    image_user = operator.config["User"]
    assert image_user.isdigit() and int(image_user) != 0
    kube.create_pod({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "operator-help"},
                     "spec": {"restartPolicy": "Never", "containers": [{
                         "name": "operator", "image": operator.reference,
                         "imagePullPolicy": "Always", "args": ["--help"],
                         # The user comes from the image: the kubelet checks it is not root.
                         "securityContext": {
                             "runAsNonRoot": True, "allowPrivilegeEscalation": False,
                             "capabilities": {"drop": ["ALL"]},
                             "seccompProfile": {"type": "RuntimeDefault"}}}]}},
                    NAMESPACE)
    pod = _finished(kube, "operator-help", POD_TIMEOUT_SECONDS)
    log = kubectl("logs", "-n", NAMESPACE, "operator-help", env=cluster.client_env())
    assert pod["status"]["phase"] == "Succeeded", json.dumps(pod["status"], indent=2) + log
    status = container_status(pod)
    assert status["containerID"].startswith("containerd://")
    assert status["imageID"] == f"{registry.host}/{operator.repository}@{operator.digest}"
    assert "usage" in log.lower() and "operator" in log
    process = _runtime_spec(node, status)["process"]
    assert process["user"]["uid"] == status["user"]["linux"]["uid"] == int(image_user)
    assert process["noNewPrivileges"] is True and not any(process["capabilities"].values())
    assert process["args"] == [*operator.config["Entrypoint"], "--help"]


def test_stopping_the_node_stops_its_way_to_the_registry(node):
    def proxies() -> list[int]:
        return [p.pid for p in psutil.process_iter(["cmdline"])
                if "tardigrade_local.netnsproxy" in (p.info["cmdline"] or [])
                and str(node.netns_path) in p.info["cmdline"]]

    assert len(proxies()) == 2  # the API server's and the registry's
    node.stop()
    assert proxies() == []
    assert node.leftovers() == node.footprint.nothing_left()
