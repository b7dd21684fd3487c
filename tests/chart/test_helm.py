"""The Helm chart, with the real helm binary, applied to the local cluster with kubectl."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from tardigrade_local.cluster import LocalCluster

from tests.chart import grants
from tests.conftest import REPO_ROOT
from tests.e2e.harness import Cluster, trainingjob

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


def render(*values: str, namespace: str = "tardigrade-system", hooks: bool = False
           ) -> list[dict]:
    """The chart's manifests. Hooks (the uninstall hook) run only under helm itself, never
    when the output is applied with kubectl, so they are left out unless asked for."""
    args = ["template", "tardigrade", str(CHART), "--namespace", namespace]
    if not hooks:
        args.append("--no-hooks")
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


def test_namespaced_mode_grants_only_namespaced_roles_and_reading_nodes():
    docs = render("watch.allNamespaces=false", "watch.namespaces={ml,lab}")
    roles = [d for d in docs if d["kind"] == "Role"]
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["lab", "ml"]
    cluster_roles = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ClusterRole"}
    assert sorted(cluster_roles) == ["tardigrade-discovery", "tardigrade-nodes",
                                     "tardigrade-trainer-tokenreview"]
    # TokenReview is cluster-scoped: the trainers' one grant, bound to the ServiceAccounts
    # trainers may run as (admission.serviceAccounts) in the watched namespaces only.
    assert cluster_roles["tardigrade-trainer-tokenreview"]["rules"] == [
        {"apiGroups": ["authentication.k8s.io"], "resources": ["tokenreviews"],
         "verbs": ["create"]}]
    binding = next(d for d in docs if d["kind"] == "ClusterRoleBinding"
                   and d["metadata"]["name"] == "tardigrade-trainer-tokenreview")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "default", "namespace": ns}
                                   for ns in ("ml", "lab")]
    assert not any(d["metadata"]["name"] == "tardigrade-tokenreview-subjects" for d in docs)
    assert all("pods" not in rule["resources"] and "nodes" not in rule["resources"]
               for rule in cluster_roles["tardigrade-discovery"]["rules"])
    # Nodes are cluster-scoped: read-only, through a ClusterRole bound to the operator.
    assert cluster_roles["tardigrade-nodes"]["rules"] == [
        {"apiGroups": [""], "resources": ["nodes"], "verbs": ["list", "watch"]}]
    binding = next(d for d in docs if d["kind"] == "ClusterRoleBinding"
                   and d["roleRef"]["name"] == "tardigrade-nodes")
    assert binding["subjects"][0]["name"] == "tardigrade"
    container = next(d for d in docs if d["kind"] == "Deployment")[
        "spec"]["template"]["spec"]["containers"][0]
    assert "--namespace=ml" in container["args"] and "--all-namespaces" not in container["args"]
    assert {"name": "TARDIGRADE_WATCH_NODES", "value": "true"} in container["env"]


def test_values_schema_rejects_bad_values():
    result = subprocess.run([_helm(), "template", "t", str(CHART), "--set", "logLevel=loud"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "logLevel" in result.stderr


def test_checkpoint_prefix_rule_reaches_the_operator_and_bad_ones_are_refused():
    docs = render("operator.checkpointPathPrefix=gs://ml-checkpoints/{namespace}/")
    env = next(d for d in docs if d["kind"] == "Deployment")[
        "spec"]["template"]["spec"]["containers"][0]["env"]
    assert {"name": "TARDIGRADE_CHECKPOINT_PATH_PREFIX",
            "value": "gs://ml-checkpoints/{namespace}/"} in env
    # Without {namespace}, every namespace would share one prefix: refused at install.
    result = subprocess.run([_helm(), "template", "t", str(CHART), "--set",
                             "operator.checkpointPathPrefix=gs://ml-checkpoints/"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "checkpointPathPrefix" in result.stderr


def _operator_pods(cluster: Cluster, selector: str) -> list[dict]:
    pods = cluster.core.list_namespaced_pod("tardigrade-system", label_selector=selector).items
    return [cluster.core.api_client.sanitize_for_serialization(p) for p in pods]


@pytest.mark.slow
def test_chart_installs_into_the_local_cluster_and_its_operator_runs_jobs(tmp_path):
    """helm template | kubectl apply, as on a real cluster: the Deployment controller starts
    the operator pods from the chart's image, the kubelet gives them API credentials, and
    the in-pod operator (no other runs here) reconciles a TrainingJob."""
    docs = render()
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    selector = ",".join(f"{k}={v}" for k, v in
                        deployment["spec"]["selector"]["matchLabels"].items())
    with LocalCluster(tmp_path / "cluster", nodes=2) as local:
        assert local.config.operator_command is None
        cluster = Cluster(local, trainer_token_review=False)
        cluster.kubectl("create", "namespace", "tardigrade-system")
        applied = cluster.kubectl("apply", "-f", "-", stdin=yaml.safe_dump_all(docs))
        for kind in ("serviceaccount/tardigrade", "clusterrole.rbac.authorization.k8s.io/"
                     "tardigrade", "deployment.apps/tardigrade",
                     "clusterkopfpeering.kopf.dev/tardigrade"):
            assert kind in applied, applied
        try:
            # Available needs every pod Ready: the readiness probe on /healthz passed.
            cluster.kubectl("-n", "tardigrade-system", "rollout", "status",
                            "deployment/tardigrade", "--timeout=120s")
        except AssertionError as err:
            logs = cluster.kubectl("-n", "tardigrade-system", "logs", "--tail=40",
                                   "-l", selector, check=False)
            raise AssertionError(f"{err}\n{logs}") from None
        replicas = deployment["spec"]["replicas"]
        pods = _operator_pods(cluster, selector)
        assert len(pods) == replicas
        for pod in pods:
            assert pod["metadata"]["ownerReferences"][0]["kind"] == "ReplicaSet"
            assert pod["metadata"]["labels"]["pod-template-hash"]
            assert {"type": "Ready", "status": "True"}.items() <= next(
                c for c in pod["status"]["conditions"] if c["type"] == "Ready").items()

        job = trainingjob("chart-smoke", steps=3, replicas=1)
        cluster.apply(job)
        cluster.wait_phase("chart-smoke", {"Succeeded"}, timeout=300)
        assert [p.metadata.name for p in cluster.pods("chart-smoke")] == ["chart-smoke-a1-0"]
        # Both replicas reached the API from inside their pods: kopf registered each in the
        # chart's peering object under its host name, which is the pod's name.
        peering = cluster.custom.get_cluster_custom_object(
            "kopf.dev", "v1", "clusterkopfpeerings", "tardigrade")
        peers = {key.split("@", 1)[1].split("/", 1)[0] for key in peering.get("status") or {}}
        assert peers == {p["metadata"]["name"] for p in pods}, peering
        # It did so under the chart's ServiceAccount and RBAC, and nothing was denied.
        grants.check_operator_calls(local.layout.audit_log, "tardigrade", "tardigrade-system",
                                    grants.ALL_NAMESPACES)
        # Liveness held too: no operator container was restarted along the way.
        assert [c["restartCount"] for p in _operator_pods(cluster, selector)
                for c in p["status"]["containerStatuses"]] == [0] * replicas
