"""TrainingJobs under real Kueue (v0.19.2; `real_cluster(kueue=True)`) on real nodes, with
Kueue's waitForPodsReady on with a short timeout (on by default from v0.19, 30 min), the
chart's operator (helm, its image from the local registry) and real trainer containers (the
registry's trainer-cpu image, the example's tiny model): a queued job resized is admitted at
its new size, a running one grows only once the quota allows and trains on meanwhile, a
running one shrunk hands quota back once the smaller gang runs, and deleted jobs leave no
Workload, pod or quota; a gang that cannot start within the PodsReady timeout is evicted and
requeued; a suspended job gives its quota to the queue and resumes when requeued, a queued
one suspended is never admitted meanwhile, an admitted job whose pods ask for more is resized
through Kueue, one moved to another LocalQueue saves and is admitted there, and a job without
the queue label runs outside Kueue.

What changed from the simulated nodes these tests ran on before (seven nodes of one cpu,
ranks asking one cpu each, simulated trainers):
- The ranks are real trainers sharing a 2-core machine, so each asks a tenth of a cpu (and
  256Mi, which the ClusterQueue covers too, with more than any test uses) and its cpu quota
  is 400m: still four ranks, the same gangs and the same arithmetic as before (a quota of 4
  cpu, one cpu a rank); the resized job asks 300m (was 3) and then 50m (was 500m). Nothing
  asserted depended on one rank per node: the ranks share one spot node (the
  ResourceFlavor's node labels pin them to spot nodes, as on GKE), which starts faster.
- A gang that must not finish trains 1,000,000 real steps; checkpoints go to the GCS
  emulator, under a prefix of the test's own (job names repeat across tests).
- The step each rank saved is read from its termination message as a watch saw it (a real
  kubelet removes a deleted pod's files, and the operator deletes stopped pods). A stopped
  gang's pods outlive its save by seconds (the kubelet ends them), where simulated ones went
  at once: the tests wait for them to go rather than assert it on the spot.
- Kueue frees a suspended job's quota as soon as its Workload is deactivated (docs/kueue.md,
  "Suspending"): the next gang may run beside the suspended one's exiting ranks.
- The PodsReady timeout is 60 s (was 45) and the trainer image is on the node before any
  gang is admitted: a real pod's start, not its first image pull, is what it times.

The core contract runs on real nodes too, in tests/local/test_real_node_kueue.py (and
against the oldest Kueue, v0.17.0, in test_real_node_kueue_oldest.py): the quota admits whole
gangs and a job that does not fit waits Queued with Kueue's reason, then runs; a gang
training past the PodsReady timeout is never evicted for it; a preempted gang saves at one
step, is requeued and resumes from it with no step lost and its restart budget untouched.
No test here repeats one of those."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from tardigrade_local import gobuild
from tardigrade_local.kueue import WaitForPodsReady
from tardigrade_local.realcluster import SPOT_LABEL
from tardigrade_operator.decision import queueing

from tests.e2e.harness import (
    NAMESPACE,
    NEEDS_REAL_NODES,
    InstalledOperator,
    RealCluster,
    real_cluster,
    wait_for,
)
from tests.local.kube_helpers import Kube, PodRecorder

pytestmark = [pytest.mark.slow, NEEDS_REAL_NODES]

KUEUE = ("kueue.x-k8s.io", "v1beta2")
QUEUE = "team-queue"
FLAVOR = "spot"
# Every test of the module runs under it: no gang here may be evicted for PodsReady but the
# one that cannot start. Requeued after a PodsReady eviction in seconds, not Kueue's minutes.
PODS_READY = WaitForPodsReady(timeout_seconds=60, backoff_base_seconds=5,
                              backoff_max_seconds=10)
# What one rank asks (RealCluster.trainingjob's request) and the quota: four ranks.
RANK_CPU, QUOTA = "100m", "400m"
# Real ranks ask for memory too (a resource Kueue must cover); never what a test runs short of.
MEMORY_QUOTA = "64Gi"
# Kueue's usage of a ClusterQueue for that many ranks, as the API server writes a quantity.
RANKS_CPU = {0: "0", 1: "100m", 2: "200m", 3: "300m", 4: "400m"}
# A real gang's start (JAX's import and compile) on a 2-core machine other runs share.
START_SECONDS = 300
# The trainer image's first pull on a node (about 1 GB from the registry).
PULL_SECONDS = 600


def kueue_objects() -> list[tuple[str, dict[str, Any]]]:
    meta = {"apiVersion": "kueue.x-k8s.io/v1beta2"}
    return [
        ("resourceflavors", {**meta, "kind": "ResourceFlavor",
                             "metadata": {"name": FLAVOR},
                             "spec": {"nodeLabels": {SPOT_LABEL: "true"}}}),
        ("workloadpriorityclasses", {**meta, "kind": "WorkloadPriorityClass",
                                     "metadata": {"name": "low"}, "value": 10}),
        ("workloadpriorityclasses", {**meta, "kind": "WorkloadPriorityClass",
                                     "metadata": {"name": "high"}, "value": 1000}),
        ("clusterqueues", {**meta, "kind": "ClusterQueue", "metadata": {"name": "team"},
                           "spec": {"namespaceSelector": {},
                                    "preemption": {"withinClusterQueue": "LowerPriority"},
                                    "resourceGroups": [{
                                        "coveredResources": ["cpu", "memory"],
                                        "flavors": [{"name": FLAVOR, "resources": [
                                            {"name": "cpu", "nominalQuota": QUOTA},
                                            {"name": "memory",
                                             "nominalQuota": MEMORY_QUOTA}]}]}]}}),
    ]


def prepull(cluster: RealCluster, image: str) -> None:
    """The trainer image on every spot node before any gang is admitted: its first pull is
    not what a PodsReady timeout of a minute is about."""
    spot = [n.metadata.name for n in cluster.core.list_node(
        label_selector=f"{SPOT_LABEL}=true").items]
    for node in spot:
        cluster.core.create_namespaced_pod(NAMESPACE, {
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"pull-{node}"},
            "spec": {"restartPolicy": "Never",
                     "nodeSelector": {"kubernetes.io/hostname": node},
                     "containers": [{"name": "main", "image": image,
                                     "command": ["python", "-c", "pass"]}]}})
    for node in spot:
        pod = wait_for(lambda node=node: (p := cluster.core.read_namespaced_pod(
            f"pull-{node}", NAMESPACE)).status.phase in ("Succeeded", "Failed") and p,
            PULL_SECONDS, f"the trainer image pulled on {node}")
        assert pod.status.phase == "Succeeded", pod.status
        cluster.core.delete_namespaced_pod(f"pull-{node}", NAMESPACE)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealCluster]:
    """The module's cluster: Kueue (the module gobuild.kueue_module names), its queues, the
    operator's node and one spot node for the gangs, the trainer image on it."""
    print(f"Kueue {gobuild.kueue_version()} ({gobuild.kueue_module().name})")
    with real_cluster(tmp_path_factory.mktemp("kq"), 1, kueue=True,
                      kueue_wait_for_pods_ready=PODS_READY) as running:
        for plural, body in kueue_objects():
            running.custom.create_cluster_custom_object(*KUEUE, plural, body)
        running.custom.create_namespaced_custom_object(*KUEUE, NAMESPACE, "localqueues", {
            "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "LocalQueue",
            "metadata": {"name": QUEUE, "namespace": NAMESPACE},
            "spec": {"clusterQueue": "team"}})
        prepull(running, running.real.images["trainer-cpu"])
        yield running


@pytest.fixture(scope="module")
def recorder(cluster: RealCluster) -> Iterator[PodRecorder]:
    """Every state of the gangs' pods, their termination messages with them."""
    with PodRecorder(Kube(str(cluster.real.kubeconfig)), NAMESPACE,
                     "tardigrade.dev/job") as running:
        yield running


@pytest.fixture(autouse=True)
def cleared(cluster: RealCluster) -> Iterator[None]:
    """Each test leaves the queue empty, passed or not: a job left over would hold quota the
    next test's jobs wait for."""
    yield
    clear(cluster)


def job(cluster: RealCluster, name: str, checkpoints: Path, steps: int,
        priority: str | None = None, replicas: int = 3) -> dict[str, Any]:
    """A gang of `replicas` real trainers under the queue, saving only when stopped; its
    checkpoints under the test's own prefix (`checkpoints`: the test's tmp_path)."""
    labels = {queueing.QUEUE_LABEL: QUEUE}
    if priority:
        labels[queueing.PRIORITY_LABEL] = priority
    body = cluster.trainingjob(name, steps, replicas,
                               failurePolicy={"backoffSeconds": 0})
    body["metadata"]["labels"] = labels
    # A gang of exactly `replicas`, as the job the tests were written for (the example's
    # bounds would let Kueue admit part of a gang).
    del body["spec"]["minReplicas"], body["spec"]["maxReplicas"]
    body["spec"]["checkpoint"].update(
        path=f"gs://tardigrade/checkpoints/{checkpoints.name}/{name}",
        interval={"steps": 100_000}, saveOnPreemption=True)
    assert body["spec"]["resources"]["requests"]["cpu"] == RANK_CPU
    return body


def workloads(cluster: RealCluster) -> list[dict[str, Any]]:
    return list(cluster.custom.list_namespaced_custom_object(
        *KUEUE, NAMESPACE, "workloads")["items"])


def workload_of(cluster: RealCluster, name: str) -> dict[str, Any] | None:
    """The gang's own Workload (not the request for a grow's extra replicas)."""
    return next((w for w in workloads(cluster)
                 if w["metadata"]["labels"].get("tardigrade.dev/job") == name
                 and w["metadata"]["labels"].get(queueing.ROLE_LABEL) != queueing.GROW_ROLE),
                None)


def condition(obj: dict[str, Any] | None, kind: str) -> dict[str, Any] | None:
    conditions = ((obj or {}).get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c["type"] == kind), None)


def quota_used(cluster: RealCluster) -> str:
    queue = cluster.custom.get_cluster_custom_object(*KUEUE, "clusterqueues", "team")
    usage = (queue.get("status") or {}).get("flavorsReservation") or [{}]
    return str(next((r["total"] for r in usage[0].get("resources") or []
                     if r["name"] == "cpu"), "0"))


def clear(cluster: RealCluster) -> None:
    cluster.clear_jobs()
    wait_for(lambda: not workloads(cluster) and quota_used(cluster) == RANKS_CPU[0], 60,
             "no Workload left and no quota in use")


def events(cluster: RealCluster, name: str) -> list[str]:
    listed = cluster.core.list_namespaced_event(
        NAMESPACE, field_selector=f"involvedObject.name={name}").items
    return [e.reason for e in listed]


def saved_step(recorder: PodRecorder, pods: set[str]) -> int:
    """The one step every rank of the stopped gang saved on the way out (their termination
    messages, as the watch saw them)."""
    messages = [wait_for(lambda pod=pod: recorder.termination(pod), 60,
                         f"{pod}'s termination message") for pod in sorted(pods)]
    assert {m["reason"] for m in messages} == {"PreemptedSaved"}, messages
    saved = {m["checkpoint_step"] for m in messages}
    assert len(saved) == 1, saved
    return int(saved.pop())


def resumed(cluster: RealCluster, name: str) -> dict[str, Any]:
    """The job's status once it runs again after a recovery of cause Resume."""
    return wait_for(lambda: (s := cluster.status(name)).get("phase") == "Running"
                    and s["recoveries"] and s["recoveries"][-1]["cause"] == "Resume"
                    and s, START_SECONDS, f"{name} resumed")


def _time(value: str) -> datetime:
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


def grow_request_of(cluster: RealCluster, name: str) -> dict[str, Any] | None:
    return next((w for w in workloads(cluster)
                 if w["metadata"]["labels"].get("tardigrade.dev/job") == name
                 and w["metadata"]["labels"].get(queueing.ROLE_LABEL) == queueing.GROW_ROLE),
                None)


def test_a_running_gang_grows_only_when_quota_allows_and_trains_on_while_it_waits(
        cluster: RealCluster, operator: InstalledOperator, recorder: PodRecorder,
        tmp_path: Path):
    """kubectl scale 2 -> 3 while another gang holds the rest of the quota (4): the extra
    replica waits in the queue with Kueue's reason while the gang of 2 trains on, pods
    untouched; once the other job is deleted (its quota with it), the gang saves one step and
    stops, its Workloads go, one for 3 is admitted, and the gang of 3 restores the saved
    step; the failure budget is untouched."""
    cluster.apply(job(cluster, "grow", tmp_path, steps=1_000_000, replicas=2))
    cluster.apply(job(cluster, "other", tmp_path, steps=1_000_000, replicas=2))
    for name in ("grow", "other"):
        cluster.wait_phase(name, {"Running"}, START_SECONDS)
    wait_for(lambda: quota_used(cluster) == RANKS_CPU[4], 30, "the quota of 4 in use")
    before = workload_of(cluster, "grow")
    assert before is not None and before["spec"]["podSets"][0]["count"] == 2
    first = {p.metadata.name for p in cluster.pods("grow")}
    cluster.kubectl("scale", "tj/grow", "--replicas=3")
    request = wait_for(lambda: (w := grow_request_of(cluster, "grow")) and (
        c := condition(w, "QuotaReserved")) and c["status"] == "False" and c["message"]
        and w, 60, "the extra replica pending in Kueue")
    assert request["spec"]["podSets"][0]["count"] == 1
    kueue_says = condition(request, "QuotaReserved")["message"]
    status = wait_for(lambda: (s := cluster.status("grow"))["queue"].get("growingTo") == 3
                      and kueue_says in s["queue"]["message"] and s, 60,
                      "the wait in the job's status")
    # Waiting does not stop the gang: it trains on at 2, on the same pods.
    step = int(status.get("step") or 0)
    wait_for(lambda: int(cluster.status("grow").get("step") or 0) > step + 20, 60,
             "training on while the grow waits")
    waiting = cluster.status("grow")
    assert waiting["phase"] == "Running" and waiting["replicas"] == 2, waiting
    assert {p.metadata.name for p in cluster.pods("grow")} == first
    assert waiting["queue"]["admittedReplicas"] == 2
    assert quota_used(cluster) == RANKS_CPU[4]
    assert "GrowQueued" in events(cluster, "grow")
    # Quota frees: the grow goes ahead.
    cluster.kubectl("delete", "tj/other", "--wait=false")
    status = resumed(cluster, "grow")
    assert status["recoveries"][-1]["restoreStep"] == saved_step(recorder, first), status
    assert status["recoveries"][-1]["restoreStep"] > step + 20
    assert status["queue"]["admittedReplicas"] == 3 and not status["queue"].get("growingTo")
    after = workload_of(cluster, "grow")
    assert after is not None and after["metadata"]["uid"] != before["metadata"]["uid"]
    assert after["spec"]["podSets"][0]["count"] == 3
    wait_for(lambda: grow_request_of(cluster, "grow") is None, 30, "the grow request gone")
    # The ClusterQueue's usage is Kueue's status write, which follows the admission.
    wait_for(lambda: quota_used(cluster) == RANKS_CPU[3], 30, "the quota of 3 in use")
    assert len({p.metadata.name for p in cluster.pods("grow")} - first) == 3
    assert status["restarts"]["total"] == 0 and status["restarts"]["failures"] == 0
    assert status["recoveries"][-1].get("stepsLost", 0) == 0
    operator.assert_alive()
    clear(cluster)


def test_a_running_gang_shrunk_keeps_its_admission_and_hands_the_rest_back_once_smaller(
        cluster: RealCluster, operator: InstalledOperator, recorder: PodRecorder,
        tmp_path: Path):
    """A gang of 3 (of the quota 4) scaled to 2 saves one step and relaunches at 2 under the
    same admitted Workload, never requeued; only once the 2 run does it hand the replica it
    no longer needs back (reclaimablePods), and the job of 2 waiting for that quota is
    admitted. Nothing lost, the failure budget untouched."""
    cluster.apply(job(cluster, "shrink", tmp_path, steps=1_000_000, replicas=3))
    cluster.wait_phase("shrink", {"Running"}, START_SECONDS)
    wait_for(lambda: int(cluster.status("shrink").get("step") or 0) > 5, START_SECONDS,
             "training")
    cluster.apply(job(cluster, "waiting", tmp_path, steps=20, replicas=2))
    wait_for(lambda: workload_of(cluster, "waiting") and "insufficient unused quota"
             in cluster.status("waiting").get("message", ""), 60, "the job of 2 waiting")
    before = workload_of(cluster, "shrink")
    assert before is not None
    first = {p.metadata.name for p in cluster.pods("shrink")}
    cluster.kubectl("scale", "tj/shrink", "--replicas=2")
    status = wait_for(lambda: (s := cluster.status("shrink"))["phase"] == "Running"
                      and s["replicas"] == 2 and s["recoveries"]
                      and s["recoveries"][-1]["cause"] == "Resize" and s, START_SECONDS,
                      "the gang of 2 running")
    assert status["recoveries"][-1]["restoreStep"] == saved_step(recorder, first), status
    handed = wait_for(lambda: (w := workload_of(cluster, "shrink"))
                      and (w.get("status") or {}).get("reclaimablePods") and w, 60,
                      "the third replica handed back")
    assert handed["status"]["reclaimablePods"] == [{"name": queueing.PODSET, "count": 1}]
    # The same Workload and admission throughout: never requeued behind the waiting job.
    assert handed["metadata"]["uid"] == before["metadata"]["uid"]
    kept, held = condition(handed, "QuotaReserved"), condition(before, "QuotaReserved")
    assert kept is not None and held is not None and kept["status"] == "True"
    assert kept["lastTransitionTime"] == held["lastTransitionTime"]
    assert handed["status"]["admission"] == before["status"]["admission"]
    # The freed quota admits the job of 2, no sooner than the gang of 2 ran.
    cluster.wait_phase("waiting", {"Running", "Succeeded"}, START_SECONDS)
    reserved = condition(workload_of(cluster, "waiting"), "QuotaReserved")
    assert reserved is not None and reserved["status"] == "True"
    running = next(c for c in cluster.status("shrink")["conditions"] if c["type"] == "Running")
    assert _time(reserved["lastTransitionTime"]) >= _time(running["lastTransitionTime"])
    assert cluster.status("shrink")["queue"]["admittedReplicas"] == 2
    cluster.wait_phase("waiting", {"Succeeded"}, START_SECONDS)
    wait_for(lambda: quota_used(cluster) == RANKS_CPU[2], 30, "only the gang of 2's quota in use")
    status = cluster.status("shrink")
    assert status["phase"] == "Running" and status["replicas"] == 2
    assert status["restarts"]["resizes"] == 1 and status["restarts"]["failures"] == 0
    assert status["recoveries"][-1].get("stepsLost", 0) == 0
    assert "Evicted" not in events(cluster, "shrink")
    operator.assert_alive()
    clear(cluster)


def test_a_queued_job_resized_is_admitted_at_its_new_size_and_deletes_leave_nothing(
        cluster: RealCluster, operator: InstalledOperator, tmp_path: Path):
    """With 3 of the 4 held by a running gang, a queued job of 3 scaled to 2 still waits (its
    Workload now asks for 2), scaled to 1 it is admitted at 1 and runs. Then a queued and a
    running job deleted leave no Workload, no pod and no quota of theirs."""
    cluster.apply(job(cluster, "holder", tmp_path, steps=1_000_000, replicas=3))
    cluster.wait_phase("holder", {"Running"}, START_SECONDS)
    cluster.apply(job(cluster, "resized", tmp_path, steps=1_000_000, replicas=3))
    cluster.wait_phase("resized", {"Queued"}, 60)
    cluster.kubectl("scale", "tj/resized", "--replicas=2")
    wait_for(lambda: (w := workload_of(cluster, "resized"))
             and w["spec"]["podSets"][0]["count"] == 2, 60, "the Workload asking for 2")
    wait_for(lambda: f"{RANKS_CPU[1]} more needed" in cluster.status("resized").get(
        "message", ""), 60, "Kueue's reason for 2 in the status")
    assert not cluster.pods("resized")
    cluster.kubectl("scale", "tj/resized", "--replicas=1")
    status = cluster.wait_phase("resized", {"Running"}, START_SECONDS)
    assert status["queue"]["admittedReplicas"] == 1 and status["replicas"] == 1, status
    assert workload_of(cluster, "resized")["spec"]["podSets"][0]["count"] == 1
    wait_for(lambda: quota_used(cluster) == RANKS_CPU[4], 30, "3 + 1 of the quota in use")
    # A third job waits; then the queued one and a running one are deleted.
    cluster.apply(job(cluster, "waiting", tmp_path, steps=1_000_000, replicas=2))
    cluster.wait_phase("waiting", {"Queued"}, 60)
    # Queued comes first (held while its Workload is being made): wait for the Workload.
    wait_for(lambda: workload_of(cluster, "waiting"), 60, "the waiting job's Workload")
    cluster.kubectl("delete", "tj", "waiting", "holder", "--wait=false")
    wait_for(lambda: workload_of(cluster, "waiting") is None
             and workload_of(cluster, "holder") is None, 60, "their Workloads gone")
    wait_for(lambda: not cluster.pods("holder") and not cluster.pods("waiting"), 120,
             "their pods gone")
    wait_for(lambda: quota_used(cluster) == RANKS_CPU[1], 30, "only the running job's quota in use")
    assert cluster.status("resized")["phase"] == "Running"
    operator.assert_alive()
    clear(cluster)


def test_a_job_without_the_label_runs_as_before(cluster: RealCluster, operator: InstalledOperator,
                                                tmp_path: Path):
    body = job(cluster, "plain", tmp_path, steps=10, replicas=2)
    body["metadata"]["labels"] = {}
    cluster.apply(body)
    cluster.wait_phase("plain", {"Succeeded"}, START_SECONDS)
    assert workload_of(cluster, "plain") is None and cluster.status("plain").get("queue") is None
    clear(cluster)


def test_a_gang_that_cannot_start_within_the_timeout_is_evicted_and_requeued(
        cluster: RealCluster, operator: InstalledOperator, tmp_path: Path):
    """Admitted, but its pods ask for a node label no node has: PodsReady stays False
    (WaitForStart), Kueue evicts it (PodsReadyTimeout), the operator stops the gang and
    releases the quota, and Kueue requeues it after its back-off and admits it again. The
    failure budget is untouched: a queue's eviction is not a failure."""
    body = job(cluster, "stuck", tmp_path, steps=1_000_000, replicas=2)
    body["spec"]["podTemplate"]["nodeSelector"]["example.com/no-such-node"] = "true"
    cluster.apply(body)
    admitted = wait_for(lambda: (c := condition(workload_of(cluster, "stuck"), "Admitted"))
                        and c["status"] == "True" and c, 60, "the stuck job admitted")
    waiting = wait_for(lambda: condition(workload_of(cluster, "stuck"), "PodsReady"), 60,
                       "PodsReady written")
    assert (waiting["status"], waiting["reason"]) == ("False", "WaitForStart"), waiting
    evicted = wait_for(lambda: (c := condition(workload_of(cluster, "stuck"), "Evicted"))
                       and c["status"] == "True" and c, PODS_READY.timeout_seconds + 60,
                       "Kueue evicting it for PodsReady")
    assert evicted["reason"] == "PodsReadyTimeout", evicted
    waited = (_time(evicted["lastTransitionTime"]) - _time(admitted["lastTransitionTime"])
              ).total_seconds()
    assert waited >= PODS_READY.timeout_seconds - 1, waited
    # The job side's answer: the gang stopped, the quota released.
    released = wait_for(lambda: (w := workload_of(cluster, "stuck"))
                        and (condition(w, "QuotaReserved") or {}).get("status") == "False"
                        and w, 60, "the quota released")
    requeued = condition(released, "Requeued")
    assert requeued is not None and requeued["reason"] in ("PodsReadyTimeout",
                                                           "BackoffFinished"), requeued
    assert (released.get("status") or {}).get("requeueState", {}).get("count") == 1
    wait_for(lambda: not cluster.pods("stuck"), 60, "the stuck gang stopped")
    assert cluster.status("stuck")["phase"] == "Queued"
    # Back-off over, Kueue admits it again (and the gang is launched again).
    wait_for(lambda: (c := condition(workload_of(cluster, "stuck"), "QuotaReserved"))
             and c["status"] == "True"
             and _time(c["lastTransitionTime"]) > _time(evicted["lastTransitionTime"]), 60,
             "admitted again after the back-off")
    wait_for(lambda: cluster.pods("stuck"), 60, "the gang launched again")
    status = cluster.status("stuck")
    assert status["restarts"]["failures"] == 0, status["restarts"]
    assert "Evicted" in events(cluster, "stuck")
    operator.assert_alive()
    clear(cluster)


def test_a_suspended_job_releases_its_quota_to_the_queue_and_resuming_requeues_it(
        cluster: RealCluster, operator: InstalledOperator, recorder: PodRecorder,
        tmp_path: Path):
    """spec.suspend on an admitted job deactivates its Workload (as Kueue's own jobs:
    spec.active false, Kueue evicts it with reason Deactivated): the gang saves and stops,
    the quota goes back and the job waiting for it is admitted. spec.suspend false
    reactivates it: queued again, it waits while the other holds the quota, then resumes
    from the saved step; no restart counted."""
    cluster.apply(job(cluster, "sleeper", tmp_path, steps=1_000_000, replicas=3))
    cluster.wait_phase("sleeper", {"Running"}, START_SECONDS)
    wait_for(lambda: int(cluster.status("sleeper").get("step") or 0) > 5, START_SECONDS,
             "training")
    first = {p.metadata.name for p in cluster.pods("sleeper")}
    cluster.apply(job(cluster, "next", tmp_path, steps=1_000_000, replicas=2))
    wait_for(lambda: workload_of(cluster, "next") and "insufficient unused quota"
             in cluster.status("next").get("message", ""), 60, "the job of 2 waiting")
    cluster.kubectl("patch", "tj/sleeper", "--type=merge", "-p", '{"spec":{"suspend":true}}')
    evicted = wait_for(lambda: (c := condition(workload_of(cluster, "sleeper"), "Evicted"))
                       and c["status"] == "True" and c, 60, "Kueue evicting the suspended job")
    assert evicted["reason"] == "Deactivated", evicted
    assert workload_of(cluster, "sleeper")["spec"]["active"] is False
    cluster.wait_phase("next", {"Running"}, START_SECONDS)
    stopped = cluster.wait_phase("sleeper", {"Suspended"}, 60)
    # Real ranks exit some seconds after their save (the phase says Suspended meanwhile).
    wait_for(lambda: not cluster.pods("sleeper"), 120, "the suspended gang's pods gone")
    step = saved_step(recorder, first)
    released = workload_of(cluster, "sleeper")
    assert (condition(released, "QuotaReserved") or {}).get("status") == "False"
    assert not (released.get("status") or {}).get("admission")
    wait_for(lambda: quota_used(cluster) == RANKS_CPU[2], 30, "only the job of 2's quota in use")
    assert "suspended (spec.suspend)" in stopped["queue"]["message"]
    # Resumed while the other holds the quota: queued again, in Kueue's words.
    cluster.kubectl("patch", "tj/sleeper", "--type=merge", "-p", '{"spec":{"suspend":false}}')
    wait_for(lambda: (w := workload_of(cluster, "sleeper")) and w["spec"].get("active")
             is not False and "insufficient unused quota" in cluster.status("sleeper").get(
                 "message", ""), 60, "the resumed job queued again")
    assert cluster.status("sleeper")["phase"] == "Queued" and not cluster.pods("sleeper")
    cluster.kubectl("delete", "tj/next", "--wait=false")
    status = resumed(cluster, "sleeper")
    assert status["recoveries"][-1]["restoreStep"] == step, status
    assert status["restarts"]["total"] == 0 and status["restarts"]["failures"] == 0
    assert "Evicted" not in events(cluster, "sleeper")
    operator.assert_alive()
    clear(cluster)


def test_a_queued_job_suspended_is_never_admitted_until_resumed(
        cluster: RealCluster, operator: InstalledOperator, tmp_path: Path):
    """Suspended while it waits, the job's Workload is deactivated: quota that frees goes to
    the next job, not to it; resumed, it is queued again and admitted."""
    cluster.apply(job(cluster, "holder", tmp_path, steps=1_000_000, replicas=3))
    cluster.wait_phase("holder", {"Running"}, START_SECONDS)
    cluster.apply(job(cluster, "later", tmp_path, steps=1_000_000, replicas=2))
    wait_for(lambda: workload_of(cluster, "later") and "insufficient unused quota"
             in cluster.status("later").get("message", ""), 60, "the job of 2 waiting")
    cluster.kubectl("patch", "tj/later", "--type=merge", "-p", '{"spec":{"suspend":true}}')
    wait_for(lambda: workload_of(cluster, "later")["spec"].get("active") is False, 60,
             "the waiting job's Workload deactivated")
    cluster.kubectl("delete", "tj/holder", "--wait=false")
    # The freed quota goes to a job queued after it, never to the suspended one.
    cluster.apply(job(cluster, "probe", tmp_path, steps=1_000_000, replicas=2))
    cluster.wait_phase("probe", {"Running"}, START_SECONDS)
    later = workload_of(cluster, "later")
    assert (condition(later, "QuotaReserved") or {}).get("status") != "True", later["status"]
    assert cluster.status("later")["phase"] == "Suspended" and not cluster.pods("later")
    cluster.kubectl("patch", "tj/later", "--type=merge", "-p", '{"spec":{"suspend":false}}')
    status = cluster.wait_phase("later", {"Running"}, START_SECONDS)
    assert status["queue"]["admitted"] and status["replicas"] == 2
    wait_for(lambda: quota_used(cluster) == RANKS_CPU[4], 30, "both jobs of 2 in the quota")
    operator.assert_alive()
    clear(cluster)


def test_an_admitted_job_whose_pods_ask_for_more_is_resized_through_kueue(
        cluster: RealCluster, operator: InstalledOperator, recorder: PodRecorder,
        tmp_path: Path):
    """A running gang of 2 x 100m patched to 300m per pod (600m > the quota of 400m) saves
    and stops, its Workload is made again at what the pods ask now, and nothing runs while
    Kueue cannot admit that; patched to 50m it is admitted (the queued Workload's podSet
    updated in place) and resumes from the saved step. Never a pod beyond the admission."""
    cluster.apply(job(cluster, "reshaped", tmp_path, steps=1_000_000, replicas=2))
    cluster.wait_phase("reshaped", {"Running"}, START_SECONDS)
    wait_for(lambda: int(cluster.status("reshaped").get("step") or 0) > 5, START_SECONDS,
             "training")
    before = workload_of(cluster, "reshaped")
    assert before is not None
    first = {p.metadata.name for p in cluster.pods("reshaped")}
    cluster.kubectl("patch", "tj/reshaped", "--type=merge", "-p",
                    '{"spec":{"resources":{"requests":{"cpu":"300m"}}}}')
    remade = wait_for(lambda: (w := workload_of(cluster, "reshaped"))
                      and w["metadata"]["uid"] != before["metadata"]["uid"] and w, 120,
                      "the Workload made again")
    requests = remade["spec"]["podSets"][0]["template"]["spec"]["containers"][0]["resources"]
    assert requests["requests"]["cpu"] == "300m" and remade["spec"]["podSets"][0]["count"] == 2
    wait_for(lambda: "insufficient quota" in cluster.status("reshaped").get("message", "")
             or "insufficient unused quota" in cluster.status("reshaped").get("message", ""),
             60, "Kueue's reason for 2 x 300m")
    assert cluster.status("reshaped")["phase"] == "Queued"
    # The stopped ranks' pods go once their kubelet has ended them, a few seconds after the
    # save; no new one comes meanwhile.
    wait_for(lambda: not cluster.pods("reshaped"), 120, "the stopped gang's pods gone")
    assert cluster.status("reshaped")["phase"] == "Queued"
    # The ClusterQueue's usage is Kueue's status write, after the old Workload went.
    wait_for(lambda: quota_used(cluster) == RANKS_CPU[0], 30, "no quota in use")
    step = saved_step(recorder, first)
    cluster.kubectl("patch", "tj/reshaped", "--type=merge", "-p",
                    '{"spec":{"resources":{"requests":{"cpu":"50m"}}}}')
    status = resumed(cluster, "reshaped")
    assert status["recoveries"][-1]["restoreStep"] == step, status
    pods = cluster.pods("reshaped")
    assert {p.spec.containers[0].resources.requests["cpu"] for p in pods} == {"50m"}
    wait_for(lambda: quota_used(cluster) == RANKS_CPU[1], 30, "2 x 50m of the quota in use")
    assert workload_of(cluster, "reshaped")["metadata"]["uid"] == remade["metadata"]["uid"]
    assert status["restarts"]["failures"] == 0
    operator.assert_alive()
    clear(cluster)


def test_a_job_moved_to_another_queue_saves_and_is_admitted_there(
        cluster: RealCluster, operator: InstalledOperator, recorder: PodRecorder,
        tmp_path: Path):
    """The queue label changed on a running job: Kueue refuses a new queueName while quota is
    reserved, so the gang saves and stops, the Workload is made again in the new LocalQueue,
    and the gang resumes there from the saved step."""
    other = {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "LocalQueue",
             "metadata": {"name": "other-queue", "namespace": NAMESPACE},
             "spec": {"clusterQueue": "team"}}
    if not any(q["metadata"]["name"] == "other-queue" for q in cluster.custom.
               list_namespaced_custom_object(*KUEUE, NAMESPACE, "localqueues")["items"]):
        cluster.custom.create_namespaced_custom_object(*KUEUE, NAMESPACE, "localqueues", other)
    cluster.apply(job(cluster, "mover", tmp_path, steps=1_000_000, replicas=2))
    cluster.wait_phase("mover", {"Running"}, START_SECONDS)
    wait_for(lambda: int(cluster.status("mover").get("step") or 0) > 5, START_SECONDS,
             "training")
    first = {p.metadata.name for p in cluster.pods("mover")}
    cluster.kubectl("label", "tj/mover", "--overwrite", f"{queueing.QUEUE_LABEL}=other-queue")
    status = resumed(cluster, "mover")
    assert status["queue"]["localQueue"] == "other-queue", status["queue"]
    assert workload_of(cluster, "mover")["spec"]["queueName"] == "other-queue"
    assert status["recoveries"][-1]["restoreStep"] == saved_step(recorder, first)
    assert status["restarts"]["failures"] == 0
    # The label removed: out of Kueue, its Workload and quota gone, the gang trains on.
    pods = {p.metadata.name for p in cluster.pods("mover")}
    cluster.kubectl("label", "tj/mover", f"{queueing.QUEUE_LABEL}-")
    wait_for(lambda: workload_of(cluster, "mover") is None
             and quota_used(cluster) == RANKS_CPU[0], 60, "the Workload gone with the label")
    step = int(cluster.status("mover").get("step") or 0)
    wait_for(lambda: int(cluster.status("mover").get("step") or 0) > step, 60, "training on")
    assert cluster.status("mover").get("queue") is None
    assert {p.metadata.name for p in cluster.pods("mover")} == pods
    operator.assert_alive()
    clear(cluster)
