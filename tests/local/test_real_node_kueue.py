"""TrainingJobs under real Kueue on real nodes, with real trainers: Kueue's manager (the pinned
v0.19.2, `RealNodeCluster(kueue=True)`) beside the control plane, Tardigrade installed by
`helm install` of the chart with the operator image from the local registry (its objects
going through Kueue's webhooks, as on a GKE cluster where Kueue came first), and gangs of two
trainer-cpu ranks on the real spot nodes a ResourceFlavor names, checkpointing to the shared
claim. waitForPodsReady is on with a short timeout (on by default from v0.19, 30 min there).

- A ClusterQueue's quota (one gang's cpu) admits whole gangs: a job that does not fit waits in
  phase Queued with Kueue's reason and no pod, and runs once the first job's end frees the
  quota; the two gangs never hold the quota together.
- A gang training past the PodsReady timeout is never evicted for it.
- That gang, of low priority, is preempted for a high-priority job: every rank saves the same
  step, the gang is requeued, and once the high job is done it resumes from exactly that step,
  no step lost, its restart budget untouched.

What the trainers did is read from the record: their termination messages (kept by a watch
on the job's pods, as the operator deletes stopped pods), rank 0's log, the jobs' status and
events, the Workloads' conditions. The rest of Kueue's behaviours (resizes, grows and
shrinks, suspend, queue moves, a gang that cannot start within the PodsReady timeout) are
tests/e2e/test_kueue.py's, on real nodes too.

One cluster (three real nodes: the operator's, two spot ones for the gangs) for the module;
the tests run in order and build on each other.
"""

from __future__ import annotations

import copy
import os
import sys
import time
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import pytest
from kube_helpers import Kube, PodRecorder, kubectl, wait_for
from kubernetes import client
from tardigrade_local import gobuild
from tardigrade_local.kueue import WaitForPodsReady
from tardigrade_local.realcluster import (
    CHECKPOINT_CLAIM,
    CHECKPOINT_MOUNT,
    SPOT_LABEL,
    RealNodeCluster,
    plan_nodes,
)
from tardigrade_local.steplog import StepLog
from tardigrade_operator.api import types
from tardigrade_operator.decision import queueing

from tests.conftest import EXAMPLES, load_yaml

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux") or os.geteuid() != 0,
                       reason="real nodes need Linux and root (namespaces, mounts, cgroups)"),
]

KUEUE = (queueing.GROUP, queueing.VERSION)
NAMESPACE = "default"
QUEUE, CLUSTER_QUEUE, FLAVOR = "team-queue", "team", "spot"
SPOT_NODES = ("real-2", "real-3")
# Each rank asks for half a cpu and the quota is one cpu: one gang of two at a time.
RANK_CPU, QUOTA_CPU = "500m", "1"
# Short, so that a gang trains well past it within the module; long enough for a gang whose
# image is on its nodes already (`prepulled`) to start on a machine other runs share. A
# PodsReady eviction is requeued after seconds, not Kueue's minutes.
PODS_READY = WaitForPodsReady(timeout_seconds=60, backoff_base_seconds=5,
                              backoff_max_seconds=10)
# JAX's start and compile on a shared machine.
START_TIMEOUT_SECONDS = 600.0
FINISH_TIMEOUT_SECONDS = 600.0
KUEUE_TIMEOUT_SECONDS = 120.0
PULL_TIMEOUT_SECONDS = 600.0
POLL_SECONDS = 0.5
# The first job trains long enough for the second to be seen waiting behind it.
FIRST_STEPS, SECOND_STEPS, HIGH_STEPS = 1500, 60, 60


@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealNodeCluster]:
    yield from started_real(tmp_path_factory)


def started_real(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealNodeCluster]:
    """The module's cluster: Kueue (the module gobuild.kueue_module names), three real
    nodes, no GCS emulator (checkpoints go to the shared claim)."""
    print(f"Kueue {gobuild.kueue_version()} ({gobuild.kueue_module().name})")
    with RealNodeCluster(tmp_path_factory.mktemp("rkueue"), plan_nodes(1, len(SPOT_NODES)),
                         gcs=False, kueue=True, kueue_wait_for_pods_ready=PODS_READY
                         ) as running:
        yield running


@pytest.fixture(scope="module")
def kube(real) -> Kube:
    return Kube(str(real.kubeconfig))


@pytest.fixture(scope="module")
def custom(kube) -> client.CustomObjectsApi:
    return client.CustomObjectsApi(kube.api)


def kueue_objects() -> list[tuple[str, dict[str, Any]]]:
    """A flavor for the spot nodes (its node labels pin an admitted gang there), two priority
    classes, a ClusterQueue of one gang's cpu that preempts lower priority within itself."""
    meta = {"apiVersion": f"{queueing.GROUP}/{queueing.VERSION}"}
    quota = [{"name": "cpu", "nominalQuota": QUOTA_CPU},
             {"name": "memory", "nominalQuota": "64Gi"}]
    return [
        ("resourceflavors", {**meta, "kind": "ResourceFlavor", "metadata": {"name": FLAVOR},
                             "spec": {"nodeLabels": {SPOT_LABEL: "true"}}}),
        ("workloadpriorityclasses", {**meta, "kind": "WorkloadPriorityClass",
                                     "metadata": {"name": "low"}, "value": 10}),
        ("workloadpriorityclasses", {**meta, "kind": "WorkloadPriorityClass",
                                     "metadata": {"name": "high"}, "value": 1000}),
        ("clusterqueues", {**meta, "kind": "ClusterQueue", "metadata": {"name": CLUSTER_QUEUE},
                           "spec": {"namespaceSelector": {},
                                    "preemption": {"withinClusterQueue": "LowerPriority"},
                                    "resourceGroups": [{
                                        "coveredResources": ["cpu", "memory"],
                                        "flavors": [{"name": FLAVOR, "resources": quota}]}]}}),
    ]


def prepull(kube: Kube, image: str) -> None:
    """The trainer image on each spot node before any gang is admitted: its first pull (1 GB
    from the registry, on a shared machine) is not what a PodsReady timeout of a minute is
    about."""
    for node in SPOT_NODES:
        kube.create_pod({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"pull-{node}"},
                         "spec": {"restartPolicy": "Never",
                                  "nodeSelector": {"kubernetes.io/hostname": node},
                                  "containers": [{"name": "main", "image": image,
                                                  "command": ["python", "-c", "pass"]}]}})
    for node in SPOT_NODES:
        pod = kube.wait_phase(f"pull-{node}", ("Succeeded", "Failed"),
                              timeout=PULL_TIMEOUT_SECONDS)
        assert pod["status"]["phase"] == "Succeeded", pod["status"]
        kube.core.delete_namespaced_pod(f"pull-{node}", NAMESPACE)


@pytest.fixture(scope="module")
def installed(real, kube, custom) -> str:
    """The operator installed with helm (rank 0's progress read every 2 s), Kueue's queues,
    the trainer image on the spot nodes; returns that image."""
    real.install_operator("--set", "operator.progressMaxIntervalSeconds=2")
    for plural, body in kueue_objects():
        custom.create_cluster_custom_object(*KUEUE, plural, body)
    custom.create_namespaced_custom_object(*KUEUE, NAMESPACE, "localqueues", {
        "apiVersion": f"{queueing.GROUP}/{queueing.VERSION}", "kind": "LocalQueue",
        "metadata": {"name": QUEUE, "namespace": NAMESPACE},
        "spec": {"clusterQueue": CLUSTER_QUEUE}})
    prepull(kube, real.images["trainer-cpu"])
    return str(real.images["trainer-cpu"])


@pytest.fixture(scope="module")
def recorder(kube) -> Iterator[PodRecorder]:
    with PodRecorder(kube, NAMESPACE, "tardigrade.dev/job") as running:
        yield running


# --- the jobs ------------------------------------------------------------------------------------
def job(name: str, image: str, steps: int, priority: str | None = None) -> dict[str, Any]:
    """The example as a gang of exactly two (no partial admission: minReplicas = replicas)
    under the queue, small, checkpointing to the shared claim only when preempted."""
    body = copy.deepcopy(load_yaml(EXAMPLES / "trainingjob.yaml"))
    labels = {queueing.QUEUE_LABEL: QUEUE}
    if priority:
        labels[queueing.PRIORITY_LABEL] = priority
    body["metadata"] = {"name": name, "namespace": NAMESPACE, "labels": labels}
    spec = body["spec"]
    spec.update(replicas=2, minReplicas=2, maxReplicas=2, image=image,
                resources={"requests": {"cpu": RANK_CPU, "memory": "512Mi"},
                           "limits": {"memory": "3Gi"}})
    spec["trainer"].update(steps=steps, global_batch_size=8, seq_len=16, devices_per_process=1)
    spec["checkpoint"].update(path=f"{CHECKPOINT_MOUNT}/{name}", interval={"steps": 100_000},
                              saveOnPreemption=True)
    spec["podTemplate"] = {
        "terminationGracePeriodSeconds": 30,
        "volumes": [{"name": "checkpoints",
                     "persistentVolumeClaim": {"claimName": CHECKPOINT_CLAIM}}],
        "volumeMounts": [{"name": "checkpoints", "mountPath": CHECKPOINT_MOUNT}]}
    return body


def create(custom: client.CustomObjectsApi, body: dict[str, Any]) -> None:
    custom.create_namespaced_custom_object(types.GROUP, types.VERSION, NAMESPACE, types.PLURAL,
                                           body)


def status(custom: client.CustomObjectsApi, name: str) -> dict[str, Any]:
    found = custom.get_namespaced_custom_object(types.GROUP, types.VERSION, NAMESPACE,
                                                types.PLURAL, name)
    return dict(found.get("status") or {})


def step(custom: client.CustomObjectsApi, name: str) -> int:
    return int(status(custom, name).get("step") or 0)


def wait_phase(custom: client.CustomObjectsApi, name: str, phases: set[str],
               timeout: float) -> dict[str, Any]:
    def reached() -> dict[str, Any] | None:
        current = status(custom, name)
        assert current.get("phase") != "Failed", current
        return current if current.get("phase") in phases else None

    return wait_for(reached, timeout, what=f"{name} in {sorted(phases)}", interval=POLL_SECONDS)


def pods(kube: Kube, name: str) -> list[dict[str, Any]]:
    return [kube.plain(p) for p in kube.core.list_namespaced_pod(
        NAMESPACE, label_selector=f"tardigrade.dev/job={name}").items
        if not p.metadata.deletion_timestamp]


def events(kube: Kube, name: str) -> list[str]:
    listed = kube.core.list_namespaced_event(
        NAMESPACE, field_selector=f"involvedObject.name={name}").items
    return [e.reason for e in listed]


def workload_of(custom: client.CustomObjectsApi, name: str) -> dict[str, Any] | None:
    listed = custom.list_namespaced_custom_object(*KUEUE, NAMESPACE, queueing.WORKLOADS,
                                                  label_selector=f"tardigrade.dev/job={name}")
    return next((w for w in listed["items"]
                 if w["metadata"]["labels"].get(queueing.ROLE_LABEL) != queueing.GROW_ROLE),
                None)


def condition(obj: dict[str, Any] | None, kind: str) -> dict[str, Any] | None:
    conditions = ((obj or {}).get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c["type"] == kind), None)


def true_condition(custom: client.CustomObjectsApi, name: str, kind: str
                   ) -> dict[str, Any] | None:
    found = condition(workload_of(custom, name), kind)
    return found if found and found["status"] == "True" else None


def quota_used(custom: client.CustomObjectsApi) -> str:
    queue = custom.get_cluster_custom_object(*KUEUE, "clusterqueues", CLUSTER_QUEUE)
    usage = (queue.get("status") or {}).get("flavorsReservation") or [{}]
    return str(next((r["total"] for r in usage[0].get("resources") or []
                     if r["name"] == "cpu"), "0"))


def _time(value: str) -> datetime:
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


# --- the tests -----------------------------------------------------------------------------------
def test_the_quota_admits_whole_gangs_and_a_job_that_does_not_fit_waits_queued_then_runs(
        installed, kube, custom, real, recorder):
    create(custom, job("first", installed, FIRST_STEPS))
    wait_phase(custom, "first", {"Running"}, START_TIMEOUT_SECONDS)
    running = pods(kube, "first")
    # Where the admitted flavor's node labels say: the spot nodes.
    assert len(running) == 2
    assert {p["spec"]["nodeSelector"][SPOT_LABEL] for p in running} == {"true"}
    assert {p["spec"]["nodeName"] for p in running} <= set(SPOT_NODES)
    assert status(custom, "first")["queue"]["clusterQueue"] == CLUSTER_QUEUE
    wait_for(lambda: quota_used(custom) == QUOTA_CPU, KUEUE_TIMEOUT_SECONDS,
             what="the first gang's quota in use", interval=POLL_SECONDS)

    create(custom, job("second", installed, SECOND_STEPS))
    queued = wait_for(lambda: (s := status(custom, "second")).get("phase") == "Queued"
                      and "insufficient unused quota" in s.get("message", "") and s,
                      KUEUE_TIMEOUT_SECONDS, what="the second job Queued in Kueue's words",
                      interval=POLL_SECONDS)
    assert queued["queue"]["localQueue"] == QUEUE
    assert status(custom, "first")["phase"] == "Running", "the first ended too soon"
    assert not pods(kube, "second")
    table = kubectl("get", "tj", "second", "-o", "wide", env={**os.environ,
                                                             **real.cluster.client_env()})
    assert "Queued" in table and "insufficient unused quota" in table
    assert "Queued" in events(kube, "second")

    # The first gang's end frees the quota; Kueue admits the second, which runs to its end.
    wait_phase(custom, "first", {"Succeeded"}, FINISH_TIMEOUT_SECONDS)
    finished = wait_for(lambda: true_condition(custom, "first", "Finished"),
                        KUEUE_TIMEOUT_SECONDS, what="the first Workload Finished",
                        interval=POLL_SECONDS)
    log = StepLog(kube.core, NAMESPACE, "second")

    def second_done() -> dict[str, Any] | None:
        log.collect()
        current = status(custom, "second")
        assert current.get("phase") != "Failed", current
        return current if current.get("phase") == "Succeeded" else None

    wait_for(second_done, START_TIMEOUT_SECONDS + FINISH_TIMEOUT_SECONDS,
             what="second Succeeded", interval=POLL_SECONDS)
    assert "Admitted" in events(kube, "second")
    # Admitted only once the first had finished: never both gangs in the quota.
    admitted = condition(workload_of(custom, "second"), "QuotaReserved")
    assert admitted is not None and admitted["status"] == "True"
    assert _time(admitted["lastTransitionTime"]) >= _time(finished["lastTransitionTime"])
    # Every rank of both gangs ended as trainers that finished their steps.
    ended = {pod: recorder.termination(pod) for pod in recorder.seen
             if pod.startswith(("first-", "second-"))}
    assert len(ended) == 4, (recorder.error, ended)
    assert {(m or {}).get("reason") for m in ended.values()} == {"Succeeded"}, ended
    # Rank 0 of the second gang trained its steps once each, from the first (as far as read
    # before the operator deleted the finished pods).
    steps = [r["step"] for r in log.records if r.get("event") == "step"]
    assert steps and steps == list(range(1, len(steps) + 1)), steps
    for name in ("first", "second"):
        custom.delete_namespaced_custom_object(types.GROUP, types.VERSION, NAMESPACE,
                                               types.PLURAL, name)
    wait_for(lambda: workload_of(custom, "first") is None and workload_of(custom, "second")
             is None and quota_used(custom) == "0", KUEUE_TIMEOUT_SECONDS,
             what="no Workload left and no quota in use", interval=POLL_SECONDS)


LONG = "long"


def test_a_gang_training_past_the_pods_ready_timeout_is_never_evicted_for_it(
        installed, kube, custom):
    """waitForPodsReady evicts an admitted Workload whose PodsReady is not True within the
    timeout: the operator says True once every rank runs, so a gang that trains for longer
    keeps its pods and its admission. (The gang, of low priority, is the next test's.)"""
    create(custom, job(LONG, installed, 1_000_000, priority="low"))
    wait_phase(custom, LONG, {"Running"}, START_TIMEOUT_SECONDS)
    ready = wait_for(lambda: true_condition(custom, LONG, "PodsReady"), KUEUE_TIMEOUT_SECONDS,
                     what="PodsReady True", interval=POLL_SECONDS)
    assert ready["reason"] == "Started", ready
    first = {p["metadata"]["name"] for p in pods(kube, LONG)}
    admitted = true_condition(custom, LONG, "Admitted")
    assert admitted is not None
    # Well past the timeout, counted from the admission Kueue times it from, and training.
    deadline = _time(admitted["lastTransitionTime"]).timestamp() + PODS_READY.timeout_seconds
    before = step(custom, LONG)
    wait_for(lambda: time.time() > deadline + 20 and step(custom, LONG) > before,
             PODS_READY.timeout_seconds + START_TIMEOUT_SECONDS,
             what="training past the PodsReady timeout", interval=POLL_SECONDS)
    after = workload_of(custom, LONG)
    assert after is not None
    evicted = condition(after, "Evicted")
    assert evicted is None or evicted["status"] == "False", evicted
    # Kueue records a PodsReady eviction's requeue here; none happened.
    assert not (after.get("status") or {}).get("requeueState"), after["status"]
    assert condition(after, "PodsReady") == ready
    assert condition(after, "Admitted") == admitted
    current = status(custom, LONG)
    assert current["phase"] == "Running", current
    assert {p["metadata"]["name"] for p in pods(kube, LONG)} == first
    assert current["restarts"]["total"] == 0 and "Evicted" not in events(kube, LONG)


def test_a_preempted_gang_saves_at_one_step_is_requeued_and_resumes_with_nothing_lost(
        installed, kube, custom, recorder):
    wait_for(lambda: step(custom, LONG) > 5, START_TIMEOUT_SECONDS, what="the low gang training",
             interval=POLL_SECONDS)
    low = status(custom, LONG)
    assert low["phase"] == "Running", low
    first = {p["metadata"]["name"] for p in pods(kube, LONG)}
    create(custom, job("high", installed, HIGH_STEPS, priority="high"))
    evicted = wait_for(lambda: true_condition(custom, LONG, "Evicted"), KUEUE_TIMEOUT_SECONDS,
                       what="Kueue evicting the low Workload", interval=POLL_SECONDS)
    assert evicted["reason"] == "Preempted", evicted
    released = wait_for(lambda: (c := condition(workload_of(custom, LONG), "QuotaReserved"))
                        and c["status"] == "False" and c, KUEUE_TIMEOUT_SECONDS,
                        what="the low Workload's quota released", interval=POLL_SECONDS)
    seconds = (_time(released["lastTransitionTime"]) - _time(evicted["lastTransitionTime"])
               ).total_seconds()
    print(f"eviction to quota released: {seconds:.0f} s (condition timestamps, 1 s resolution)")
    queued = wait_phase(custom, LONG, {"Queued"}, KUEUE_TIMEOUT_SECONDS)
    assert queued["queue"]["localQueue"] == QUEUE
    # Every rank saved the same step on the way out, the last it trained.
    messages = [wait_for(lambda pod=pod: recorder.termination(pod), KUEUE_TIMEOUT_SECONDS,
                         what=f"{pod}'s termination message", interval=POLL_SECONDS)
                for pod in sorted(first)]
    assert {m["reason"] for m in messages} == {"PreemptedSaved"}, messages
    assert len({m["checkpoint_step"] for m in messages}) == 1, messages
    saved = int(messages[0]["checkpoint_step"])
    assert all(m["step"] == saved for m in messages), messages
    # The high job ran only once the low gang had let its quota go.
    wait_phase(custom, "high", {"Succeeded"}, START_TIMEOUT_SECONDS + FINISH_TIMEOUT_SECONDS)
    reserved = condition(workload_of(custom, "high"), "QuotaReserved")
    assert reserved is not None and reserved["status"] == "True"
    assert _time(reserved["lastTransitionTime"]) >= _time(released["lastTransitionTime"])

    # Requeued and admitted again: the low gang resumes from exactly the saved step.
    log = StepLog(kube.core, NAMESPACE, LONG)

    def resumed() -> dict[str, Any] | None:
        log.collect()
        current = status(custom, LONG)
        assert current.get("phase") != "Failed", current
        trained = [r for r in log.records if r.get("event") == "step"
                   and r["attempt"] > low["attempt"]]
        return current if current.get("phase") == "Running" and current["recoveries"] \
            and current["recoveries"][-1]["cause"] == "Resume" and trained else None

    current = wait_for(resumed, START_TIMEOUT_SECONDS, what="the low gang training again",
                       interval=POLL_SECONDS)
    recovery = current["recoveries"][-1]
    assert recovery["restoreStep"] == saved, recovery
    assert recovery.get("stepsLost", 0) == 0, recovery
    assert current["restarts"]["total"] == 0 and current["restarts"]["failures"] == 0, current
    # Rank 0's log: restored the saved step, then trained on from the next one.
    assert log.restored and log.restored[-1] == saved, log.restored
    again = [r["step"] for r in log.records if r.get("event") == "step"
             and r["attempt"] > low["attempt"]]
    assert again == list(range(saved + 1, saved + 1 + len(again))), again
    assert {"Evicted", "Admitted"} <= set(events(kube, LONG))
    assert not {p["metadata"]["name"] for p in pods(kube, LONG)} & first
    for name in (LONG, "high"):
        custom.delete_namespaced_custom_object(types.GROUP, types.VERSION, NAMESPACE,
                                               types.PLURAL, name)
    wait_for(lambda: workload_of(custom, LONG) is None and workload_of(custom, "high") is None
             and quota_used(custom) == "0" and not pods(kube, LONG), KUEUE_TIMEOUT_SECONDS,
             what="no Workload, pod or quota left", interval=POLL_SECONDS)
