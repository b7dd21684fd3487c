"""The ReplicaSet controller's decision: (replica set, its pods, now) -> what to do. Pure.

As upstream: pods that finished (Succeeded/Failed) or are being deleted do not count, so a
failed or deleted pod is replaced; surplus pods are deleted least valuable first (unbound,
then pending, then not ready, then most restarts, then newest).
"""

from __future__ import annotations

import copy
import dataclasses
import datetime as dt
from collections.abc import Mapping, Sequence
from typing import Any

from tardigrade_local.controllers.objects import (
    Obj,
    controller_ref,
    is_active,
    parse_time,
    pod_ready,
)

_PHASE_RANK = {"Pending": 0, "Unknown": 1, "Running": 2}


@dataclasses.dataclass
class ReplicaSetPlan:
    create: int = 0
    delete: list[str] = dataclasses.field(default_factory=list)
    status: Obj = dataclasses.field(default_factory=dict)
    # Check again after this many seconds even if nothing changes (minReadySeconds).
    recheck_after: float | None = None


def pod_from_template(rs: Mapping[str, Any]) -> Obj:
    """The pod the replica set creates: its template, named `<rs>-<random>` by the server."""
    meta = rs["metadata"]
    template = copy.deepcopy((rs.get("spec") or {}).get("template") or {})
    template_meta = template.get("metadata") or {}
    pod_meta: Obj = {"generateName": f"{meta['name']}-", "namespace": meta.get("namespace"),
                     "labels": dict(template_meta.get("labels") or {}),
                     "ownerReferences": [controller_ref(rs)]}
    if template_meta.get("annotations"):
        pod_meta["annotations"] = dict(template_meta["annotations"])
    return {"apiVersion": "v1", "kind": "Pod", "metadata": pod_meta,
            "spec": template.get("spec") or {}}


def _deletion_rank(pod: Mapping[str, Any]) -> tuple[Any, ...]:
    """Lower sorts first = deleted first (a simplified upstream ActivePodsWithRanks)."""
    status = pod.get("status") or {}
    ready, _ = pod_ready(pod)
    restarts = sum(c.get("restartCount", 0) for c in status.get("containerStatuses") or [])
    created = parse_time(pod["metadata"].get("creationTimestamp"))
    age_key = -(created.timestamp() if created else 0.0)
    return (bool((pod.get("spec") or {}).get("nodeName")),
            _PHASE_RANK.get(status.get("phase", "Pending"), 0), ready, -restarts, age_key,
            pod["metadata"]["name"])


def decide_replicaset(rs: Mapping[str, Any], pods: Sequence[Mapping[str, Any]],
                      now: dt.datetime) -> ReplicaSetPlan:
    """`pods`: the pods this replica set controls (see `objects.owned`)."""
    spec = rs.get("spec") or {}
    meta = rs["metadata"]
    plan = ReplicaSetPlan()
    if meta.get("deletionTimestamp"):
        return plan
    want = int(spec.get("replicas", 1))
    active = [p for p in pods if is_active(p)]
    if len(active) < want:
        plan.create = want - len(active)
    elif len(active) > want:
        ranked = sorted(active, key=_deletion_rank)
        plan.delete = [p["metadata"]["name"] for p in ranked[:len(active) - want]]

    min_ready = float(spec.get("minReadySeconds") or 0)
    template_labels = ((spec.get("template") or {}).get("metadata") or {}).get("labels") or {}
    ready = available = labeled = 0
    waits: list[float] = []
    for pod in active:
        labels = pod["metadata"].get("labels") or {}
        labeled += all(labels.get(k) == v for k, v in template_labels.items())
        is_ready, since = pod_ready(pod)
        if not is_ready:
            continue
        ready += 1
        ready_for = (now - since).total_seconds() if since else min_ready
        if ready_for >= min_ready:
            available += 1
        else:
            waits.append(min_ready - ready_for)
    plan.recheck_after = min(waits) if waits else None
    # Zero counts are left out, as the real API's `omitempty` does (replicas always shows).
    counts = {"fullyLabeledReplicas": labeled, "readyReplicas": ready,
              "availableReplicas": available}
    plan.status = {"replicas": len(active), **{k: v for k, v in counts.items() if v},
                   "observedGeneration": meta.get("generation", 1)}
    return plan
