"""No way around the quota: whatever an owner edits on an admitted TrainingJob (replicas, GPUs
per pod, requests), the gang never runs beyond what Kueue admitted. The operator's decisions
(decide, queueing.workload_actions) run pass after pass against a small model of Kueue (a
ClusterQueue of 4 GPUs that admits a Workload only if it fits; Workloads stored as the bodies
the operator writes, read back through parse_workload) and of the kubelets (pods start, and
save and exit when deleted). After every pass: the GPUs that pods not yet finished ask for are
within the 4. Once settled: a job that fits runs at its new shape; one that does not waits with
no pod, or, grown at the same shape, trains on at what is admitted while the rest waits."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from tardigrade_contract import contract
from tardigrade_operator.api.parse import parse_spec
from tardigrade_operator.decision import queueing
from tardigrade_operator.decision.queueing import Flavor, JobIdentity
from tardigrade_operator.observation.pods import parse_pod
from tardigrade_operator.rendering.placement import GPU_RESOURCE

from tests.fuzz import CHEAP
from tests.operator.fake_cluster import JOB, FakeCluster, spec

NOW = datetime(2026, 1, 1, tzinfo=UTC)
IDENTITY = JobIdentity(JOB.name, JOB.namespace, JOB.uid)
QUEUE = "team-queue"
QUOTA_GPUS = 4
FLAVORS = {"h100": Flavor({"pool": "h100"}, [])}
SAVED = contract.EXIT_PREEMPTED_SAVED


def gpu_spec(replicas: int = 4, gpus: int = 1, cpu: str = "1") -> dict[str, Any]:
    return spec(replicas=replicas, resources={"requests": {"cpu": cpu}},
                accelerator={"kind": "nvidia-gpu", "type": "nvidia-h100-80gb", "count": gpus})


def pod_gpus(template: dict[str, Any]) -> int:
    containers = template["spec"]["containers"]
    return sum(int((c.get("resources") or {}).get("limits", {}).get(GPU_RESOURCE, 0))
               for c in containers)


@dataclasses.dataclass
class FakeKueue:
    """One ClusterQueue of QUOTA_GPUS, admitting whole Workloads in creation order; the
    Workloads as the operator's writes (kube.apply_workload) leave them."""

    bodies: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)

    def views(self) -> dict[str, queueing.WorkloadView]:
        return {name: queueing.parse_workload(body) for name, body in self.bodies.items()}

    def used(self) -> int:
        total = 0
        for body in self.bodies.values():
            view = queueing.parse_workload(body)
            if view.true("QuotaReserved"):
                assert view.admitted_count is not None
                held = min(view.admitted_count, view.count - view.reclaimable)
                total += held * pod_gpus(body["spec"]["podSets"][0]["template"])
        return total

    def admit(self) -> None:
        for body in self.bodies.values():
            view = queueing.parse_workload(body)
            if view.true("QuotaReserved") or not view.active:
                continue
            podset = body["spec"]["podSets"][0]
            need = podset["count"] * pod_gpus(podset["template"])
            if self.used() + need > QUOTA_GPUS:
                continue
            status = body.setdefault("status", {})
            status["conditions"] = [c for c in status.get("conditions") or []
                                    if c["type"] not in ("QuotaReserved", "Admitted", "Evicted")]
            status["conditions"] += [
                {"type": "QuotaReserved", "status": "True", "reason": "QuotaReserved"},
                {"type": "Admitted", "status": "True", "reason": "Admitted"}]
            status["admission"] = {"clusterQueue": "team", "podSetAssignments": [{
                "name": queueing.PODSET, "count": podset["count"],
                "flavors": {GPU_RESOURCE: "h100", "cpu": "h100"}}]}

    def apply(self, action: queueing.WorkloadAction) -> None:
        if isinstance(action, queueing.CreateWorkload):
            body = {**action.body, "metadata": {**action.body["metadata"],
                                                "resourceVersion": "1"}}
            self.bodies.setdefault(body["metadata"]["name"], body)
            return
        body = self.bodies.get(action.name)
        if body is None or body["metadata"]["resourceVersion"] != action.resource_version:
            return
        body["metadata"]["resourceVersion"] = str(int(action.resource_version) + 1)
        status = body.setdefault("status", {})
        podset = body["spec"]["podSets"][0]
        reserved = queueing.parse_workload(body).true("QuotaReserved")
        if isinstance(action, queueing.DeleteWorkload):
            del self.bodies[action.name]
        elif isinstance(action, queueing.ResizeWorkload):
            assert not reserved, "Kueue's webhook refuses podSet changes while reserved"
            podset["count"] = action.count
            if action.clear_reclaimable:
                status.pop("reclaimablePods", None)
            if action.template is not None:
                podset["template"] = action.template
                body["metadata"]["annotations"][queueing.PODSET_HASH_ANNOTATION] = (
                    action.podset_hash)
        elif isinstance(action, queueing.ReclaimPods):
            status["reclaimablePods"] = [{"name": queueing.PODSET, "count": action.count}]
        elif isinstance(action, queueing.PatchWorkloadSpec):
            for field, value in action.changes.items():
                if value is None:
                    body["spec"].pop(field, None)
                else:
                    body["spec"][field] = value
        else:
            status["conditions"] = action.conditions
            if isinstance(action, queueing.ReleaseQuota):
                status.pop("admission", None)


def live_gpus(cluster: FakeCluster) -> int:
    """GPUs asked for by pods not yet finished (running, starting, or saving on the way out)."""
    return sum(pod_gpus(p) for p in cluster.pods.values()
               if p["status"].get("phase") not in ("Succeeded", "Failed"))


def one_pass(cluster: FakeCluster, kueue: FakeKueue) -> None:
    parsed = parse_spec(cluster.spec)
    views = [v for v in (parse_pod(p) for p in cluster.pods.values()) if v is not None]
    active = any(v.active for v in views)
    workloads = kueue.views().values()
    main = next((w for w in workloads if w.role != queueing.GROW_ROLE), None)
    grow = next((w for w in workloads if w.role == queueing.GROW_ROLE), None)
    gate = queueing.gate_for(QUEUE, main, FLAVORS, parsed.replicas, grow, spec=parsed,
                             gang_active=active)
    cluster.queue = gate
    cluster.reconcile()
    assert live_gpus(cluster) <= QUOTA_GPUS, (cluster.spec, cluster.status.phase)
    stored = (main and kueue.bodies[main.name].get("status", {}).get("conditions")) or []
    for action in queueing.workload_actions(IDENTITY, parsed, cluster.status, gate, active,
                                            None, NOW, stored):
        kueue.apply(action)
    kueue.admit()
    assert kueue.used() <= QUOTA_GPUS
    # The kubelets: deleted pods save and exit, new ones start.
    for pod in list(cluster.pods.values()):
        if pod["metadata"].get("deletionTimestamp") and pod["status"].get("phase") not in (
                "Succeeded", "Failed"):
            cluster.terminate(pod, SAVED, contract.TerminationMessage(
                reason="PreemptedSaved", step=40, checkpoint_step=40,
                checkpoint_path="gs://bucket/tiny/40").to_json())
        elif pod["status"].get("phase") == "Pending":
            pod["spec"]["nodeName"] = f"node-{pod['metadata']['name']}"
            pod["status"] = {"phase": "Running", "podIP": "127.0.1.1", "containerStatuses": [
                {"name": "trainer", "state": {"running": {}}}]}
    assert live_gpus(cluster) <= QUOTA_GPUS


def settle(cluster: FakeCluster, kueue: FakeKueue, passes: int = 14) -> None:
    for _ in range(passes):
        one_pass(cluster, kueue)


def admitted_running() -> tuple[FakeCluster, FakeKueue]:
    cluster, kueue = FakeCluster(gpu_spec()), FakeKueue()
    settle(cluster, kueue, 6)
    assert cluster.status.phase == "Running" and cluster.status.replicas == 4
    assert kueue.used() == QUOTA_GPUS
    return cluster, kueue


def check_settled(cluster: FakeCluster, kueue: FakeKueue) -> None:
    body = cluster.spec
    replicas, gpus = body["replicas"], body["accelerator"]["count"]
    current = [p for p in cluster.pods.values()
               if p["status"].get("phase") not in ("Succeeded", "Failed")]
    if replicas * gpus <= QUOTA_GPUS:
        assert cluster.status.phase == "Running", (body, cluster.status.message)
        assert len(current) == replicas and {pod_gpus(p) for p in current} == {gpus}
    elif current:
        # Grown past the quota at the same shape: it trains on at what is admitted while the
        # rest waits in the queue (never at the old shape after a change of what pods ask).
        assert {pod_gpus(p) for p in current} == {gpus}, body
        assert cluster.status.phase == "Running" and cluster.status.queue is not None
        assert cluster.status.queue.growing_to == replicas
    else:
        assert cluster.status.phase == "Queued", (body, cluster.status.phase)


def test_admitted_at_4_by_1_gpu_patched_to_8_gpus_then_scaled_to_3_never_runs_beyond_quota():
    cluster, kueue = admitted_running()
    cluster.spec["accelerator"] = {**cluster.spec["accelerator"], "count": 8}
    settle(cluster, kueue, 4)
    cluster.spec["replicas"] = 3
    settle(cluster, kueue)
    check_settled(cluster, kueue)
    assert cluster.status.conditions[-1].reason == "Queued"
    # Back to what fits: admitted and running at 2 x 2.
    cluster.spec["accelerator"] = {**cluster.spec["accelerator"], "count": 2}
    cluster.spec["replicas"] = 2
    settle(cluster, kueue)
    check_settled(cluster, kueue)


edits = st.lists(st.tuples(st.integers(1, 6), st.sampled_from([1, 2, 4, 8]),
                           st.sampled_from(["1", "2"]), st.integers(0, 3)),
                 min_size=1, max_size=3)


@pytest.mark.fuzz
@CHEAP
@given(edits)
def test_any_edit_of_an_admitted_job_stays_within_the_quota(changes):
    cluster, kueue = admitted_running()
    for replicas, gpus, cpu, passes_before_next in changes:
        cluster.spec["replicas"] = replicas
        cluster.spec["accelerator"] = {**cluster.spec["accelerator"], "count": gpus}
        cluster.spec["resources"] = {"requests": {"cpu": cpu}}
        settle(cluster, kueue, passes_before_next)
    settle(cluster, kueue)
    check_settled(cluster, kueue)
