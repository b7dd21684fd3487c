"""The kube-scheduler's InterPodAffinity filter for required terms, pure.

Follows pkg/scheduler/framework/plugins/interpodaffinity/filtering.go (PreFilter, Filter):
- existing pods' required anti-affinity: a node is refused when a pod already in its topology
  domain has an anti-affinity term matching the incoming pod
  (satisfyExistingPodsAntiAffinity);
- the incoming pod's required affinity: every term needs a matching pod in the node's domain,
  and the node must carry every term's topology key; except that when no pod in the cluster
  matches any term and the pod matches all its own terms, it may go anywhere (the first pod
  of a group with affinity to itself, satisfyPodAffinity);
- the incoming pod's required anti-affinity: no matching pod in the node's domain.
Terms select pods by label selector (nil: none, {}: all) in the pod's own namespace, the
listed `namespaces`, or all namespaces for an empty `namespaceSelector`
(schedutil.GetNamespacesFromPodAffinityTerm). A non-empty namespaceSelector needs namespace
labels, which this pure filter does not have: such a term is reported as unsupported.
Preferred terms only score, and the local scheduler does not score.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

Obj = Mapping[str, Any]

# The scheduler's reasons (interpodaffinity/filtering.go ErrReason...).
EXISTING_ANTI_AFFINITY = "node(s) didn't satisfy existing pods anti-affinity rules"
AFFINITY = "node(s) didn't match pod affinity rules"
ANTI_AFFINITY = "node(s) didn't match pod anti-affinity rules"
UNSUPPORTED = "pod affinity term with a non-empty namespaceSelector (not emulated)"


class Unsupported(ValueError):
    pass


def _terms(spec: Obj, kind: str) -> list[Obj]:
    block = (spec.get("affinity") or {}).get(kind) or {}
    return list(block.get("requiredDuringSchedulingIgnoredDuringExecution") or [])


def states_terms(pod: Obj) -> bool:
    """Whether the pod has any required pod (anti-)affinity term: only then can this filter
    turn a node down, for it or for pods placed after it."""
    spec = pod.get("spec") or {}
    return bool(_terms(spec, "podAffinity") or _terms(spec, "podAntiAffinity"))


def _selector_matches(selector: Obj | None, labels: Mapping[str, str]) -> bool:
    if selector is None:
        return False  # metav1.LabelSelectorAsSelector(nil) is labels.Nothing()
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], list(expr.get("values") or [])
        have = labels.get(key)
        if op == "In" and have not in values:
            return False
        if op == "NotIn" and have is not None and have in values:
            return False
        if op == "Exists" and have is None:
            return False
        if op == "DoesNotExist" and have is not None:
            return False
    return True


def _term_matches(term: Obj, owner: Obj, target: Obj) -> bool:
    """Does `target` fall under `term`, a term of pod `owner`? (no topology check)"""
    namespace_selector = term.get("namespaceSelector")
    target_ns = target["metadata"].get("namespace") or "default"
    if namespace_selector is not None and (namespace_selector.get("matchLabels")
                                           or namespace_selector.get("matchExpressions")):
        raise Unsupported(UNSUPPORTED)
    if namespace_selector is None:
        namespaces = set(term.get("namespaces") or []) or {
            owner["metadata"].get("namespace") or "default"}
        if target_ns not in namespaces:
            return False
    return _selector_matches(term.get("labelSelector"), target["metadata"].get("labels") or {})


def _domain(node: Obj | None, key: str) -> str | None:
    if node is None:
        return None
    return (node["metadata"].get("labels") or {}).get(key)


def unfit_reason(pod: Obj, node: Obj, nodes: Sequence[Obj],
                 bound_pods: Iterable[Obj]) -> str | None:
    """Why `pod` may not go on `node` given the pods already bound on `nodes`; None: it may."""
    by_name = {n["metadata"]["name"]: n for n in nodes}
    placed = [(p, by_name.get(p["spec"].get("nodeName") or "")) for p in bound_pods]
    placed = [(p, n) for p, n in placed if n is not None]
    node_labels = node["metadata"].get("labels") or {}
    try:
        for other, other_node in placed:
            for term in _terms(other["spec"], "podAntiAffinity"):
                key = term["topologyKey"]
                value = _domain(other_node, key)
                if (value is not None and node_labels.get(key) == value
                        and _term_matches(term, other, pod)):
                    return EXISTING_ANTI_AFFINITY
        affinity = _terms(pod["spec"], "podAffinity")
        if affinity:
            # Only pods matching all terms count, each in its node's domain of every term
            # (topologyToMatchedTermCount.updateWithAffinityTerms).
            counted = {(t["topologyKey"], _domain(n, t["topologyKey"]))
                       for p, n in placed if all(_term_matches(t, pod, p) for t in affinity)
                       for t in affinity if _domain(n, t["topologyKey"]) is not None}
            here = all((t["topologyKey"], node_labels.get(t["topologyKey"])) in counted
                       for t in affinity)
            if not here and (counted or not all(_term_matches(t, pod, pod) for t in affinity)):
                return AFFINITY
        for term in _terms(pod["spec"], "podAntiAffinity"):
            key = term["topologyKey"]
            if node_labels.get(key) is None:
                continue
            if any(_domain(n, key) == node_labels[key] and _term_matches(term, pod, p)
                   for p, n in placed):
                return ANTI_AFFINITY
    except Unsupported as err:
        return str(err)
    return None
