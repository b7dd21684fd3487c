"""No object the API server accepts can stop the operator (issues 15 and 31), on real nodes.

While a neighbour in another tenant's namespace trains (the registry's trainer image on a real
kubelet), this module applies, through the API server, the deepest TrainingJob it accepts
(found by asking it, near its 10,000 levels) and then generated objects at and beyond every
limit: TrainingJobs with any JSON at any field of the spec and the pod template, trainer
configs nested up to the API server's depth, annotations of any text up to the size the API
server takes (kopf's own diff-base annotation among them), and pods with the job label
carrying the same. Each is refused at the door or fails alone with a reason; afterwards the
neighbour has kept training; the chart's operator pod still runs, never restarted, is Ready
(the kubelet's probe of /healthz) and answers /healthz green; it never restarted a watch; and
a job applied afterwards is reconciled and runs.

Issue 15's first finding (kopf's json.loads raised RecursionError in the watch stream, the
operator exited, and crash-looped on the same object) was reproduced here at 1,000 levels.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from tardigrade_local.steplog import StepLog

from tests.e2e.harness import (
    NAMESPACE,
    NEEDS_REAL_NODES,
    Cluster,
    InstalledOperator,
    RealCluster,
    installed_operator,
    real_cluster,
    trainingjob,
    wait_for,
)
from tests.fuzz import (
    API_SERVER_MAX_NESTING_DEPTH,
    THROUGH_THE_API,
    deep_json,
    dns_labels,
    json_values,
)
from tests.operator.test_fuzz_spec import PATHS

pytestmark = [
    pytest.mark.slow,
    pytest.mark.fuzz,
    NEEDS_REAL_NODES,
    # The first test carries the module's cluster start, the operator's install and the
    # trainer image's pull for the neighbour.
    pytest.mark.timeout(1200),
]

NEIGHBOURS = "team-b"  # another tenant's namespace, watched by the same operator
DIFF_BASE = "tardigrade.dev/last-handled-configuration"  # kopf reads it on every event
# Annotations may total 256 KiB (apimachinery ValidateAnnotationsSize).
ANNOTATIONS_BYTES = 256 * 1024
PLURAL_URL = f"/apis/tardigrade.dev/v1alpha1/namespaces/{NAMESPACE}/trainingjobs"


# The neighbour's node, which the job applied afterwards shares: no object here makes pods
# (jobs are suspended or fail, stray pods select no node).
SPOT_NODES = 1
# The neighbour's first steps wait on the node's pull of the trainer image too.
NEIGHBOUR_TRAINS_SECONDS = 420


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealCluster]:
    # Short: the kubelets' socket paths live under each node's directory.
    with real_cluster(tmp_path_factory.mktemp("hostile"), SPOT_NODES) as running:
        yield running


@pytest.fixture(scope="module")
def operator(cluster: RealCluster, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[InstalledOperator]:
    # The chart's operator watches every namespace, the neighbours' too.
    cluster.kubectl("create", "namespace", NEIGHBOURS)
    with installed_operator(cluster, tmp_path_factory.mktemp("operator")) as installed:
        yield installed


def post_raw(cluster: Cluster, path: str, body: bytes, scratch: Path) -> str | None:
    """POST `body` as it is (no client could build a 10,000-level object to send): None when
    the API server created it, else its refusal."""
    scratch.write_bytes(body)
    result = subprocess.run(["kubectl", "create", "--raw", path, "-f", str(scratch)],
                            env=cluster.env, capture_output=True, timeout=120)
    return None if result.returncode == 0 else result.stderr.decode(errors="replace")[-500:]


def job_body(name: str, trainer_text: str, **meta: Any) -> bytes:
    job = trainingjob(name, steps=5, replicas=1)
    job["metadata"].update(meta)
    job["spec"]["trainer"] = "HOLE"
    return json.dumps(job).replace('"HOLE"', trainer_text).encode()


def phase_or_none(cluster: Cluster, name: str) -> dict[str, Any] | None:
    status = cluster.status(name)
    return status if status.get("phase") else None


@pytest.fixture(scope="module")
def neighbour(cluster: RealCluster, operator: InstalledOperator) -> StepLog:
    job = cluster.trainingjob("neighbour", steps=100_000, replicas=1)
    job["metadata"]["namespace"] = NEIGHBOURS
    job["spec"]["checkpoint"]["interval"] = {"steps": 1_000_000}
    cluster.apply(job)
    log = StepLog(cluster.core, NEIGHBOURS, "neighbour")
    wait_for(lambda: (log.collect(), log.last_step >= 2)[1], NEIGHBOUR_TRAINS_SECONDS,
             "the neighbour to train")
    return log


def assert_neighbour_trains_on(cluster: Cluster, log: StepLog, since: int) -> None:
    wait_for(lambda: (log.collect(), log.last_step > since)[1], 120,
             f"the neighbour to train past step {since}")
    status = cluster.custom.get_namespaced_custom_object(
        "tardigrade.dev", "v1alpha1", NEIGHBOURS, "trainingjobs", "neighbour")["status"]
    assert status["phase"] == "Running", status
    assert status["restarts"] == {**status["restarts"], "failures": 0, "retries": 0}


def test_the_deepest_job_the_api_server_accepts_fails_alone(
        cluster: RealCluster, operator: InstalledOperator, neighbour: StepLog, tmp_path: Path):
    before = neighbour.last_step
    # Ask the API server: from its own limit down, the first depth it stores. The object and
    # its spec take 2 of its levels.
    refusals = []
    for depth in range(API_SERVER_MAX_NESTING_DEPTH, API_SERVER_MAX_NESTING_DEPTH - 20, -1):
        inner = '{"n":' * (depth - 2) + "1" + "}" * (depth - 2)
        refused = post_raw(cluster, PLURAL_URL, job_body("deepest", inner), tmp_path / "body")
        if refused is None:
            break
        refusals.append(refused)
    else:
        pytest.fail(f"the API server refused every depth near its limit: {refusals[-1]}")
    trainer_depth = depth - 2
    status = wait_for(lambda: phase_or_none(cluster, "deepest"), 120, "the deepest job's phase")
    assert status["phase"] == "Failed", status
    conditions = {c["type"]: c for c in status["conditions"]}
    assert conditions["InvalidSpec"]["status"] == "True"
    assert (f"spec.trainer: the trainer config is nested {trainer_depth} levels deep; at most "
            f"100 are accepted") in status["message"]
    assert cluster.pods("deepest") == []
    # The CLI, as a kubectl plugin, reads the job too.
    plugins = Path(sys.executable).parent
    shown = subprocess.run(["kubectl", "tardigrade", "timeline", "deepest", "-o", "json"],
                           env={**cluster.env, "PATH": f"{plugins}:{cluster.env['PATH']}"},
                           capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["phase"] == "Failed"
    assert_neighbour_trains_on(cluster, neighbour, before)
    operator.assert_alive()


ANNOTATION_TEXT = st.one_of(
    st.text(max_size=200),
    st.just("not json {["),
    json_values(10).map(json.dumps),
    deep_json(max_depth=ANNOTATIONS_BYTES // 6).map(lambda d: d[0]),
    st.integers(1, ANNOTATIONS_BYTES - 1024).map(lambda n: "[" * n),
)


@st.composite
def hostile_job(draw: st.DrawFn, name: str) -> bytes:
    job = trainingjob(name, steps=5, replicas=1)
    spec = job["spec"]
    for path, value in draw(st.lists(st.tuples(st.sampled_from(PATHS), json_values(8)),
                                     max_size=4)):
        target = spec
        for key in path[:-1]:
            if not isinstance(target.get(key), dict):
                target[key] = {}
            target = target[key]
        target[path[-1]] = value
    # A valid job among them would launch a gang: it is kept suspended (still reconciled).
    spec["suspend"] = True
    annotations = draw(st.dictionaries(st.sampled_from([DIFF_BASE, "example.com/note"]),
                                       ANNOTATION_TEXT, max_size=2))
    job["metadata"]["annotations"] = annotations
    spec["trainer"] = "HOLE"
    trainer = draw(st.one_of(json_values(10).map(json.dumps),
                             deep_json().map(lambda d: d[0])))
    return json.dumps(job).replace('"HOLE"', trainer).encode()


def stray_pod(name: str, annotation: str) -> bytes:
    """A pod a tenant made with the job label (kopf watches those): never scheduled."""
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": name, "namespace": NAMESPACE,
                        "labels": {"tardigrade.dev/job": name, "tardigrade.dev/rank": "x"},
                        "annotations": {DIFF_BASE: annotation}},
           "spec": {"nodeSelector": {"example.com/nowhere": "true"},
                    "containers": [{"name": "c", "image": "none"}]}}
    return json.dumps(pod).encode()


def test_generated_hostile_objects_fail_alone_while_the_neighbour_trains(
        cluster: RealCluster, operator: InstalledOperator, neighbour: StepLog,
        tmp_path_factory: pytest.TempPathFactory):
    before = neighbour.last_step
    scratch = tmp_path_factory.mktemp("bodies") / "body"
    seen: dict[str, str | None] = {}

    @THROUGH_THE_API
    @given(dns_labels(), st.data())
    def apply_one(label: str, data: st.DataObject) -> None:
        name = f"h-{len(seen)}-{label}"[:40]
        refused = post_raw(cluster, PLURAL_URL, data.draw(hostile_job(name)), scratch)
        seen[name] = refused
        if refused is None:
            # Accepted: reconciled (a phase), or failed alone with the field named.
            status = wait_for(lambda: phase_or_none(cluster, name), 60, f"{name}'s phase")
            assert status["phase"] in ("Failed", "Suspended"), status
            if status["phase"] == "Failed":
                assert "spec." in status["message"], status
        else:
            assert refused.strip(), "refused without a reason"
        pod_refused = post_raw(cluster, f"/api/v1/namespaces/{NAMESPACE}/pods",
                               stray_pod(name, data.draw(ANNOTATION_TEXT)), scratch)
        assert pod_refused is None or pod_refused.strip(), "refused without a reason"

    apply_one()
    assert any(refused is None for refused in seen.values()), seen

    later = cluster.trainingjob("later", steps=3, replicas=1)
    cluster.apply(later)
    cluster.wait_phase("later", {"Running", "Succeeded"}, timeout=300)
    assert_neighbour_trains_on(cluster, neighbour, before)
    operator.assert_alive()
    code, body = operator.healthz()
    assert code == 200 and json.loads(body)["watch_streams"] == "ok", body
    assert operator.ready(), "the kubelet's probe of /healthz fails"
    log_text = operator.read_log()
    for sign in ("RecursionError", "has failed", "unrecoverable error"):
        assert sign not in log_text, sign
