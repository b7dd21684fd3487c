"""GKE's part acting on real nodes (real kubelets and containerd, `RealNodeCluster`), each
test asserting what kube-apiserver, kube-controller-manager and the real kubelet do about it:

- a VM lost without a shutdown (`RealNodeCluster.halt`): the node Unknown after the node
  monitor grace and tainted unreachable, taint eviction of a pod at its toleration's end
  (Terminating, still Running: no kubelet confirms), a pod with the default 300 s toleration
  left alone; the VM back under its name finishes the one and reports the other lost;
- a node cut off from the control plane (`partition`, `heal`): Unknown and tainted, then
  Ready and untainted, its pod never touched;
- the out-of-service taint freeing a pod stuck Terminating on a lost node;
- scheduled host maintenance (`schedule_maintenance`): the label ahead, at the start the
  impending-termination taint and the pods deleted with their own grace, the VM back under
  its name without the label;
- a multi-host TPU slice lost or maintained as one: a host halted takes the slice's other
  hosts down through their shutdown, a maintenance of one host is every host's, and the slice
  comes back whole;
- the cluster autoscaler's NotTriggerScaleUp on a pod no pool can take;
- kube-apiserver's default tolerations.

One cluster of two nodes and a slice of two hosts for the module; the tests share it in
order (`vm-b` is lost for good in the last one). With a training gang and the operator:
tests/e2e/test_node_loss.py, test_maintenance.py, test_node_pools.py, test_tpu_slices.py."""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from kube_helpers import Kube, PodRecorder, condition, container_status, wait_for
from kubernetes import client
from kubernetes.client import ApiException, V1Node
from tardigrade_local import nodeimage
from tardigrade_local.gke import disruptions as d
from tardigrade_local.gke.autoscaler import NOT_TRIGGER_SCALE_UP, NodePool
from tardigrade_local.gke.nodes import NodeConfig
from tardigrade_local.gke.tpuslices import TPU_TAINT, SliceShape, slice_nodes
from tardigrade_local.realcluster import NodePlan, RealNodeCluster

from tests.e2e.harness import NEEDS_REAL_NODES

pytestmark = [pytest.mark.slow, NEEDS_REAL_NODES]

# Fast node-loss detection, as tests/e2e/test_node_loss.py has it: the kubelets renew a 4 s
# Lease every second; kube-controller-manager looks every second and marks a node whose Lease
# went unrenewed for 6 s Unknown (not shorter: a real kubelet on a loaded 2-core machine
# would flap).
NODE_LEASE = 4
NODE_MONITOR_PERIOD = 1.0
NODE_MONITOR_GRACE = 6.0
# A pod's containers started (the busybox image is on every node, a fresh one too); a VM's
# boot and its kubelet's registration on a loaded machine.
POD_START_SECONDS = 120.0
NODE_BACK_SECONDS = 300.0
HALTED_BACK_AFTER = 15.0
# An autoscaled pool that can never grow, of nodes smaller than any machine: its verdicts on
# pods are all the autoscaler does here.
NO_ROOM = NodePool("no-room", max_size=0, template=NodeConfig(
    "template", capacity={"cpu": "1", "memory": "1Gi", "pods": "10"}))
FOREVER = "echo ready; while true; do sleep 1; done"
STOPS_ON_TERM = f"trap 'echo stopping; exit 0' TERM; {FOREVER}"
# The maintenance's pod saves for longer on SIGTERM than the kubelet's graceful node shutdown
# gives a regular pod (15 s): only the maintenance handler's grace, the pod's own, lets it
# finish.
SAVE_SECONDS = 20
SAVER_GRACE = 60
SAVER = (f"trap 'echo saving; sleep {SAVE_SECONDS}; echo saved; exit 42' TERM; "
         f"echo ready; while true; do sleep 1; done")
MAINTENANCE_IN = 5.0
MAINTENANCE_BACK_AFTER = 5.0
# A v5e slice of 2 hosts (4 chips each), its hosts as small as a real node here may be.
SLICE = slice_nodes("tpu-slice", SliceShape("tpu-v5-lite-podslice", "2x4", 4),
                    host_capacity={"cpu": "1", "memory": "2Gi", "pods": "10"})
SLICE_HOSTS = [host.name for host in SLICE]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealNodeCluster]:
    # Short: the kubelet's socket paths live under each node's directory.
    with RealNodeCluster(tmp_path_factory.mktemp("gke"),
                         [NodePlan("vm-a"), NodePlan("vm-b"), *map(NodePlan.of, SLICE)],
                         gcs=False, node_lease_seconds=NODE_LEASE,
                         node_monitor_period_seconds=NODE_MONITOR_PERIOD,
                         node_monitor_grace_seconds=NODE_MONITOR_GRACE, pools=[NO_ROOM],
                         autoscaler_scan_seconds=0.5) as running:
        yield running


@pytest.fixture(scope="module")
def kube(cluster: RealNodeCluster) -> Kube:
    return Kube(str(cluster.kubeconfig))


def sh_pod(name: str, script: str, node: str | None = None, grace: int | None = None,
           **spec: Any) -> dict[str, Any]:
    """A pod whose one container runs `script` in busybox's sh."""
    container = {"name": "main", "image": nodeimage.BUSYBOX_IMAGE, "imagePullPolicy": "Never",
                 "command": ["sh", "-c", script], **spec.pop("container", {})}
    body: dict[str, Any] = {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "labels": {"test": name}},
        "spec": {"restartPolicy": "Never", "containers": [container], **spec}}
    if node is not None:
        body["spec"]["nodeSelector"] = {"kubernetes.io/hostname": node}
    if grace is not None:
        body["spec"]["terminationGracePeriodSeconds"] = grace
    return body


def tolerating(name: str, node: str, seconds: int) -> dict[str, Any]:
    return sh_pod(name, FOREVER, node=node, grace=30, tolerations=[{
        "key": d.TAINT_UNREACHABLE, "operator": "Exists", "effect": "NoExecute",
        "tolerationSeconds": seconds}])


def started(kube: Kube, cluster: RealNodeCluster, name: str) -> dict[str, Any]:
    """The pod once its script said `ready` (its trap, if any, is set), read from the
    container's log on its node: not through kube-apiserver, whose first log request to a
    recreated VM's kubelet was seen to hang (the old VM's connection, dead)."""
    def ready() -> dict[str, Any] | None:
        pod = kube.pod(name)
        statuses = ((pod or {}).get("status") or {}).get("containerStatuses") or [{}]
        if "running" not in (statuses[0].get("state") or {}):
            return None
        node = cluster.nodes.get(pod["spec"]["nodeName"])
        logs = node.pod_logs_dir.glob(f"default_{name}_*/main/*.log") if node else []
        return pod if any("ready" in log.read_text() for log in logs) else None

    return wait_for(ready, POD_START_SECONDS, what=f"pod {name} running", interval=0.2)


def node(kube: Kube, name: str) -> dict[str, Any]:
    return kube.plain(kube.core.read_node(name))


def read_node(kube: Kube, name: str) -> V1Node | None:
    try:
        return kube.core.read_node(name)
    except ApiException as err:
        if err.status == 404:
            return None
        raise


def parse_time(stamp: str) -> datetime:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00"))


def lease_renewed(kube: Kube, name: str) -> datetime:
    lease = kube.plain(client.CoordinationV1Api(kube.api).read_namespaced_lease(
        name, "kube-node-lease"))
    return parse_time(lease["spec"]["renewTime"])


def ready(obj: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in obj["status"]["conditions"] if c["type"] == "Ready")


def unreachable(obj: dict[str, Any]) -> set[str]:
    return {t["effect"] for t in obj["spec"].get("taints") or []
            if t["key"] == d.TAINT_UNREACHABLE}


def delete(kube: Kube, *names: str) -> None:
    for name in names:
        kube.core.delete_namespaced_pod(name, "default", grace_period_seconds=0)


def test_pods_get_the_default_toleration_seconds(kube: Kube):
    kube.create_pod(sh_pod("tolerant", "true"))
    tolerations = kube.pod("tolerant")["spec"]["tolerations"]
    assert {(t["key"], t["effect"], t["tolerationSeconds"]) for t in tolerations} == {
        ("node.kubernetes.io/not-ready", "NoExecute", 300),
        ("node.kubernetes.io/unreachable", "NoExecute", 300),
    }
    delete(kube, "tolerant")


def test_halted_vm_goes_unknown_its_pods_stay_then_come_back_failed(
        kube: Kube, cluster: RealNodeCluster):
    # Short: deleted by taint eviction at once; long: the 300 s default, still Running.
    kube.create_pod(tolerating("short", "vm-a", 1))
    kube.create_pod(sh_pod("long", FOREVER, node="vm-a", grace=30))
    started(kube, cluster, "short")
    started(kube, cluster, "long")
    halted = datetime.now(UTC)
    cluster.halt("vm-a", back_after_seconds=HALTED_BACK_AFTER)

    def marked() -> dict[str, Any] | None:
        # The controller adds the NoSchedule taint in one pass and the NoExecute one from its
        # rate-limited eviction queue: both, whatever the order.
        obj = node(kube, "vm-a")
        return obj if ready(obj)["status"] == "Unknown" and len(unreachable(obj)) == 2 else None

    obj = wait_for(marked, 60, what="node Unknown and tainted")
    # Not before the node monitor grace period, counted as kube-controller-manager counts it:
    # from the last Lease renewal it saw (node_lifecycle_controller.go, tryUpdateNodeHealth).
    # The kubelet is dead, so the Lease read now holds that last renewal; the condition's
    # time has whole seconds.
    renewed = lease_renewed(kube, "vm-a")
    went_unknown = parse_time(ready(obj)["lastTransitionTime"])
    assert went_unknown >= (renewed + timedelta(seconds=NODE_MONITOR_GRACE)).replace(
        microsecond=0)
    # The Lease was being renewed till then (every second; late by at most its duration).
    assert renewed >= halted - timedelta(seconds=NODE_LEASE)
    assert ready(obj)["reason"] == d.NODE_STATUS_UNKNOWN
    assert ready(obj)["message"] == d.NODE_STATUS_UNKNOWN_MESSAGE
    assert unreachable(obj) == {"NoExecute", "NoSchedule"}

    def evicted() -> dict[str, Any] | None:
        pod = kube.pod("short")
        return pod if pod and pod["metadata"].get("deletionTimestamp") else None

    pod = wait_for(evicted, 60, what="taint eviction")
    target = condition(pod, d.DISRUPTION_TARGET)
    assert target is not None and target["reason"] == d.REASON_DELETION_BY_TAINT_MANAGER
    # No kubelet confirms: Terminating, and still Running in the API, as is the tolerant pod.
    assert pod["status"]["phase"] == "Running"
    long = kube.pod("long")
    assert long["status"]["phase"] == "Running" and not long["metadata"].get("deletionTimestamp")
    assert kube.pod("short") is not None

    # The VM boots again under its name (a fresh disk): its kubelet finishes the deleted pod
    # and reports the one it cannot find a container for.
    wait_for(lambda: ready(node(kube, "vm-a"))["status"] == "True", NODE_BACK_SECONDS,
             what="node Ready again", interval=0.5)
    kube.wait_gone("short", timeout=120)
    # The phase and the container's state may come in separate status writes.
    lost = wait_for(lambda: (found := kube.pod("long")) and found["status"]["phase"] == "Failed"
                    and "terminated" in (container_status(found).get("state") or {}) and found,
                    120, what="the lost pod Failed with its container terminated")
    terminated = container_status(lost)["state"]["terminated"]
    assert (terminated["reason"], terminated["exitCode"]) == ("ContainerStatusUnknown", 137)
    wait_for(lambda: not unreachable(node(kube, "vm-a")), 60, what="unreachable taint removed")
    delete(kube, "long")


def test_partitioned_kubelet_flaps_unknown_and_back_leaving_its_pods_alone(
        kube: Kube, cluster: RealNodeCluster):
    kube.create_pod(sh_pod("flap", FOREVER, node="vm-b"))
    started(kube, cluster, "flap")
    cluster.partition("vm-b")
    try:
        # The controller marks the node Unknown, then taints it from its own queue: the taint
        # may come a moment after the condition.
        wait_for(lambda: ready(obj := node(kube, "vm-b"))["status"] == "Unknown"
                 and unreachable(obj), 60, what="node Unknown and tainted unreachable")
    finally:
        cluster.heal("vm-b")
    wait_for(lambda: ready(node(kube, "vm-b"))["status"] == "True", 60, what="node Ready again")
    wait_for(lambda: not unreachable(node(kube, "vm-b")), 60, what="unreachable taint removed")
    pod = kube.pod("flap")
    assert pod["status"]["phase"] == "Running" and not pod["metadata"].get("deletionTimestamp")
    assert container_status(pod)["restartCount"] == 0
    delete(kube, "flap")
    kube.wait_gone("flap", timeout=60)


def test_maintenance_is_announced_then_terminates_the_node_with_the_pods_grace(
        kube: Kube, cluster: RealNodeCluster):
    kube.create_pod(sh_pod("saver", SAVER, node="vm-a", grace=SAVER_GRACE))
    started(kube, cluster, "saver")
    first_vm = kube.core.read_node("vm-a").metadata.uid
    with PodRecorder(kube, "default", "test=saver") as states:
        start = cluster.schedule_maintenance("vm-a", MAINTENANCE_IN,
                                             back_after_seconds=MAINTENANCE_BACK_AFTER)
        labels = kube.core.read_node("vm-a").metadata.labels
        assert labels[d.SCHEDULED_MAINTENANCE_LABEL] == str(int(start))
        assert kube.pod("saver")["status"]["phase"] == "Running"  # only announced

        def tainted() -> bool:
            found = read_node(kube, "vm-a")
            return found is not None and any(
                t.key == d.IMPENDING_TERMINATION_TAINT and t.effect == "NoSchedule"
                for t in found.spec.taints or [])

        wait_for(tainted, MAINTENANCE_IN + 60, "the impending-termination taint", interval=0.1)
        assert time.time() >= start - 0.5

        def first_vm_gone() -> bool:
            found = read_node(kube, "vm-a")
            return found is None or found.metadata.uid != first_vm

        # The handler waits for the pod to be gone before the VM shuts down.
        wait_for(first_vm_gone, SAVE_SECONDS + 120, "the maintenance to take the VM down",
                 interval=0.5)
    # The maintenance handler deleted the pod with its own grace, not a spot reclaim's, and
    # the pod finished its save: the real kubelet reported it terminated with the save's exit
    # code before the deletion ended (no DisruptionTarget: a plain deletion sets none).
    seen = states.seen["saver"]
    deleting = [s for s in seen if s["metadata"].get("deletionTimestamp")]
    assert deleting and deleting[0]["metadata"]["deletionGracePeriodSeconds"] == SAVER_GRACE
    terminated = [container_status(s)["state"]["terminated"] for s in seen
                  if (container_status(s).get("state") or {}).get("terminated")]
    assert terminated and terminated[-1]["exitCode"] == 42, terminated

    # The VM comes back under its name, registered anew: untainted, with no maintenance
    # scheduled any more.
    def successor() -> V1Node | None:
        found = read_node(kube, "vm-a")
        return found if found is not None and found.metadata.uid != first_vm else None

    back = wait_for(successor, NODE_BACK_SECONDS, "the VM back", interval=0.5)
    assert not any(t.key == d.IMPENDING_TERMINATION_TAINT for t in back.spec.taints or [])
    assert d.SCHEDULED_MAINTENANCE_LABEL not in back.metadata.labels


def slice_back(kube: Kube, cluster: RealNodeCluster, gone: dict[str, object]
               ) -> None:
    """Every host of the slice a new VM (not the RealNode in `gone`), its Node Ready."""
    def back() -> bool:
        return all(cluster.nodes.get(host) not in (None, gone[host])
                   and ready(node(kube, host))["status"] == "True" for host in SLICE_HOSTS)
    wait_for(back, NODE_BACK_SECONDS, "every host of the slice back", interval=0.5)


def test_a_halted_slice_host_takes_its_whole_slice_down_and_back(
        kube: Kube, cluster: RealNodeCluster):
    lost, other = SLICE_HOSTS
    for pod, host in (("on-lost", lost), ("on-other", other)):
        # Ends on SIGTERM, as a workload does: the kubelet writes the pod's status once it is
        # killed, and a pod still running at the shutdown's grace would be cut off with its VM.
        kube.create_pod(sh_pod(pod, STOPS_ON_TERM, node=host, grace=30,
                               tolerations=[{**TPU_TAINT, "operator": "Equal"}]))
    for pod in ("on-lost", "on-other"):
        started(kube, cluster, pod)
    vms = {host: cluster.nodes[host] for host in SLICE_HOSTS}
    with PodRecorder(kube, "default", "test in (on-lost,on-other)") as states:
        cluster.halt(lost, back_after_seconds=HALTED_BACK_AFTER)
        # The other host went through its kubelet's graceful node shutdown: its pod was told.
        wait_for(lambda: any(condition(s, d.DISRUPTION_TARGET)
                             for s in states.seen.get("on-other", [])), 60,
                 "the other host's pod given the node shutdown's DisruptionTarget")
    told = next(condition(s, d.DISRUPTION_TARGET) for s in states.seen["on-other"]
                if condition(s, d.DISRUPTION_TARGET))
    assert told["reason"] == d.REASON_TERMINATION_BY_KUBELET, told
    # The halted host's pod was killed with its VM: nobody told it.
    assert not any(condition(s, d.DISRUPTION_TARGET) for s in states.seen["on-lost"])
    # Both Nodes stayed (stopped VMs, not deleted ones) and the slice comes back as one.
    assert {n.metadata.name for n in kube.core.list_node().items} >= set(SLICE_HOSTS)
    slice_back(kube, cluster, dict(vms))
    delete(kube, "on-lost", "on-other")


def test_maintenance_of_one_slice_host_is_the_whole_slices(
        kube: Kube, cluster: RealNodeCluster):
    first = {host: kube.core.read_node(host).metadata.uid for host in SLICE_HOSTS}
    vms = {host: cluster.nodes[host] for host in SLICE_HOSTS}
    start = cluster.schedule_maintenance(SLICE_HOSTS[0], MAINTENANCE_IN,
                                         back_after_seconds=MAINTENANCE_BACK_AFTER)
    for host in SLICE_HOSTS:  # announced on every host, for the same start
        labels = kube.core.read_node(host).metadata.labels
        assert labels[d.SCHEDULED_MAINTENANCE_LABEL] == str(int(start)), (host, labels)

    def replaced() -> bool:
        return all((found := read_node(kube, host)) is not None
                   and found.metadata.uid != first[host] for host in SLICE_HOSTS)
    # Each host's Node goes with its VM and comes back as a new one.
    wait_for(replaced, MAINTENANCE_IN + NODE_BACK_SECONDS, "every host maintained and back",
             interval=0.5)
    slice_back(kube, cluster, dict(vms))
    for host in SLICE_HOSTS:
        back = kube.core.read_node(host)
        assert d.SCHEDULED_MAINTENANCE_LABEL not in back.metadata.labels, host
        assert not any(t.key == d.IMPENDING_TERMINATION_TAINT for t in back.spec.taints or [])


def test_a_pod_no_pool_can_take_gets_not_trigger_scale_up(kube: Kube):
    kube.create_pod(sh_pod("too-big", "true",
                           container={"resources": {"requests": {"cpu": "64"}}}))

    def told() -> list[str] | None:
        listed = kube.core.list_namespaced_event(
            "default", field_selector="involvedObject.kind=Pod,involvedObject.name=too-big")
        return [e.message for e in listed.items if e.reason == NOT_TRIGGER_SCALE_UP] or None

    assert wait_for(told, 60, what="NotTriggerScaleUp") == [
        "pod didn't trigger scale-up: 1 Insufficient cpu"]
    delete(kube, "too-big")


def test_out_of_service_taint_frees_pods_stuck_terminating(
        kube: Kube, cluster: RealNodeCluster):
    kube.create_pod(tolerating("stuck", "vm-b", 0))
    started(kube, cluster, "stuck")
    cluster.halt("vm-b")  # lost for good
    wait_for(lambda: (kube.pod("stuck") or {}).get("metadata", {}).get("deletionTimestamp"),
             60, what="taint eviction")
    assert kube.pod("stuck") is not None
    # No kubelet confirms the deletion: the pod stays Terminating.
    wait_for(lambda: unreachable(node(kube, "vm-b")) == {"NoExecute", "NoSchedule"}, 30,
             what="both unreachable taints")
    assert kube.pod("stuck") is not None
    taints = node(kube, "vm-b")["spec"]["taints"]
    kube.core.patch_node("vm-b", {"spec": {"taints": [
        *taints, {"key": d.TAINT_OUT_OF_SERVICE, "value": "nodeshutdown",
                  "effect": "NoExecute"}]}})
    # kube-controller-manager's pod garbage collector (every 20 s) force-deletes a terminating
    # pod of a not-ready node with that taint.
    kube.wait_gone("stuck", timeout=90)
