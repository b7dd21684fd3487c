"""`tardigrade operator release` (the chart's pre-delete hook), against the real API server."""

from __future__ import annotations

import kubernetes
import pytest
from tardigrade_operator import naming
from tardigrade_operator.apply.kube import ClusterWriter
from tardigrade_operator.cli.uninstall import release_pods, stop_deployment

from tests.polling import wait_for

LABELS = {"app.kubernetes.io/name": "tardigrade-operator", "app.kubernetes.io/instance": "t"}
HOLD = "example.dev/hold"


def pod(name: str, namespace: str, labels: dict[str, str], finalizers: list[str]) -> dict:
    meta: dict = {"name": name, "namespace": namespace, "labels": labels,
                  "finalizers": finalizers}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta,
            "spec": {"containers": [{"name": "c", "image": "python"}]}}


def test_release_pods_takes_only_our_finalizer_in_the_given_namespaces(shared_api):
    client = shared_api.api
    core = kubernetes.client.CoreV1Api(client)
    ml, lab = shared_api.new_namespace("ml"), shared_api.new_namespace("lab")
    for ns in (ml, lab):
        core.create_namespaced_pod(ns, pod("trainer", ns, naming.pod_labels("j", 1, 0),
                                           [naming.POD_FINALIZER, "example.dev/keep"]))
    released = release_pods(ClusterWriter(client), [ml])
    assert released == [f"{ml}/trainer"]
    assert core.read_namespaced_pod("trainer", ml).metadata.finalizers == ["example.dev/keep"]
    assert naming.POD_FINALIZER in core.read_namespaced_pod("trainer", lab).metadata.finalizers
    assert f"{lab}/trainer" in release_pods(ClusterWriter(client), None)
    assert core.read_namespaced_pod("trainer", lab).metadata.finalizers == ["example.dev/keep"]


def test_stop_deployment_scales_to_zero_and_waits_for_its_own_pods_only(shared_api):
    """Against kube-controller-manager's Deployment and ReplicaSet controllers: the pods they
    made are waited for (one held by a finalizer keeps the wait going), a pod that only
    shares the labels (the hook's own) is not."""
    client = shared_api.api
    apps = kubernetes.client.AppsV1Api(client)
    core = kubernetes.client.CoreV1Api(client)
    ns = shared_api.new_namespace("uninstall")
    spec = {"replicas": 2, "selector": {"matchLabels": LABELS}, "template": {
        "metadata": {"labels": LABELS},
        "spec": {"containers": [{"name": "operator", "image": "tardigrade-operator"}]}}}
    apps.create_namespaced_deployment(ns, {"metadata": {"name": "t"}, "spec": spec})
    selector = ",".join(f"{k}={v}" for k, v in LABELS.items())

    def both_pods() -> list | None:
        pods = core.list_namespaced_pod(ns, label_selector=selector).items
        return pods if len(pods) == 2 else None

    held = wait_for(both_pods, 30, "the ReplicaSet controller to create the Deployment's "
                    "pods")[0].metadata.name
    core.patch_namespaced_pod(held, ns, {"metadata": {"finalizers": [HOLD]}})
    # The hook's own pod may share the labels; it is not the Deployment's and is not waited for.
    core.create_namespaced_pod(ns, pod("hook", ns, LABELS, []))
    with pytest.raises(TimeoutError, match=rf"running after 3 s: {held}$"):
        stop_deployment(apps, core, ns, "t", timeout=3)
    assert apps.read_namespaced_deployment("t", ns).spec.replicas == 0
    core.patch_namespaced_pod(held, ns, {"metadata": {"finalizers": None}})
    stop_deployment(apps, core, ns, "t", timeout=30)
    stop_deployment(apps, core, ns, "absent", timeout=2)  # already gone: nothing to stop
