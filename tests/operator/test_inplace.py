"""Restart in place: which pods a recovery keeps, per pod and node (keepers.py)."""

from __future__ import annotations

import pytest
from tardigrade_contract import contract
from tardigrade_operator.decision.recovery import keepers
from tardigrade_operator.decision.recovery.keepers import InPlacePlan, Keep, Member, plan


def m(rank: int, healthy: bool = True, can: bool = True) -> Member:
    return Member(f"p{rank}", rank, healthy, can)


@pytest.mark.parametrize("members, replicas, enabled, expected", [
    # Switched off: recreate everything, as today.
    ([m(0), m(1), m(2)], 3, False,
     InPlacePlan((), ("p0", "p1", "p2"), (0, 1, 2))),
    # One host lost: the others stay with their ranks, only rank 1 gets a new pod.
    ([m(0), m(1, healthy=False), m(2)], 3, True,
     InPlacePlan((Keep("p0", 0, 0), Keep("p2", 2, 2)), ("p1",), (1,))),
    # A node whose kubelet (or API server) cannot restart in place: that rank is recreated.
    ([m(0), m(1, can=False), m(2)], 3, True,
     InPlacePlan((Keep("p0", 0, 0), Keep("p2", 2, 2)), ("p1",), (1,))),
    # Grow: every pod stays, the new ranks get pods.
    ([m(0), m(1)], 4, True,
     InPlacePlan((Keep("p0", 0, 0), Keep("p1", 1, 1)), (), (2, 3))),
    # Shrink: the ranks past the new size go.
    ([m(0), m(1), m(2), m(3)], 2, True,
     InPlacePlan((Keep("p0", 0, 0), Keep("p1", 1, 1)), ("p2", "p3"), ())),
    # Shrink after losing rank 0: rank 1 stays; rank 2 cannot become rank 0 (the rendezvous
    # binds a rank to its pod's name), so it goes and rank 0 gets a new pod.
    ([m(0, healthy=False), m(1), m(2)], 2, True,
     InPlacePlan((Keep("p1", 1, 1),), ("p0", "p2"), (0,))),
    # Nothing can restart in place: a plain recreation.
    ([m(0, can=False), m(1, can=False)], 2, True,
     InPlacePlan((), ("p0", "p1"), (0, 1))),
])
def test_plan_keeps_healthy_pods_and_recreates_the_rest(members, replicas, enabled, expected):
    got = plan(members, replicas, enabled)
    assert got == expected
    # Every rank of the new world has exactly one pod, kept or new.
    assert sorted([k.rank for k in got.keep] + list(got.create_ranks)) == list(range(replicas))


RESTART_ALL = [keepers.RESTART_ALL_CONTAINERS]


@pytest.mark.parametrize("version, declared, supported", [
    ("v1.36.3", RESTART_ALL, True), ("v1.37.0", RESTART_ALL, True),
    # A 1.36 kubelet with the rules' gate off (so RestartAllContainers off too, its
    # dependent) declares nothing: the same version, no rules.
    ("v1.36.3", [], False), ("v1.36.3", ["SomethingElse"], False),
    # 1.35 declares nothing by default: its version decides.
    ("v1.35.1-gke.1200", [], True), ("v1.34.3", RESTART_ALL, False),
    ("v1.33.0-tardigrade-local", [], False), ("", [], False), ("garbage", RESTART_ALL, False),
])
def test_kubelet_support_is_read_per_node(version, declared, supported):
    status = {"nodeInfo": {"kubeletVersion": version}, "declaredFeatures": declared}
    assert keepers.kubelet_supports_rules({"status": status}) is supported
    # What the operator indexes per node: the version where rules run, else "".
    assert keepers.rules_kubelet_version(status) == (version if supported else "")
    assert keepers.version_supports_rules(keepers.rules_kubelet_version(status)) is supported


def test_rule_survival_is_read_from_the_created_pod():
    kept = {"spec": {"containers": [{"name": "trainer", **keepers.restart_rule()}]}}
    dropped = {"spec": {"containers": [{"name": "trainer"}]}}
    assert keepers.rule_survived(kept) and not keepers.rule_survived(dropped)
    rule = keepers.restart_rule()["restartPolicyRules"][0]
    assert rule["exitCodes"]["values"] == [contract.EXIT_RESTART_IN_PLACE]
    assert contract.EXIT_RESTART_IN_PLACE not in (contract.RETRYABLE_EXIT_CODES
                                                  | contract.FATAL_EXIT_CODES)
