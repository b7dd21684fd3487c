"""Deployments on the local cluster, driven with the real kubectl (current and 1.20)."""

from __future__ import annotations

import pytest
import yaml
from api_helpers import require_kubectls
from kube_helpers import Kube
from tardigrade_local.cluster import LocalCluster

from tests.e2e.harness import Cluster
from tests.polling import wait_for

pytestmark = pytest.mark.slow

WEB = {
    "apiVersion": "apps/v1", "kind": "Deployment",
    "metadata": {"name": "web", "namespace": "default"},
    "spec": {
        "replicas": 2,
        "selector": {"matchLabels": {"app": "web"}},
        "template": {
            "metadata": {"labels": {"app": "web"}},
            "spec": {"terminationGracePeriodSeconds": 2, "containers": [{
                "name": "web", "image": "local/python",
                "command": ["python", "-m", "http.server", "8000"],
                "ports": [{"name": "http", "containerPort": 8000}],
                "readinessProbe": {"httpGet": {"path": "/", "port": "http"},
                                   "periodSeconds": 1}}]},
        },
    },
}


def test_deployment_rolls_out_scales_replaces_pods_and_updates(tmp_path):
    binaries = [str(p) for p in require_kubectls()]
    with LocalCluster(tmp_path / "cluster", nodes=1, with_gcs=False) as local:
        cluster = Cluster(local)
        kube = Kube(str(local.kubeconfig))

        def pods() -> list[dict]:
            items = kube.core.list_namespaced_pod("default", label_selector="app=web").items
            return [kube.plain(p) for p in items if p.metadata.deletion_timestamp is None]

        def rollout(binary: str = "kubectl") -> None:
            result = cluster.kubectl("rollout", "status", "deployment/web", "--timeout=60s",
                                     binary=binary)
            assert 'deployment "web" successfully rolled out' in result

        cluster.apply(WEB)
        for binary in binaries:  # current and 1.20
            rollout(binary)
            cluster.kubectl("wait", "--for=condition=Available", "deployment/web",
                            "--timeout=30s", binary=binary)
        first = pods()
        assert len(first) == 2
        rs_name = first[0]["metadata"]["ownerReferences"][0]["name"]
        assert rs_name == f"web-{first[0]['metadata']['labels']['pod-template-hash']}"
        assert all(p["metadata"]["name"].startswith(f"{rs_name}-") for p in first)

        # A deleted pod is replaced.
        victim = first[0]["metadata"]["name"]
        cluster.kubectl("delete", "pod", victim, "--wait=false")
        wait_for(lambda: len(pods()) == 2 and victim not in {p["metadata"]["name"]
                                                              for p in pods()},
                 30, "a replacement pod")
        rollout()

        cluster.kubectl("scale", "deployment/web", "--replicas=3")
        rollout()
        assert len(pods()) == 3

        # A template change rolls out through a new ReplicaSet; the old one is kept at 0.
        cluster.kubectl("set", "env", "deployment/web", "COLOUR=blue")
        rollout()
        sets = yaml.safe_load(cluster.kubectl("get", "rs", "-l", "app=web", "-o", "yaml"))
        replicas = {rs["metadata"]["name"]: rs["spec"]["replicas"] for rs in sets["items"]}
        new_name = next(n for n in replicas if n != rs_name)
        assert replicas == {rs_name: 0, new_name: 3}
        wait_for(lambda: {p["metadata"]["labels"]["pod-template-hash"] for p in pods()}
                 == {new_name.removeprefix("web-")} and len(pods()) == 3, 30, "only new pods")
        deploy = yaml.safe_load(cluster.kubectl("get", "deployment/web", "-o", "yaml"))
        assert deploy["metadata"]["annotations"]["deployment.kubernetes.io/revision"] == "2"
        assert deploy["status"]["observedGeneration"] == deploy["metadata"]["generation"]
        # The API server's apps/v1 defaults, which the rollout followed.
        assert deploy["spec"]["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {
            "maxSurge": "25%", "maxUnavailable": "25%"}}
        assert deploy["spec"]["progressDeadlineSeconds"] == 600
        described = cluster.kubectl("describe", "deployment/web")
        assert f"NewReplicaSet:   {new_name} (3/3 replicas created)" in described

        # Deleting the Deployment takes its ReplicaSets and pods with it (garbage collector).
        cluster.kubectl("delete", "deployment/web")
        wait_for(lambda: not cluster.kubectl("get", "rs,pods", "-l", "app=web", "-o",
                                             "name").strip(), 60, "rs and pods gone")
