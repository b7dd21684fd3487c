"""One gang, one TPU slice: the pod affinity that keeps every host of a slice on one node pool
and every other gang off it, pure.

On GKE a multi-host TPU slice is one node pool: its hosts are created, linked by ICI and
reclaimed together, and every node carries the pool's name in `cloud.google.com/gke-nodepool`.
Selecting accelerator type and topology alone lets the scheduler split a gang across two
matching pools, where it never forms. JobSet's exclusive placement
(`alpha.jobset.sigs.k8s.io/exclusive-topology`, pkg/webhooks/pod_mutating_webhook.go,
setExclusiveAffinities) solves this with two required terms on the node-pool key:
- pod affinity to the pods of the same slice: the first host picks a pool, the rest follow;
- pod anti-affinity to pods of any other exclusive slice (label present, other value), in all
  namespaces: a pool already holding another gang is skipped, and (the kube-scheduler checks
  existing pods' anti-affinity too) no other gang lands on ours.

JobSet puts the terms on the leader only and gives followers a node selector for the leader's
pool once the leader is bound (its admission webhook refuses followers before that), which keeps
scheduling linear in hosts. The operator creates a gang in one pass, so every host carries the
terms; that is the same placement, at the cost the kube-scheduler's InterPodAffinity PreFilter
pays for pods with affinity.

The label value names job, attempt and slice: a new attempt's slice waits for the old attempt's
pods to leave a pool (as their TPU chips must be released anyway) instead of joining them.
"""

from __future__ import annotations

from typing import Any

from tardigrade_operator.api import types
from tardigrade_operator.api.types import TrainingJobSpec

NODE_POOL_LABEL = "cloud.google.com/gke-nodepool"
SLICE_LABEL = f"{types.GROUP}/slice"


def is_exclusive(spec: TrainingJobSpec) -> bool:
    """TPU gangs get a slice (node pool) of their own; GPU and CPU hosts are interchangeable."""
    return spec.accelerator.kind == "tpu"


def slice_id(job: str, attempt: int, slice_index: int) -> str:
    return f"{job}-a{attempt}-s{slice_index}"


def slice_labels(spec: TrainingJobSpec, job: str, attempt: int,
                 slice_index: int) -> dict[str, str]:
    if not is_exclusive(spec):
        return {}
    return {SLICE_LABEL: slice_id(job, attempt, slice_index)}


def exclusive_affinity(slice_value: str) -> dict[str, Any]:
    """The `affinity` of every host of one slice (`slice_value`: its SLICE_LABEL value)."""
    all_namespaces: dict[str, Any] = {}
    return {
        "podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [{
            "labelSelector": {"matchExpressions": [
                {"key": SLICE_LABEL, "operator": "In", "values": [slice_value]}]},
            "topologyKey": NODE_POOL_LABEL,
            "namespaceSelector": all_namespaces,
        }]},
        "podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [{
            "labelSelector": {"matchExpressions": [
                {"key": SLICE_LABEL, "operator": "Exists"},
                {"key": SLICE_LABEL, "operator": "NotIn", "values": [slice_value]}]},
            "topologyKey": NODE_POOL_LABEL,
            "namespaceSelector": dict(all_namespaces),
        }]},
    }


def slice_affinity(spec: TrainingJobSpec, job: str, attempt: int,
                   slice_index: int) -> dict[str, Any] | None:
    if not is_exclusive(spec):
        return None
    return exclusive_affinity(slice_id(job, attempt, slice_index))
