"""The Deployment controller's decision: (deployment, its replica sets, their pods, now) ->
replica sets to create, scale or delete, and the deployment's status. Pure.

Follows upstream's pkg/controller/deployment for what Tardigrade's chart and users need:
- the template's replica set is `<deployment>-<pod-template-hash>`; a template change makes a
  new one (or reuses the old one with an equal template, as a rollback does) and bumps the
  `deployment.kubernetes.io/revision` annotation;
- RollingUpdate: maxSurge / maxUnavailable (ints or percentages, rounded like upstream) bound
  the new set's scale-up and the old sets' scale-down; unhealthy old pods go first;
- Recreate: old sets scale to 0, the new one starts once no old pod runs;
- status: observedGeneration, replicas, updatedReplicas, readyReplicas, availableReplicas,
  unavailableReplicas and the Available / Progressing conditions (with progressDeadlineSeconds)
  that `kubectl rollout status` and `kubectl wait --for=condition=Available` read;
- old replica sets at 0 beyond revisionHistoryLimit are deleted once a rollout completes.
Simplified: scaling during a rollout is not proportional across sets (upstream spreads it),
no collisionCount handling, paused deployments only report status, no orphan adoption.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime as dt
import math
from collections.abc import Mapping, Sequence
from typing import Any

from tardigrade_local.controllers.objects import (
    DESIRED_REPLICAS_ANNOTATION,
    HASH_LABEL,
    MAX_REPLICAS_ANNOTATION,
    REVISION_ANNOTATION,
    Obj,
    condition,
    controller_ref,
    parse_time,
    template_hash,
    without_hash,
)

AVAILABLE = "Available"
PROGRESSING = "Progressing"
DEFAULT_PROGRESS_DEADLINE_SECONDS = 600


@dataclasses.dataclass
class DeploymentPlan:
    create: Obj | None = None  # a new ReplicaSet
    # Merge patches for existing replica sets, by name (spec.replicas, annotations).
    patch: dict[str, Obj] = dataclasses.field(default_factory=dict)
    delete: list[str] = dataclasses.field(default_factory=list)
    annotations: dict[str, str] = dataclasses.field(default_factory=dict)  # the deployment's
    status: Obj | None = None  # None: leave the status alone
    events: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    recheck_after: float | None = None


def _replicas(obj: Mapping[str, Any]) -> int:
    value = (obj.get("spec") or {}).get("replicas")
    return 1 if value is None else int(value)


def _status(obj: Mapping[str, Any], key: str) -> int:
    return int((obj.get("status") or {}).get(key) or 0)


def _revision(rs: Mapping[str, Any]) -> int:
    try:
        return int((rs["metadata"].get("annotations") or {}).get(REVISION_ANNOTATION, 0))
    except ValueError:
        return 0


def _created(rs: Mapping[str, Any]) -> tuple[float, str]:
    stamp = parse_time(rs["metadata"].get("creationTimestamp"))
    return (stamp.timestamp() if stamp else 0.0, rs["metadata"]["name"])


def _scaled(value: Any, total: int, round_up: bool) -> int:
    """An IntOrString of the strategy against the replica count."""
    if isinstance(value, str) and value.endswith("%"):
        share = int(value[:-1]) * total / 100
        return math.ceil(share) if round_up else math.floor(share)
    return int(value)


def rolling_limits(deploy: Mapping[str, Any]) -> tuple[int, int]:
    """(maxSurge, maxUnavailable) as numbers of pods, like upstream ResolveFenceposts."""
    spec = deploy.get("spec") or {}
    strategy = spec.get("strategy") or {}
    if strategy.get("type", "RollingUpdate") != "RollingUpdate":
        return 0, 0
    rolling = strategy.get("rollingUpdate") or {}
    replicas = _replicas(deploy)
    surge = _scaled(rolling.get("maxSurge", "25%"), replicas, round_up=True)
    unavailable = _scaled(rolling.get("maxUnavailable", "25%"), replicas, round_up=False)
    if surge == 0 and unavailable == 0:
        unavailable = 1
    return surge, unavailable


def new_replicaset(deploy: Mapping[str, Any], replicas: int, revision: int) -> Obj:
    meta, spec = deploy["metadata"], deploy.get("spec") or {}
    template = copy.deepcopy(spec.get("template") or {})
    pod_hash = template_hash(template)
    template_meta = template.setdefault("metadata", {})
    template_meta["labels"] = {**(template_meta.get("labels") or {}), HASH_LABEL: pod_hash}
    selector = copy.deepcopy(spec.get("selector") or {})
    selector["matchLabels"] = {**(selector.get("matchLabels") or {}), HASH_LABEL: pod_hash}
    surge, _ = rolling_limits(deploy)
    rs_spec: Obj = {"replicas": replicas, "selector": selector, "template": template}
    if spec.get("minReadySeconds"):
        rs_spec["minReadySeconds"] = spec["minReadySeconds"]
    return {
        "apiVersion": "apps/v1", "kind": "ReplicaSet",
        "metadata": {
            "name": f"{meta['name']}-{pod_hash}", "namespace": meta.get("namespace"),
            "labels": dict(template_meta["labels"]),
            "annotations": {REVISION_ANNOTATION: str(revision),
                            DESIRED_REPLICAS_ANNOTATION: str(_replicas(deploy)),
                            MAX_REPLICAS_ANNOTATION: str(_replicas(deploy) + surge)},
            "ownerReferences": [controller_ref(deploy)],
        },
        "spec": rs_spec,
    }


def _scale(plan: DeploymentPlan, deploy: Mapping[str, Any], rs: Mapping[str, Any],
           counts: dict[str, int], to: int) -> None:
    name = rs["metadata"]["name"]
    before = counts[name]
    if to == before:
        return
    counts[name] = to
    surge, _ = rolling_limits(deploy)
    body = plan.patch.setdefault(name, {})
    body["spec"] = {"replicas": to}
    body.setdefault("metadata", {}).setdefault("annotations", {}).update({
        DESIRED_REPLICAS_ANNOTATION: str(_replicas(deploy)),
        MAX_REPLICAS_ANNOTATION: str(_replicas(deploy) + surge)})
    direction = "up" if to > before else "down"
    plan.events.append(("ScalingReplicaSet",
                        f"Scaled {direction} replica set {name} from {before} to {to}"))


def _still_running(pods: Sequence[Mapping[str, Any]]) -> bool:
    return any((p.get("status") or {}).get("phase") not in ("Succeeded", "Failed") for p in pods)


def _rollout(plan: DeploymentPlan, deploy: Mapping[str, Any], new: Mapping[str, Any] | None,
             old: list[Mapping[str, Any]], pods_by_rs: Mapping[str, Sequence[Mapping[str, Any]]],
             counts: dict[str, int], revision: int) -> None:
    replicas = _replicas(deploy)
    strategy = ((deploy.get("spec") or {}).get("strategy") or {}).get("type", "RollingUpdate")
    if strategy == "Recreate":
        running_old = [rs for rs in old if counts[rs["metadata"]["name"]] > 0]
        for rs in running_old:
            _scale(plan, deploy, rs, counts, 0)
        if running_old or any(_still_running(pods_by_rs.get(rs["metadata"]["name"], ()))
                              for rs in old):
            return  # the new pods start only once every old one has stopped
        if new is None:
            plan.create = new_replicaset(deploy, replicas, revision)
        else:
            _scale(plan, deploy, new, counts, replicas)
        return

    surge, unavailable = rolling_limits(deploy)
    total = sum(counts.values())
    if new is None:
        plan.create = new_replicaset(deploy, max(0, min(replicas + surge - total, replicas)),
                                     revision)
        return
    new_name = new["metadata"]["name"]
    if counts[new_name] > replicas:
        _scale(plan, deploy, new, counts, replicas)
        return
    if counts[new_name] < replicas:
        up = min(replicas + surge - total, replicas - counts[new_name])
        if up > 0:
            _scale(plan, deploy, new, counts, counts[new_name] + up)
            return
    if not any(counts[rs["metadata"]["name"]] for rs in old):
        return
    min_available = replicas - min(unavailable, replicas)
    new_unavailable = counts[new_name] - _status(new, "availableReplicas")
    budget = total - min_available - new_unavailable
    if budget <= 0:
        return
    # Old pods that are not available anyway go first: removing them costs no availability.
    for rs in old:
        name = rs["metadata"]["name"]
        unhealthy = counts[name] - _status(rs, "availableReplicas")
        if budget <= 0 or counts[name] == 0 or unhealthy <= 0:
            continue
        down = min(budget, unhealthy)
        budget -= down
        _scale(plan, deploy, rs, counts, counts[name] - down)
    available = sum(_status(rs, "availableReplicas") for rs in [new, *old])
    excess = available - min_available
    for rs in old:
        name = rs["metadata"]["name"]
        if excess <= 0:
            break
        down = min(counts[name], excess)
        if down > 0:
            excess -= down
            _scale(plan, deploy, rs, counts, counts[name] - down)


def _progress(deploy: Mapping[str, Any], status: Obj, previous: Mapping[str, Any] | None,
              new_name: str, created: bool, complete: bool, now: dt.datetime
              ) -> tuple[Obj, float | None]:
    """The Progressing condition, and when its deadline falls if it has not yet."""
    spec = deploy.get("spec") or {}
    deadline = float(spec.get("progressDeadlineSeconds") or DEFAULT_PROGRESS_DEADLINE_SECONDS)
    old = deploy.get("status") or {}

    def count(source: Mapping[str, Any], key: str) -> int:
        return int(source.get(key) or 0)

    progressed = (
        count(status, "updatedReplicas") > count(old, "updatedReplicas")
        or count(status, "replicas") - count(status, "updatedReplicas")
        < count(old, "replicas") - count(old, "updatedReplicas")
        or count(status, "readyReplicas") > count(old, "readyReplicas")
        or count(status, "availableReplicas") > count(old, "availableReplicas"))
    if created:
        return condition(PROGRESSING, True, "NewReplicaSetCreated",
                         f'Created new replica set "{new_name}"', now, previous, True), deadline
    if complete:
        return condition(PROGRESSING, True, "NewReplicaSetAvailable",
                         f'ReplicaSet "{new_name}" has successfully progressed.', now,
                         previous), None
    if progressed or previous is None:
        return condition(PROGRESSING, True, "ReplicaSetUpdated",
                         f'ReplicaSet "{new_name}" is progressing.', now, previous,
                         True), deadline
    if previous.get("reason") == "NewReplicaSetAvailable":
        return dict(previous), None  # a finished rollout does not time out
    since = parse_time(previous.get("lastUpdateTime")) or now
    left = deadline - (now - since).total_seconds()
    if left <= 0 or previous.get("reason") == "ProgressDeadlineExceeded":
        return condition(PROGRESSING, False, "ProgressDeadlineExceeded",
                         f'ReplicaSet "{new_name}" has timed out progressing.', now,
                         previous), None
    return dict(previous), left


def decide_deployment(deploy: Mapping[str, Any], replicasets: Sequence[Mapping[str, Any]],
                      pods_by_rs: Mapping[str, Sequence[Mapping[str, Any]]],
                      now: dt.datetime) -> DeploymentPlan:
    """`replicasets`: those the deployment controls; `pods_by_rs`: their pods, by set name."""
    plan = DeploymentPlan()
    meta, spec = deploy["metadata"], deploy.get("spec") or {}
    if meta.get("deletionTimestamp"):
        return plan
    wanted = without_hash(spec.get("template") or {})
    ordered = sorted(replicasets, key=_created)
    matching = [rs for rs in ordered
                if without_hash((rs.get("spec") or {}).get("template") or {}) == wanted]
    new = matching[0] if matching else None
    old = [rs for rs in ordered if rs is not new]
    newest_old = max((_revision(rs) for rs in old), default=0)
    revision = _revision(new) if new is not None and _revision(new) > newest_old \
        else newest_old + 1
    if new is not None and _revision(new) != revision:
        plan.patch.setdefault(new["metadata"]["name"], {}).setdefault("metadata", {})[
            "annotations"] = {REVISION_ANNOTATION: str(revision)}
    if (meta.get("annotations") or {}).get(REVISION_ANNOTATION) != str(revision):
        plan.annotations[REVISION_ANNOTATION] = str(revision)

    counts = {rs["metadata"]["name"]: _replicas(rs) for rs in ordered}
    if not spec.get("paused"):
        _rollout(plan, deploy, new, old, pods_by_rs, counts, revision)
    if plan.create is not None:
        plan.events.append(("ScalingReplicaSet",
                            f"Scaled up replica set {plan.create['metadata']['name']} from 0 "
                            f"to {plan.create['spec']['replicas']}"))

    # Status from what was observed (the next pass sees the effect of this one's writes).
    replicas = _replicas(deploy)
    _, unavailable = rolling_limits(deploy)
    observed = {
        "replicas": sum(_status(rs, "replicas") for rs in ordered),
        "updatedReplicas": _status(new, "replicas") if new is not None else 0,
        "readyReplicas": sum(_status(rs, "readyReplicas") for rs in ordered),
        "availableReplicas": sum(_status(rs, "availableReplicas") for rs in ordered),
    }
    observed["unavailableReplicas"] = max(
        0, sum(_replicas(rs) for rs in ordered) - observed["availableReplicas"])
    complete = (plan.create is None and observed["updatedReplicas"] == replicas
                and observed["replicas"] == replicas
                and observed["availableReplicas"] == replicas)
    previous = {c.get("type"): c for c in (deploy.get("status") or {}).get("conditions") or []}
    available = observed["availableReplicas"] >= replicas - min(unavailable, replicas)
    conditions = [condition(
        AVAILABLE, available,
        "MinimumReplicasAvailable" if available else "MinimumReplicasUnavailable",
        "Deployment has minimum availability." if available
        else "Deployment does not have minimum availability.", now, previous.get(AVAILABLE))]
    new_name = (plan.create or new or {"metadata": {"name": ""}})["metadata"]["name"]
    progressing, plan.recheck_after = _progress(
        deploy, observed, previous.get(PROGRESSING), new_name, plan.create is not None,
        complete, now)
    conditions.append(progressing)
    conditions += [dict(c) for t, c in previous.items() if t not in (AVAILABLE, PROGRESSING)]
    # Zero counts are left out, as the real API's `omitempty` does.
    plan.status = {"observedGeneration": meta.get("generation", 1),
                   **{k: v for k, v in observed.items() if v}, "conditions": conditions}

    if complete:
        limit = int(spec.get("revisionHistoryLimit", 10))
        idle = [rs for rs in old if counts[rs["metadata"]["name"]] == 0
                and _status(rs, "replicas") == 0 and not rs["metadata"].get("deletionTimestamp")]
        plan.delete = [rs["metadata"]["name"] for rs in idle[:max(0, len(idle) - limit)]]
    return plan
