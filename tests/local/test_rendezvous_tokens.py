"""Rendezvous authentication end to end against the API server's TokenReview: real projected-
style tokens (TokenRequest with the rendezvous audience, bound to a pod), reviewed by rank 0
under RBAC, as in a cluster; then who gets to hold a rank."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from tardigrade_contract import contract
from tardigrade_local.ports import free_port
from tardigrade_sdk import distributed, peerauth

from tests.apiserver import SharedApi
from tests.polling import wait_for
from tests.rendezvous import coordinator_in_thread

AUD = contract.RENDEZVOUS_AUDIENCE
RBAC = "rbac.authorization.k8s.io/v1"


def _pod_token(api: SharedApi, namespace: str, pod: Any, audience: str | None = AUD) -> str:
    """What the kubelet asks for a pod's projected token (TokenRequest bound to the pod)."""
    spec: dict[str, Any] = {"expirationSeconds": 3600, "boundObjectRef": {
        "kind": "Pod", "apiVersion": "v1", "name": pod.metadata.name, "uid": pod.metadata.uid}}
    if audience:
        spec["audiences"] = [audience]
    answer = api.core.create_namespaced_service_account_token("default", namespace,
                                                              {"spec": spec})
    return str(answer.status.token)


def _has_default_account(api: SharedApi, namespace: str) -> bool:
    try:
        api.core.read_namespaced_service_account("default", namespace)
        return True
    except ApiException:
        return False


@pytest.fixture(scope="module")
def cluster(shared_api: SharedApi) -> Iterator[dict[str, Any]]:
    team_a, team_b = shared_api.new_namespace("team-a"), shared_api.new_namespace("team-b")
    for ns in (team_a, team_b):
        wait_for(lambda n=ns: _has_default_account(shared_api, n), 30,
                 "the controller manager to make the default ServiceAccount")
    spec = {"containers": [{"name": "trainer", "image": "trainer:1"}]}
    pods = {f"{team}/{name}": shared_api.core.create_namespaced_pod(
                ns, {"metadata": {"name": name}, "spec": spec})
            for team, ns, name in [("team-a", team_a, "job-a1-0"), ("team-a", team_a, "job-a1-1"),
                                   ("team-a", team_a, "other-a1-1"),
                                   ("team-b", team_b, "job-a1-1")]}
    namespaces = {"team-a": team_a, "team-b": team_b}
    # What the chart grants trainers (trainerTokenReview): team-a's ServiceAccounts only.
    rbac = client.RbacAuthorizationV1Api(shared_api.api)
    role = f"tokenreview-{team_a}"
    rbac.create_cluster_role({
        "apiVersion": RBAC, "kind": "ClusterRole", "metadata": {"name": role},
        "rules": [{"apiGroups": ["authentication.k8s.io"], "resources": ["tokenreviews"],
                   "verbs": ["create"]}]})
    rbac.create_cluster_role_binding({
        "apiVersion": RBAC, "kind": "ClusterRoleBinding", "metadata": {"name": role},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                    "name": role},
        "subjects": [{"kind": "Group", "apiGroup": "rbac.authorization.k8s.io",
                      "name": f"system:serviceaccounts:{team_a}"}]})
    ca_pem = Path(shared_api.cluster.info["ca_file"]).read_text()

    def token(team: str, pod: str, audience: str | None = AUD) -> str:
        return _pod_token(shared_api, namespaces[team], pods[f"{team}/{pod}"], audience)

    def access(team: str, pod: str) -> peerauth.ApiAccess:
        # Rank 0's own API credentials: its pod's token for the API server.
        return peerauth.ApiAccess(shared_api.cluster.api_url, token(team, pod, None), ca_pem)

    yield {"token": token, "access": access, "namespaces": namespaces}


def test_token_review_names_the_pod_and_the_audience(cluster):
    token = cluster["token"]
    access = cluster["access"]("team-a", "job-a1-0")
    status = peerauth.review(access, token("team-a", "job-a1-1"))
    assert status["authenticated"] is True and status["audiences"] == [AUD]
    team_a = cluster["namespaces"]["team-a"]
    assert status["user"]["username"] == f"system:serviceaccount:{team_a}:default"
    assert status["user"]["extra"][peerauth.POD_NAME_EXTRA] == ["job-a1-1"]
    # A token for the API server itself is not one for the rendezvous.
    # (kube-apiserver leaves `authenticated` out when false: omitempty.)
    assert "authenticated" not in peerauth.review(access, token("team-a", "job-a1-1", None))


def test_token_review_needs_its_grant(cluster):
    with pytest.raises(peerauth.PeerAuthError, match="create tokenreviews"):
        peerauth.review(cluster["access"]("team-b", "job-a1-1"), "anything")


def _serve(port: int, reviewer: peerauth.TokenReviewer) -> tuple[threading.Thread, list[object]]:
    return coordinator_in_thread(port, 2, 20, attempt=1, check=reviewer.check)


def _hello(port: int, token: str | None, changes: dict[str, Any]) -> bytes:
    hello: dict[str, Any] = {"job": "job", "attempt": 1, "num_processes": 2, "process_id": 1,
                             **changes}
    if token is not None:
        hello["token"] = token
    sock = wait_for(lambda: _try_connect(port), 10, "the coordinator")
    with sock:
        sock.sendall(json.dumps(hello).encode() + b"\n")
        sock.settimeout(10)
        return sock.recv(4096)


def _try_connect(port: int) -> socket.socket | None:
    try:
        return socket.create_connection(("127.0.0.1", port), timeout=1)
    except OSError:
        return None


HELLOS = yaml.safe_load((Path(__file__).parents[1] / "data" /
                         "hostile_rendezvous_hellos.yaml").read_text())


@pytest.mark.parametrize("case", HELLOS, ids=[c["name"] for c in HELLOS])
def test_an_outsider_cannot_take_a_rank(cluster, case, tmp_path: Path):
    token = cluster["token"]
    tokens = {
        None: None,
        "garbage": "a.b.c",
        "api-audience": token("team-a", "job-a1-1", None),
        "other-job": token("team-a", "other-a1-1"),
        "other-namespace": token("team-b", "job-a1-1"),
        "rank-0": token("team-a", "job-a1-0"),
        "rank-1": token("team-a", "job-a1-1"),
    }
    port = free_port()
    reviewer = peerauth.TokenReviewer(cluster["namespaces"]["team-a"], "job",
                                      cluster["access"]("team-a", "job-a1-0"))
    thread, result = _serve(port, reviewer)
    answer = _hello(port, tokens[case["token"]], case.get("hello") or {})
    assert answer.startswith(b"rejected: "), answer
    assert case["says"] in answer.decode(), answer
    # The real rank 1 still gets in, with the token its pod's volume holds.
    token_file = tmp_path / "token"
    token_file.write_text(tokens["rank-1"] or "")
    distributed._join_rendezvous("127.0.0.1", port, {"job": "job", "attempt": 1,
                                                     "num_processes": 2, "process_id": 1},
                                 time.monotonic() + 15, str(token_file))
    thread.join(15)
    assert result == ["ok"]
