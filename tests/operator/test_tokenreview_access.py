"""Cluster-wide installs: the operator adds each job's account to the trainers' TokenReview
binding, with the chart's narrow grant, and can touch no other binding."""

from __future__ import annotations

import subprocess
from typing import Any

import kubernetes
import pytest
import yaml
from kubernetes.client.exceptions import ApiException
from tardigrade_operator.api.types import TrainingJobStatus
from tardigrade_operator.apply import tokenreview_access
from tardigrade_operator.apply.kube import ClusterWriter
from tardigrade_operator.decision.plan import Plan

from tests.conftest import REPO_ROOT

CHART = REPO_ROOT / "charts" / "tardigrade"
BINDING = "tardigrade-trainer-tokenreview"


def test_a_subject_is_added_once():
    binding = {"metadata": {"name": BINDING}, "roleRef": {}}
    added = tokenreview_access.with_subject(binding, "ml", "trainer")
    assert added is not None and added["subjects"] == [
        {"kind": "ServiceAccount", "name": "trainer", "namespace": "ml"}]
    assert tokenreview_access.with_subject(added, "ml", "trainer") is None
    assert tokenreview_access.with_subject(added, "lab", "trainer") is not None


def test_a_concurrent_change_is_read_again_not_lost():
    stored: dict[str, Any] = {"subjects": [{"kind": "ServiceAccount", "name": "a",
                                            "namespace": "x"}]}
    conflicts = iter([True, False])

    def replace(body: dict[str, Any]) -> None:
        if next(conflicts):
            # Someone else added theirs between our read and our write.
            stored["subjects"] = [*stored["subjects"], {"kind": "ServiceAccount",
                                                        "name": "b", "namespace": "y"}]
            raise ApiException(status=409)
        stored.update(body)

    assert tokenreview_access.ensure(lambda: dict(stored), replace, "ml", "default")
    assert [s["name"] for s in stored["subjects"]] == ["a", "b", "default"]


def _chart_rbac() -> list[dict[str, Any]]:
    helm = REPO_ROOT / ".ci" / "cache" / "helm"
    found = str(helm) if helm.exists() else "helm"
    try:
        out = subprocess.run([found, "template", "tardigrade", str(CHART), "--namespace",
                              "tardigrade-system", "--no-hooks", "--show-only",
                              "templates/rbac.yaml"], capture_output=True, text=True,
                             timeout=60, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as err:
        pytest.skip(f"no helm to render the chart: {err}")
    wanted = {BINDING, "tardigrade-tokenreview-subjects"}
    return [d for d in yaml.safe_load_all(out) if d and d["metadata"]["name"] in wanted]


def test_the_operator_fills_the_binding_under_the_charts_grant_and_nothing_more(
        shared_api):
    rbac = kubernetes.client.RbacAuthorizationV1Api(shared_api.api)
    operator_ns = shared_api.new_namespace("operator")
    jobs_ns = shared_api.new_namespace("jobs")
    for doc in _chart_rbac():
        if doc["kind"] == "ClusterRoleBinding" and doc["metadata"]["name"] != BINDING:
            doc["subjects"] = [{"kind": "ServiceAccount", "name": "tardigrade",
                                "namespace": operator_ns}]
        create = (rbac.create_cluster_role if doc["kind"] == "ClusterRole"
                  else rbac.create_cluster_role_binding)
        try:
            create(doc)
        except ApiException as err:
            if err.status != 409:
                raise
            (rbac.replace_cluster_role if doc["kind"] == "ClusterRole"
             else rbac.replace_cluster_role_binding)(doc["metadata"]["name"], doc)
    # The operator's own identity, not the admin's: RBAC and its escalation check apply.
    as_operator = kubernetes.client.ApiClient(shared_api.api.configuration)
    as_operator.set_default_header("Impersonate-User",
                                   f"system:serviceaccount:{operator_ns}:tardigrade")
    writer = ClusterWriter(as_operator, token_review_binding=BINDING)
    try:
        assert writer.grant_token_review(jobs_ns, "trainer") is True
        assert writer.grant_token_review(jobs_ns, "trainer") is False
        subjects = rbac.read_cluster_role_binding(BINDING).subjects
        assert [(s.kind, s.namespace, s.name) for s in subjects] == [
            ("ServiceAccount", jobs_ns, "trainer")]
        # No other binding: the grant names this one.
        other = ClusterWriter(as_operator, token_review_binding="tardigrade-discovery")
        with pytest.raises(ApiException) as denied:
            other.grant_token_review(jobs_ns, "trainer")
        assert denied.value.status == 403
        # Before the pods, with the account the pods run as.
        pod = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": "p", "namespace": jobs_ns},
               "spec": {"containers": [{"name": "c", "image": "x"}]}}
        with pytest.raises(ApiException):  # the operator may not create pods here
            writer.apply(jobs_ns, "job", TrainingJobStatus(),
                         Plan(TrainingJobStatus(), create_pods=[pod]))
        names = {(s.namespace, s.name) for s in rbac.read_cluster_role_binding(BINDING).subjects}
        assert (jobs_ns, "default") in names
    finally:
        as_operator.close()
