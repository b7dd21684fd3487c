"""TrainingJobs behind a ProvisioningRequest admission check (real Kueue v0.19.2, its
provisioning controller on because the ProvisioningRequest CRD is installed), served by the
local cluster's GKE queued provisioning (`gke/provisioning.py`, class
`queued-provisioning.gke.io`) from a node pool that has no node until a request asks for
some: the job's Workload reserves quota, Kueue creates the ProvisioningRequest, the job
waits with no pod until GKE reports Provisioned, then Kueue admits it and the gang runs on
the nodes provisioned for it, its pods carrying the check's podSetUpdates (the
consume-provisioning-request annotations); deleting the job gives the nodes back. A running
job grown trains on at its size while the extra replicas' request is provisioned, then
saves, and resumes at the new size on nodes provisioned for the new Workload.

On real nodes (real kubelets and containerd, `RealNodeCluster(pools=...)` with Kueue): the
queued-provisioning pool's nodes are real nodes started from its template, one CPU each (one
rank a node), and a released node's VM is deleted and its Node object goes; the operator is
the chart's, on the default pool's node, and the ranks are real trainers of the registry's
image checkpointing to the GCS emulator."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from tardigrade_local.gke.autoscaler import NodePool
from tardigrade_local.gke.nodes import NodeConfig
from tardigrade_local.gke.provisioning import QUEUED_PROVISIONING_CLASS, REQUEST_LABEL
from tardigrade_local.kueue import WaitForPodsReady
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
PROVREQ = ("autoscaling.x-k8s.io", "v1")
QUEUE = "dws-queue"
POOL = "dws-pool"
POOL_LABEL = "cloud.google.com/gke-nodepool"
CHECK = "dws-prov"
# Kueue's pod annotations for a provisioned request (the autoscaler API's
# ProvisioningRequestPodAnnotationKey and ProvisioningClassPodAnnotationKey).
CONSUME = "autoscaling.x-k8s.io/consume-provisioning-request"
CLASS_ANNOTATION = "autoscaling.x-k8s.io/provisioning-class-name"
# Long enough to see the job wait with no pod; the booked nodes come together after it.
PROVISION_SECONDS = 30.0
# A pool node's allocatable, well within this 2-core machine (nodeshape.py): one rank of a
# CPU a node, as the simulated nodes had.
POOL_NODE_CAPACITY = {"cpu": "1", "memory": "4Gi", "pods": "20"}
# Real nodes' boot, the trainer image's pull onto each fresh disk, JAX's start and compile,
# on a shared 2-core machine: Kueue's waitForPodsReady and our waits for a running gang.
RUNNING_SECONDS = 600
# A gang's save on its way out (its SIGTERM grace), then its empty nodes' VMs deleted.
RELEASE_SECONDS = 240


def kueue_objects() -> list[tuple[str, dict[str, Any]]]:
    meta = {"apiVersion": "kueue.x-k8s.io/v1beta2"}
    return [
        ("resourceflavors", {**meta, "kind": "ResourceFlavor", "metadata": {"name": "dws"},
                             "spec": {"nodeLabels": {POOL_LABEL: POOL}}}),
        ("provisioningrequestconfigs", {
            **meta, "kind": "ProvisioningRequestConfig", "metadata": {"name": "dws-config"},
            "spec": {"provisioningClassName": QUEUED_PROVISIONING_CLASS,
                     "managedResources": ["cpu"]}}),
        ("admissionchecks", {
            **meta, "kind": "AdmissionCheck", "metadata": {"name": CHECK},
            "spec": {"controllerName": "kueue.x-k8s.io/provisioning-request",
                     "parameters": {"apiGroup": "kueue.x-k8s.io",
                                    "kind": "ProvisioningRequestConfig",
                                    "name": "dws-config"}}}),
        ("clusterqueues", {**meta, "kind": "ClusterQueue", "metadata": {"name": "dws"},
                           "spec": {"namespaceSelector": {},
                                    "admissionChecksStrategy": {
                                        "admissionChecks": [{"name": CHECK}]},
                                    "resourceGroups": [{
                                        # A real trainer asks for memory too.
                                        "coveredResources": ["cpu", "memory"],
                                        "flavors": [{"name": "dws", "resources": [
                                            {"name": "cpu", "nominalQuota": "4"},
                                            {"name": "memory", "nominalQuota": "16Gi"}]}]}]}}),
    ]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealCluster]:
    template = NodeConfig("template", capacity=POOL_NODE_CAPACITY)
    # Room for a grow's peak: the gang's 2 nodes, the extra one, and the 3 of the Workload
    # made again at the new size, before the old requests' nodes are given back.
    pool = NodePool(POOL, max_size=6, template=template, provision_seconds=PROVISION_SECONDS,
                    queued_provisioning=True)
    # The operator's node (the default pool, outside the flavor) and the empty pool.
    with real_cluster(tmp_path_factory.mktemp("pv"), 0, kueue=True, pools=[pool],
                      kueue_wait_for_pods_ready=WaitForPodsReady(
                          timeout_seconds=RUNNING_SECONDS)) as cluster:
        for plural, body in kueue_objects():
            cluster.custom.create_cluster_custom_object(*KUEUE, plural, body)
        cluster.custom.create_namespaced_custom_object(*KUEUE, NAMESPACE, "localqueues", {
            "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "LocalQueue",
            "metadata": {"name": QUEUE, "namespace": NAMESPACE},
            "spec": {"clusterQueue": "dws"}})
        wait_for(lambda: condition(cluster.custom.get_cluster_custom_object(
            *KUEUE, "admissionchecks", CHECK), "Active") == "True", 60,
            "Kueue's provisioning controller marking the check Active")
        yield cluster


def condition(obj: dict[str, Any] | None, kind: str) -> str | None:
    found = [c for c in ((obj or {}).get("status") or {}).get("conditions") or []
             if c["type"] == kind]
    return found[0]["status"] if found else None


def job(cluster: RealCluster, name: str, replicas: int) -> dict[str, Any]:
    """A real trainer that runs until deleted, one rank a pool node (a CPU each), wherever
    Kueue's flavor puts it (no spot node selector: the flavor's nodeLabels are the pods')."""
    body = cluster.trainingjob(name, steps=1_000_000, replicas=replicas)
    body["metadata"]["labels"] = {queueing.QUEUE_LABEL: QUEUE}
    spec = body["spec"]
    spec["resources"]["requests"] = {"cpu": "1", "memory": "256Mi"}
    spec["checkpoint"]["interval"] = {"steps": 1000}
    spec["checkpoint"]["saveOnPreemption"] = True
    spec["failurePolicy"] = {"backoffSeconds": 0}
    spec["podTemplate"] = {"terminationGracePeriodSeconds": 30}
    return body


def workload_of(cluster: RealCluster, name: str) -> dict[str, Any] | None:
    listed = cluster.custom.list_namespaced_custom_object(*KUEUE, NAMESPACE, "workloads")
    return next((w for w in listed["items"]
                 if w["metadata"]["labels"].get("tardigrade.dev/job") == name), None)


def requests(cluster: RealCluster) -> list[dict[str, Any]]:
    return list(cluster.custom.list_namespaced_custom_object(
        *PROVREQ, NAMESPACE, "provisioningrequests")["items"])


def pool_nodes(cluster: RealCluster) -> dict[str, dict[str, str]]:
    return {n.metadata.name: n.metadata.labels
            for n in cluster.core.list_node(label_selector=f"{POOL_LABEL}={POOL}").items}


def check_state(workload: dict[str, Any] | None) -> dict[str, Any] | None:
    return next((c for c in ((workload or {}).get("status") or {}).get("admissionChecks")
                 or [] if c["name"] == CHECK), None)


def test_a_job_waits_for_provisioned_then_runs_on_the_provisioned_nodes(
        cluster: RealCluster, operator: InstalledOperator):
    assert pool_nodes(cluster) == {}
    cluster.apply(job(cluster, "booked", replicas=2))
    request = wait_for(lambda: next(iter(requests(cluster)), None), 60,
                       "Kueue's ProvisioningRequest")
    assert request["spec"]["provisioningClassName"] == QUEUED_PROVISIONING_CLASS
    assert [p["count"] for p in request["spec"]["podSets"]] == [2]
    # Quota reserved, the check pending: the job waits, no pod, no node yet.
    waiting = wait_for(lambda: (w := workload_of(cluster, "booked"))
                       and condition(w, "QuotaReserved") == "True"
                       and (check_state(w) or {}).get("state") == "Pending" and w, 60,
                       "the Workload holding quota, its check Pending")
    assert condition(waiting, "Admitted") != "True"
    status = wait_for(lambda: (s := cluster.status("booked")).get("message", "").startswith(
        f"waiting in LocalQueue {QUEUE}: quota reserved, admission check {CHECK} Pending: "
        "provisioning 2 node(s)") and s, 60, "the job saying which check it waits for")
    assert status["phase"] == "Queued" and not cluster.pods("booked"), status
    assert pool_nodes(cluster) == {}
    # GKE provisions the nodes together, then says Provisioned; Kueue admits the Workload.
    provisioned = wait_for(lambda: (r := next(iter(requests(cluster)), None))
                           and condition(r, "Provisioned") == "True" and r, RUNNING_SECONDS,
                           "the request Provisioned")
    assert condition(provisioned, "Accepted") == "True"
    nodes = pool_nodes(cluster)
    assert len(nodes) == 2 and {labels[REQUEST_LABEL] for labels in nodes.values()} == {
        provisioned["metadata"]["name"]}, nodes
    admitted = wait_for(lambda: (w := workload_of(cluster, "booked"))
                        and condition(w, "Admitted") == "True" and w, 60, "admitted")
    assert check_state(admitted)["state"] == "Ready"
    updates = check_state(admitted)["podSetUpdates"]
    assert [u["annotations"][CONSUME] for u in updates] == [provisioned["metadata"]["name"]]
    cluster.wait_phase("booked", {"Running"}, RUNNING_SECONDS)
    pods = cluster.pods("booked")
    assert len(pods) == 2
    for pod in pods:
        assert pod.metadata.annotations[CONSUME] == provisioned["metadata"]["name"]
        assert pod.metadata.annotations[CLASS_ANNOTATION] == QUEUED_PROVISIONING_CLASS
        assert pod.spec.node_name in nodes
    assert len({p.spec.node_name for p in pods}) == 2
    # Deleted, the job gives its nodes back: its Workload and request go, and GKE the nodes.
    cluster.kubectl("delete", "tj/booked", "--wait=false")
    wait_for(lambda: not requests(cluster) and not pool_nodes(cluster), RELEASE_SECONDS,
             "the request and its nodes released")
    operator.assert_alive()
    cluster.clear_jobs()


def request_of(cluster: RealCluster, workload: dict[str, Any] | None) -> dict[str, Any] | None:
    """Kueue's request for `workload` (owned by it)."""
    uid = (workload or {}).get("metadata", {}).get("uid")
    return next((r for r in requests(cluster)
                 if any(o["uid"] == uid for o in r["metadata"].get("ownerReferences") or [])),
                None)


def grow_workload_of(cluster: RealCluster, name: str) -> dict[str, Any] | None:
    listed = cluster.custom.list_namespaced_custom_object(*KUEUE, NAMESPACE, "workloads")
    return next((w for w in listed["items"]
                 if w["metadata"]["labels"].get("tardigrade.dev/job") == name
                 and w["metadata"]["labels"].get(queueing.ROLE_LABEL) == queueing.GROW_ROLE),
                None)


def termination_messages(cluster: RealCluster, job: str) -> PodRecorder:
    """The job's pods from now on, for their trainers' termination messages as their kubelets
    report the containers terminated (a real kubelet removes a deleted pod's files: the API
    is where the message stays, until the pod goes)."""
    return PodRecorder(Kube(str(cluster.real.kubeconfig)), NAMESPACE,
                       f"tardigrade.dev/job={job}", timeout_seconds=3 * RUNNING_SECONDS,
                       since_now=True).start()


def saved_step(ended: PodRecorder, pods: set[str]) -> int:
    # As the kubelet reported it: a message that is not the trainer's (the kubelet's fallback
    # to the log's end) shows as it is.
    texts = wait_for(lambda: (found := {pod: ended.termination_text(pod, "trainer")
                                        for pod in pods}) and all(found.values()) and found,
                     60, f"the termination messages of {sorted(pods)}")
    ended.stop()
    try:
        messages = {pod: json.loads(texts[pod]) for pod in sorted(pods)}
    except ValueError as err:
        raise AssertionError(f"a termination message is not the trainer's: {texts}") from err
    saved = {message.get("checkpoint_step") for message in messages.values()}
    assert len(saved) == 1 and None not in saved, messages
    return int(saved.pop())


def test_a_grow_trains_on_at_its_size_until_the_extra_nodes_are_provisioned(
        cluster: RealCluster, operator: InstalledOperator):
    cluster.apply(job(cluster, "grower", replicas=2))
    cluster.wait_phase("grower", {"Running"}, RUNNING_SECONDS)
    first = {p.metadata.name for p in cluster.pods("grower")}
    ended = termination_messages(cluster, "grower")
    # A real gang trains some time after its pods run (JAX's start, restore, compile): a grow
    # provisioned before then would stop a gang that never trained.
    wait_for(lambda: int(cluster.status("grower").get("step") or 0) > 5, 180, "training")
    before = workload_of(cluster, "grower")
    assert before is not None and len(pool_nodes(cluster)) == 2
    cluster.kubectl("scale", "tj/grower", "--replicas=3")
    grow = wait_for(lambda: grow_workload_of(cluster, "grower"), 60, "the grow Workload")
    extra = wait_for(lambda: request_of(cluster, grow), 60, "the grow's ProvisioningRequest")
    assert [p["count"] for p in extra["spec"]["podSets"]] == [1]
    # Quota for the extra replica reserved, its node being provisioned: training goes on.
    status = wait_for(lambda: (s := cluster.status("grower"))["queue"].get("growingTo") == 3
                      and f"admission check {CHECK} Pending: provisioning 1 node(s)"
                      in s["queue"].get("message", "") and s, 60,
                      "the grow waiting for its node, in the job's status")
    step = int(status.get("step") or 0)
    wait_for(lambda: int(cluster.status("grower").get("step") or 0) > step + 20, 60,
             "training on while the extra node is provisioned")
    waiting = cluster.status("grower")
    assert waiting["phase"] == "Running" and waiting["replicas"] == 2, waiting
    assert {p.metadata.name for p in cluster.pods("grower")} == first
    assert condition(request_of(cluster, grow), "Provisioned") != "True"
    # Provisioned: the gang saves, the Workload is made at 3, its own request provisioned,
    # and the gang of 3 resumes from the saved step on the nodes booked for it.
    status = wait_for(lambda: (s := cluster.status("grower")).get("phase") == "Running"
                      and s["recoveries"] and s["recoveries"][-1]["cause"] == "Resume"
                      and s, RUNNING_SECONDS, "the gang of 3 resumed")
    assert status["recoveries"][-1]["restoreStep"] == saved_step(ended, first) > step + 20
    after = workload_of(cluster, "grower")
    assert after is not None and after["metadata"]["uid"] != before["metadata"]["uid"]
    booked = request_of(cluster, after)
    assert booked is not None and condition(booked, "Provisioned") == "True"
    pods = [p for p in cluster.pods("grower") if p.metadata.name not in first]
    assert len(pods) == 3
    nodes = pool_nodes(cluster)
    for pod in pods:
        assert pod.metadata.annotations[CONSUME] == booked["metadata"]["name"]
        assert nodes[pod.spec.node_name][REQUEST_LABEL] == booked["metadata"]["name"]
    # The first and the grow's requests went with their Workloads, and their nodes with them.
    wait_for(lambda: [r["metadata"]["name"] for r in requests(cluster)] == [
        booked["metadata"]["name"]] and len(pool_nodes(cluster)) == 3, RELEASE_SECONDS,
        "only the new request's nodes left")
    assert status["restarts"]["failures"] == 0
    cluster.kubectl("delete", "tj/grower", "--wait=false")
    wait_for(lambda: not requests(cluster) and not pool_nodes(cluster), RELEASE_SECONDS,
             "the request and its nodes released")
    operator.assert_alive()
    cluster.clear_jobs()


def test_an_evicted_job_gives_its_nodes_back_and_is_provisioned_again_when_requeued(
        cluster: RealCluster, operator: InstalledOperator):
    """Suspended, the job's Workload is evicted (Deactivated); Kueue v0.19 deletes an evicted
    Workload's request (CleanupProvisioningRequestsOnEviction, beta, on) and GKE takes the
    nodes back. Resumed, the Workload gets a new request and the gang resumes on its nodes."""
    cluster.apply(job(cluster, "evictee", replicas=2))
    cluster.wait_phase("evictee", {"Running"}, RUNNING_SECONDS)
    first_request = requests(cluster)[0]["metadata"]["uid"]
    first_nodes = set(pool_nodes(cluster))
    first = {p.metadata.name for p in cluster.pods("evictee")}
    ended = termination_messages(cluster, "evictee")
    wait_for(lambda: int(cluster.status("evictee").get("step") or 0) > 5, 180, "training")
    cluster.kubectl("patch", "tj/evictee", "--type=merge", "-p", '{"spec":{"suspend":true}}')
    cluster.wait_phase("evictee", {"Suspended"}, RELEASE_SECONDS)
    wait_for(lambda: not requests(cluster) and not pool_nodes(cluster), RELEASE_SECONDS,
             "the evicted Workload's request and nodes given back")
    step = saved_step(ended, first)
    cluster.kubectl("patch", "tj/evictee", "--type=merge", "-p", '{"spec":{"suspend":false}}')
    status = wait_for(lambda: (s := cluster.status("evictee")).get("phase") == "Running"
                      and s["recoveries"] and s["recoveries"][-1]["cause"] == "Resume"
                      and s, RUNNING_SECONDS, "resumed on newly provisioned nodes")
    assert status["recoveries"][-1]["restoreStep"] == step
    [again] = requests(cluster)
    assert again["metadata"]["uid"] != first_request
    assert condition(again, "Provisioned") == "True"
    nodes = pool_nodes(cluster)
    assert len(nodes) == 2 and not set(nodes) & first_nodes, nodes
    for pod in cluster.pods("evictee"):
        assert pod.metadata.annotations[CONSUME] == again["metadata"]["name"]
        assert nodes[pod.spec.node_name][REQUEST_LABEL] == again["metadata"]["name"]
    assert status["restarts"]["failures"] == 0
    cluster.kubectl("delete", "tj/evictee", "--wait=false")
    wait_for(lambda: not requests(cluster) and not pool_nodes(cluster), RELEASE_SECONDS,
             "the request and its nodes released")
    operator.assert_alive()
    cluster.clear_jobs()
