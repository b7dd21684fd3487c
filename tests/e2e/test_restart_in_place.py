"""End to end on real nodes, restart in place on: the operator installed by helm from the
registry's image (the chart's `operator.restartInPlace`), real JAX trainers in containers of
the trainer-cpu image on real kubelets v1.36.3, checkpointing to the GCS emulator.

Three spot nodes, one trainer each (a trainer asks for more than half a node's CPU). Two
kubelets run with their release's defaults, under which a container's restart rule
(`restartPolicyRules`, KEP-5307) is followed: gate `ContainerRestartRules`, beta and on by
default since 1.35 on kube-apiserver (which otherwise drops the field) and kubelet. The third
kubelet runs with that gate off (and `RestartAllContainersOnContainerExits`, which depends on
it, off too: `realnode.KUBELET_WITHOUT_RESTART_RULES`): it ignores restart rules, as a kubelet
before 1.34 does, so a trainer exiting 77 there ends its `restartPolicy: Never` pod. What
differs from a real 1.33 kubelet: it reports v1.36.3, so the operator cannot tell it by its
version; it tells it by the Node's `status.declaredFeatures`, which lacks
RestartAllContainersOnContainerExits (`keepers.kubelet_supports_rules`). So every gang of three
has ranks that can restart in place and one that must be recreated.

Every test runs twice: kept trainers restarted by the real kubelet on their rule (exit 77),
and restarted in process (the chart's `operator.restartInProcess`), where no kept container
restarts and the pod on the kubelet without rules is kept too."""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from tardigrade_local import nodeimage
from tardigrade_local.realcluster import plan_nodes
from tardigrade_local.realnode import KUBELET_WITHOUT_RESTART_RULES
from tardigrade_local.steplog import StepLog
from tardigrade_operator.decision.recovery import keepers

from tests.e2e.harness import (
    NAMESPACE,
    NEEDS_REAL_NODES,
    InstalledOperator,
    RealCluster,
    assert_goodput_adds_up,
    installed_operator,
    real_cluster,
    wait_for,
)
from tests.local.kube_helpers import Kube, PodRecorder

pytestmark = [
    pytest.mark.slow,
    NEEDS_REAL_NODES,
]

SPOT_NODES = 3
# plan_nodes(1, 3): real-1 is the operator's on-demand node, real-2..4 the spot ones.
VICTIM_NODE, OLD_NODE = "real-2", "real-4"
# The node pool recreates the reclaimed VM soon: the lost rank's new pod waits for it (one
# trainer per node), and the job's minReplicas keeps the operator from shrinking meanwhile.
REPLACE_AFTER_SECONDS = 1.0
NODE_BACK_SECONDS = 300.0
STEPS = 300
# Pulls of the 1 GB trainer image, JAX's start and compile, three trainers on a shared machine.
TRAIN_SECONDS = 600.0
FINISH_SECONDS = 600.0
# The log shipper reads the nodes' files every `logshipper.POLL_SECONDS`; a loaded machine.
SHIPPED_SECONDS = 60.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealCluster]:
    nodes = [dataclasses.replace(plan, kubelet_feature_gates=KUBELET_WITHOUT_RESTART_RULES)
             if plan.name == OLD_NODE else plan for plan in plan_nodes(1, SPOT_NODES)]
    # Short: the kubelet's socket paths live under each node's directory.
    with real_cluster(tmp_path_factory.mktemp("inp"), SPOT_NODES, nodes=nodes) as running:
        yield running


@pytest.fixture(scope="module", params=["by kubelet", "in process"])
def operator(request: pytest.FixtureRequest, cluster: RealCluster,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[InstalledOperator]:
    in_process = request.param == "in process"
    # Uninstalled at the end: the next param installs the release again, other values.
    with installed_operator(cluster, tmp_path_factory.mktemp("operator"),
                            "--set", "operator.restartInPlace=true",
                            "--set", f"operator.restartInProcess={str(in_process).lower()}",
                            uninstall=True) as installed:
        installed.in_process = in_process  # type: ignore[attr-defined]
        yield installed


@pytest.fixture(autouse=True)
def _one_job_at_a_time(request: pytest.FixtureRequest, cluster: RealCluster
                       ) -> Iterator[None]:
    yield
    if "operator" in request.fixturenames:  # the chart brings the CRD
        cluster.clear_jobs()


def _node_json(cluster: RealCluster, name: str) -> dict[str, Any]:
    """The Node as the API server has it (kubectl: the Python client may predate
    `status.declaredFeatures`)."""
    return dict(json.loads(cluster.kubectl("get", "node", name, "-o", "json")))


def _one_trainer_per_node(cluster: RealCluster) -> str:
    """A CPU request of more than half a spot node's allocatable: one trainer per node."""
    cpu = _node_json(cluster, VICTIM_NODE)["status"]["allocatable"]["cpu"]
    millis = int(cpu[:-1]) if cpu.endswith("m") else int(float(cpu) * 1000)
    return f"{millis // 2 + 100}m"


def _job(cluster: RealCluster, name: str, replicas: int, min_replicas: int
         ) -> dict[str, Any]:
    job = cluster.trainingjob(name, steps=STEPS, replicas=replicas, minReplicas=min_replicas)
    job["spec"]["resources"]["requests"]["cpu"] = _one_trainer_per_node(cluster)
    job["spec"]["checkpoint"]["interval"] = {"steps": 1000}  # only the coordinated save
    # Split evenly over 2 and 3 ranks of one device each.
    job["spec"]["trainer"]["global_batch_size"] = 12
    return job


def _pods(cluster: RealCluster, name: str) -> dict[str, Any]:
    return {p.metadata.name: p for p in cluster.pods(name) if p.metadata.deletion_timestamp
            is None}


def _in_process(operator: InstalledOperator) -> bool:
    """The operator of this run restarts kept trainers in process (the fixture's param)."""
    return bool(getattr(operator, "in_process", False))


def _name(base: str, operator: InstalledOperator) -> str:
    """One name (and checkpoint path) per way of restarting: the second run must not find
    the first's checkpoints."""
    return f"{base}-exec" if _in_process(operator) else base


def _restarts(pod: Any) -> int:
    return max((s.restart_count or 0 for s in pod.status.container_statuses or []), default=0)


def _train_past(cluster: RealCluster, log: StepLog, name: str, step: int) -> None:
    def past() -> bool:
        log.collect()
        status = cluster.status(name)
        if status.get("phase") == "Failed":
            raise AssertionError(f"{name} failed: {status.get('message')}")
        return log.last_step >= step
    wait_for(past, TRAIN_SECONDS, f"training past {step}")


def _wait_running(cluster: RealCluster, log: StepLog, name: str, field: str, value: int,
                  what: str) -> None:
    """Until the job is Running with status `field` at `value`, after its one recovery; a job
    that went on to another recovery, or ended, fails at once with its status."""

    def running() -> dict[str, Any] | None:
        log.collect()
        status = cluster.status(name)
        if status.get("attempt", 0) > 2 or status.get("phase") in ("Succeeded", "Failed"):
            raise AssertionError(f"waiting for {what}, {name} went on: {status}")
        return status if status.get(field) == value and status.get("phase") == "Running" \
            else None

    wait_for(running, NODE_BACK_SECONDS + TRAIN_SECONDS, what)


def _assert_every_step_trained(cluster: RealCluster, name: str, steps: int) -> None:
    """From the logs shipped off the nodes (a real kubelet removes a deleted pod's files)."""
    missing: list[int] = []

    def all_shipped() -> bool:
        losses = cluster.complete_log(name).losses
        missing[:] = [s for s in range(1, steps + 1) if s not in losses]
        return not missing
    try:
        wait_for(all_shipped, SHIPPED_SECONDS, "every step's loss shipped")
    except AssertionError as err:
        raise AssertionError(f"no loss logged for steps {missing[:10]}") from err


def _assert_kept_and_recreated(before: dict[str, Any], after: dict[str, Any],
                               lost: set[str], operator: InstalledOperator,
                               log: StepLog) -> None:
    """Pods that were not lost stay (same uid) where their trainer can restart: on a node
    whose kubelet follows restart rules, or on any node in process with the container
    untouched; the rest are new."""
    for name, pod in before.items():
        old_kubelet = pod.spec.node_name == OLD_NODE and not _in_process(operator)
        if old_kubelet or name in lost:
            assert name not in after, f"{name} on {pod.spec.node_name} should be recreated"
            continue
        assert name in after, f"{name} on {pod.spec.node_name} was not kept"
        assert after[name].metadata.uid == pod.metadata.uid
        if _in_process(operator):
            assert _restarts(after[name]) == 0, f"{name}'s container restarted"
        else:
            assert _restarts(after[name]) >= 1, f"{name} was kept but never restarted"
    rank0 = next(name for name, pod in before.items()
                 if pod.metadata.labels["tardigrade.dev/rank"] == "0")
    if _in_process(operator) and rank0 in after:
        # Rank 0 was kept: its trainer said it would restart in process (the step log reads
        # rank 0's pods only).
        said = [r for r in log.records if r.get("event") == "restart_in_place"]
        assert said and said[-1]["in_process"] is True, said
        # Its new attempt is a new child of the same container process (attempts.py), which
        # kept its imports: none were paid again.
        starts = {r["attempt"]: r for r in log.records if r.get("event") == "startup"}
        old, new = (starts[a] for a in sorted(starts)[-2:])
        assert new["keeper_pid"] == old["keeper_pid"] and new["pid"] != old["pid"], starts
        assert new["imports_done"] - new["process_started"] < 0.05, new


WORLD_ANNOTATION = "tardigrade.dev/world"


@dataclasses.dataclass(frozen=True)
class PodEvent:
    pod: str
    attempt: str  # the pod's attempt label in this event
    restarts: int  # its container's restart count

    @classmethod
    def of(cls, pod: dict[str, Any]) -> PodEvent:
        restarts = max((s.get("restartCount") or 0
                        for s in pod["status"].get("containerStatuses") or []), default=0)
        return cls(pod["metadata"]["name"], pod["metadata"]["labels"]["tardigrade.dev/attempt"],
                   restarts)


def pod_events(cluster: RealCluster, job: str) -> PodRecorder:
    """The job's pod watch events from now on, in the order the API server sent them."""
    return PodRecorder(Kube(str(cluster.real.kubeconfig)), NAMESPACE,
                       f"tardigrade.dev/job={job}",
                       timeout_seconds=int(NODE_BACK_SECONDS + TRAIN_SECONDS),
                       since_now=True).start()


def _assert_kept_pods_joined_after_the_gang_ran(cluster: RealCluster, name: str,
                                                kept: set[str], recovery: dict[str, Any],
                                                events: PodRecorder,
                                                operator: InstalledOperator) -> None:
    """Every pod of the new attempt carries its world; a kept pod gets the new attempt's label
    only once the whole gang runs again, so no pod write competes with its restart."""
    labelled = wait_for(lambda: (pods := [p for p in cluster.pods(name)
                                          if p.metadata.labels["tardigrade.dev/attempt"] == "2"
                                          and p.metadata.deletion_timestamp is None])
                        and len(pods) == 3 and pods, 120, "every pod labelled anew")
    worlds = {p.metadata.name: json.loads(p.metadata.annotations[WORLD_ANNOTATION])
              for p in labelled}
    assert {w["attempt"] for w in worlds.values()} == {2}, worlds
    assert sorted(w["processId"] for w in worlds.values()) == [0, 1, 2], worlds
    assert kept <= set(worlds), (kept, worlds)
    # The kept pods' worlds name the step the gang restored (the pin), as the new pod's does.
    assert {worlds[pod]["restoreStep"] for pod in kept} == {str(recovery["restoreStep"])}
    seen = [PodEvent.of(pod) for pod in events.stop()]
    assert events.error is None, events.error
    relabels = [i for i, e in enumerate(seen) if e.pod in kept and e.attempt == "2"]
    assert relabels, seen
    if _in_process(operator):
        # The gang met again on rank 0's report of the new attempt, not a container restart.
        assert recovery.get("gangFormedTime"), recovery
        return
    restarted = [next(i for i, e in enumerate(seen) if e.pod == pod and e.restarts >= 1)
                 for pod in kept]
    assert min(relabels) > max(restarted), (restarted, relabels)
    for pod in kept:
        # The kept rank's own world came with the request, not with a pod patch: the trainer
        # said which attempt it saved for as its container ended.
        status = cluster.core.read_namespaced_pod(pod, NAMESPACE).status.container_statuses[0]
        saved = json.loads(status.last_state.terminated.message)
        assert saved["attempt"] == 1, saved


def _rule_pod(name: str, node: str) -> dict[str, Any]:
    """A container with the trainer's restart rule and, as the trainer has, an env var from
    an annotation: it runs until told to go, then exits 77; restarted, it runs on if the
    annotation it got is the one written after the pod's creation (else exits 77 again)."""
    script = ("if [ -e /marks/once ]; then [ \"$WORLD\" = second ] || exit 77; "
              "echo \"world=$WORLD\"; exec sleep 3600; fi; touch /marks/once; "
              "while [ ! -e /marks/go ]; do sleep 0.2; done; exit 77")
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "annotations": {WORLD_ANNOTATION: "first"}},
            "spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 0,
                     "nodeSelector": {"kubernetes.io/hostname": node},
                     "volumes": [{"name": "marks", "emptyDir": {}}],
                     "containers": [{
                         "name": "main", "image": nodeimage.BUSYBOX_IMAGE,
                         "imagePullPolicy": "Never", "command": ["sh", "-c", script],
                         "env": [{"name": "WORLD", "valueFrom": {"fieldRef": {
                             "fieldPath": f"metadata.annotations['{WORLD_ANNOTATION}']"}}}],
                         "volumeMounts": [{"name": "marks", "mountPath": "/marks"}],
                         **keepers.restart_rule()}]}}


def test_kubelets_follow_the_restart_rule_unless_their_gate_is_off(cluster: RealCluster):
    """The real kubelets themselves, before any operator: the operator's rule restarts the
    container in the same pod on the two default kubelets, with the env var resolved again
    from the annotation as it is now, and ends the pod on the kubelet with the gate off; the
    Nodes say which is which (what the operator reads)."""
    nodes = {"real-2": "new", "real-3": "new", OLD_NODE: "old"}
    names = {node: f"rule-{node}" for node in nodes}
    for node in nodes:
        cluster.core.create_namespaced_pod(NAMESPACE, _rule_pod(names[node], node))

    def read() -> dict[str, Any]:
        return {node: cluster.core.read_namespaced_pod(names[node], NAMESPACE)
                for node in nodes}

    def running() -> dict[str, Any] | None:
        pods = read()
        return pods if all(p.status.phase == "Running" for p in pods.values()) else None

    seen: dict[str, Any] = {}

    def settled() -> dict[str, Any] | None:
        pods = read()
        seen.update(pods)
        for node, pod in pods.items():
            statuses = pod.status.container_statuses or []
            if nodes[node] == "new" and not (statuses and statuses[0].restart_count >= 1
                                            and statuses[0].state.running is not None):
                return None
            if nodes[node] == "old":
                # Restarted: that kubelet follows the rule after all (its gates not set?).
                assert not (statuses and statuses[0].restart_count), (node, statuses)
                if pod.status.phase != "Failed":
                    return None
        return pods
    try:
        created = wait_for(running, 180, "the rule pods running")
        for node in nodes:
            cluster.core.patch_namespaced_pod(names[node], NAMESPACE, {
                "metadata": {"annotations": {WORLD_ANNOTATION: "second"}}})
            cluster.kubectl("exec", names[node], "--", "touch", "/marks/go")
        try:
            pods = wait_for(settled, 180, "the rule pods restarted or ended")
        except AssertionError as err:
            raise AssertionError(f"{err}\n" + "\n".join(
                f"{node}: {pod.status.phase} {pod.status.container_statuses}"
                for node, pod in seen.items())) from err
        for node, pod in pods.items():
            assert pod.metadata.uid == created[node].metadata.uid
            status = pod.status.container_statuses[0]
            if nodes[node] == "new":
                # Restarted by the rule after its exit 77, in the same pod, with the env var
                # read from the annotation as it is now.
                assert pod.status.phase == "Running", pod.status
                assert status.last_state.terminated.exit_code == 77, status
                log = cluster.core.read_namespaced_pod_log(names[node], NAMESPACE)
                assert "world=second" in log, log
            else:
                assert status.restart_count == 0, status
                assert status.state.terminated.exit_code == 77, status
        for node, kind in nodes.items():
            found = _node_json(cluster, node)
            assert found["status"]["nodeInfo"]["kubeletVersion"].startswith("v1.36."), found
            assert keepers.kubelet_supports_rules(found) is (kind == "new"), \
                found["status"].get("declaredFeatures")
    finally:
        for name in names.values():
            cluster.core.delete_namespaced_pod(name, NAMESPACE, grace_period_seconds=0)


def test_preemption_of_one_rank_restarts_the_others_in_place(cluster: RealCluster,
                                                             operator: InstalledOperator):
    name = _name("inplace-preempt", operator)
    cluster.apply(_job(cluster, name, replicas=3, min_replicas=3))
    log = cluster.step_log(name)
    _train_past(cluster, log, name, 8)
    before = _pods(cluster, name)
    assert {p.spec.node_name for p in before.values()} == {"real-2", "real-3", OLD_NODE}
    victim = next(p for p in before.values() if p.spec.node_name == VICTIM_NODE)
    events = pod_events(cluster, name)
    # The reclaim returns once the VM is off; the pool recreates it a moment later, where the
    # lost rank's new pod goes (one trainer per node).
    reclaim = threading.Thread(target=cluster.real.reclaim,
                               args=(VICTIM_NODE, REPLACE_AFTER_SECONDS), daemon=True)
    reclaim.start()
    _wait_running(cluster, log, name, "attempt", 2, "the gang running again")
    after = _pods(cluster, name)
    _assert_kept_and_recreated(before, after, {victim.metadata.name}, operator, log)
    kept = {pod for pod in before if pod in after}
    _assert_kept_pods_joined_after_the_gang_ran(
        cluster, name, kept, cluster.status(name)["recoveries"][0], events, operator)
    status = cluster.wait_phase(name, {"Succeeded"}, timeout=FINISH_SECONDS, collector=log)
    operator.assert_alive()
    assert status["restarts"]["preemptions"] == 1 and status["restarts"]["failures"] == 0
    recovery = status["recoveries"][0]
    assert recovery["cause"] == "Preemption", recovery
    # In process the rank on the kubelet without rules is kept too.
    assert recovery["keptPods"] == (2 if _in_process(operator) else 1), recovery
    assert recovery["stepsLost"] == 0, recovery
    assert recovery["restoreStep"] >= 8 and recovery["downtimeSeconds"] > 0
    _assert_every_step_trained(cluster, name, STEPS)
    assert_goodput_adds_up(cluster, name)
    reclaim.join(NODE_BACK_SECONDS)


def test_resize_keeps_the_gang_and_adds_a_rank(cluster: RealCluster,
                                               operator: InstalledOperator):
    name = _name("inplace-resize", operator)
    cluster.apply(_job(cluster, name, replicas=2, min_replicas=2))
    log = cluster.step_log(name)
    _train_past(cluster, log, name, 8)
    before = _pods(cluster, name)
    cluster.kubectl("scale", f"tj/{name}", "--replicas=3")
    _wait_running(cluster, log, name, "replicas", 3, "3 ranks running")
    after = _pods(cluster, name)
    assert len(after) == 3
    _assert_kept_and_recreated(before, after, set(), operator, log)
    status = cluster.wait_phase(name, {"Succeeded"}, timeout=FINISH_SECONDS, collector=log)
    recovery = status["recoveries"][0]
    assert recovery["cause"] == "Resize" and recovery["toReplicas"] == 3
    kept = sum(p.spec.node_name != OLD_NODE or _in_process(operator)
               for p in before.values())
    assert recovery["keptPods"] == kept, recovery
    assert recovery["stepsLost"] == 0, recovery
    _assert_every_step_trained(cluster, name, STEPS)
