"""The Helm chart, with the real helm binary: rendered and validated, and applied with kubectl
to a local cluster of real nodes, its operator image from the cluster's registry."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes
import kubernetes_validate
import pytest
import yaml
from tardigrade_local.realcluster import OPERATOR_NAMESPACE, SPOT_LABEL

from tests.chart import grants
from tests.conftest import REPO_ROOT
from tests.e2e.harness import (
    NEEDS_REAL_NODES,
    OPERATOR_READY_SECONDS,
    RealCluster,
    real_cluster,
    wait_for,
)

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


def render(*values: str, namespace: str = "tardigrade-system", hooks: bool = False,
           include_crds: bool = False) -> list[dict]:
    """The chart's manifests. Hooks (the uninstall hook) run only under helm itself, never
    when the output is applied with kubectl, so they are left out unless asked for; so are
    the chart's crds/ files (kopf's peering CRDs), which helm installs on its own."""
    args = ["template", "tardigrade", str(CHART), "--namespace", namespace]
    if not hooks:
        args.append("--no-hooks")
    if include_crds:
        args.append("--include-crds")
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


SYSTEM = OPERATOR_NAMESPACE
# The trainer image's first pull on the spot node, JAX's start and compile, on a machine other
# test runs share.
JOB_TIMEOUT_SECONDS = 600.0


@pytest.fixture(scope="module")
def real_nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealCluster]:
    """One on-demand node (the operator's), one spot node (the trainer's), the registry with
    our images."""
    with real_cluster(tmp_path_factory.mktemp("helm"), 1) as running:
        yield running


def _operator_pods(cluster: RealCluster, selector: str) -> list[dict[str, Any]]:
    pods = cluster.core.list_namespaced_pod(SYSTEM, label_selector=selector).items
    return [cluster.core.api_client.sanitize_for_serialization(p) for p in pods
            if p.metadata.deletion_timestamp is None]


def _registry_digest(cluster: RealCluster, reference: str) -> str:
    """`<registry>/<repository>@<digest>`: the imageID the kubelet reports for a pull."""
    host = cluster.real.registry.host
    repository, tag = reference.removeprefix(f"{host}/").rsplit(":", 1)
    _, digest = cluster.real.registry.manifest(repository, tag)
    return f"{host}/{repository}@{digest}"


@pytest.mark.slow
# The module's cluster start, the image pulls and the waits, on a machine other runs share.
@pytest.mark.timeout(1200)
@NEEDS_REAL_NODES
def test_chart_installs_onto_real_nodes_and_its_operator_runs_jobs(real_nodes: RealCluster):
    """helm template | kubectl apply, as on a real cluster (CRDs first, then the rest): the
    Deployment controller starts the operator pods, the real kubelet pulls the chart's
    image from the registry and gives the pods API credentials, and the in-pod operator (no
    other runs here) reconciles a TrainingJob whose trainer runs on the spot node."""
    cluster = real_nodes
    repository, tag = cluster.real.images["operator"].rsplit(":", 1)
    docs = render(f"image.repository={repository}", f"image.tag={tag}", include_crds=True)
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    selector = ",".join(f"{k}={v}" for k, v in
                        deployment["spec"]["selector"]["matchLabels"].items())
    crds = [d for d in docs if d["kind"] == "CustomResourceDefinition"]
    rest = [d for d in docs if d["kind"] != "CustomResourceDefinition"]
    cluster.kubectl("create", "namespace", SYSTEM)
    applied = cluster.kubectl("apply", "-f", "-", stdin=yaml.safe_dump_all(crds))
    # The chart's own CRDs: the TrainingJob's (a template) and kopf's peering (crds/).
    for name in ("trainingjobs.tardigrade.dev", "clusterkopfpeerings.kopf.dev"):
        assert f"customresourcedefinition.apiextensions.k8s.io/{name}" in applied, applied
    cluster.kubectl("wait", "--for=condition=Established", "--timeout=120s",
                    *(f"crd/{d['metadata']['name']}" for d in crds))
    applied = cluster.kubectl("apply", "-f", "-", stdin=yaml.safe_dump_all(rest))
    for kind in ("serviceaccount/tardigrade", "clusterrole.rbac.authorization.k8s.io/"
                 "tardigrade", "deployment.apps/tardigrade",
                 "clusterkopfpeering.kopf.dev/tardigrade"):
        assert kind in applied, applied
    replicas = deployment["spec"]["replicas"]
    apps = kubernetes.client.AppsV1Api(cluster.core.api_client)

    def rolled_out() -> bool:
        # What `kubectl rollout status` waits for: every replica updated and Available, which
        # needs every pod Ready (the readiness probe on /healthz passed).
        found = apps.read_namespaced_deployment("tardigrade", SYSTEM)
        status = found.status
        return (status.observed_generation or 0) >= found.metadata.generation and all(
            (n or 0) == replicas for n in (status.updated_replicas, status.available_replicas,
                                           status.ready_replicas, status.replicas))

    try:
        wait_for(rolled_out, OPERATOR_READY_SECONDS, "the operator's Deployment rolled out",
                 interval=1)
    except AssertionError as err:
        logs = cluster.kubectl("-n", SYSTEM, "logs", "--tail=40", "-l", selector, check=False)
        described = cluster.kubectl("-n", SYSTEM, "describe", "pods", "-l", selector,
                                    check=False)
        raise AssertionError(f"{err}\n{logs}\n{described[-4000:]}") from None
    pods = _operator_pods(cluster, selector)
    assert len(pods) == replicas
    digest = _registry_digest(cluster, cluster.real.images["operator"])
    for pod in pods:
        assert pod["metadata"]["ownerReferences"][0]["kind"] == "ReplicaSet"
        assert pod["metadata"]["labels"]["pod-template-hash"]
        assert {"type": "Ready", "status": "True"}.items() <= next(
            c for c in pod["status"]["conditions"] if c["type"] == "Ready").items()
        # A container of the registry's operator image, run by containerd...
        [status] = pod["status"]["containerStatuses"]
        assert status["containerID"].startswith("containerd://"), status
        assert status["imageID"] == digest, status
        # ...on the on-demand node: the chart keeps the operator off spot nodes.
        labels = cluster.core.read_node(pod["spec"]["nodeName"]).metadata.labels or {}
        assert labels.get(SPOT_LABEL) != "true", pod["spec"]["nodeName"]

    cluster.apply(cluster.trainingjob("chart-smoke", steps=3, replicas=1))
    cluster.wait_phase("chart-smoke", {"Succeeded"}, timeout=JOB_TIMEOUT_SECONDS)
    status = cluster.status("chart-smoke")
    # One gang, launched once, never restarted: one pod, chart-smoke-a1-0.
    assert (status["attempt"], status["restarts"]["total"]) == (1, 0), status
    assert {p.metadata.name for p in cluster.pods("chart-smoke")} <= {"chart-smoke-a1-0"}
    # Both replicas reached the API from inside their pods: kopf registered each in the
    # chart's peering object under its host name, which is the pod's name.
    names = {p["metadata"]["name"] for p in pods}

    def peers() -> set[str]:
        peering = cluster.custom.get_cluster_custom_object(
            "kopf.dev", "v1", "clusterkopfpeerings", "tardigrade")
        return {key.split("@", 1)[1].split("/", 1)[0] for key in peering.get("status") or {}}

    wait_for(lambda: peers() == names, 120, f"both replicas {sorted(names)} in the peering",
             interval=1)
    # It did so under the chart's ServiceAccount and RBAC, and nothing was denied.
    grants.check_operator_calls(cluster.local.layout.audit_log, "tardigrade", SYSTEM,
                                grants.ALL_NAMESPACES)
    # Liveness held too: no operator container was restarted along the way, and the pods
    # are the ones that rolled out.
    after = _operator_pods(cluster, selector)
    assert {p["metadata"]["uid"] for p in after} == {p["metadata"]["uid"] for p in pods}
    assert [c["restartCount"] for p in after
            for c in p["status"]["containerStatuses"]] == [0] * replicas
