"""Ungraceful node loss on the local cluster: a VM that stops without a shutdown, the node
lifecycle controller, taint eviction, pods stuck Terminating, and the VM back under its name."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from kube_helpers import Kube, condition, container_status, python_pod, wait_for
from kubernetes import client
from tardigrade_local.cluster import LocalCluster
from tardigrade_local.gke import disruptions as d
from tardigrade_local.gke.nodes import NodeConfig

pytestmark = pytest.mark.slow
FOREVER = "import time\nprint('ready', flush=True)\nwhile True: time.sleep(0.1)"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    state = tmp_path_factory.mktemp("nodeloss") / "state"
    nodes = [NodeConfig("vm-a"), NodeConfig("vm-b")]
    # Fast node-loss detection, set on the components as a test may (local_cluster/README.md,
    # "The control plane"): kubelets renew a 2 s Lease every 0.5 s, the controller manager
    # looks every 0.5 s and marks a node silent for 2 s Unknown.
    with LocalCluster(state, nodes=nodes, with_gcs=False, node_lease_seconds=2.0,
                      node_monitor_period_seconds=0.5, node_monitor_grace_seconds=2.0
                      ) as running:
        yield running


@pytest.fixture(scope="module")
def kube(cluster):
    return Kube(str(cluster.kubeconfig))


def node(kube: Kube, name: str) -> dict:
    return kube.plain(kube.core.read_node(name))


def parse_time(stamp: str) -> datetime:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00"))


def lease_renewed(kube: Kube, name: str) -> datetime:
    lease = kube.plain(client.CoordinationV1Api(kube.api).read_namespaced_lease(
        name, "kube-node-lease"))
    return parse_time(lease["spec"]["renewTime"])


def ready(obj: dict) -> dict:
    return next(c for c in obj["status"]["conditions"] if c["type"] == "Ready")


def unreachable(obj: dict) -> set[str]:
    return {t["effect"] for t in obj["spec"].get("taints") or []
            if t["key"] == d.TAINT_UNREACHABLE}


def tolerating(name: str, vm: str, seconds: int) -> dict:
    pod = python_pod(name, FOREVER, node=vm, grace=30)
    pod["spec"]["tolerations"] = [{"key": d.TAINT_UNREACHABLE, "operator": "Exists",
                                   "effect": "NoExecute", "tolerationSeconds": seconds}]
    return pod


def test_pods_get_the_default_toleration_seconds(kube):
    kube.create_pod(python_pod("tolerant", "pass"))
    tolerations = kube.pod("tolerant")["spec"]["tolerations"]
    assert {(t["key"], t["effect"], t["tolerationSeconds"]) for t in tolerations} == {
        ("node.kubernetes.io/not-ready", "NoExecute", 300),
        ("node.kubernetes.io/unreachable", "NoExecute", 300),
    }


def test_halted_vm_goes_unknown_its_pods_stay_then_come_back_failed(kube, cluster):
    # Short: deleted by taint eviction at once; long: the 300 s default, still Running.
    kube.create_pod(tolerating("short", "vm-a", 1))
    kube.create_pod(python_pod("long", FOREVER, node="vm-a", grace=30))
    kube.wait_phase("short", ("Running",))
    kube.wait_phase("long", ("Running",))
    halted = datetime.now(UTC)
    cluster.halt_node("vm-a", back_after_seconds=12)

    def marked():
        # The controller adds the NoSchedule taint in one pass and the NoExecute one from its
        # rate-limited eviction queue: both, whatever the order.
        obj = node(kube, "vm-a")
        return obj if ready(obj)["status"] == "Unknown" and len(unreachable(obj)) == 2 else None

    obj = wait_for(marked, what="node Unknown and tainted")
    # Not before the node monitor grace period, counted as kube-controller-manager counts it:
    # from the last Lease renewal it saw (node_lifecycle_controller.go, tryUpdateNodeHealth),
    # which may precede the halt by up to one renew interval. The kubelet is frozen, so the
    # Lease read now holds that last renewal; the condition's time has whole seconds.
    renewed = lease_renewed(kube, "vm-a")
    went_unknown = parse_time(ready(obj)["lastTransitionTime"])
    assert went_unknown >= (renewed + timedelta(seconds=2.0)).replace(microsecond=0)
    assert renewed >= halted - timedelta(seconds=2.0)  # the Lease was being renewed till then
    assert ready(obj)["reason"] == d.NODE_STATUS_UNKNOWN
    assert ready(obj)["message"] == d.NODE_STATUS_UNKNOWN_MESSAGE
    assert unreachable(obj) == {"NoExecute", "NoSchedule"}

    def evicted():
        pod = kube.pod("short")
        return pod if pod["metadata"].get("deletionTimestamp") else None

    pod = evicted() or wait_for(evicted, what="taint eviction")
    target = condition(pod, d.DISRUPTION_TARGET)
    assert target["reason"] == d.REASON_DELETION_BY_TAINT_MANAGER
    # No kubelet confirms: Terminating, and still Running in the API, as is the tolerant pod.
    assert pod["status"]["phase"] == "Running"
    long = kube.pod("long")
    assert long["status"]["phase"] == "Running" and not long["metadata"].get("deletionTimestamp")
    assert kube.pod("short") is not None

    # The VM boots again under its name: the kubelet finishes the deleted pod and reports the
    # one it cannot find a container for.
    wait_for(lambda: ready(node(kube, "vm-a"))["status"] == "True", timeout=30,
             what="node Ready again")
    kube.wait_gone("short")
    lost = kube.wait_phase("long", ("Failed",))
    terminated = container_status(lost)["state"]["terminated"]
    assert (terminated["reason"], terminated["exitCode"]) == ("ContainerStatusUnknown", 137)
    wait_for(lambda: not unreachable(node(kube, "vm-a")), what="unreachable taint removed")


def test_partitioned_kubelet_flaps_unknown_and_back_leaving_its_pods_alone(kube, cluster):
    kube.create_pod(python_pod("flap", FOREVER, node="vm-b"))
    kube.wait_phase("flap", ("Running",))
    cluster.partition_node("vm-b", 4.0)
    # The controller marks the node Unknown, then taints it from its own queue: the taint may
    # come a moment after the condition.
    wait_for(lambda: ready(obj := node(kube, "vm-b"))["status"] == "Unknown"
             and unreachable(obj), what="node Unknown and tainted unreachable")
    wait_for(lambda: ready(node(kube, "vm-b"))["status"] == "True", what="node Ready again")
    wait_for(lambda: not unreachable(node(kube, "vm-b")), what="unreachable taint removed")
    pod = kube.pod("flap")
    assert pod["status"]["phase"] == "Running" and not pod["metadata"].get("deletionTimestamp")
    kube.core.delete_namespaced_pod("flap", "default")
    kube.wait_gone("flap")


def test_out_of_service_taint_frees_pods_stuck_terminating(kube, cluster):
    kube.create_pod(tolerating("stuck", "vm-b", 0))
    kube.wait_phase("stuck", ("Running",))
    cluster.halt_node("vm-b")
    wait_for(lambda: (kube.pod("stuck") or {}).get("metadata", {}).get("deletionTimestamp"),
             what="taint eviction")
    assert kube.pod("stuck") is not None
    taints = node(kube, "vm-b")["spec"]["taints"]
    kube.core.patch_node("vm-b", {"spec": {"taints": [
        *taints, {"key": d.TAINT_OUT_OF_SERVICE, "value": "nodeshutdown",
                  "effect": "NoExecute"}]}})
    kube.wait_gone("stuck")
