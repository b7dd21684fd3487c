"""One gang, one TPU slice: the pod affinity that keeps every host of a slice on one node pool
and every other gang off it, pure.

On GKE a multi-host TPU slice is one node pool: its hosts are created, linked by ICI and
reclaimed together, and every node carries the pool's name in `cloud.google.com/gke-nodepool`.
Selecting accelerator type and topology alone lets the scheduler split a gang across two
matching pools, where it never forms. JobSet's exclusive placement
(`alpha.jobset.sigs.k8s.io/exclusive-topology`; pkg/webhooks/pod_webhook.go,
setExclusiveAffinities, formerly pod_mutating_webhook.go) solves this with two required terms
on the node-pool key:
- pod affinity to the pods of the same slice: the first host picks a pool, the rest follow;
- pod anti-affinity to pods of any other exclusive slice (label present, other value), in all
  namespaces: a pool already holding another gang is skipped, and (the kube-scheduler checks
  existing pods' anti-affinity too) no other gang lands on ours.

JobSet puts the terms on the leader only (worker 0 of the slice) and gives followers a node
selector for the leader's pool once the leader is bound (pod_webhook.go, ValidateCreate, refuses
followers before that), and so does the operator (`to_create`): it creates a slice's leader
first and its followers once the leader has a node. The kube-scheduler's InterPodAffinity
PreFilter (pkg/scheduler/framework/plugins/interpodaffinity/filtering.go) walks every pod in the
cluster for an incoming pod with required terms (getIncomingAffinityAntiAffinityCounts), and
every pod carrying required anti-affinity for any incoming pod (getExistingAntiAffinityCounts):
with terms on leaders only, a gang of N hosts in S slices costs S such walks instead of N, and
adds S, not N, anti-affinity pods to every other pod's scheduling. Without the nodes' pool labels
(the operator does not watch nodes), every host carries the terms. Single-host slices carry none
(`is_exclusive`): a slice of one VM has no hosts to keep together, its chip request fills the
VM, and GKE does not join single-host slices into a multislice ("Deploy TPU Multislices in GKE";
the API refuses more than one replica of them).

The label value names job, attempt and slice: a new attempt's slice waits for the old attempt's
pods to leave a pool (as their TPU chips must be released anyway) instead of joining them.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from tardigrade_operator import naming
from tardigrade_operator.api import types
from tardigrade_operator.api.types import TrainingJobSpec
from tardigrade_operator.rendering import tpu_layout

NODE_POOL_LABEL = "cloud.google.com/gke-nodepool"
SLICE_LABEL = f"{types.GROUP}/slice"


def is_exclusive(spec: TrainingJobSpec) -> bool:
    """Multi-host TPU slices get a node pool of their own. A single-host slice is one VM, which
    its pod's google.com/tpu request fills: nothing to keep together, and nothing to keep out
    that the chip request does not already. GPU and CPU hosts are interchangeable."""
    per_slice = tpu_layout.hosts_per_slice(spec.accelerator)
    return per_slice is not None and per_slice > 1


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


def as_follower(pod: dict[str, Any], pool: str) -> dict[str, Any]:
    """A follower host of a slice whose leader is bound in `pool`: the pool as a node selector
    in place of the inter-pod terms (any node affinity, e.g. for maintenance, stays)."""
    pod = copy.deepcopy(pod)
    spec = pod["spec"]
    affinity = {kind: terms for kind, terms in (spec.get("affinity") or {}).items()
                if kind not in ("podAffinity", "podAntiAffinity")}
    if affinity:
        spec["affinity"] = affinity
    else:
        spec.pop("affinity", None)
    spec["nodeSelector"] = {**(spec.get("nodeSelector") or {}), NODE_POOL_LABEL: pool}
    return pod


def _leaders_first(spec: TrainingJobSpec, replicas: int,
                   node_pools: Mapping[str, str] | None) -> tpu_layout.SliceLayout | None:
    """The gang's slice layout when its followers wait for their leaders, else None."""
    layout = tpu_layout.layout_for(spec.accelerator, replicas)
    if not is_exclusive(spec) or layout is None or node_pools is None:
        return None
    return layout


def followers(spec: TrainingJobSpec, replicas: int, ranks: list[int],
              node_pools: Mapping[str, str] | None) -> list[int]:
    """The ranks among `ranks` that are followers created after their leader (none where every
    host is created at once)."""
    layout = _leaders_first(spec, replicas, node_pools)
    return [] if layout is None else [r for r in ranks if layout.worker_of(r) != 0]


def to_create(spec: TrainingJobSpec, replicas: int, pods: list[dict[str, Any]],
              bound: Mapping[int, str | None], node_pools: Mapping[str, str] | None
              ) -> list[dict[str, Any]]:
    """Which of `pods` (ranks of a gang of `replicas` not created yet) to create now.

    `bound`: rank -> node of the gang's existing pods (None while unscheduled); `node_pools`:
    node -> its pool, None when nodes are not watched. A slice's leader is created at once; a
    follower once its leader has a node, pinned to that node's pool (with the terms, as the
    leader, where the node carries no pool label). Everything at once where leaders do not apply.
    """
    layout = _leaders_first(spec, replicas, node_pools)
    if layout is None or node_pools is None:
        return pods
    chosen = []
    for pod in pods:
        rank = int(pod["metadata"]["labels"][naming.LABEL_RANK])
        if layout.worker_of(rank) == 0:
            chosen.append(pod)
            continue
        node = bound.get(layout.slice_of(rank) * layout.hosts_per_slice)
        if node is None:
            continue  # its leader is not placed yet
        pool = node_pools.get(node)
        chosen.append(as_follower(pod, pool) if pool else pod)
    return chosen
