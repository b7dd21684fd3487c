"""The whole bad-input corpus against the local API server and the real operator.

Every malformed, hostile, huge or unrunnable TrainingJob gets a clear error that names the field
(from the API server at admission, from the operator as a Failed condition, or from the trainer
as the job's failure message) and the operator never crashes or spins on any of them.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException
from tardigrade_local.cluster import LocalCluster

from tests.conftest import bad_trainingjob_cases, corpus_cases
from tests.e2e.harness import (
    NAMESPACE,
    Cluster,
    OperatorProcess,
    running_operator,
    trainingjob,
    wait_for,
)

pytestmark = pytest.mark.slow

SCHEMA_CASES = bad_trainingjob_cases()
UNRUNNABLE_CASES = corpus_cases("unrunnable_trainingjobs.yaml")
# Schema-valid, but beyond what the operator's default admission policy lets a pod do.
FORBIDDEN_CASES = corpus_cases("forbidden_trainingjobs.yaml")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with LocalCluster(tmp_path_factory.mktemp("badinput") / "cluster", nodes=2) as local:
        yield Cluster(local)


@pytest.fixture(scope="module")
def operator(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[OperatorProcess]:
    # The forbidden corpus is judged under the strictest admission policy (its header); the
    # operator's default is baseline (docs/gke.md, "Pod Security").
    with running_operator(cluster, tmp_path_factory.mktemp("operator"),
                          env={"TARDIGRADE_POD_SECURITY": "restricted"}) as process:
        yield process


def _named(document: dict[str, Any], name: str, renamed: bool = True) -> dict[str, Any]:
    document = copy.deepcopy(document)
    if renamed:
        document["metadata"]["name"] = name
    document["metadata"]["namespace"] = NAMESPACE
    return document


def _create(cluster: Cluster, document: dict[str, Any]) -> ApiException | None:
    try:
        # Strict, as kubectl asks by default: unknown fields are errors, not silently pruned.
        cluster.custom.create_namespaced_custom_object(
            "tardigrade.dev", "v1alpha1", NAMESPACE, "trainingjobs", document,
            field_validation="Strict")
    except ApiException as err:
        return err
    return None


def _failed(cluster: Cluster, name: str) -> dict[str, Any] | None:
    status = cluster.status(name)
    return status if status.get("phase") == "Failed" else None


def _renames(case: dict[str, Any]) -> bool:
    return not any(op["path"] == "/metadata/name" for op in case["ops"])


def test_every_bad_input_gets_a_clear_error_and_the_operator_survives(
    cluster: Cluster, operator: OperatorProcess
):
    assert len(SCHEMA_CASES) + len(UNRUNNABLE_CASES) >= 40
    accepted: dict[str, dict[str, Any]] = {}  # job name -> case the operator must fail
    for index, case in enumerate(SCHEMA_CASES):
        name = f"bad-{index}"
        error = _create(cluster, _named(case["document"], name, _renames(case)))
        if case.get("crd", True):
            assert error is not None, f"{case['name']}: accepted by the API server"
            # 422 Invalid for schema and CEL rules, 400 for strict decoding (unknown fields).
            assert error.status in (400, 422), (case["name"], error.status, error.body)
            body = json.loads(error.body)
            fields = [c.get("field", "") for c in (body.get("details") or {}).get("causes", [])]
            assert any(case["field"] in text for text in [*fields, body["message"]]), (
                case["name"], body["message"])
        else:
            assert error is None, f"{case['name']}: {error.body if error else ''}"
            accepted[name] = case
    for index, case in enumerate(UNRUNNABLE_CASES):
        name = f"unrunnable-{index}"
        document = case["document"]
        document["spec"]["trainer"]["devices_per_process"] = document["spec"]["trainer"].get(
            "devices_per_process", 2)
        assert _create(cluster, _named(document, name)) is None, case["name"]
        accepted[name] = case
    for index, case in enumerate(FORBIDDEN_CASES):
        name = f"forbidden-{index}"
        assert _create(cluster, _named(case["document"], name)) is None, case["name"]
        accepted[name] = case

    # Past admission, nothing the API server refuses or the kubelet cannot run is retried
    # forever: the operator says why (the refusal, the stuck container) in status.
    too_big = trainingjob("annotations-too-big", steps=5)
    too_big["spec"]["podTemplate"]["annotations"] = {f"note-{i}": "x" * 8192 for i in range(40)}
    assert _create(cluster, too_big) is None
    no_image = trainingjob("image-not-found", steps=5)
    no_image["spec"]["image"] = "ghcr.io/example/not-a-local-program:v1"
    assert _create(cluster, no_image) is None

    for name, case in accepted.items():
        status = wait_for(lambda n=name: _failed(cluster, n), 180, f"{name} to fail")
        expected = case.get("says") if name.startswith("unrunnable") else case["field"]
        assert expected in status["message"], (case["name"], status["message"])
        if name.startswith(("bad", "forbidden")):
            reason = {c["type"]: c["reason"] for c in status["conditions"]}["Failed"]
            assert reason == "InvalidSpec", (case["name"], status)
            assert cluster.pods(name) == [], f"{case['name']}: pods created for an invalid spec"
        assert status["restarts"]["total"] == 0, (case["name"], status["restarts"])

    status = wait_for(lambda: _failed(cluster, "annotations-too-big"), 60, "refused pods")
    assert "metadata.annotations" in status["message"], status["message"]
    assert {c["type"]: c["reason"] for c in status["conditions"]}["Failed"] == "PodRejected"
    stuck = wait_for(lambda: (lambda s: s if "cannot start" in s.get("message", "") else None)(
        cluster.status("image-not-found")), 60, "the stuck container to be explained")
    assert re.search(r"cannot start: (ErrImagePull|ImagePullBackOff)", stuck["message"]), stuck
    events = cluster.kubectl("get", "events", "--field-selector",
                             "involvedObject.name=image-not-found")
    assert "ContainerCannotStart" in events

    # Still reconciling after all that: a good job is picked up at once.
    cluster.apply(trainingjob("still-alive", steps=5, suspend=True))
    wait_for(lambda: cluster.status("still-alive").get("phase") == "Suspended", 60,
             "a good job to be reconciled")
    operator.assert_alive()
    log = operator.log_path.read_text()
    assert "Traceback" not in log, log[log.find("Traceback") - 200:][:3000]
