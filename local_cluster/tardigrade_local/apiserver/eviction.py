"""The Eviction API: PodDisruptionBudgets, the DisruptionTarget condition, graceful delete.

There is no disruption controller here, so a budget's allowance is computed at eviction
time from the pods it selects (the real server reads it from the budget's status).
"""

from __future__ import annotations

import math
from typing import Any

from .core import Core
from .errors import ApiError
from .meta import now_rfc3339
from .resources import ResourceType
from .selectors import labels_match, selector_from_match

PDB_KEY = "policy/poddisruptionbudgets"


def _healthy(pod: dict[str, Any]) -> bool:
    if pod["metadata"].get("deletionTimestamp"):
        return False
    if pod.get("status", {}).get("phase") != "Running":
        return False
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in pod.get("status", {}).get("conditions") or [])


def _scaled(value: Any, total: int) -> int:
    if isinstance(value, str) and value.endswith("%"):
        return math.ceil(int(value[:-1]) * total / 100)
    return int(value)


def check_budgets(core: Core, pod: dict[str, Any]) -> None:
    """Raise 429 when evicting `pod` would break the budget that covers it."""
    if not _healthy(pod):
        return  # pending, finished or unready pods may always go
    ns = pod["metadata"]["namespace"]
    budgets = [b for b in core.store.iter(PDB_KEY, ns)
               if labels_match(selector_from_match((b.get("spec") or {}).get("selector") or {}),
                               pod)]
    if not budgets:
        return
    if len(budgets) > 1:
        raise ApiError(500, "InternalError", "This pod has more than one PodDisruptionBudget, "
                       "which the eviction subresource does not support.")
    budget = budgets[0]
    spec = budget.get("spec") or {}
    selected = [p for p in core.store.iter("/pods", ns)
                if labels_match(selector_from_match(spec.get("selector") or {}), p)]
    healthy = sum(1 for p in selected if _healthy(p))
    if "maxUnavailable" in spec:
        desired = len(selected) - _scaled(spec["maxUnavailable"], len(selected))
    else:
        desired = _scaled(spec.get("minAvailable", 1), len(selected))
    if healthy - desired <= 0:
        name = budget["metadata"]["name"]
        raise ApiError(429, "TooManyRequests",
                       "Cannot evict pod as it would violate the pod's disruption budget.",
                       {"causes": [{"reason": "DisruptionBudget",
                                    "message": f"The disruption budget {name} needs {desired} "
                                               f"healthy pods and has {healthy} currently"}]})


def evict(core: Core, rt: ResourceType, ns: str, name: str, body: Any,
          dry_run: bool) -> None:
    pod = core.get(rt, ns, name)
    options = (body.get("deleteOptions") or {}) if isinstance(body, dict) else {}
    if pod["metadata"].get("deletionTimestamp"):
        return  # already going: the real server answers success too
    check_budgets(core, pod)
    if dry_run:
        return
    # Since Kubernetes 1.26 the Eviction API marks the pod before deleting it.
    conds = [c for c in pod.get("status", {}).get("conditions") or []
             if c.get("type") != "DisruptionTarget"]
    conds.append({"type": "DisruptionTarget", "status": "True",
                  "reason": "EvictionByEvictionAPI", "message": "Eviction API: evicting",
                  "lastTransitionTime": now_rfc3339()})
    pod.setdefault("status", {})["conditions"] = conds
    core.update(rt, ns, name, pod, subresource="status")
    core.delete(rt, ns, name, options)
