"""Nothing waits on an operator that is not running: a TrainingJob carries no finalizer, and
the pods of a job deleted meanwhile are released as soon as an operator starts again. On real
nodes, the chart's operator scaled to zero and back."""

from __future__ import annotations

import pytest

from tests.e2e.harness import NEEDS_REAL_NODES, installed_operator, real_cluster, wait_for

pytestmark = [
    pytest.mark.slow,
    NEEDS_REAL_NODES,
]

TRACKING = "tardigrade.dev/gang-tracking"


def test_delete_while_the_operator_is_down_returns_and_its_pods_go(tmp_path, tmp_path_factory):
    # Short: the kubelet's socket paths live under each node's directory.
    with real_cluster(tmp_path_factory.mktemp("down"), 2) as cluster, \
            installed_operator(cluster, tmp_path) as operator:
        name = "down"
        cluster.apply(cluster.trainingjob(name, steps=100000, replicas=2))
        cluster.wait_phase(name, {"Running"}, timeout=300)
        assert (cluster.job(name) or {})["metadata"].get("finalizers") is None
        assert all(TRACKING in p.metadata.finalizers for p in cluster.pods(name))
        # A job from an older operator version, which gave jobs kopf's finalizer.
        legacy = cluster.trainingjob("legacy", steps=3, replicas=1, suspend=True)
        legacy["metadata"]["finalizers"] = ["tardigrade.dev/operator"]
        operator.scale(0)
        cluster.apply(legacy)

        # `kubectl delete` returns at once: nothing on the job waits for the operator.
        cluster.kubectl("delete", "tj", name, "--timeout=20s")
        # Its pods are deleted by the garbage collector; their tracking finalizer keeps them
        # (terminated, in Terminating) until an operator has looked at them.
        wait_for(lambda: all(p.metadata.deletion_timestamp and p.status.phase in (
            "Succeeded", "Failed") for p in cluster.pods(name)), 120, "pods terminated")
        assert cluster.pods(name)

        operator.scale(1)
        operator.start()
        wait_for(lambda: not cluster.pods(name), 60, "orphaned pods released and gone")
        wait_for(lambda: not (cluster.job("legacy") or {})["metadata"].get("finalizers"),
                 60, "kopf's old finalizer removed from the legacy job")
        cluster.kubectl("delete", "tj", "legacy", "--timeout=20s")
        operator.assert_alive()
