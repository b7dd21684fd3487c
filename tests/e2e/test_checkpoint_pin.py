"""End to end: a plain preemption after the keep policy deleted the operator's pinned step
(issue 14, point 1) resumes from a newer step instead of ending the job as CannotRun."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from tardigrade_local.cluster import LocalCluster

from tests.e2e.harness import Cluster, running_operator, trainingjob, wait_for

pytestmark = pytest.mark.slow

GRACE_SECONDS = 20


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("e2e-pin")
    with LocalCluster(root / "cluster", nodes=3, shutdown_grace_seconds=GRACE_SECONDS) as local:
        yield Cluster(local)


def _committed(cluster: Cluster, job: str) -> set[int]:
    url = f"{cluster.local.gcs_url}/storage/v1/b/tardigrade/o?prefix=checkpoints/{job}/"
    with urllib.request.urlopen(url, timeout=10) as response:
        names = [item["name"] for item in json.load(response).get("items", [])]
    return {int(n.split("/step_")[1].split("/")[0]) for n in names
            if n.endswith("/metadata.json") and "/step_" in n}


def test_a_preemption_after_the_pinned_step_was_deleted_resumes_from_a_newer_one(
        cluster: Cluster, tmp_path: Path) -> None:
    name = "e2e-pin"
    job = trainingjob(name, steps=160)
    # A commit every 2 steps, only the newest kept, no save on SIGTERM: between two progress
    # polls (30 s apart here) the keep policy deletes the step the operator pinned.
    job["spec"]["checkpoint"].update(interval={"steps": 2}, keep={"last": 1},
                                     saveOnPreemption=False)
    # Progress is read on each reconcile pass: rare passes make the pin lag, as several
    # commits between polls or an operator fail-over do.
    with running_operator(cluster, tmp_path, env={"TARDIGRADE_RESYNC_SECONDS": "30"}):
        cluster.apply(job)
        log = cluster.step_log(name)

        def pin_deleted() -> int | None:
            log.collect()
            pinned = (cluster.status(name).get("lastCheckpoint") or {}).get("step")
            if pinned and cluster.status(name).get("phase") == "Running":
                committed = _committed(cluster, name)
                if committed and pinned not in committed and max(committed) > pinned:
                    return int(pinned)
            return None

        pinned = wait_for(pin_deleted, 420, "the keep policy to delete the pinned step",
                          interval=1.0)
        victim = next(p for p in cluster.pods(name)
                      if p.metadata.labels["tardigrade.dev/rank"] == "1")
        cluster.local.preempt_node(victim.spec.node_name, grace_seconds=GRACE_SECONDS,
                                   replace_after_seconds=1)
        status = cluster.wait_phase(name, {"Succeeded", "Failed"}, timeout=600, collector=log)
    assert status["phase"] == "Succeeded", status.get("message")
    assert status["restarts"]["preemptions"] >= 1 and status["restarts"]["failures"] == 0
    recovery = status["recoveries"][0]
    assert recovery["cause"] == "Preemption"
    assert recovery["restoreStep"] >= pinned
    # The gang resumed from a step newer than the pin it was given: the pin itself was gone.
    assert log.restored and log.restored[0] > recovery["restoreStep"], (log.restored, recovery)
