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
from api_helpers import ThreadedServer, running_server
from tardigrade_local.ports import free_port
from tardigrade_trainer import contract, distributed, peerauth
from test_rbac_api import admin, call, token_for

from tests.polling import wait_for
from tests.rendezvous import coordinator_in_thread

AUD = contract.RENDEZVOUS_AUDIENCE
RBAC = "rbac.authorization.k8s.io/v1"


def _pod(server: ThreadedServer, namespace: str, name: str) -> dict[str, Any]:
    return admin(server, "POST", f"/api/v1/namespaces/{namespace}/pods", {
        "metadata": {"name": name},
        "spec": {"containers": [{"name": "trainer", "image": "trainer:1"}]}})


def _pod_token(server: ThreadedServer, namespace: str, pod: dict[str, Any],
               audience: str | None = AUD) -> str:
    spec: dict[str, Any] = {"expirationSeconds": 3600, "boundObjectRef": {
        "kind": "Pod", "apiVersion": "v1", "name": pod["metadata"]["name"],
        "uid": pod["metadata"]["uid"]}}
    if audience:
        spec["audiences"] = [audience]
    return token_for(server, namespace, "default", **spec)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("rdv")
    with running_server(tmp, authorization_mode="RBAC", secure_port=0, pki_dir=tmp / "pki") as (
            server, _):
        for ns in ("team-a", "team-b"):
            admin(server, "POST", "/api/v1/namespaces", {"metadata": {"name": ns}})
            wait_for(lambda n=ns: call(server, "GET",
                                       f"/api/v1/namespaces/{n}/serviceaccounts/default",
                                       server.server.admin_token)[0] == 200, 10, "default SA")
        pods = {f"{ns}/{name}": _pod(server, ns, name)
                for ns, name in [("team-a", "job-a1-0"), ("team-a", "job-a1-1"),
                                 ("team-a", "other-a1-1"), ("team-b", "job-a1-1")]}
        # What the chart grants trainers (trainerTokenReview): team-a's ServiceAccounts only.
        admin(server, "POST", "/apis/rbac.authorization.k8s.io/v1/clusterroles", {
            "apiVersion": RBAC, "kind": "ClusterRole", "metadata": {"name": "tokenreview"},
            "rules": [{"apiGroups": ["authentication.k8s.io"], "resources": ["tokenreviews"],
                       "verbs": ["create"]}]})
        admin(server, "POST", "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings", {
            "apiVersion": RBAC, "kind": "ClusterRoleBinding", "metadata": {"name": "tokenreview"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                        "name": "tokenreview"},
            "subjects": [{"kind": "Group", "apiGroup": "rbac.authorization.k8s.io",
                          "name": "system:serviceaccounts:team-a"}]})

        def access(ns: str, pod: str) -> peerauth.ApiAccess:
            # Rank 0's own API credentials: its pod's token for the API server.
            return peerauth.ApiAccess(server.server.secure_url or "",
                                      _pod_token(server, ns, pods[f"{ns}/{pod}"], None),
                                      server.server.ca_pem)

        yield {"server": server, "pods": pods, "access": access}


def test_token_review_names_the_pod_and_the_audience(cluster):
    server, pods = cluster["server"], cluster["pods"]
    access = cluster["access"]("team-a", "job-a1-0")
    status = peerauth.review(access, _pod_token(server, "team-a", pods["team-a/job-a1-1"]))
    assert status["authenticated"] is True and status["audiences"] == [AUD]
    assert status["user"]["username"] == "system:serviceaccount:team-a:default"
    assert status["user"]["extra"][peerauth.POD_NAME_EXTRA] == ["job-a1-1"]
    # A token for the API server itself is not one for the rendezvous.
    api_token = _pod_token(server, "team-a", pods["team-a/job-a1-1"], None)
    assert peerauth.review(access, api_token)["authenticated"] is False


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
    server, pods = cluster["server"], cluster["pods"]
    tokens = {
        None: None,
        "garbage": "a.b.c",
        "api-audience": _pod_token(server, "team-a", pods["team-a/job-a1-1"], None),
        "other-job": _pod_token(server, "team-a", pods["team-a/other-a1-1"]),
        "other-namespace": _pod_token(server, "team-b", pods["team-b/job-a1-1"]),
        "rank-0": _pod_token(server, "team-a", pods["team-a/job-a1-0"]),
        "rank-1": _pod_token(server, "team-a", pods["team-a/job-a1-1"]),
    }
    port = free_port()
    reviewer = peerauth.TokenReviewer("team-a", "job", cluster["access"]("team-a", "job-a1-0"))
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
