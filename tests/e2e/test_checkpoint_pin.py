"""End to end: a plain preemption after the keep policy deleted the operator's pinned step
(issue 14, point 1) resumes from a newer step instead of ending the job as CannotRun.
Before the fix the relaunched trainer exited 3 (`requested restore step ... is not a committed
checkpoint`) and the job failed."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.harness import (
    NEEDS_REAL_NODES,
    RealCluster,
    installed_operator,
    real_cluster,
    wait_for,
)

pytestmark = [
    pytest.mark.slow,
    NEEDS_REAL_NODES,
]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealCluster]:
    # The gang's two spot nodes and a third for the relaunch (the reclaimed ones come back).
    with real_cluster(tmp_path_factory.mktemp("pin"), 3) as running:
        yield running


def _committed(cluster: RealCluster, job: str) -> set[int]:
    url = f"{cluster.real.gcs_url}/storage/v1/b/tardigrade/o?prefix=checkpoints/{job}/"
    with urllib.request.urlopen(url, timeout=10) as response:
        names = [item["name"] for item in json.load(response).get("items", [])]
    return {int(n.split("/step_")[1].split("/")[0]) for n in names
            if n.endswith("/metadata.json") and "/step_" in n}


def test_a_preemption_after_the_pinned_step_was_deleted_resumes_from_a_newer_one(
        cluster: RealCluster, tmp_path: Path) -> None:
    name = "e2e-pin"
    job = cluster.trainingjob(name, steps=160)
    # A commit every 2 steps, only the newest kept, no save on SIGTERM.
    job["spec"]["checkpoint"].update(interval={"steps": 2}, keep={"last": 1},
                                     saveOnPreemption=False)
    with installed_operator(cluster, tmp_path) as operator:
        cluster.apply(job)
        log = cluster.step_log(name)

        def pinned() -> int | None:
            log.collect()
            status = cluster.status(name)
            step = (status.get("lastCheckpoint") or {}).get("step")
            return int(step) if step and status.get("phase") == "Running" else None

        pin = wait_for(pinned, 420, "a pinned checkpoint", interval=1.0)
        # An operator fail-over: the gang keeps committing, the keep policy deletes the pinned
        # step, and the gang is preempted before any operator reads its progress again.
        operator.scale(0)
        pin = pinned() or pin
        wait_for(lambda: (lambda c: c and pin not in c and max(c) > pin)(_committed(cluster, name)),
                 300, "the keep policy to delete the pinned step", interval=1.0)
        # Both ranks' nodes reclaimed (the pool recreates them): with a rank left running, the
        # returning operator would read the newer step from it, and no pin would be stale.
        for pod in cluster.pods(name):
            cluster.real.reclaim(cluster.spot_node_of(pod), replace_after_seconds=5)
        wait_for(lambda: all(p.status.phase in ("Failed", "Succeeded") for p in cluster.pods(name)),
                 180, "both ranks to be gone", interval=1.0)
        assert cluster.status(name)["lastCheckpoint"]["step"] == pin
        operator.scale(1)
        operator.start()
        status = cluster.wait_phase(name, {"Succeeded", "Failed"}, timeout=600, collector=log)
    assert status["phase"] == "Succeeded", status.get("message")
    assert status["restarts"]["failures"] == 0
    recovery = status["recoveries"][0]
    assert recovery["cause"] == "Preemption" and recovery["restoreStep"] == pin
    # The gang resumed from a step newer than the pin it was given: the pin itself was gone.
    assert log.restored and log.restored[0] > pin, (log.restored, recovery)
