"""Two operator replicas: one leads through kopf peering, the other takes over when it dies."""

from __future__ import annotations

from typing import Any

import pytest
from tardigrade_local.cluster import LocalCluster

from tests.e2e.harness import Cluster, OperatorProcess, trainingjob, wait_for

pytestmark = pytest.mark.slow

SLEEPER = ["python", "-c", "import signal; signal.pause()"]
SUCCEED = ["python", "-c", "pass"]


def _peers(cluster: Cluster) -> dict[str, Any]:
    peering = cluster.custom.get_namespaced_custom_object(
        "kopf.dev", "v1", "default", "kopfpeerings", "tardigrade")
    return peering.get("status") or {}


def _paused(replica: OperatorProcess) -> bool:
    """Kopf starts a replica paused; every later pause or resume is logged."""
    log = replica.log_path.read_text()
    return log.count("Resuming operations after the pause") == log.count(
        "Pausing operations in favour of")


def test_standby_replica_takes_over_without_duplicating_the_gang(tmp_path):
    with LocalCluster(tmp_path / "cluster", nodes=2) as local:
        cluster = Cluster(local)
        cluster.apply({"apiVersion": "kopf.dev/v1", "kind": "KopfPeering",
                       "metadata": {"name": "tardigrade", "namespace": "default"}})
        leader = OperatorProcess(local, tmp_path / "leader.log", peering=("tardigrade", 100))
        standby = OperatorProcess(local, tmp_path / "standby.log", peering=("tardigrade", 50))
        leader.start()
        standby.start()
        try:
            # Both replicas have registered in the peering object. A replica starts paused and
            # logs "Pausing operations" only if it ran before a higher priority appeared, so
            # its log is no signal; the peering object is.
            wait_for(lambda: sorted(p["priority"] for p in _peers(cluster).values()) == [50, 100],
                     120, "both replicas to join the peering")
            # Stand-in trainers: this test is about who reconciles, not about training.
            cluster.apply(trainingjob("le-long", steps=5000, replicas=1, command=SLEEPER))
            cluster.wait_phase("le-long", {"Running"}, timeout=240)
            assert [p.metadata.name for p in cluster.pods("le-long")] == ["le-long-a1-0"]

            assert wait_for(lambda: _paused(standby), 60, "the standby to stand by")

            leader.kill()  # no goodbye: the standby must notice the silence
            cluster.apply(trainingjob("le-after", steps=3, replicas=1, command=SUCCEED))
            cluster.wait_phase("le-after", {"Succeeded"}, timeout=240)
            assert not _paused(standby)
            # The running gang was adopted as it was: same attempt, no second copy.
            status = cluster.status("le-long")
            assert (status["attempt"], status["restarts"]["total"]) == (1, 0), status

            assert [p.metadata.name for p in cluster.pods("le-long")] == ["le-long-a1-0"]
            standby.assert_alive()
        finally:
            standby.stop()
            leader.stop()
