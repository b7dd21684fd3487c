"""Kubelet admission: may a pod bound to this node run here? Pure.

The scheduler already checked the same resources, but the kubelet checks again against what
it knows itself (its allocatable, the pods it admitted), because the two can disagree: a pod
bound by name (spec.nodeName) skips the scheduler, and a node's allocatable can shrink after
a pod was bound to it (a device plugin reporting fewer healthy GPUs). A refused pod is
failed with the predicate's reason (`OutOfcpu`, `OutOfnvidia.com/gpu`...) and
"Pod was rejected: " + its message, as `Kubelet.rejectPod` writes it.

Upstream: pkg/kubelet/lifecycle/predicate.go (`predicateAdmitHandler.Admit`,
`removeMissingExtendedResources`, `InsufficientResourceError`) over the scheduler's
`noderesources.fitsRequest` (pods, cpu, memory, ephemeral-storage, then extended resources).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterable, Mapping
from decimal import Decimal
from typing import Any

from kubernetes.utils import parse_quantity

from tardigrade_local.gke.fitcheck import pod_requests

# What `fitsRequest` compares, in its order; the rest of the requests are extended resources.
NATIVE = ("cpu", "memory", "ephemeral-storage")
REJECTED_PREFIX = "Pod was rejected: "


@dataclasses.dataclass(frozen=True)
class Rejection:
    reason: str  # pod.status.reason
    message: str  # the admit handler's message; the status gets REJECTED_PREFIX before it

    def pod_status(self) -> dict[str, Any]:
        return {"phase": "Failed", "reason": self.reason,
                "message": REJECTED_PREFIX + self.message}


def _is_extended(name: str) -> bool:
    # v1helper.IsExtendedResourceName: fully qualified, outside the kubernetes.io domain.
    return "/" in name and not name.split("/", 1)[0].endswith("kubernetes.io") \
        and not name.startswith("requests.")


def _int64(name: str, amount: Decimal) -> int:
    # The scheduler's Resource counts CPU in millicores, everything else in units.
    return int(amount * 1000) if name == "cpu" else int(amount)


def _insufficient(name: str, requested: Decimal, used: Decimal, capacity: Decimal) -> Rejection:
    reason = "OutOf" + name
    return Rejection(reason, f"Node didn't have enough resource: {name}, requested: "
                             f"{_int64(name, requested)}, used: {_int64(name, used)}, "
                             f"capacity: {_int64(name, capacity)}")


def holds_resources(phase: str, *, termination_requested: bool, terminated: bool) -> bool:
    """Whether a pod this kubelet runs still counts when another pod is admitted.

    `Kubelet.isPodInactive` (pkg/kubelet/kubelet_pods.go): a pod whose worker has finished
    terminating is out; one in a terminal phase is out unless its termination was requested
    and is under way. The phase is the kubelet's own (its status manager's), not
    the API's: the scheduler's pod informer drops a pod as soon as the API shows it Succeeded
    or Failed (`newPodInformer`'s field selector, pkg/scheduler/scheduler.go) and binds the
    next pod into the space, so a kubelet that counted it a moment longer would refuse that
    pod.
    """
    if terminated:
        return False
    return phase not in ("Succeeded", "Failed") or termination_requested


def admit(pod: Mapping[str, Any], allocatable: Mapping[str, str],
          admitted: Iterable[Mapping[str, Any]]) -> Rejection | None:
    """None to run the pod; `admitted` are the active pods this kubelet already runs."""
    admitted = list(admitted)
    capacity = {k: parse_quantity(str(v)) for k, v in allocatable.items()}
    max_pods = capacity.get("pods", Decimal(110))
    if len(admitted) + 1 > max_pods:
        return _insufficient("pods", Decimal(1), Decimal(len(admitted)), max_pods)
    used: Counter[str] = Counter()
    for other in admitted:
        used.update(pod_requests(other.get("spec") or {}))
    requests = pod_requests(pod.get("spec") or {})
    scalar = sorted(n for n in requests if n not in NATIVE)
    for name in [*(n for n in NATIVE if n in requests), *scalar]:
        if name not in capacity and _is_extended(name):
            # removeMissingExtendedResources: an extended resource the node does not list at
            # all (a cluster-level or DRA-backed one) is not the kubelet's to check.
            continue
        amount, total = requests[name], capacity.get(name, Decimal(0))
        if amount > 0 and amount > total - used[name]:
            return _insufficient(name, amount, used[name], total)
    return None
