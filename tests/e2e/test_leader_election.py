"""Two operator replicas: one leads through kopf peering, the other takes over when it dies."""

from __future__ import annotations

import pytest
from tardigrade_local.cluster import LocalCluster

from tests.e2e.harness import Cluster, OperatorProcess, trainingjob, wait_for

# Not in the default run: on a loaded 2-core machine the standby replica sometimes never
# receives the KopfPeering events (its log stops after authentication); root cause not found.
pytestmark = [pytest.mark.slow, pytest.mark.peering]


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
            try:
                wait_for(lambda: "Pausing operations in favour of" in
                         standby.log_path.read_text(), 120, "the standby to pause")
            except AssertionError as err:
                raise AssertionError(f"{err}\nstandby log:\n"
                                     f"{standby.log_path.read_text()[-4000:]}") from None
            cluster.apply(trainingjob("le-long", steps=5000, replicas=1))
            cluster.wait_phase("le-long", {"Running"}, timeout=240)
            assert [p.metadata.name for p in cluster.pods("le-long")] == ["le-long-a1-0"]

            leader.kill()  # no goodbye: the standby must notice the silence
            cluster.apply(trainingjob("le-after", steps=3, replicas=1))
            cluster.wait_phase("le-after", {"Succeeded"}, timeout=240)
            after_pause = standby.log_path.read_text().split("Pausing operations", 1)[1]
            assert "Resuming operations after the pause" in after_pause
            # The running gang was adopted as it was: same attempt, no second copy.
            status = cluster.status("le-long")
            assert (status["attempt"], status["restarts"]["total"]) == (1, 0), status

            assert [p.metadata.name for p in cluster.pods("le-long")] == ["le-long-a1-0"]
            standby.assert_alive()
        finally:
            standby.stop()
            leader.stop()
