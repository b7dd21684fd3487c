"""A tiny in-memory stand-in for the cluster, to drive `decide` through whole scenarios."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime, timedelta
from typing import Any

from tardigrade_contract import contract
from tardigrade_operator.api.parse import parse_spec
from tardigrade_operator.api.types import TrainingJobStatus
from tardigrade_operator.decision.decide import decide
from tardigrade_operator.decision.plan import Plan
from tardigrade_operator.decision.queueing import QueueGate
from tardigrade_operator.observation.autoscaling import newest_signals
from tardigrade_operator.observation.gang import gang_of
from tardigrade_operator.observation.observed import DecisionSettings, Observed
from tardigrade_operator.observation.pods import parse_pod, parse_service
from tardigrade_operator.rendering.keys import JobKeys
from tardigrade_operator.rendering.manifests import JobRef

T0 = datetime(2026, 12, 2, 12, 0, 0, tzinfo=UTC)
JOB = JobRef(name="tiny", namespace="ml", uid="uid-1")
# What the handlers would make the job's Secret with (keys.JobKeys.fresh in the operator).
KEYS = JobKeys(restart_key="r" * 43, progress_token="p" * 43, cache_key="c" * 43)


def spec(**overrides: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "replicas": 2,
        "image": "trainer:1",
        "checkpoint": {"path": "gs://bucket/tiny"},
        "failurePolicy": {"maxRestarts": 2, "backoffSeconds": 10},
    }
    base.update(overrides)
    return base


def pod_env(pod: dict[str, Any]) -> dict[str, str]:
    """Literal environment variables of the trainer container."""
    return {e["name"]: e["value"] for e in pod["spec"]["containers"][0]["env"] if "value" in e}


def iso(when: datetime) -> str:
    return when.strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclasses.dataclass
class FakeCluster:
    spec: dict[str, Any]
    status: TrainingJobStatus = dataclasses.field(default_factory=TrainingJobStatus)
    pods: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    service: dict[str, Any] | None = None
    keys_secret: dict[str, Any] | None = None  # the job's keys Secret, whoever made it
    network_policy: dict[str, Any] | None = None
    now: datetime = T0
    generation: int = 1
    progress: contract.ProgressReport | None = None
    progress_error: str | None = None  # rank 0 answered with a malformed report
    nodes_ready: dict[str, bool] | None = None
    nodes_not_ready_since: dict[str, datetime] = dataclasses.field(default_factory=dict)
    nodes_shutting_down: frozenset[str] = frozenset()
    settings: DecisionSettings = dataclasses.field(default_factory=DecisionSettings)
    plans: list[Plan] = dataclasses.field(default_factory=list)
    rejected: str | None = None  # the API server refused a child of this spec
    job: JobRef = JOB  # another uid: the job was deleted and re-created under its name
    # Events in the job's namespace (API JSON), e.g. the cluster autoscaler's on pods.
    events: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    # Node -> scheduled host maintenance start (GKE's scheduled-maintenance-time label).
    nodes_maintenance: dict[str, datetime] = dataclasses.field(default_factory=dict)
    # Node -> its GKE node pool, as the operator's node watch sees it; None: nodes not watched.
    node_pools: dict[str, str] | None = None
    # Node -> status.nodeInfo.kubeletVersion (restart in place).
    kubelet_versions: dict[str, str] = dataclasses.field(default_factory=dict)
    # Kept pods whose trainers did not take the operator's restart request.
    refused_restarts: frozenset[str] = frozenset()
    # Kueue's hold on the job (queueing.QueueGate); None: not labelled for a queue.
    queue: QueueGate | None = None
    # The job's metadata.creationTimestamp (where its goodput account starts).
    created: datetime | None = T0

    def observe(self) -> Observed:
        try:
            parsed, error = parse_spec(self.spec), None
        except ValueError as err:
            parsed, error = None, str(err)
        views = [v for v in (parse_pod(p) for p in self.pods.values()) if v is not None]
        return Observed(
            job=self.job, generation=self.generation, spec=parsed, spec_error=error,
            status=self.status,
            gang=gang_of(views, self.job.uid, self.status, self.nodes_shutting_down),
            service=None if self.service is None else parse_service(self.service),
            now=self.now, progress=self.progress, progress_error=self.progress_error,
            nodes_ready=self.nodes_ready,
            nodes_not_ready_since=self.nodes_not_ready_since,
            nodes_shutting_down=self.nodes_shutting_down,
            settings=self.settings, rejected=self.rejected,
            scale_up=newest_signals(self.events), nodes_maintenance=self.nodes_maintenance,
            node_pools=self.node_pools,
            kubelet_versions=self.kubelet_versions,
            keys_secret=None if self.keys_secret is None else parse_service(self.keys_secret),
            new_keys=KEYS if self.keys_secret is None else None,
            network_policy=self.network_policy is not None and any(
                r.get("uid") == self.job.uid
                for r in self.network_policy["metadata"].get("ownerReferences") or []),
            refused_restarts=self.refused_restarts, queue=self.queue, created=self.created,
        )

    def reconcile(self) -> Plan:
        plan = decide(self.observe())
        self.plans.append(plan)
        self.status = plan.status  # written first, as the applier does
        # Created only where none exists: a create of a taken name answers AlreadyExists.
        if plan.create_keys_secret is not None and self.keys_secret is None:
            self.keys_secret = plan.create_keys_secret
        if plan.create_service is not None and self.service is None:
            self.service = plan.create_service
        if plan.create_network_policy is not None and self.network_policy is None:
            self.network_policy = plan.create_network_policy
        for name in plan.release_pods:
            self.pods[name]["metadata"]["finalizers"].remove("tardigrade.dev/gang-tracking")
        for name, patch in plan.patch_pods:  # a merge patch of labels and annotations
            meta = self.pods[name]["metadata"]
            for field in ("labels", "annotations"):
                meta.setdefault(field, {}).update(patch["metadata"].get(field) or {})
        for name, grace in plan.delete_pods:
            pod = self.pods.get(name)
            if pod is None:
                continue
            terminal = pod["status"].get("phase") in ("Succeeded", "Failed")
            seconds = 0 if terminal else grace if grace is not None else pod["spec"].get(
                "terminationGracePeriodSeconds", 30)
            pod["metadata"].setdefault("deletionTimestamp",
                                       iso(self.now + timedelta(seconds=seconds)))
            if grace == 0:
                pod["status"]["phase"] = "Failed"
        self._collect()
        for pod in plan.create_pods:
            name = pod["metadata"]["name"]
            if name not in self.pods:
                pod = {**pod, "status": {"phase": "Pending"}}
                self.pods[name] = pod
        return plan

    def _collect(self) -> None:
        """The API server removes deleted pods once they are finished and unfinalized."""
        for name, pod in list(self.pods.items()):
            meta = pod["metadata"]
            if meta.get("deletionTimestamp") and not meta.get("finalizers") and pod["status"].get(
                "phase"
            ) in ("Succeeded", "Failed"):
                del self.pods[name]

    # --- what kubelets and trainers do ---------------------------------------------------

    def attempt_pods(self, attempt: int | None = None) -> list[dict[str, Any]]:
        attempt = self.status.attempt if attempt is None else attempt
        return sorted(
            (p for p in self.pods.values()
             if p["metadata"]["labels"]["tardigrade.dev/attempt"] == str(attempt)),
            key=lambda p: int(p["metadata"]["labels"]["tardigrade.dev/rank"]),
        )

    def run_all(self) -> None:
        for index, pod in enumerate(self.attempt_pods()):
            pod["spec"]["nodeName"] = f"node-{index}"
            pod["status"] = {
                "phase": "Running", "podIP": f"127.0.1.{index + 1}",
                "containerStatuses": [{"name": "trainer", "state": {"running": {}}}],
            }

    def terminate(self, pod: dict[str, Any], code: int, message: str = "",
                  reason: str | None = None) -> None:
        phase = "Succeeded" if code == 0 else "Failed"
        pod["status"] = {
            **pod["status"], "phase": phase,
            "containerStatuses": [{"name": "trainer", "state": {"terminated": {
                "exitCode": code, "reason": reason or ("Completed" if code == 0 else "Error"),
                "message": message}}}],
        }
        self._collect()

    def terminate_all(self, code: int, step: int | None = None,
                      checkpoint: int | None = None) -> None:
        reason = {0: "Succeeded", contract.EXIT_PREEMPTED_SAVED: "PreemptedSaved"}.get(
            code, "Failed")
        message = contract.TerminationMessage(
            reason=reason, step=step, checkpoint_step=checkpoint,
            checkpoint_path=None if checkpoint is None else f"gs://bucket/tiny/{checkpoint}",
        ).to_json()
        for pod in self.attempt_pods():
            self.terminate(pod, code, message)

    def disrupt(self, pod: dict[str, Any], reason: str = "TerminationByKubelet") -> None:
        pod["status"].setdefault("conditions", []).append(
            {"type": "DisruptionTarget", "status": "True", "reason": reason,
             "lastTransitionTime": iso(self.now)})

    def advance(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)
