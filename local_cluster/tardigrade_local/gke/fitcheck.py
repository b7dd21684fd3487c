"""Where a pod may run: the default scheduler's filters that matter for our pods, pure.

Filters: node readiness/cordon, nodeSelector and required node affinity, taints and
tolerations, resource requests against allocatable (incl. extended resources such as
`google.com/tpu`), and required inter-pod (anti-)affinity (`interpodaffinity.py`). Among
feasible nodes the least loaded wins. When none fits, the message has the real scheduler's
shape, e.g.
`0/2 nodes are available: 1 Insufficient cpu, 1 node(s) didn't match Pod's node
affinity/selector. preemption: ...`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from decimal import Decimal
from typing import Any

from kubernetes.utils import parse_quantity

from tardigrade_local.gke import interpodaffinity

Obj = Mapping[str, Any]

NOT_READY = "node(s) were unschedulable"
AFFINITY = "node(s) didn't match Pod's node affinity/selector"
TOO_MANY_PODS = "Too many pods"


@dataclasses.dataclass(frozen=True)
class Decision:
    node: str | None
    message: str = ""  # why no node fits (PodScheduled=False, reason Unschedulable)


def pod_requests(spec: Obj) -> dict[str, Decimal]:
    """Effective requests: sum over containers, at least the largest init container."""

    def one(container: Obj) -> dict[str, Decimal]:
        resources = container.get("resources") or {}
        # A limit without a request defaults the request to the limit.
        merged = {**(resources.get("limits") or {}), **(resources.get("requests") or {})}
        return {k: parse_quantity(str(v)) for k, v in merged.items()}

    total: Counter[str] = Counter()
    for container in spec.get("containers") or []:
        total.update(one(container))
    result = dict(total)
    for container in spec.get("initContainers") or []:
        for name, value in one(container).items():
            result[name] = max(result.get(name, Decimal(0)), value)
    return result


@functools.lru_cache(maxsize=4096)
def _quantity(text: str) -> Decimal:
    # Nodes repeat a handful of allocatable strings; parsing them is most of a fit check.
    return Decimal(parse_quantity(text))


def _is_terminal(pod: Obj) -> bool:
    return (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed")


def _node_ready(node: Obj) -> bool:
    if (node.get("spec") or {}).get("unschedulable") or node["metadata"].get("deletionTimestamp"):
        return False
    for cond in (node.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Ready":
            return cond.get("status") == "True"
    return False


def _match_expression(expr: Obj, values: Mapping[str, str]) -> bool:
    key, op = expr["key"], expr["operator"]
    wanted = [str(v) for v in expr.get("values") or []]
    have = values.get(key)
    if op == "In":
        return have is not None and have in wanted
    if op == "NotIn":
        return have is None or have not in wanted
    if op == "Exists":
        return have is not None
    if op == "DoesNotExist":
        return have is None
    if op in ("Gt", "Lt") and have is not None and wanted:
        try:
            a, b = int(have), int(wanted[0])
        except ValueError:
            return False
        return a > b if op == "Gt" else a < b
    return False


def matches_affinity(spec: Obj, node: Obj) -> bool:
    labels = node["metadata"].get("labels") or {}
    selector = spec.get("nodeSelector") or {}
    if any(labels.get(k) != v for k, v in selector.items()):
        return False
    required = (
        ((spec.get("affinity") or {}).get("nodeAffinity") or {})
        .get("requiredDuringSchedulingIgnoredDuringExecution")
    )
    if not required:
        return True
    fields = {"metadata.name": node["metadata"]["name"]}
    for term in required.get("nodeSelectorTerms") or []:
        if all(_match_expression(e, labels) for e in term.get("matchExpressions") or []) and all(
            _match_expression(e, fields) for e in term.get("matchFields") or []
        ):
            return True
    return False


def tolerates(tolerations: Sequence[Obj], taint: Obj) -> bool:
    for tol in tolerations:
        if tol.get("effect") and tol["effect"] != taint.get("effect"):
            continue
        if tol.get("operator") == "Exists":
            if not tol.get("key") or tol["key"] == taint["key"]:
                return True
        elif tol.get("key") == taint["key"] and str(tol.get("value") or "") == str(
            taint.get("value") or ""
        ):
            return True
    return False


def untolerated_taint(spec: Obj, node: Obj) -> Obj | None:
    tolerations = spec.get("tolerations") or []
    for taint in (node.get("spec") or {}).get("taints") or []:
        if taint.get("effect") in ("NoSchedule", "NoExecute") and not tolerates(tolerations, taint):
            return taint
    return None


def _insufficient(requests: Mapping[str, Decimal], node: Obj, used: Mapping[str, Decimal],
                  pod_count: int) -> str | None:
    allocatable = (node.get("status") or {}).get("allocatable") or {}
    max_pods = int(_quantity(str(allocatable.get("pods", "110"))))
    if pod_count + 1 > max_pods:
        return TOO_MANY_PODS
    for name, amount in sorted(requests.items()):
        if amount <= 0:
            continue
        free = _quantity(str(allocatable.get(name, "0"))) - used.get(name, Decimal(0))
        if amount > free:
            return f"Insufficient {name}"
    return None


def unfit_reason(pod: Obj, node: Obj, bound_pods: Iterable[Obj] = ()) -> str | None:
    """Why `pod` does not fit `node` (with `bound_pods` on it), in the scheduler's words;
    None when it fits. The cluster autoscaler asks this of a node group's template node."""
    decision = schedule(pod, [node], bound_pods)
    if decision.node is not None:
        return None
    # "0/1 nodes are available: 1 <reason>. preemption: ..."
    return decision.message.split(": ", 1)[1].split(". preemption", 1)[0].split(" ", 1)[1]


class NodeUsage:
    """What the pods bound to each node take: the scheduler cache's per-node totals (upstream's
    `NodeInfo.Requested`, pkg/scheduler/framework/types.go), so that a pass placing many pods
    adds each bound pod up once, not once per pod placed."""

    def __init__(self, bound_pods: Iterable[Obj] = ()) -> None:
        self.requests: dict[str, Counter[str]] = {}
        self.counts: Counter[str] = Counter()
        for pod in bound_pods:
            self.add(pod)

    def add(self, pod: Obj) -> None:
        node_name = pod["spec"].get("nodeName")
        if not node_name or _is_terminal(pod):
            return
        self.counts[node_name] += 1
        self.requests.setdefault(node_name, Counter()).update(pod_requests(pod["spec"]))


def schedule(pod: Obj, nodes: Iterable[Obj], bound_pods: Iterable[Obj] = (),
             usage: NodeUsage | None = None) -> Decision:
    """Pick a node for `pod`; `bound_pods` are all pods with a nodeName (incl. just bound),
    or `usage` what they take."""
    nodes = list(nodes)
    if not nodes:
        return Decision(None, "no nodes available to schedule pods")
    bound_pods = list(bound_pods)
    taken = NodeUsage(bound_pods) if usage is None else usage
    # Inter-pod affinity looks at the pods that run, and only when some pod states a term:
    # scanning every bound pod for every node costs a thousand-host gang dearly otherwise.
    live = [p for p in bound_pods if not _is_terminal(p)]
    affinity_matters = interpodaffinity.states_terms(pod) or any(
        interpodaffinity.states_terms(p) for p in live)
    counts, usage_by_node = taken.counts, taken.requests
    spec = pod["spec"]
    requests = pod_requests(spec)
    reasons: Counter[str] = Counter()
    feasible: list[tuple[int, str]] = []
    for node in nodes:
        name = node["metadata"]["name"]
        taint = untolerated_taint(spec, node)
        if not _node_ready(node):
            reasons[NOT_READY] += 1
        elif not matches_affinity(spec, node):
            reasons[AFFINITY] += 1
        elif taint is not None:
            value = taint.get("value") or ""
            reasons[f"node(s) had untolerated taint {{{taint['key']}: {value}}}"] += 1
        elif (why := (_insufficient(requests, node, usage_by_node.get(name, {}), counts[name])
                      or (affinity_matters
                          and interpodaffinity.unfit_reason(pod, node, nodes, live)))):
            reasons[why] += 1
        else:
            feasible.append((counts[name], name))
    if feasible:
        return Decision(min(feasible)[1])
    histogram = ", ".join(sorted(f"{n} {reason}" for reason, n in reasons.items()))
    total = len(nodes)
    return Decision(
        None,
        f"0/{total} nodes are available: {histogram}. preemption: 0/{total} nodes are "
        f"available: {total} Preemption is not helpful for scheduling.",
    )
