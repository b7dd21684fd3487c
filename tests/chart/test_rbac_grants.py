"""The chart grants exactly what `grants.GRANTS` lists, and the operator needs no more.

The table states, for each grant, the call that needs it; the chart e2e tests (here for the
namespaced mode, in test_helm.py for the cluster-wide one) run the operator under the
chart's ServiceAccount with RBAC enforced and fail on any denial.
"""

from __future__ import annotations

import pytest
import yaml
from tardigrade_local.cluster import LocalCluster

from tests.chart import grants
from tests.chart.test_helm import render
from tests.e2e.harness import NAMESPACE, Cluster, trainingjob, wait_for

ACCOUNT = "tardigrade"
RELEASE_NAMESPACE = "tardigrade-system"


@pytest.mark.parametrize("config", sorted(grants.CONFIGS))
def test_chart_grants_exactly_the_table(config):
    granted = grants.rendered_grants(render(*grants.CONFIGS[config]), ACCOUNT,
                                     RELEASE_NAMESPACE)
    expected = grants.expected_grants(config)
    assert not granted - expected, (
        f"the chart grants what GRANTS does not explain: {sorted(granted - expected)}")
    assert not expected - granted, (
        f"GRANTS lists what the chart does not grant: {sorted(expected - granted)}")


def test_every_grant_names_its_call():
    keys = [(g.group, g.resource, g.verb, g.scope) for g in grants.GRANTS]
    assert len(keys) == len(set(keys))
    for grant in grants.GRANTS:
        assert grant.needed_by.strip() and grant.configs <= set(grants.CONFIGS), grant
        assert grant.scope in (grants.CLUSTER, grants.JOBS), grant


def test_unused_grants_are_gone():
    """The issue's list: nothing grants `update` on trainingjobs, `get` on the watched kinds
    the operator only lists, or anything in events.k8s.io."""
    granted = {(g, r, v) for config in grants.CONFIGS for _, g, r, v in
               grants.rendered_grants(render(*grants.CONFIGS[config]), ACCOUNT,
                                      RELEASE_NAMESPACE)}
    assert ("tardigrade.dev", "trainingjobs", "update") not in granted
    assert not {r for g, r, v in granted if g == "events.k8s.io"}
    for group, resource in [("apiextensions.k8s.io", "customresourcedefinitions"),
                            ("", "namespaces"), ("", "nodes"), ("", "services"),
                            ("kopf.dev", "clusterkopfpeerings"), ("kopf.dev", "kopfpeerings"),
                            ("tardigrade.dev", "trainingjobs/status")]:
        assert (group, resource, "get") not in granted, resource
    assert ("tardigrade.dev", "trainingjobs/finalizers", "update") in granted


@pytest.mark.slow
def test_namespaced_chart_runs_a_job_under_its_role(tmp_path):
    """watch.namespaces mode: a Role in the jobs' namespace, no cluster-wide job grants; the
    in-pod operator (one replica, with peering) runs a job there and is denied nothing."""
    values = ("watch.allNamespaces=false", f"watch.namespaces={{{NAMESPACE}}}",
              "replicaCount=1")
    docs = render(*values, namespace=RELEASE_NAMESPACE)
    with LocalCluster(tmp_path / "cluster", nodes=1) as local:
        cluster = Cluster(local, trainer_token_review=False)
        cluster.kubectl("create", "namespace", RELEASE_NAMESPACE)
        cluster.kubectl("apply", "-f", "-", stdin=yaml.safe_dump_all(docs))
        cluster.kubectl("-n", RELEASE_NAMESPACE, "rollout", "status", "deployment/tardigrade",
                        "--timeout=120s")
        cluster.apply(trainingjob("ns-smoke", steps=2, replicas=1))
        try:
            cluster.wait_phase("ns-smoke", {"Succeeded"}, timeout=300)
        except AssertionError as err:
            logs = cluster.kubectl("-n", RELEASE_NAMESPACE, "logs", "--tail=60",
                                   "deployment/tardigrade", check=False)
            denied = grants.denials(grants.audited_calls(
                local.layout.audit_log, f"system:serviceaccount:{RELEASE_NAMESPACE}:{ACCOUNT}"))
            raise AssertionError(f"{err}\ndenied: {denied}\n{logs}") from None
        used = grants.check_operator_calls(local.layout.audit_log, ACCOUNT, RELEASE_NAMESPACE,
                                           grants.NAMESPACED)
        # The job's own calls were made in its namespace, under the Role.
        assert ("tardigrade.dev", "trainingjobs/status", "patch") in used
        assert ("", "pods", "create") in used
        # Nodes are cluster-scoped: kopf watches them cluster-wide, under the nodes ClusterRole.
        assert {("", "nodes", "list"), ("", "nodes", "watch")} <= used


@pytest.mark.slow
def test_chart_operator_queues_a_job_through_real_kueue_under_its_role(tmp_path):
    """With Kueue installed, the in-pod operator under the chart's ClusterRole creates the
    job's Workload, reads the flavors and the priority class, runs the admitted gang and
    marks the Workload Finished, and is denied nothing."""
    docs = render("replicaCount=1", namespace=RELEASE_NAMESPACE)
    with LocalCluster(tmp_path / "cluster", nodes=1, kueue=True) as local:
        cluster = Cluster(local, trainer_token_review=False)
        kueue = ("kueue.x-k8s.io", "v1beta2")
        meta = {"apiVersion": "kueue.x-k8s.io/v1beta2"}
        cluster.custom.create_cluster_custom_object(*kueue, "resourceflavors", {
            **meta, "kind": "ResourceFlavor", "metadata": {"name": "default"}})
        cluster.custom.create_cluster_custom_object(*kueue, "workloadpriorityclasses", {
            **meta, "kind": "WorkloadPriorityClass", "metadata": {"name": "low"}, "value": 10})
        cluster.custom.create_cluster_custom_object(*kueue, "clusterqueues", {
            **meta, "kind": "ClusterQueue", "metadata": {"name": "team"},
            "spec": {"namespaceSelector": {}, "resourceGroups": [{
                "coveredResources": ["cpu", "memory"],
                "flavors": [{"name": "default", "resources": [
                    {"name": "cpu", "nominalQuota": "4"},
                    {"name": "memory", "nominalQuota": "16Gi"}]}]}]}})
        cluster.custom.create_namespaced_custom_object(*kueue, NAMESPACE, "localqueues", {
            **meta, "kind": "LocalQueue", "metadata": {"name": "team", "namespace": NAMESPACE},
            "spec": {"clusterQueue": "team"}})
        cluster.kubectl("create", "namespace", RELEASE_NAMESPACE)
        cluster.kubectl("apply", "-f", "-", stdin=yaml.safe_dump_all(docs))
        cluster.kubectl("-n", RELEASE_NAMESPACE, "rollout", "status", "deployment/tardigrade",
                        "--timeout=120s")
        job = trainingjob("queued-smoke", steps=2, replicas=1)
        job["metadata"]["labels"] = {"kueue.x-k8s.io/queue-name": "team",
                                     "kueue.x-k8s.io/priority-class": "low"}
        cluster.apply(job)
        cluster.wait_phase("queued-smoke", {"Succeeded"}, timeout=300)

        def finished() -> dict | None:
            workloads = cluster.custom.list_namespaced_custom_object(
                *kueue, NAMESPACE, "workloads",
                label_selector="tardigrade.dev/job=queued-smoke")["items"]
            return next((w for w in workloads if any(
                c["type"] == "Finished" and c["status"] == "True"
                for c in (w.get("status") or {}).get("conditions") or [])), None)

        workload = wait_for(finished, timeout=60, what="the Workload marked Finished",
                            interval=0.5)
        assert workload["spec"]["priority"] == 10
        expected = {("kueue.x-k8s.io", "workloads", "create"),
                    ("kueue.x-k8s.io", "workloads/status", "update"),
                    ("kueue.x-k8s.io", "resourceflavors", "list"),
                    ("kueue.x-k8s.io", "workloadpriorityclasses", "get")}
        # kube-apiserver writes a request's audit event at ResponseComplete, after the
        # response: the Finished write can be read back before its line is in the log.
        wait_for(lambda: expected <= grants.check_operator_calls(
            local.layout.audit_log, ACCOUNT, RELEASE_NAMESPACE, grants.ALL_NAMESPACES),
            timeout=30, what="the operator's Workload writes in the audit log", interval=0.5)
