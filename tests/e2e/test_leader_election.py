"""Two operator replicas, as the chart installs them by default (`replicaCount: 2`, kopf
peering): one leads, the other stands by, and when the leader's pod dies the gang it runs is
adopted as it was, never launched twice. On real nodes, the operator from the registry."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from tardigrade_local.realcluster import OPERATOR_NAMESPACE

from tests.e2e.harness import (
    NEEDS_REAL_NODES,
    OPERATOR_SELECTOR,
    RealCluster,
    installed_operator,
    real_cluster,
    wait_for,
)

pytestmark = [
    pytest.mark.slow,
    NEEDS_REAL_NODES,
]

# Stand-in trainers in the trainer image: this test is about who reconciles, not training.
SLEEPER = ["python3", "-c", "import signal; signal.pause()"]
SUCCEED = ["python3", "-c", "pass"]
PEERING = "tardigrade"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealCluster]:
    with real_cluster(tmp_path_factory.mktemp("le"), 1) as running:
        yield running


def _peers(cluster: RealCluster) -> dict[str, Any]:
    """The chart's ClusterKopfPeering (it watches every namespace): identity -> record."""
    peering = cluster.custom.get_cluster_custom_object(
        "kopf.dev", "v1", "clusterkopfpeerings", PEERING)
    return peering.get("status") or {}


def _pod_of(identity: str) -> str:
    """kopf's identity of a replica in a pod: `<user>@<hostname>/<start>/<random>`, the
    hostname being the pod's name."""
    return identity.split("@", 1)[1].split("/", 1)[0]


def _running_pods(cluster: RealCluster) -> set[str]:
    return {p.metadata.name for p in cluster.core.list_namespaced_pod(
        OPERATOR_NAMESPACE, label_selector=OPERATOR_SELECTOR).items
        if p.metadata.deletion_timestamp is None and p.status.phase == "Running"}


def test_the_leaders_pod_dies_and_the_gang_is_adopted_not_duplicated(
        cluster: RealCluster, tmp_path) -> None:
    with installed_operator(cluster, tmp_path, "--set", "replicaCount=2",
                            "--set", "leaderElection.enabled=true") as operator:
        pods = wait_for(lambda: (lambda p: p if len(p) == 2 else None)(_running_pods(cluster)),
                        300, "both replicas running")
        # Both have joined the peering: the object, not their logs, says so.
        peers = wait_for(lambda: (lambda p: p if {_pod_of(i) for i in p} == pods else None)(
            _peers(cluster)), 120, "both replicas in the peering")
        leader = _pod_of(max(peers, key=lambda i: peers[i]["priority"]))

        cluster.apply(cluster.trainingjob("le-long", steps=5000, replicas=1, command=SLEEPER))
        cluster.wait_phase("le-long", {"Running"}, timeout=300)
        assert [p.metadata.name for p in cluster.pods("le-long")] == ["le-long-a1-0"]

        # The leader's process killed with its pod, no goodbye: the standby must notice the
        # silence. The Deployment starts a third replica meanwhile; whichever leads next
        # must adopt the gang.
        cluster.core.delete_namespaced_pod(leader, OPERATOR_NAMESPACE, grace_period_seconds=0)
        cluster.apply(cluster.trainingjob("le-after", steps=3, replicas=1, command=SUCCEED))
        cluster.wait_phase("le-after", {"Succeeded"}, timeout=300)
        status = cluster.status("le-long")
        assert (status["attempt"], status["restarts"]["total"]) == (1, 0), status
        assert [p.metadata.name for p in cluster.pods("le-long")] == ["le-long-a1-0"]
        survivors = _running_pods(cluster)
        assert leader not in survivors and len(survivors) == 2, survivors
        operator.read_log()
