"""The per-job NetworkPolicy, proved against NetworkPolicy semantics (netpolicy_eval.py): the
local cluster does not enforce NetworkPolicy, so who may connect is checked here."""

from __future__ import annotations

import pytest
from tardigrade_operator import naming
from tardigrade_operator.rendering.manifests import JobRef
from tardigrade_operator.rendering.netpolicy import NetworkPeers, build_network_policy

from tests.operator.netpolicy_eval import Pod, allowed, validate

COORDINATOR, PROGRESS, COLLECTIVE = 8476, 8477, 40123
OPERATOR_LABELS = {"app.kubernetes.io/name": "tardigrade-operator",
                   "app.kubernetes.io/instance": "tardigrade"}
PEERS = NetworkPeers(
    operator_namespace="tardigrade-system",
    operator_pod_labels=OPERATOR_LABELS,
    scraper_namespace_selector={"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
    scraper_pod_selector={"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
)
NAMESPACES = {ns: {"kubernetes.io/metadata.name": ns}
              for ns in ("team-a", "team-b", "tardigrade-system", "monitoring")}
POLICY = build_network_policy(JobRef("tiny", "team-a", "uid-1"), PEERS)


def rank(job: str, r: int, namespace: str = "team-a") -> Pod:
    return Pod(namespace, naming.pod_labels(job, 1, r))


TARGET = rank("tiny", 0)
CASES = [
    # (who, source, port, allowed)
    ("a rank of the gang, rendezvous", rank("tiny", 1), COORDINATOR, True),
    ("a rank of the gang, collectives on an ephemeral port", rank("tiny", 1), COLLECTIVE, True),
    ("a rank of the gang, progress", rank("tiny", 1), PROGRESS, True),
    ("the operator, progress", Pod("tardigrade-system", OPERATOR_LABELS), PROGRESS, True),
    ("the operator, rendezvous", Pod("tardigrade-system", OPERATOR_LABELS), COORDINATOR, False),
    ("the scraper, metrics", Pod("monitoring", {"app.kubernetes.io/name": "prometheus"}),
     PROGRESS, True),
    ("the scraper, rendezvous", Pod("monitoring", {"app.kubernetes.io/name": "prometheus"}),
     COORDINATOR, False),
    ("a scraper look-alike in a tenant namespace",
     Pod("team-b", {"app.kubernetes.io/name": "prometheus"}), PROGRESS, False),
    ("an operator look-alike in the job's namespace", Pod("team-a", OPERATOR_LABELS),
     PROGRESS, False),
    ("another job's rank, same namespace", rank("other", 1), COORDINATOR, False),
    ("a pod labelled as the job in another namespace", rank("tiny", 1, "team-b"),
     COORDINATOR, False),
    ("a hand-made pod with only the job label", Pod("team-a", {naming.LABEL_JOB: "tiny"}),
     COORDINATOR, False),
    ("any other pod of the cluster", Pod("team-b", {}), PROGRESS, False),
]


def test_policy_is_valid_networking_v1():
    assert POLICY["apiVersion"] == "networking.k8s.io/v1"
    assert validate(POLICY) == []


@pytest.mark.parametrize(("who", "source", "port", "expected"), CASES,
                         ids=[c[0] for c in CASES])
def test_who_may_connect_to_a_rank(who, source, port, expected):
    assert allowed([POLICY], source, TARGET, port, NAMESPACES) is expected


def test_other_jobs_pods_are_not_selected():
    # The policy isolates this job only; another job's pods keep their own policy (or none).
    assert allowed([POLICY], Pod("team-b", {}), rank("other", 0), COORDINATOR, NAMESPACES)


def test_without_operator_or_scraper_settings_only_the_gang_gets_in():
    bare = build_network_policy(JobRef("tiny", "team-a", "uid-1"), NetworkPeers())
    assert validate(bare) == []
    assert allowed([bare], rank("tiny", 1), TARGET, COORDINATOR, NAMESPACES)
    assert not allowed([bare], Pod("tardigrade-system", OPERATOR_LABELS), TARGET, PROGRESS,
                       NAMESPACES)


def test_the_policy_is_owned_by_the_job():
    owner = POLICY["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["uid"], owner["controller"]) == ("TrainingJob", "uid-1", True)


def test_first_launch_creates_the_policy_with_the_service():
    from tardigrade_operator.observation.observed import DecisionSettings

    from tests.operator.fake_cluster import FakeCluster, spec

    cluster = FakeCluster(spec(), settings=DecisionSettings(network_peers=PEERS))
    plan = cluster.reconcile()
    assert plan.create_service is not None
    assert plan.create_network_policy["spec"]["podSelector"] == POLICY["spec"]["podSelector"]


@pytest.mark.parametrize(("peers", "job_switch"), [(None, True), (PEERS, False)],
                         ids=["operator setting off", "spec.networkPolicy.enabled false"])
def test_the_policy_can_be_switched_off(peers, job_switch):
    from tardigrade_operator.observation.observed import DecisionSettings

    from tests.operator.fake_cluster import FakeCluster, spec

    cluster = FakeCluster(spec(networkPolicy={"enabled": job_switch}),
                          settings=DecisionSettings(network_peers=peers))
    plan = cluster.reconcile()
    assert plan.create_service is not None and plan.create_network_policy is None
