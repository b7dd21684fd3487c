"""What the chart's values render to: CRD, disruption budget, placement, names, NOTES."""

from __future__ import annotations

import json
import subprocess

import kubernetes_validate
import pytest
import yaml

from tests.chart.test_helm import CHART, _helm, render
from tests.conftest import CRD_FILE

OFF_SPOT = [{"key": "cloud.google.com/gke-spot", "operator": "NotIn", "values": ["true"]},
            {"key": "cloud.google.com/gke-preemptible", "operator": "NotIn", "values": ["true"]}]


def is_hook(doc: dict) -> bool:
    return "helm.sh/hook" in (doc["metadata"].get("annotations") or {})


def kinds(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def pod_spec(docs: list[dict]) -> dict:
    return kinds(docs, "Deployment")[0]["spec"]["template"]["spec"]


def hook_pod_spec(docs: list[dict]) -> dict:
    [pod] = [d for d in kinds(docs, "Pod") if is_hook(d)]
    return pod["spec"]


def test_crd_is_the_generated_one_owned_by_the_release_and_kept():
    [crd] = kinds(render(), "CustomResourceDefinition")
    meta = crd["metadata"]
    assert meta["annotations"] == {"helm.sh/resource-policy": "keep"}
    assert meta["labels"]["app.kubernetes.io/managed-by"] == "Helm"
    generated = yaml.safe_load(CRD_FILE.read_text())
    # Exactly the generated CRD (numbers and all survive the template round trip), plus the
    # release's labels and the keep annotation.
    assert generated["metadata"]["labels"].items() <= meta["labels"].items()
    for key in ("labels", "annotations"):
        meta.pop(key)
        generated["metadata"].pop(key, None)
    assert crd == generated


def test_crd_values():
    assert kinds(render("crds.install=false"), "CustomResourceDefinition") == []
    [crd] = kinds(render("crds.keep=false"), "CustomResourceDefinition")
    assert "annotations" not in crd["metadata"]


def test_disruption_budget_only_with_a_standby():
    [pdb] = kinds(render(), "PodDisruptionBudget")
    assert pdb["spec"]["maxUnavailable"] == 1
    deployment = kinds(render(), "Deployment")[0]
    assert pdb["spec"]["selector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]
    assert kinds(render("replicaCount=1"), "PodDisruptionBudget") == []
    assert kinds(render("podDisruptionBudget.enabled=false"), "PodDisruptionBudget") == []


@pytest.mark.parametrize("spec_of", [pod_spec, hook_pod_spec], ids=["operator", "uninstall-hook"])
def test_operator_stays_off_spot_nodes_unless_told_otherwise(spec_of):
    required = spec_of(render(hooks=True))["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]
    assert required["nodeSelectorTerms"] == [{"matchExpressions": OFF_SPOT}]
    assert "affinity" not in spec_of(render("avoidSpotNodes=false", hooks=True))
    # A nodeAffinity of the user's replaces ours; other affinity kinds sit beside it.
    mine = {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["system"]}]}]}}
    args = ["template", "t", str(CHART), "--set-json",
            f"affinity={json.dumps({'nodeAffinity': mine})}"]
    result = subprocess.run([_helm(), *args], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    docs = [d for d in yaml.safe_load_all(result.stdout) if d]
    assert spec_of(docs)["affinity"] == {"nodeAffinity": mine}


def test_priority_class_and_name_overrides():
    assert "priorityClassName" not in pod_spec(render())
    assert pod_spec(render("priorityClassName=system-cluster-critical"))[
        "priorityClassName"] == "system-cluster-critical"
    named = render("fullnameOverride=trainer-ops")
    assert kinds(named, "Deployment")[0]["metadata"]["name"] == "trainer-ops"
    assert kinds(named, "ServiceAccount")[0]["metadata"]["name"] == "trainer-ops"
    renamed = render("nameOverride=tg")
    deployment = kinds(renamed, "Deployment")[0]
    assert deployment["metadata"]["name"] == "tardigrade-tg"
    assert deployment["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"] == "tg"


def test_bad_new_values_are_refused_naming_the_value():
    for value in ("priorityClassName=Not_A_Name", "podDisruptionBudget.maxUnavailable=0",
                  "avoidSpotNodes=maybe"):
        result = subprocess.run([_helm(), "template", "t", str(CHART), "--set", value],
                                capture_output=True, text=True, timeout=60)
        assert result.returncode != 0, value
        assert value.split("=")[0].split(".")[-1] in result.stderr, result.stderr


def test_notes_say_how_to_check_the_operator_and_run_a_job():
    args = ["install", "tg", str(CHART), "-n", "ops", "--dry-run=client",
            "--set", "watch.allNamespaces=false", "--set", "watch.namespaces={ml}"]
    result = subprocess.run([_helm(), *args], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    notes = result.stdout.split("NOTES:", 1)[1]
    assert "kubectl -n ops rollout status deployment/tg-tardigrade" in notes
    assert "watching namespaces ml" in notes
    assert "kubectl apply -n ml -f examples/trainingjob.yaml" in notes


@pytest.mark.parametrize(("values", "warns"), [
    ((), True), (("image.repository=registry.example/team/tardigrade-operator",), False)])
def test_notes_warn_when_the_operator_image_is_the_docs_placeholder(values, warns):
    # Nobody publishes the images: the checkout's default names the docs' placeholder
    # registry, and `tardigrade local ship` pushes a chart naming the user's.
    args = ["install", "tg", str(CHART), "-n", "ops", "--dry-run=client"]
    for value in values:
        args += ["--set", value]
    result = subprocess.run([_helm(), *args], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    notes = result.stdout.split("NOTES:", 1)[1]
    assert ("WARNING: image.repository is the placeholder" in notes) is warns
    assert ("tardigrade local ship --registry REGISTRY" in notes) is warns


def test_uninstall_hook_grants_live_only_with_the_hook_and_only_for_it():
    docs = render("watch.allNamespaces=false", "watch.namespaces={ml,lab}", hooks=True)
    hooks = [d for d in docs if is_hook(d)]
    for doc in hooks:
        kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)
    assert {(d["kind"], d["metadata"].get("namespace")) for d in hooks} == {
        ("ServiceAccount", "tardigrade-system"), ("Pod", "tardigrade-system"),
        ("Role", "tardigrade-system"), ("RoleBinding", "tardigrade-system"),
        ("Role", "ml"), ("RoleBinding", "ml"), ("Role", "lab"), ("RoleBinding", "lab")}
    for doc in hooks:
        annotations = doc["metadata"]["annotations"]
        assert annotations["helm.sh/hook"] == "pre-delete"
        assert "hook-succeeded" in annotations["helm.sh/hook-delete-policy"]
        if doc["kind"] == "RoleBinding":
            assert doc["subjects"] == [{"kind": "ServiceAccount", "name": "tardigrade-uninstall",
                                        "namespace": "tardigrade-system"}]
    [pod] = kinds(hooks, "Pod")
    # RBAC first (lower weight), and the pod must not look like one of the operator's.
    assert int(pod["metadata"]["annotations"]["helm.sh/hook-weight"]) > max(
        int(d["metadata"]["annotations"]["helm.sh/hook-weight"]) for d in hooks if d is not pod)
    selector = kinds(docs, "Deployment")[0]["spec"]["selector"]["matchLabels"]
    assert not selector.items() <= pod["metadata"]["labels"].items()
    assert pod["spec"]["containers"][0]["args"] == [
        "operator", "release", "--deployment=tardigrade-system/tardigrade",
        "--namespace=ml", "--namespace=lab"]
    assert not [d for d in render("uninstallHook.enabled=false", hooks=True) if is_hook(d)]


def test_tenant_isolation_values_reach_the_operator():
    docs = render("admission.podSecurity=baseline",
                  "networkPolicy.metricsScraper.namespaceSelector.matchLabels.name=monitoring")
    container = pod_spec(docs)["containers"][0]
    env = {e["name"]: e for e in container["env"]}
    assert env["TARDIGRADE_POD_SECURITY"]["value"] == "baseline"
    assert env["TARDIGRADE_ALLOW_SYSTEM_SCHEDULING"]["value"] == "false"
    assert env["TARDIGRADE_NETWORK_POLICY"]["value"] == "true"
    assert json.loads(env["TARDIGRADE_METRICS_SCRAPER_NAMESPACE_SELECTOR"]["value"]) == {
        "matchLabels": {"name": "monitoring"}}
    assert "TARDIGRADE_METRICS_SCRAPER_POD_SELECTOR" not in env  # left empty: not rendered
    # The job policies let in exactly the pods this Deployment makes.
    selector = kinds(docs, "Deployment")[0]["spec"]["selector"]["matchLabels"]
    assert json.loads(env["TARDIGRADE_OPERATOR_POD_LABELS"]["value"]) == selector
    assert env["TARDIGRADE_OPERATOR_NAMESPACE"]["valueFrom"] == {
        "fieldRef": {"fieldPath": "metadata.namespace"}}


def _operator_env(docs: list[dict]) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in pod_spec(docs)["containers"][0]["env"]}


def test_admission_lists_reach_the_operator_as_the_grants_it_enforces():
    from tardigrade_operator.decision.grants import SETTINGS, Grants

    names = [env for env, _ in SETTINGS.values()]
    default = _operator_env(render())
    assert Grants.from_settings({n: default[n] for n in names}) == Grants()
    chosen = _operator_env(render("admission.serviceAccounts={default,trainer}",
                                  "admission.secrets={hf-token}",
                                  "admission.volumeTypes={emptyDir,nfs}",
                                  "admission.csiDrivers=null", "admission.priorityClasses={low}"))
    assert Grants.from_settings({n: chosen[n] for n in names}) == Grants(
        service_accounts=("default", "trainer"), secrets=("hf-token",),
        volume_types=("emptyDir", "nfs"), csi_drivers=(), priority_classes=("low",))


def test_values_schema_refuses_a_volume_type_core_v1_lacks_and_secret():
    for value in ("admission.volumeTypes={NFS}", "admission.volumeTypes={secret}",
                  "admission.serviceAccounts={../admin}"):
        result = subprocess.run([_helm(), "template", "t", str(CHART), "--set", value],
                                capture_output=True, text=True, timeout=60)
        assert result.returncode != 0 and "admission" in result.stderr, value


def test_cluster_wide_token_review_binding_is_filled_by_the_operator_alone():
    docs = render()
    binding = next(d for d in docs if d["kind"] == "ClusterRoleBinding"
                   and d["metadata"]["name"] == "tardigrade-trainer-tokenreview")
    # No group of every ServiceAccount: the operator adds each job's account.
    assert "subjects" not in binding
    assert _operator_env(docs)["TARDIGRADE_TOKEN_REVIEW_BINDING"] == binding["metadata"]["name"]
    role = next(d for d in docs if d["kind"] == "ClusterRole"
                and d["metadata"]["name"] == "tardigrade-tokenreview-subjects")
    assert all(rule["resourceNames"] == ["tardigrade-trainer-tokenreview"]
               for rule in role["rules"])
    assert sorted((r["resources"][0], v) for r in role["rules"] for v in r["verbs"]) == [
        ("clusterrolebindings", "get"), ("clusterrolebindings", "update"),
        ("clusterroles", "bind")]
    namespaced = render("watch.allNamespaces=false", "watch.namespaces={ml}")
    assert "TARDIGRADE_TOKEN_REVIEW_BINDING" not in _operator_env(namespaced)
    off = render("trainerTokenReview.enabled=false")
    assert "TARDIGRADE_TOKEN_REVIEW_BINDING" not in _operator_env(off)
    assert not [d for d in off if "tokenreview" in d["metadata"]["name"]]


def test_kueue_require_queue_name_reaches_the_operator_in_each_form():
    from tardigrade_operator.decision.queue_name_rule import ENV, QueueNameRule

    def rule(*values: str) -> QueueNameRule:
        return QueueNameRule.parse(_operator_env(render(*values))[ENV])

    assert rule() == QueueNameRule()
    assert rule("kueue.requireQueueName=true") == QueueNameRule(everywhere=True)
    assert rule("kueue.requireQueueName={team-a,team-b}") == QueueNameRule(
        namespaces=frozenset({"team-a", "team-b"}))


def test_values_schema_refuses_a_require_queue_name_that_is_no_bool_nor_namespaces():
    for value in ("kueue.requireQueueName=maybe", "kueue.requireQueueName={Team_A}"):
        result = subprocess.run([_helm(), "template", "t", str(CHART), "--set", value],
                                capture_output=True, text=True, timeout=60)
        assert result.returncode != 0, value
        assert "requireQueueName" in result.stderr, result.stderr
