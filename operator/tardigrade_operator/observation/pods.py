"""Observe: raw Pod objects -> a typed view of the gang, and why each rank stopped. Pure."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any

from tardigrade_contract import contract

from tardigrade_operator import naming
from tardigrade_operator.decision.recovery import keepers
from tardigrade_operator.finalizers import owner_uid

# pod.status.reason values that mean the node went away or the pod was pushed off it.
PREEMPTION_POD_REASONS = frozenset(
    {"Evicted", "Preempting", "Terminated", "NodeShutdown", "Shutdown", "NodeLost"}
)
# pod.status.reason values the kubelet writes when it refuses to run a pod bound to its node
# (phase Failed, message "Pod was rejected: ...", no container started): the kubelet's
# `admissionRejectionReasons` (pkg/kubelet/kubelet.go) and `rejectPod`. A placement or capacity
# problem of that node, never the trainer's fault.
ADMISSION_REJECTION_REASONS = frozenset({
    # pkg/kubelet/lifecycle/predicate.go, predicateAdmitHandler.Admit
    "PodOSSelectorNodeLabelDoesNotMatch", "PodOSNotSupported", "InvalidNodeInfo",
    "InitContainerRestartPolicyForbidden", "SupplementalGroupsPolicyNotSupported",
    "UnexpectedAdmissionError", "UnknownReason", "UnexpectedPredicateFailureType",
    # ... the failed predicate's name (scheduler.AdmissionCheck, generalFilter)
    "NodeName", "NodeAffinity", "NodePorts", "TaintToleration",
    # pkg/kubelet/lifecycle/handlers.go
    "AppArmor", "PodLevelResourcesNotSupported", "PodFeatureUnsupported",
    "Evicted",  # pkg/kubelet/eviction: Admit under node pressure
    "SysctlForbidden",  # pkg/kubelet/sysctl
    "TopologyAffinityError",  # pkg/kubelet/cm/topologymanager
    "NodeShutdown",  # pkg/kubelet/nodeshutdown: bound to a node that is shutting down
})
# predicate.go: InsufficientResourceError -> "OutOf" + resource name (OutOfcpu, OutOfpods,
# OutOfnvidia.com/gpu, OutOfgoogle.com/tpu...).
INSUFFICIENT_RESOURCE_PREFIX = "OutOf"
# Exit codes from a signal we did not send: 143 = SIGTERM, 137 = SIGKILL.
SIGTERM_EXIT = 143
# The terminated reason (exit code 137) the kubelet reports for a container that used to run
# and that it cannot find any more (kubecontainer.ContainerReasonStatusUnknown,
# pkg/kubelet/kubelet_pods.go convertToAPIContainerStatuses).
CONTAINER_STATUS_UNKNOWN = "ContainerStatusUnknown"


class Outcome(enum.Enum):
    PENDING = "Pending"
    RUNNING = "Running"
    SUCCEEDED = "Succeeded"
    PREEMPTED = "Preempted"  # spot reclaim, eviction, node lost: never uses up maxRestarts
    REJECTED = "Rejected"  # the kubelet refused to admit the pod: placement, not the trainer
    RETRYABLE = "Retryable"  # exit code marked retryable
    FATAL = "Fatal"  # the trainer says the spec cannot run (config error, corrupt checkpoint)
    FAILED = "Failed"  # a real crash


@dataclasses.dataclass(frozen=True)
class PodView:
    name: str
    attempt: int
    rank: int
    phase: str
    node_name: str | None = None
    deletion_timestamp: datetime | None = None
    unschedulable_since: datetime | None = None
    disruption: str | None = None  # DisruptionTarget reason, when the condition is True
    status_reason: str | None = None  # pod.status.reason (Evicted, Terminated, ...)
    status_message: str = ""  # pod.status.message ("Pod was rejected: ...")
    container_started: bool = False
    exit_code: int | None = None
    terminated_reason: str | None = None  # Completed, Error, OOMKilled
    termination: contract.TerminationMessage | None = None
    termination_text: str = ""
    pod_ip: str | None = None
    tracked: bool = False  # still carries our finalizer
    # Why the container has not started (ErrImagePull, CreateContainerConfigError, ...).
    waiting: str | None = None
    # uid of the TrainingJob in the pod's ownerReferences: a job deleted and re-created under
    # the same name has a new uid, and the old one's pods carry the same labels.
    owner_uid: str | None = None
    # Restart in place (recovery/in_place.py): the API server kept the trainer's restart rule;
    # its trainer holds the job's restart key (from the job's Secret, keys.py), without which
    # it takes no restart request; the container's restarts, and the termination message and
    # exit code of its previous run in this pod.
    restart_rule: bool = False
    restart_keyed: bool = False
    # Its trainer restarts in process (contract.ENV_RESTART_IN_PROCESS): it needs no kubelet.
    restart_in_process: bool = False
    restart_count: int = 0
    last_exit_code: int | None = None
    last_termination: contract.TerminationMessage | None = None
    last_finished_at: datetime | None = None
    # The attempt its label says, when it is not `attempt`: a pod kept by a restart in place
    # counts in the new attempt before its label is patched (carry.carried).
    label_attempt: int | None = None

    @property
    def deleting(self) -> bool:
        return self.deletion_timestamp is not None

    @property
    def terminal(self) -> bool:
        return self.phase in ("Succeeded", "Failed")

    @property
    def abandoned(self) -> bool:
        """Deleted before any node took it: no process ran and none ever will, so no kubelet
        will report a final phase either."""
        return self.deleting and not self.node_name and not self.terminal

    @property
    def active(self) -> bool:
        """Still holds (or may hold) a running process."""
        return not self.terminal and not self.abandoned


@dataclasses.dataclass(frozen=True)
class RankOutcome:
    outcome: Outcome
    reason: str


def parse_pod(pod: Mapping[str, Any]) -> PodView | None:
    """Read a Pod (API JSON). None for pods without our labels."""
    meta = pod.get("metadata") or {}
    labels = meta.get("labels") or {}
    try:
        attempt = int(labels[naming.LABEL_ATTEMPT])
        rank = int(labels[naming.LABEL_RANK])
    except (KeyError, ValueError):
        return None
    status = pod.get("status") or {}
    conditions = {c.get("type"): c for c in status.get("conditions") or []}
    disruption = conditions.get("DisruptionTarget")
    scheduled = conditions.get("PodScheduled")
    unschedulable_since = None
    if scheduled and (scheduled.get("status"), scheduled.get("reason")) == (
        "False", "Unschedulable"
    ):
        unschedulable_since = contract.parse_time(scheduled.get("lastTransitionTime"))
    container = _trainer_status(status.get("containerStatuses") or [])
    state = (container or {}).get("state") or {}
    terminated = state.get("terminated") or {}
    text = terminated.get("message") or ""
    last = ((container or {}).get("lastState") or {}).get("terminated") or {}
    return PodView(
        name=meta.get("name", ""),
        attempt=attempt,
        rank=rank,
        phase=status.get("phase") or "Pending",
        node_name=(pod.get("spec") or {}).get("nodeName"),
        deletion_timestamp=contract.parse_time(meta.get("deletionTimestamp")),
        unschedulable_since=unschedulable_since,
        disruption=(disruption.get("reason") or "DisruptionTarget")
        if disruption and disruption.get("status") == "True" else None,
        status_reason=status.get("reason"),
        status_message=status.get("message") or "",
        container_started="running" in state or bool(terminated),
        exit_code=terminated.get("exitCode"),
        terminated_reason=terminated.get("reason"),
        termination=contract.TerminationMessage.from_json(text) if text else None,
        termination_text=text,
        pod_ip=status.get("podIP"),
        tracked=naming.POD_FINALIZER in (meta.get("finalizers") or []),
        waiting=_waiting(state.get("waiting") or {}),
        owner_uid=owner_uid(pod),
        restart_rule=keepers.rule_survived(pod),
        restart_keyed=_secret_ref(pod, contract.ENV_RESTART_KEY) == (
            naming.keys_secret_name(str(labels.get(naming.LABEL_JOB) or "")),
            contract.SECRET_RESTART_KEY),
        restart_in_process=_trainer_env(pod, contract.ENV_RESTART_IN_PROCESS) == "true",
        restart_count=int((container or {}).get("restartCount") or 0),
        last_exit_code=last.get("exitCode"),
        last_finished_at=contract.parse_time(last.get("finishedAt")),
        last_termination=(contract.TerminationMessage.from_json(last["message"])
                          if last.get("message") else None),
    )


def _trainer_env(pod: Mapping[str, Any], name: str) -> str | None:
    for container in (pod.get("spec") or {}).get("containers") or []:
        if container.get("name") == naming.TRAINER_CONTAINER:
            return next((e.get("value") for e in container.get("env") or []
                         if e.get("name") == name), None)
    return None


def _secret_ref(pod: Mapping[str, Any], name: str) -> tuple[str, str] | None:
    """(Secret, key) the trainer's variable `name` comes from, if a Secret."""
    for container in (pod.get("spec") or {}).get("containers") or []:
        if container.get("name") == naming.TRAINER_CONTAINER:
            ref = next((((e.get("valueFrom") or {}).get("secretKeyRef") or {})
                        for e in container.get("env") or [] if e.get("name") == name), {})
            return (str(ref["name"]), str(ref["key"])) if "name" in ref and "key" in ref \
                else None
    return None


# Waiting reasons that mean "stuck until someone fixes something", not "about to start".
STUCK_WAITING_REASONS = frozenset({
    "ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull",
    "CreateContainerConfigError", "CreateContainerError", "RunContainerError",
})


def _waiting(waiting: Mapping[str, Any]) -> str | None:
    reason = waiting.get("reason")
    if reason not in STUCK_WAITING_REASONS:
        return None
    message = waiting.get("message")
    return f"{reason}: {message}" if message else str(reason)


def classify(pod: PodView, retryable_exit_codes: Iterable[int] = ()) -> RankOutcome:
    """Why a rank is where it is. The order matters: a disruption explains the crash after it.

    A rank on a node that is not Ready is judged with the gang (nodeloss.py), not here: a
    kubelet restart or a short partition looks the same as a lost VM for a while."""
    # The trainer container decides, not the pod phase: a non-native sidecar (a second regular
    # container) keeps the pod Running after the trainer exited, and fails it when the trainer
    # succeeded but the sidecar did not.
    if pod.phase == "Succeeded" or pod.exit_code == 0:
        return RankOutcome(Outcome.SUCCEEDED, "completed")
    if pod.disruption:
        return RankOutcome(Outcome.PREEMPTED, f"{pod.name}: {pod.disruption}")
    if pod.phase == "Failed" and is_admission_rejection(pod.status_reason):
        # Re-admission after a kubelet restart can reject a pod that already ran: then it was
        # pushed off a node like an eviction; one that never started is relaunched with backoff
        # so a node that keeps rejecting cannot make a tight loop.
        kind = Outcome.PREEMPTED if pod.container_started else Outcome.REJECTED
        detail = f": {pod.status_message}" if pod.status_message else ""
        return RankOutcome(kind, f"{pod.name}: {pod.status_reason}{detail}")
    if pod.status_reason in PREEMPTION_POD_REASONS:
        return RankOutcome(Outcome.PREEMPTED, f"{pod.name}: {pod.status_reason}")
    if pod.phase == "Unknown":
        return RankOutcome(Outcome.PREEMPTED, f"{pod.name}: node unreachable")
    if pod.terminated_reason == CONTAINER_STATUS_UNKNOWN:
        # The kubelet lost the container with its VM (a VM recreated under the node's name,
        # a pod deleted while its node was away): nothing the trainer did.
        return RankOutcome(Outcome.PREEMPTED,
                           f"{pod.name}: container lost with its node ({CONTAINER_STATUS_UNKNOWN})")
    if pod.exit_code == contract.EXIT_RESTART_IN_PLACE:
        # Saved at the gang's step and asked to be started again in this pod: its kubelet
        # does so (restart rule) while the pod lives; a pod that ended with it (a kubelet
        # without the rule, a pod being deleted) saved and stopped, as with exit 75.
        if pod.terminal or pod.deleting:
            return RankOutcome(Outcome.PREEMPTED, f"{pod.name}: saved and stopped")
        return RankOutcome(Outcome.PENDING, "restarting in place")
    if pod.phase == "Failed" or pod.exit_code is not None:
        code = pod.exit_code
        if code == contract.EXIT_PREEMPTED_SAVED:
            return RankOutcome(Outcome.PREEMPTED, f"{pod.name}: saved and stopped")
        if code in contract.FATAL_EXIT_CODES:
            return RankOutcome(Outcome.FATAL, describe_failure(pod))
        if code is not None and (
            code in contract.RETRYABLE_EXIT_CODES or code in set(retryable_exit_codes)
        ):
            return RankOutcome(Outcome.RETRYABLE, f"{pod.name}: exit code {code} (retryable)")
        return RankOutcome(Outcome.FAILED, describe_failure(pod))
    if pod.deleting:
        # Deleted by someone else (eviction, kubectl delete) while we did not stop the gang.
        return RankOutcome(Outcome.PREEMPTED, f"{pod.name}: deleted")
    if pod.phase == "Running" and pod.container_started:
        return RankOutcome(Outcome.RUNNING, "running")
    return RankOutcome(Outcome.PENDING, "pending")


def is_admission_rejection(reason: str | None) -> bool:
    """True for a pod.status.reason the kubelet writes when it refuses to admit a pod."""
    return bool(reason) and (
        reason in ADMISSION_REJECTION_REASONS
        or str(reason).startswith(INSUFFICIENT_RESOURCE_PREFIX)
    )


# A node object's readiness as last seen: (resourceVersion, to tell objects of one name
# apart; Ready; the Ready condition's lastTransitionTime, RFC 3339, "" when absent; whether
# its kubelet says the node is shutting down).
NodeReadiness = tuple[int, bool, str, bool]
# The Ready condition's message while the kubelet runs its graceful node shutdown (a spot
# reclaim, host maintenance): pkg/kubelet/nodeshutdown/nodeshutdown_manager_linux.go
# (`ShutdownStatus`), through the node status setter `ReadyCondition` (reason
# KubeletNotReady). It is the first sign of a reclaim a controller can see: the kubelet
# sends the pods' DisruptionTarget only with their terminal phase (`mergePodStatus`).
NODE_SHUTTING_DOWN_MESSAGE = "node is shutting down"
# What the operator calls a rank on such a node, as the kubelet calls pods it refuses there.
NODE_SHUTDOWN_REASON = "NodeShutdown"


def newest_readiness(index: Iterable[tuple[str, Iterable[NodeReadiness]]]) -> dict[str, bool]:
    """Node name -> readiness of the newest object of that name.

    A watch that is cut and resumed with 410 Gone relists, and a node deleted in the gap
    never gets its DELETED event: its last state (NotReady, on its way out) stays in the
    index beside the replacement registered under the same name, as clouds do when they
    recreate a reclaimed VM. The older one must not make every rank placed on the new node
    look preempted.
    """
    return {name: max(entries)[1] for name, entries in index if entries}


def not_ready_since(
    index: Iterable[tuple[str, Iterable[NodeReadiness]]],
) -> dict[str, datetime]:
    """Node name -> since when the newest object of that name has not been Ready."""
    found: dict[str, datetime] = {}
    for name, entries in index:
        newest = max(entries, default=None)
        when = contract.parse_time(newest[2]) if newest is not None and not newest[1] else None
        if when is not None:
            found[name] = when
    return found


def nodes_shutting_down(index: Iterable[tuple[str, Iterable[NodeReadiness]]]
                        ) -> frozenset[str]:
    """Names of nodes whose newest object says their kubelet is shutting them down."""
    found = set()
    for name, entries in index:
        newest = max(entries, default=None)
        if newest is not None and len(newest) > 3 and not newest[1] and newest[3]:
            found.add(name)
    return frozenset(found)


def with_shutdown_notice(pods: Iterable[PodView], shutting_down: frozenset[str]
                         ) -> list[PodView]:
    """Ranks still running on a node that is shutting down, seen as preempted now: the gang
    saves while the reclaimed ranks can still take part."""
    return [dataclasses.replace(p, disruption=NODE_SHUTDOWN_REASON)
            if p.active and not p.disruption and p.node_name in shutting_down else p
            for p in pods]


def describe_failure(pod: PodView) -> str:
    text = f"{pod.name} exited with code {pod.exit_code}"
    if pod.terminated_reason and pod.terminated_reason not in ("Error", "Completed"):
        text += f" ({pod.terminated_reason})"
    if pod.termination and pod.termination.message:
        # The trainer's reason (CheckpointMissing, CheckpointRootOwned...) names the problem.
        if pod.termination.reason not in ("Failed", ""):
            text += f" ({pod.termination.reason})"
        text += f": {pod.termination.message}"
    elif pod.termination_text:
        # FallbackToLogsOnError: the kubelet put the last log lines here.
        lines = pod.termination_text.strip().splitlines()[-10:]
        text += ":\n" + "\n".join(lines)
    return text


def _trainer_status(statuses: list[dict[str, Any]]) -> dict[str, Any] | None:
    # Native sidecars (init containers with restartPolicy Always) are not in
    # containerStatuses, and are shut down once the regular containers completed (core/v1
    # Container.restartPolicy); regular sidecars are here, beside the trainer.
    for status in statuses:
        if status.get("name") == naming.TRAINER_CONTAINER:
            return status
    return statuses[0] if statuses else None


# ------------------------------------------------------------------------------ ownership ---
# A job deleted and re-created under the same name gets a new uid while the old one's pods and
# Service, with the same names and labels, wait for the garbage collector (which deletes
# dependents whose owner uid no longer exists: "Garbage Collection" in the Kubernetes docs).
# Children are matched to a job by the uid of its ownerReference, never by name or label.


def owned(pods: Iterable[PodView], uid: str) -> list[PodView]:
    """The pods of the job with this uid; pods of a previous job of the same name are not."""
    return [p for p in pods if p.owner_uid == uid]


@dataclasses.dataclass(frozen=True)
class ServiceView:
    """A child the job needs under a fixed name (its Service, its keys Secret), whoever made
    it."""

    name: str
    owner_uid: str | None  # the TrainingJob in its ownerReferences, if any
    owner: str  # who owns it, for messages: "TrainingJob uid ...", "Deployment web", "nobody"


def parse_service(service: Mapping[str, Any]) -> ServiceView:
    """Who owns a Service, or any other child object (API JSON)."""
    meta = service.get("metadata") or {}
    refs = meta.get("ownerReferences") or []
    owners = ", ".join(f"{r.get('kind')} {r.get('name')} (uid {r.get('uid')})" for r in refs)
    return ServiceView(name=meta.get("name", ""), owner_uid=owner_uid(service),
                       owner=owners or "no owner")
