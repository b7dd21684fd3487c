"""The Deployment and ReplicaSet controllers' pure decisions, and a rollout simulated with them.

The simulation plays API server and kubelet in memory: it applies each plan the way
`controllers/manager.py` does, and the kubelet makes pods ready on command, so the rollout
invariants can be checked at every step.
"""

from __future__ import annotations

import copy
import datetime as dt
import itertools

import pytest
from tardigrade_local.controllers.deployment import decide_deployment, rolling_limits
from tardigrade_local.controllers.manager import status_patch
from tardigrade_local.controllers.objects import (
    HASH_LABEL,
    REVISION_ANNOTATION,
    owned,
    template_hash,
)
from tardigrade_local.controllers.replicaset import decide_replicaset, pod_from_template

T0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)


def stamp(when: dt.datetime) -> str:
    return when.strftime("%Y-%m-%dT%H:%M:%SZ")


def deployment(replicas: int = 3, image: str = "app:1", strategy: dict | None = None,
               **spec) -> dict:
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "web", "namespace": "ns", "uid": "d-uid", "generation": 1,
                     "creationTimestamp": stamp(T0)},
        "spec": {"replicas": replicas, "selector": {"matchLabels": {"app": "web"}},
                 "strategy": strategy or {"type": "RollingUpdate", "rollingUpdate": {
                     "maxSurge": "25%", "maxUnavailable": "25%"}},
                 "template": {"metadata": {"labels": {"app": "web"}},
                              "spec": {"containers": [{"name": "c", "image": image}]}},
                 **spec},
        "status": {},
    }


def pod(name: str, owner: dict, phase: str = "Running", ready: bool = True,
        node: str | None = "n1", since: dt.datetime = T0, **meta) -> dict:
    labels = owner["spec"]["template"]["metadata"]["labels"]
    return {
        "metadata": {"name": name, "namespace": "ns", "labels": dict(labels),
                     "creationTimestamp": stamp(since),
                     "ownerReferences": [{"kind": "ReplicaSet", "uid": owner["metadata"]["uid"],
                                          "controller": True}], **meta},
        "spec": {"nodeName": node} if node else {},
        "status": {"phase": phase, "conditions": [
            {"type": "Ready", "status": "True" if ready else "False",
             "lastTransitionTime": stamp(since)}]},
    }


def replicaset(replicas: int, name: str = "web-abc", uid: str = "rs-uid", **spec) -> dict:
    return {"apiVersion": "apps/v1", "kind": "ReplicaSet",
            "metadata": {"name": name, "namespace": "ns", "uid": uid, "generation": 4},
            "spec": {"replicas": replicas, "selector": {"matchLabels": {"app": "web"}},
                     "template": {"metadata": {"labels": {"app": "web"}},
                                  "spec": {"containers": [{"name": "c"}]}}, **spec}}


# --- ReplicaSet ---------------------------------------------------------------------------
def test_replicaset_creates_missing_pods_and_replaces_failed_or_deleted_ones():
    rs = replicaset(3)
    pods = [pod("a", rs), pod("b", rs, phase="Failed"),
            pod("c", rs, deletionTimestamp=stamp(T0))]
    plan = decide_replicaset(rs, pods, T0)
    assert (plan.create, plan.delete) == (2, [])
    assert plan.status == {"replicas": 1, "fullyLabeledReplicas": 1, "readyReplicas": 1,
                           "availableReplicas": 1, "observedGeneration": 4}


def test_replicaset_deletes_the_least_valuable_surplus_pods_first():
    rs = replicaset(1)
    pods = [pod("old-ready", rs, since=T0), pod("new-ready", rs, since=T0 + dt.timedelta(1)),
            pod("not-ready", rs, ready=False), pod("unbound", rs, phase="Pending", node=None)]
    plan = decide_replicaset(rs, pods, T0 + dt.timedelta(2))
    assert plan.create == 0
    assert plan.delete == ["unbound", "not-ready", "new-ready"]


def test_replicaset_counts_pods_available_only_after_min_ready_seconds():
    rs = replicaset(2, minReadySeconds=30)
    pods = [pod("a", rs, since=T0), pod("b", rs, since=T0 + dt.timedelta(seconds=20))]
    plan = decide_replicaset(rs, pods, T0 + dt.timedelta(seconds=40))
    assert plan.status["readyReplicas"] == 2 and plan.status["availableReplicas"] == 1
    assert plan.recheck_after == pytest.approx(10)


def test_pods_from_a_replicaset_carry_its_template_and_controller_reference():
    rs = replicaset(1)
    body = pod_from_template(rs)
    assert body["metadata"]["generateName"] == "web-abc-"
    assert body["metadata"]["labels"] == {"app": "web"}
    assert body["metadata"]["ownerReferences"] == [{
        "apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "web-abc", "uid": "rs-uid",
        "controller": True, "blockOwnerDeletion": True}]
    assert body["spec"] == rs["spec"]["template"]["spec"]


# --- Deployment ---------------------------------------------------------------------------
def test_a_new_deployment_creates_its_hashed_replicaset():
    d = deployment(replicas=3)
    plan = decide_deployment(d, [], {}, T0)
    rs = plan.create
    pod_hash = template_hash(d["spec"]["template"])
    assert rs["metadata"]["name"] == f"web-{pod_hash}"
    assert rs["metadata"]["labels"] == {"app": "web", HASH_LABEL: pod_hash}
    assert rs["spec"]["selector"]["matchLabels"] == {"app": "web", HASH_LABEL: pod_hash}
    assert rs["spec"]["template"]["metadata"]["labels"][HASH_LABEL] == pod_hash
    assert rs["spec"]["replicas"] == 3
    assert rs["metadata"]["annotations"][REVISION_ANNOTATION] == "1"
    assert rs["metadata"]["ownerReferences"][0]["uid"] == "d-uid"
    assert rs["metadata"]["ownerReferences"][0]["controller"] is True
    assert plan.annotations == {REVISION_ANNOTATION: "1"}
    progressing = plan.status["conditions"][1]
    assert (progressing["type"], progressing["reason"]) == ("Progressing", "NewReplicaSetCreated")


@pytest.mark.parametrize(("replicas", "surge", "unavailable", "expected"), [
    (4, "25%", "25%", (1, 1)), (2, "25%", "25%", (1, 0)), (3, 0, 0, (0, 1)), (5, 2, "50%", (2, 2)),
])
def test_rolling_limits_round_like_upstream(replicas, surge, unavailable, expected):
    d = deployment(replicas, strategy={"type": "RollingUpdate", "rollingUpdate": {
        "maxSurge": surge, "maxUnavailable": unavailable}})
    assert rolling_limits(d) == expected


def test_unavailable_pods_keep_the_deployment_unavailable_and_the_deadline_applies():
    d = deployment(replicas=2, progressDeadlineSeconds=60)
    rs = decide_deployment(d, [], {}, T0).create
    rs["metadata"].update(uid="rs1", creationTimestamp=stamp(T0))
    rs["status"] = {"replicas": 2}
    plan = decide_deployment(d, [rs], {}, T0)
    d["status"] = plan.status
    available, progressing = plan.status["conditions"]
    assert (available["status"], available["reason"]) == ("False", "MinimumReplicasUnavailable")
    assert progressing["status"] == "True"
    later = decide_deployment(d, [rs], {}, T0 + dt.timedelta(seconds=30))
    assert later.status == d["status"] and later.recheck_after == pytest.approx(30)
    timed_out = decide_deployment(d, [rs], {}, T0 + dt.timedelta(seconds=61)).status
    assert timed_out["conditions"][1]["reason"] == "ProgressDeadlineExceeded"
    assert timed_out["conditions"][1]["status"] == "False"


# --- a rollout, simulated -------------------------------------------------------------------
class World:
    """API server + kubelet in memory, applying plans like the manager does."""

    def __init__(self, d: dict) -> None:
        self.d = d
        self.sets: dict[str, dict] = {}
        self.pods: dict[str, dict] = {}
        self.now = T0
        self.ids = itertools.count()
        self.writes = 0

    def pods_of(self, rs: dict) -> list[dict]:
        return owned(list(self.pods.values()), rs)

    def controllers(self) -> None:
        sets = owned(list(self.sets.values()), self.d)
        plan = decide_deployment(self.d, sets, {r["metadata"]["name"]: self.pods_of(r)
                                                for r in sets}, self.now)
        if plan.create is not None:
            rs = copy.deepcopy(plan.create)
            rs["metadata"].update(uid=f"rs{next(self.ids)}", generation=1,
                                  creationTimestamp=stamp(self.now))
            self.sets[rs["metadata"]["name"]] = rs
            self.writes += 1
        for name, body in plan.patch.items():
            rs = self.sets[name]
            rs["spec"].update(body.get("spec") or {})
            rs["metadata"].setdefault("annotations", {}).update(
                (body.get("metadata") or {}).get("annotations") or {})
            self.writes += 1
        for name in plan.delete:
            del self.sets[name]
            self.writes += 1
        self.d["metadata"].setdefault("annotations", {}).update(plan.annotations)
        if plan.status != self.d["status"]:
            patched = status_patch(self.d["status"], plan.status)["status"]
            self.d["status"] = {k: v for k, v in patched.items() if v is not None}
            self.writes += 1
        for rs in list(self.sets.values()):
            rs_plan = decide_replicaset(rs, self.pods_of(rs), self.now)
            for _ in range(rs_plan.create):
                name = f"{rs['metadata']['name']}-{next(self.ids)}"
                body = pod_from_template(rs)
                body["metadata"].update(name=name, creationTimestamp=stamp(self.now))
                body["status"] = {"phase": "Pending"}
                self.pods[name] = body
                self.writes += 1
            for name in rs_plan.delete:
                # Graceful deletion: the pod runs on for a grace period of 2 s.
                self.pods[name]["metadata"]["deletionTimestamp"] = stamp(
                    self.now + dt.timedelta(seconds=2))
                self.writes += 1
            if rs_plan.status != rs.get("status"):
                rs["status"] = rs_plan.status
                self.writes += 1

    def kubelet(self, ready: bool = True) -> None:
        self.now += dt.timedelta(seconds=1)
        for name in [n for n, p in self.pods.items()
                     if p["metadata"].get("deletionTimestamp", "~") <= stamp(self.now)]:
            del self.pods[name]
        for p in self.pods.values():
            if p["status"]["phase"] == "Pending":
                p["spec"]["nodeName"] = "n1"
                p["status"] = {"phase": "Running", "conditions": [
                    {"type": "Ready", "status": "True" if ready else "False",
                     "lastTransitionTime": stamp(self.now)}]}

    def settle(self, ready: bool = True, steps: int = 40, check=None) -> int:
        """Run controllers and kubelet until nothing is written; returns the steps taken."""
        for step in range(steps):
            self.writes = 0
            self.controllers()
            if check is not None:
                check(self)
            if self.writes == 0:
                return step
            self.kubelet(ready)
        raise AssertionError("did not settle")

    def owner_of(self, p: dict) -> dict:
        uid = p["metadata"]["ownerReferences"][0]["uid"]
        return next(r for r in self.sets.values() if r["metadata"]["uid"] == uid)

    def active(self) -> list[dict]:
        return [p for p in self.pods.values() if not p["metadata"].get("deletionTimestamp")]

    def available(self) -> int:
        return sum(1 for p in self.active()
                   if p["status"].get("conditions", [{}])[0].get("status") == "True")


def test_rolling_update_keeps_within_surge_and_availability_bounds_and_completes():
    world = World(deployment(replicas=4))
    world.settle()
    assert world.d["status"]["availableReplicas"] == 4
    first = next(iter(world.sets))
    world.d["spec"]["template"]["spec"]["containers"][0]["image"] = "app:2"
    world.d["metadata"]["generation"] = 2
    surge, unavailable = rolling_limits(world.d)

    def bounds(w: World) -> None:
        assert len(w.active()) <= 4 + surge
        assert w.available() >= 4 - unavailable

    world.settle(check=bounds)
    (old, new) = sorted(world.sets.values(), key=lambda r: r["metadata"]["name"] != first)
    assert old["spec"]["replicas"] == 0 and new["spec"]["replicas"] == 4
    assert all(p["metadata"]["labels"][HASH_LABEL] == new["metadata"]["labels"][HASH_LABEL]
               for p in world.pods.values())
    status = world.d["status"]
    assert (status["updatedReplicas"], status["availableReplicas"], status["replicas"],
            status["observedGeneration"]) == (4, 4, 4, 2)
    assert [c["reason"] for c in status["conditions"]] == [
        "MinimumReplicasAvailable", "NewReplicaSetAvailable"]
    assert world.d["metadata"]["annotations"][REVISION_ANNOTATION] == "2"
    # Rolling back to the first template reuses its replica set under a new revision.
    world.d["spec"]["template"]["spec"]["containers"][0]["image"] = "app:1"
    world.settle(check=bounds)
    assert world.sets[first]["spec"]["replicas"] == 4
    assert world.sets[first]["metadata"]["annotations"][REVISION_ANNOTATION] == "3"


def test_rolling_update_waits_for_new_pods_to_become_available():
    world = World(deployment(replicas=2))
    world.settle()
    world.d["spec"]["template"]["spec"]["containers"][0]["image"] = "broken:1"
    world.settle(ready=False)
    replicas = sorted(rs["spec"]["replicas"] for rs in world.sets.values())
    assert replicas == [1, 2]  # one surge pod that never gets ready; old pods all kept
    assert world.available() == 2


def test_recreate_stops_every_old_pod_before_starting_new_ones():
    world = World(deployment(replicas=2, strategy={"type": "Recreate"}))
    world.settle()
    world.d["spec"]["template"]["spec"]["containers"][0]["image"] = "app:2"

    def never_mixed(w: World) -> None:
        images = {w.owner_of(p)["spec"]["template"]["spec"]["containers"][0]["image"]
                  for p in w.pods.values()}
        assert len(images) <= 1

    world.settle(check=never_mixed)
    assert len(world.pods) == 2 and len(world.sets) == 2


def test_scaling_changes_only_the_replica_count_and_history_is_trimmed():
    world = World(deployment(replicas=2, revisionHistoryLimit=1))
    world.settle()
    world.d["spec"]["replicas"] = 5
    world.settle()
    assert len(world.sets) == 1 and len(world.pods) == 5
    for image in ("app:2", "app:3"):
        world.d["spec"]["template"]["spec"]["containers"][0]["image"] = image
        world.settle()
    assert len(world.sets) == 2  # the current one plus one old revision
    world.d["spec"]["replicas"] = 1
    world.settle()
    assert len(world.pods) == 1 and world.d["status"]["replicas"] == 1


def test_deciding_again_on_its_own_result_writes_nothing():
    world = World(deployment(replicas=3))
    world.settle()
    world.writes = 0
    world.controllers()
    assert world.writes == 0
