"""The Helm chart, with the real helm binary, applied to the local cluster with kubectl."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from tardigrade_local.cluster import LocalCluster

from tests.conftest import REPO_ROOT, SOURCE_DIRS
from tests.e2e.harness import Cluster, trainingjob, wait_for

CHART = REPO_ROOT / "charts" / "tardigrade"
CUSTOM_KINDS = {"ClusterKopfPeering", "KopfPeering", "ServiceMonitor"}


def _helm() -> str:
    found = shutil.which("helm") or str(REPO_ROOT / ".ci" / "cache" / "helm")
    if not Path(found).exists():
        pytest.fail("no helm binary: run .ci/install-kube-clients.sh .ci/cache")
    return found


def helm(*args: str) -> str:
    result = subprocess.run([_helm(), *args], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout


def render(*values: str, namespace: str = "tardigrade-system") -> list[dict]:
    args = ["template", "tardigrade", str(CHART), "--namespace", namespace]
    for value in values:
        args += ["--set", value]
    return [doc for doc in yaml.safe_load_all(helm(*args)) if doc]


def test_helm_lint():
    assert "0 chart(s) failed" in helm("lint", str(CHART))


@pytest.mark.parametrize("values", [(), ("watch.allNamespaces=false", "watch.namespaces={ml,lab}"),
                                    ("leaderElection.enabled=false", "metrics.enabled=false",
                                     "metrics.serviceMonitor.enabled=true")])
def test_rendered_manifests_are_valid_kubernetes(values):
    version = kubernetes_validate.latest_version()
    docs = render(*values)
    for doc in docs:
        if doc["kind"] not in CUSTOM_KINDS:
            kubernetes_validate.validate(doc, version, strict=True)
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"


def test_namespaced_mode_grants_only_namespaced_roles():
    docs = render("watch.allNamespaces=false", "watch.namespaces={ml,lab}")
    roles = [d for d in docs if d["kind"] == "Role"]
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["lab", "ml"]
    cluster_roles = [d for d in docs if d["kind"] == "ClusterRole"]
    assert [r["metadata"]["name"] for r in cluster_roles] == ["tardigrade-discovery"]
    cluster_rules = cluster_roles[0]["rules"]
    assert all("pods" not in rule["resources"] for rule in cluster_rules)
    assert all("nodes" not in rule["resources"] for rule in cluster_rules)
    args = next(d for d in docs if d["kind"] == "Deployment")[
        "spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=ml" in args and "--all-namespaces" not in args


def test_values_schema_rejects_bad_values():
    result = subprocess.run([_helm(), "template", "t", str(CHART), "--set", "logLevel=loud"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "logLevel" in result.stderr


@pytest.mark.slow
def test_rendered_chart_applies_and_its_operator_command_works(tmp_path):
    docs = render()
    with LocalCluster(tmp_path / "cluster", nodes=2) as local:
        cluster = Cluster(local)
        cluster.kubectl("create", "namespace", "tardigrade-system")
        applied = cluster.kubectl("apply", "-f", "-", stdin=yaml.safe_dump_all(docs))
        for kind in ("serviceaccount/tardigrade", "clusterrole.rbac.authorization.k8s.io/"
                     "tardigrade", "deployment.apps/tardigrade",
                     "clusterkopfpeering.kopf.dev/tardigrade"):
            assert kind in applied, applied
        # No controller turns the Deployment into a pod here: run its container's command
        # line and environment as that pod would, with the chart's ServiceAccount rights
        # standing in for the in-cluster credentials.
        deployment = next(d for d in docs if d["kind"] == "Deployment")
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        env = {**os.environ, **local.client_env(),
               "PYTHONPATH": os.pathsep.join(str(p) for p in SOURCE_DIRS)}
        env.update({e["name"]: e["value"] for e in container["env"]})
        env["TARDIGRADE_METRICS_PORT"] = "0"
        args = [a for a in container["args"] if not a.startswith("--health-port")]
        log = (tmp_path / "operator.log").open("wb")
        operator = subprocess.Popen([sys.executable, "-m", "tardigrade_operator.cli", *args,
                                     "--health-port=0"], env=env, stdout=log,
                                    stderr=subprocess.STDOUT)
        try:
            job = trainingjob("chart-smoke", steps=3, replicas=1)
            cluster.apply(job)
            wait_for(lambda: cluster.status("chart-smoke").get("phase") == "Succeeded", 300,
                     "the job to succeed under the chart's operator")
        finally:
            operator.terminate()
            operator.wait(30)
            log.close()
        assert "--peering=tardigrade" in args
