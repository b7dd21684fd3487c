"""The local scheduler's required inter-pod (anti-)affinity, against the kube-scheduler's rules
(interpodaffinity/filtering.go), and a TPU gang rendered by the operator placed on node pools."""

from __future__ import annotations

from typing import Any

import pytest
from tardigrade_local.gke import fitcheck
from tardigrade_local.gke import interpodaffinity as ipa
from tardigrade_local.gke.nodes import NODE_POOL_LABEL, NodeConfig
from tardigrade_local.simulator.node import node_object
from tardigrade_operator.api.parse import parse_trainingjob
from tardigrade_operator.rendering.manifests import GangLaunch, JobRef, build_gang

from tests.conftest import EXAMPLES, load_yaml

TPU_LABELS = {"cloud.google.com/gke-tpu-accelerator": "tpu-v5-lite-podslice",
              "cloud.google.com/gke-tpu-topology": "2x4", "cloud.google.com/gke-spot": "true"}
TPU_TAINT = {"key": "google.com/tpu", "value": "present", "effect": "NoSchedule"}


def tpu_node(name: str, pool: str) -> dict[str, Any]:
    config = NodeConfig(name, labels=TPU_LABELS, taints=(TPU_TAINT,), pool=pool,
                        capacity={"cpu": "32", "memory": "128Gi", "pods": "110",
                                  "google.com/tpu": "4"})
    return node_object(config, "10.0.0.1", 10250)


def node(name: str, **labels: str) -> dict[str, Any]:
    return node_object(NodeConfig(name, labels=labels), "10.0.0.1", 10250)


def pod(name: str, namespace: str = "default", labels: dict[str, str] | None = None,
        affinity: dict[str, Any] | None = None, on: str | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": [{"name": "main"}]}
    if affinity:
        spec["affinity"] = affinity
    if on:
        spec["nodeName"] = on
    return {"metadata": {"name": name, "namespace": namespace, "labels": labels or {}},
            "spec": spec, "status": {"phase": "Running" if on else "Pending"}}


def term(selector: dict[str, Any] | None, key: str = "zone", **extra: Any) -> dict[str, Any]:
    return {"labelSelector": selector, "topologyKey": key, **extra}


def required(kind: str, *terms: dict[str, Any]) -> dict[str, Any]:
    return {kind: {"requiredDuringSchedulingIgnoredDuringExecution": list(terms)}}


NODES = [node("a1", zone="a"), node("a2", zone="a"), node("b1", zone="b"), node("bare")]
APP_X = {"matchLabels": {"app": "x"}}


def reasons(candidate: dict[str, Any], bound: list[dict[str, Any]]) -> dict[str, str | None]:
    return {n["metadata"]["name"]: ipa.unfit_reason(candidate, n, NODES, bound) for n in NODES}


def test_affinity_needs_a_matching_pod_in_the_domain_and_the_topology_key():
    bound = [pod("x", labels={"app": "x"}, on="b1")]
    candidate = pod("p", affinity=required("podAffinity", term(APP_X)))
    assert reasons(candidate, bound) == {
        "a1": ipa.AFFINITY, "a2": ipa.AFFINITY, "b1": None, "bare": ipa.AFFINITY}


def test_the_first_pod_of_a_self_affine_group_may_go_anywhere_but_others_may_not():
    self_affine = pod("p", labels={"app": "x"}, affinity=required("podAffinity", term(APP_X)))
    assert set(reasons(self_affine, []).values()) == {None}
    # A pod that does not match its own term waits for a matching pod to exist.
    other = pod("q", labels={"app": "y"}, affinity=required("podAffinity", term(APP_X)))
    assert set(reasons(other, []).values()) == {ipa.AFFINITY}


def test_anti_affinity_refuses_the_domain_of_a_matching_pod():
    bound = [pod("x", labels={"app": "x"}, on="a1")]
    candidate = pod("p", affinity=required("podAntiAffinity", term(APP_X)))
    assert reasons(candidate, bound) == {
        "a1": ipa.ANTI_AFFINITY, "a2": ipa.ANTI_AFFINITY, "b1": None, "bare": None}


def test_an_existing_pods_anti_affinity_keeps_others_out_of_its_domain():
    guard = pod("g", labels={"app": "g"}, on="a2",
                affinity=required("podAntiAffinity", term(APP_X)))
    assert reasons(pod("p", labels={"app": "x"}), [guard]) == {
        "a1": ipa.EXISTING_ANTI_AFFINITY, "a2": ipa.EXISTING_ANTI_AFFINITY, "b1": None,
        "bare": None}
    assert set(reasons(pod("p", labels={"app": "y"}), [guard]).values()) == {None}


@pytest.mark.parametrize(("extra", "matches_other_namespace"), [
    ({}, False),  # no namespaces, no selector: the pod's own namespace
    ({"namespaces": ["other"]}, True),
    ({"namespaceSelector": {}}, True),  # empty selector: every namespace
])
def test_term_namespaces(extra, matches_other_namespace):
    bound = [pod("x", namespace="other", labels={"app": "x"}, on="a1")]
    candidate = pod("p", affinity=required("podAntiAffinity", term(APP_X, **extra)))
    assert (reasons(candidate, bound)["a1"] == ipa.ANTI_AFFINITY) is matches_other_namespace


def test_nil_selector_matches_nothing_and_terminal_pods_do_not_count():
    bound = [pod("x", labels={"app": "x"}, on="a1")]
    assert set(reasons(pod("p", affinity=required("podAntiAffinity", term(None))),
                       bound).values()) == {None}
    done = {**bound[0], "status": {"phase": "Succeeded"}}
    candidate = pod("p", affinity=required("podAntiAffinity", term(APP_X)))
    assert fitcheck.schedule(candidate, NODES[:1], [done]).node == "a1"


def test_a_non_empty_namespace_selector_is_refused_not_guessed():
    candidate = pod("p", affinity=required("podAntiAffinity", term(
        APP_X, namespaceSelector={"matchLabels": {"team": "ml"}})))
    assert ipa.unfit_reason(candidate, NODES[0], NODES,
                            [pod("x", labels={"app": "x"}, on="a1")]) == ipa.UNSUPPORTED


def test_scheduler_message_names_the_affinity_reason():
    bound = [pod("x", labels={"app": "x"}, on="a1")]
    candidate = pod("p", affinity=required("podAntiAffinity", term(APP_X)))
    decision = fitcheck.schedule(candidate, NODES[:2], bound)
    assert decision.node is None
    assert decision.message.startswith(f"0/2 nodes are available: 2 {ipa.ANTI_AFFINITY}.")


# --------------------------------------- the operator's TPU gangs on two matching pools ---

# Two node pools of the same slice shape whose node names interleave, so spreading alone
# (the least loaded node, ties by name) would split a gang across them.
POOLS = [tpu_node("tpu-1", "slice-a"), tpu_node("tpu-2", "slice-b"),
         tpu_node("tpu-3", "slice-a"), tpu_node("tpu-4", "slice-b")]


def _tpu_gang(job: str, attempt: int = 1) -> list[dict[str, Any]]:
    spec = parse_trainingjob(load_yaml(EXAMPLES / "gke-tpu-v5e.yaml")).spec
    return build_gang(JobRef(job, "ml", f"uid-{job}"), spec,
                      GangLaunch(attempt, spec.replicas, "latest"))


def _place(pods: list[dict[str, Any]], nodes: list[dict[str, Any]],
           bound: list[dict[str, Any]]) -> dict[str, str | None]:
    """Bind one pod after another, as the scheduling queue does, each seeing the ones before."""
    placed: dict[str, str | None] = {}
    for candidate in pods:
        decision = fitcheck.schedule(candidate, nodes, bound)
        placed[candidate["metadata"]["name"]] = decision.node
        if decision.node is not None:
            bound.append({**candidate, "spec": {**candidate["spec"], "nodeName": decision.node},
                          "status": {"phase": "Running"}})
    return placed


def _pools(placed: dict[str, str | None]) -> set[str | None]:
    pool_of = {n["metadata"]["name"]: n["metadata"]["labels"][NODE_POOL_LABEL] for n in POOLS}
    return {pool_of.get(node or "") for node in placed.values()}


def test_each_tpu_gang_gets_one_whole_node_pool_of_its_own():
    bound: list[dict[str, Any]] = []
    first = _place(_tpu_gang("alpha"), POOLS, bound)
    second = _place(_tpu_gang("beta"), POOLS, bound)
    assert len(_pools(first)) == 1 and None not in _pools(first)
    assert len(_pools(second)) == 1 and None not in _pools(second)
    assert _pools(first) != _pools(second)


def test_a_third_gang_waits_rather_than_share_a_slice():
    bound: list[dict[str, Any]] = []
    _place(_tpu_gang("alpha") + _tpu_gang("beta"), POOLS, bound)
    # Free chips on a pool held by another gang would not help: the pools are exclusive.
    roomy = [tpu_node(n["metadata"]["name"], n["metadata"]["labels"][NODE_POOL_LABEL])
             for n in POOLS]
    for n in roomy:
        n["status"]["allocatable"].update({"google.com/tpu": "8", "cpu": "64", "memory": "256Gi"})
    third = _tpu_gang("gamma")[0]
    decision = fitcheck.schedule(third, roomy, bound)
    assert decision.node is None
    assert f"4 {ipa.EXISTING_ANTI_AFFINITY}" in decision.message
