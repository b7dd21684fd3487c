"""The whole bad-input corpus against the local API server and the operator, on real nodes.

Every malformed, hostile, huge or unrunnable TrainingJob gets a clear error that names the field
(from the API server at admission, from the operator as a Failed condition, or from the trainer
as the job's failure message) and the operator never crashes or spins on any of them. The
operator is the chart's (helm, its image from the registry); the unrunnable jobs run the
registry's trainer image on real kubelets, whose containers exit with the trainer's own
message; an image the registry lacks is pulled by a real kubelet and fails as on GKE.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterator
from typing import Any

import jsonpatch
import pytest
from kubernetes.client.exceptions import ApiException

from tests.conftest import bad_trainingjob_cases, corpus_cases, expand
from tests.e2e.harness import (
    NAMESPACE,
    NEEDS_REAL_NODES,
    InstalledOperator,
    RealCluster,
    real_cluster,
    wait_for,
)

pytestmark = [
    pytest.mark.slow,
    NEEDS_REAL_NODES,
    # The one test carries the module's cluster start, the operator's install and the
    # trainer image's pull on the nodes.
    pytest.mark.timeout(1200),
]

SCHEMA_CASES = bad_trainingjob_cases()
UNRUNNABLE_CASES = corpus_cases("unrunnable_trainingjobs.yaml")
# Schema-valid, but beyond what the operator's default admission policy lets a pod do.
FORBIDDEN_CASES = corpus_cases("forbidden_trainingjobs.yaml")


# The unrunnable jobs' gangs of 2, spread as on node pools of two.
SPOT_NODES = 2
# An unrunnable job fails once its trainers ran: the first waits on the nodes' pull of the
# trainer image too, beside 17 other trainers starting on a shared 2-core machine.
UNRUNNABLE_FAILS_SECONDS = 420


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealCluster]:
    # Short: the kubelets' socket paths live under each node's directory.
    with real_cluster(tmp_path_factory.mktemp("bad"), SPOT_NODES) as running:
        yield running


# Added to the chart's install (tests/e2e/conftest.py's `operator`): the forbidden corpus is
# judged under the strictest admission policy (its header); the chart's default is baseline
# (docs/gke.md, "Pod Security").
OPERATOR_HELM_VALUES = (
    "--set", "admission.podSecurity=restricted",
)


def _named(document: dict[str, Any], name: str, renamed: bool = True) -> dict[str, Any]:
    document = copy.deepcopy(document)
    if renamed:
        document["metadata"]["name"] = name
    document["metadata"]["namespace"] = NAMESPACE
    return document


def _runnable_here(cluster: RealCluster, case: dict[str, Any], name: str) -> dict[str, Any]:
    """The case's patch on this cluster's job (the registry's trainer image on the spot
    nodes) instead of on the example: its trainer config is what the trainer refuses."""
    return jsonpatch.apply_patch(cluster.trainingjob(name, steps=200), expand(case["ops"]))


def _create(cluster: RealCluster, document: dict[str, Any]) -> ApiException | None:
    try:
        # Strict, as kubectl asks by default: unknown fields are errors, not silently pruned.
        cluster.custom.create_namespaced_custom_object(
            "tardigrade.dev", "v1alpha1", NAMESPACE, "trainingjobs", document,
            field_validation="Strict")
    except ApiException as err:
        return err
    return None


def _failed(cluster: RealCluster, name: str) -> dict[str, Any] | None:
    status = cluster.status(name)
    return status if status.get("phase") == "Failed" else None


def _renames(case: dict[str, Any]) -> bool:
    return not any(op["path"] == "/metadata/name" for op in case["ops"])


def test_every_bad_input_gets_a_clear_error_and_the_operator_survives(
    cluster: RealCluster, operator: InstalledOperator
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
        assert _create(cluster, _runnable_here(cluster, case, name)) is None, case["name"]
        accepted[name] = case
    for index, case in enumerate(FORBIDDEN_CASES):
        name = f"forbidden-{index}"
        assert _create(cluster, _named(case["document"], name)) is None, case["name"]
        accepted[name] = case

    # Past admission, nothing the API server refuses or the kubelet cannot run is retried
    # forever: the operator says why (the refusal, the stuck container) in status.
    too_big = cluster.trainingjob("annotations-too-big", steps=5)
    too_big["spec"]["podTemplate"]["annotations"] = {f"note-{i}": "x" * 8192 for i in range(40)}
    assert _create(cluster, too_big) is None
    no_image = cluster.trainingjob("image-not-found", steps=5)
    # A tag the registry the nodes pull from does not have (a typo in a release's tag).
    repository = cluster.real.images["trainer-cpu"].rsplit(":", 1)[0]
    no_image["spec"]["image"] = f"{repository}:no-such-tag"
    assert _create(cluster, no_image) is None

    for name, case in accepted.items():
        status = wait_for(lambda n=name: _failed(cluster, n),
                          UNRUNNABLE_FAILS_SECONDS if name.startswith("unrunnable") else 180,
                          f"{name} to fail")
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
    cluster.apply(cluster.trainingjob("still-alive", steps=5, suspend=True))
    wait_for(lambda: cluster.status("still-alive").get("phase") == "Suspended", 60,
             "a good job to be reconciled")
    operator.assert_alive()
    log = operator.read_log()
    assert "Traceback" not in log, log[log.find("Traceback") - 200:][:3000]
