"""`tardigrade operator release` (the chart's pre-delete hook), against the local API server."""

from __future__ import annotations

import json

import kubernetes
import pytest
from tardigrade_operator import naming
from tardigrade_operator.kube import ClusterWriter
from tardigrade_operator.uninstall import release_pods, stop_deployment

from tests.local.api_helpers import running_server

LABELS = {"app.kubernetes.io/name": "tardigrade-operator", "app.kubernetes.io/instance": "t"}


@pytest.fixture
def client(tmp_path):
    with running_server(tmp_path) as (_, kubeconfig):
        yield kubernetes.config.new_client_from_config(config_file=str(kubeconfig))


def pod(name: str, namespace: str, labels: dict[str, str], finalizers: list[str],
        owner: tuple[str, str] | None = None) -> dict:
    meta: dict = {"name": name, "namespace": namespace, "labels": labels,
                  "finalizers": finalizers}
    if owner:
        meta["ownerReferences"] = [{"apiVersion": "apps/v1", "kind": "ReplicaSet",
                                    "name": owner[0], "uid": owner[1], "controller": True}]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta,
            "spec": {"containers": [{"name": "c", "image": "python"}]}}


def test_release_pods_takes_only_our_finalizer_in_the_given_namespaces(client):
    core = kubernetes.client.CoreV1Api(client)
    for ns in ("ml", "lab"):
        core.create_namespace({"metadata": {"name": ns}})
        core.create_namespaced_pod(ns, pod("trainer", ns, naming.pod_labels("j", 1, 0),
                                           [naming.POD_FINALIZER, "example.dev/keep"]))
    released = release_pods(ClusterWriter(client), ["ml"])
    assert released == ["ml/trainer"]
    assert core.read_namespaced_pod("trainer", "ml").metadata.finalizers == ["example.dev/keep"]
    assert naming.POD_FINALIZER in core.read_namespaced_pod("trainer", "lab").metadata.finalizers
    assert sorted(release_pods(ClusterWriter(client), None)) == ["lab/trainer"]


def test_stop_deployment_scales_to_zero_and_waits_for_its_own_pods_only(client):
    apps = kubernetes.client.AppsV1Api(client)
    core = kubernetes.client.CoreV1Api(client)
    spec = {"replicas": 2, "selector": {"matchLabels": LABELS}, "template": {
        "metadata": {"labels": LABELS},
        "spec": {"containers": [{"name": "operator", "image": "tardigrade-operator"}]}}}
    apps.create_namespaced_deployment("default", {"metadata": {"name": "t"}, "spec": spec})
    replica_set = json.loads(apps.create_namespaced_replica_set(
        "default", {"metadata": {"name": "t-1"}, "spec": spec}, _preload_content=False).data)
    # The hook's own pod may share the labels; it is not the Deployment's and is not waited for.
    core.create_namespaced_pod("default", pod("hook", "default", LABELS, []))
    core.create_namespaced_pod("default", pod("t-abc", "default", LABELS, [],
                                                 owner=("t-1", replica_set["metadata"]["uid"])))
    ticks = iter(range(100))
    with pytest.raises(TimeoutError, match=r"running after 2 s: t-abc$"):
        stop_deployment(apps, core, "default", "t", timeout=2, clock=lambda: next(ticks))
    assert apps.read_namespaced_deployment("t", "default").spec.replicas == 0
    core.delete_namespaced_pod("t-abc", "default", grace_period_seconds=0)
    stop_deployment(apps, core, "default", "t", timeout=2)
    stop_deployment(apps, core, "default", "absent", timeout=2)  # already gone: nothing to stop
