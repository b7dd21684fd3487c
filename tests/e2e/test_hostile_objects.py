"""One tenant's object cannot stop the operator for the others (issue 15, finding 1).

A trainer config 1,000 levels deep is stored by a real API server (its JSON decoder allows
10,000). Python's `json`, which kopf parses watch events with, raised RecursionError on it:
the TrainingJob watcher failed, kopf's orchestrator re-raised it and the operator exited (and,
restarted, would list the same object and exit again), so no job was reconciled. Here the
poisoned job fails with a clear condition while a neighbour in another namespace trains, is
preempted, and recovers.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from tardigrade_local.cluster import LocalCluster
from tardigrade_local.steplog import StepLog

from tests.e2e.harness import (
    NAMESPACE,
    Cluster,
    OperatorProcess,
    running_operator,
    trainingjob,
    wait_for,
)

pytestmark = pytest.mark.slow

GRACE_SECONDS = 20
DEPTH = 1000
NEIGHBOURS = "team-b"  # another tenant's namespace, watched by the same operator


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("poisoned")
    with LocalCluster(root / "cluster", nodes=3, shutdown_grace_seconds=GRACE_SECONDS) as local:
        yield Cluster(local)


@pytest.fixture(scope="module")
def operator(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[OperatorProcess]:
    cluster.kubectl("create", "namespace", NEIGHBOURS)
    with running_operator(cluster, tmp_path_factory.mktemp("operator"),
                          namespaces=(NAMESPACE, NEIGHBOURS)) as process:
        yield process


def create_raw(cluster: Cluster, body: bytes) -> int:
    """POST a TrainingJob as bytes: a client library would have to build it as an object,
    which this test process cannot nest this deep either."""
    url = (f"{cluster.local.api_url}/apis/tardigrade.dev/v1alpha1/namespaces/{NAMESPACE}/"
           f"trainingjobs")
    request = urllib.request.Request(url, data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return int(response.status)


def poisoned_body(name: str) -> bytes:
    job = trainingjob(name, steps=5, replicas=1)
    job["spec"]["trainer"]["deep"] = "HOLE"
    inner = '{"n":' * DEPTH + "1" + "}" * DEPTH
    return json.dumps(job).replace('"HOLE"', inner).encode()


def neighbour_status(cluster: Cluster) -> dict[str, Any]:
    job = cluster.custom.get_namespaced_custom_object(
        "tardigrade.dev", "v1alpha1", NEIGHBOURS, "trainingjobs", "neighbour")
    return job.get("status") or {}


def neighbour_in(cluster: Cluster, phases: set[str], log: StepLog) -> dict[str, Any] | None:
    log.collect()
    status = neighbour_status(cluster)
    assert status.get("phase") != "Failed", status.get("message")
    return status if status.get("phase") in phases else None


def test_a_poisoned_job_fails_alone_while_its_neighbour_trains_and_recovers(
        cluster: Cluster, operator: OperatorProcess):
    assert create_raw(cluster, poisoned_body("poisoned")) == 201
    neighbour = trainingjob("neighbour", steps=40)
    neighbour["metadata"]["namespace"] = NEIGHBOURS
    neighbour["spec"]["checkpoint"]["interval"] = {"steps": 1000}  # only the preemption save
    cluster.apply(neighbour)

    status = cluster.wait_phase("poisoned", {"Failed"}, timeout=120)
    conditions = {c["type"]: c for c in status["conditions"]}
    assert conditions["InvalidSpec"]["status"] == "True"
    assert f"spec.trainer: the trainer config is nested {DEPTH + 1} levels deep" in (
        status["message"])
    assert cluster.pods("poisoned") == []

    log = StepLog(cluster.core, NEIGHBOURS, "neighbour")
    wait_for(lambda: (log.collect(), log.last_step >= 5)[1], 300, "the neighbour to train")
    victim = next(p for p in cluster.core.list_namespaced_pod(
        NEIGHBOURS, label_selector="tardigrade.dev/job=neighbour").items
        if p.metadata.labels["tardigrade.dev/rank"] == "1")
    cluster.local.preempt_node(victim.spec.node_name, grace_seconds=GRACE_SECONDS,
                               replace_after_seconds=1)
    status = wait_for(lambda: neighbour_in(cluster, {"Succeeded"}, log), 420,
                      "the neighbour to succeed")
    operator.assert_alive()
    assert status["restarts"]["preemptions"] == 1 and status["restarts"]["failures"] == 0
    assert status["recoveries"][0]["stepsLost"] == 0
    log_text = operator.log_path.read_text()
    assert "RecursionError" not in log_text and "has failed" not in log_text
