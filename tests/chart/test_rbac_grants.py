"""The chart grants exactly what `grants.GRANTS` lists, and the operator needs no more.

The table states, for each grant, the call that needs it; the chart e2e tests (here for the
namespaced mode and for Kueue's kinds, in test_helm.py for the cluster-wide one) install the
chart with helm, its operator from the registry's image on a real node under the chart's
ServiceAccount with RBAC enforced, and fail on any denial. One cluster (Kueue's manager, one
on-demand node, one spot node for the trainers) for the module: each test installs the chart,
reads the audit log from its install on, and uninstalls it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime

import pytest
from tardigrade_local.realcluster import INSTALL_TIMEOUT, OPERATOR_RELEASE

from tests.chart import grants
from tests.chart.test_helm import CHART, render
from tests.e2e.harness import (
    NAMESPACE,
    NEEDS_REAL_NODES,
    OPERATOR_SELECTOR,
    RealCluster,
    real_cluster,
    wait_for,
)

ACCOUNT = "tardigrade"
RELEASE_NAMESPACE = "tardigrade-system"
# The trainer image's first pull on the spot node, JAX's start and compile, on a machine other
# test runs share.
JOB_TIMEOUT_SECONDS = 600.0
# The module's cluster start (in the first test), an install, the image pull and the waits, on
# a machine other runs share.
REAL_NODES_TIMEOUT = pytest.mark.timeout(1200)


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


def _audited(code: int, at: str, message: str = "", name: str = "job-keys") -> dict:
    return {"verb": "create", "requestReceivedTimestamp": f"2026-12-07T07:22:{at}Z",
            "objectRef": {"resource": "secrets", "namespace": "default", "name": name},
            "annotations": {"authorization.k8s.io/decision": "allow"},
            "responseStatus": {"code": code, "message": message}}


def test_a_refusal_is_a_denial_unless_it_is_the_servers_restmapper_lag_and_passed_later():
    lag = (f'secrets "job-keys" is forbidden: cannot set blockOwnerDeletion in this case because '
           f'{grants.RESTMAPPER_LAG}v1alpha1 Kind TrainingJob: no matches for kind')
    finalizers = ('secrets "job-keys" is forbidden: cannot set blockOwnerDeletion if an '
                  'ownerReference refers to a resource you can\'t set finalizers on')
    assert grants.denials([_audited(403, "10.0", lag), _audited(201, "12.0")]) == []
    # Never passed, passed before it, or passed for another object: still a denial.
    assert grants.denials([_audited(403, "10.0", lag)])
    assert grants.denials([_audited(201, "09.0"), _audited(403, "10.0", lag)])
    assert grants.denials([_audited(403, "10.0", lag), _audited(201, "12.0", name="other")])
    # A refusal for any other reason counts, passed later or not.
    assert grants.denials([_audited(403, "10.0", finalizers), _audited(201, "12.0")])


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


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealCluster]:
    with real_cluster(tmp_path_factory.mktemp("rbac"), 1, kueue=True) as running:
        yield running


@contextmanager
def chart_installed(cluster: RealCluster, *values: str) -> Iterator[datetime]:
    """`helm install` of the chart with `values` (`k=v`) and the registry's operator image,
    waiting for its pod; yields when the install began (the audit log's calls from then on
    are this install's). Uninstalled after, the operator's pods gone."""
    began = datetime.now(UTC)
    sets = [arg for value in values for arg in ("--set", value)]
    cluster.real.helm("install", OPERATOR_RELEASE, str(CHART), "-n", RELEASE_NAMESPACE,
                      "--create-namespace", *cluster.real.operator_image_values(), *sets,
                      "--wait", "--timeout", INSTALL_TIMEOUT)
    try:
        yield began
    finally:
        cluster.real.helm("uninstall", OPERATOR_RELEASE, "-n", RELEASE_NAMESPACE, "--wait",
                          "--timeout", INSTALL_TIMEOUT)
        wait_for(lambda: not cluster.core.list_namespaced_pod(
            RELEASE_NAMESPACE, label_selector=OPERATOR_SELECTOR).items, 240,
            "the operator's pods gone", interval=1)


def operator_log(cluster: RealCluster) -> str:
    return cluster.kubectl("-n", RELEASE_NAMESPACE, "logs", "--tail=60",
                           "deployment/tardigrade", check=False)


@pytest.mark.slow
@NEEDS_REAL_NODES
@REAL_NODES_TIMEOUT
def test_namespaced_chart_runs_a_job_under_its_role(cluster: RealCluster):
    """watch.namespaces mode: a Role in the jobs' namespace, no cluster-wide job grants; the
    in-pod operator (one replica, with peering) runs a job there and is denied nothing."""
    values = ("watch.allNamespaces=false", f"watch.namespaces={{{NAMESPACE}}}",
              "replicaCount=1")
    audit_log = cluster.local.layout.audit_log
    with chart_installed(cluster, *values) as began:
        cluster.apply(cluster.trainingjob("ns-smoke", steps=2, replicas=1))
        try:
            cluster.wait_phase("ns-smoke", {"Succeeded"}, timeout=JOB_TIMEOUT_SECONDS)
        except AssertionError as err:
            denied = grants.denials(grants.audited_calls(
                audit_log, f"system:serviceaccount:{RELEASE_NAMESPACE}:{ACCOUNT}", began))
            raise AssertionError(f"{err}\ndenied: {denied}\n{operator_log(cluster)}") from None
        used = grants.check_operator_calls(audit_log, ACCOUNT, RELEASE_NAMESPACE,
                                           grants.NAMESPACED, since=began)
        # The job's own calls were made in its namespace, under the Role.
        assert ("tardigrade.dev", "trainingjobs/status", "patch") in used
        assert ("", "pods", "create") in used
        # Nodes are cluster-scoped: kopf watches them cluster-wide, under the nodes ClusterRole.
        assert {("", "nodes", "list"), ("", "nodes", "watch")} <= used


@pytest.mark.slow
@NEEDS_REAL_NODES
@REAL_NODES_TIMEOUT
def test_chart_operator_queues_a_job_through_real_kueue_under_its_role(cluster: RealCluster):
    """With Kueue installed, the in-pod operator under the chart's ClusterRole creates the
    job's Workload, reads the flavors and the priority class, runs the admitted gang and
    marks the Workload Finished, and is denied nothing."""
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
    audit_log = cluster.local.layout.audit_log
    with chart_installed(cluster, "replicaCount=1") as began:
        job = cluster.trainingjob("queued-smoke", steps=2, replicas=1)
        job["metadata"]["labels"] = {"kueue.x-k8s.io/queue-name": "team",
                                     "kueue.x-k8s.io/priority-class": "low"}
        cluster.apply(job)
        try:
            cluster.wait_phase("queued-smoke", {"Succeeded"}, timeout=JOB_TIMEOUT_SECONDS)
        except AssertionError as err:
            raise AssertionError(f"{err}\n{operator_log(cluster)}") from None

        def finished() -> dict | None:
            workloads = cluster.custom.list_namespaced_custom_object(
                *kueue, NAMESPACE, "workloads",
                label_selector="tardigrade.dev/job=queued-smoke")["items"]
            return next((w for w in workloads if any(
                c["type"] == "Finished" and c["status"] == "True"
                for c in (w.get("status") or {}).get("conditions") or [])), None)

        workload = wait_for(finished, timeout=120, what="the Workload marked Finished",
                            interval=0.5)
        assert workload["spec"]["priority"] == 10
        expected = {("kueue.x-k8s.io", "workloads", "create"),
                    ("kueue.x-k8s.io", "workloads/status", "update"),
                    ("kueue.x-k8s.io", "resourceflavors", "list"),
                    ("kueue.x-k8s.io", "workloadpriorityclasses", "get")}
        # kube-apiserver writes a request's audit event at ResponseComplete, after the
        # response: the Finished write can be read back before its line is in the log.
        wait_for(lambda: expected <= grants.check_operator_calls(
            audit_log, ACCOUNT, RELEASE_NAMESPACE, grants.ALL_NAMESPACES, since=began),
            timeout=60, what="the operator's Workload writes in the audit log", interval=0.5)
