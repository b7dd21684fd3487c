"""The API server serves networking.k8s.io/v1 NetworkPolicy, so the operator can create the
per-job policy (stored, not enforced: see local_cluster/README.md)."""

from __future__ import annotations

import json
import urllib.request

from api_helpers import api  # noqa: F401  (fixture)
from tardigrade_operator.netpolicy import NetworkPeers, build_network_policy
from tardigrade_operator.render import JobRef

BASE = "/apis/networking.k8s.io/v1/namespaces/default/networkpolicies"


def _call(server, method: str, path: str, body: object = None) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(server.url + path, data=data, method=method,
                                 headers={"Content-Type": "application/json",
                                          "Accept": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_the_operator_policy_is_stored_and_listed(api):  # noqa: F811
    policy = build_network_policy(JobRef("tiny", "default", "uid-1"),
                                  NetworkPeers("tardigrade-system", {"app": "op"}))
    policy["metadata"].pop("ownerReferences")  # no TrainingJob of that uid here
    status, created = _call(api, "POST", BASE, policy)
    assert status == 201, created
    assert created["spec"] == policy["spec"] and created["metadata"]["uid"]
    status, listed = _call(api, "GET", BASE)
    assert status == 200 and listed["kind"] == "NetworkPolicyList"
    assert [p["metadata"]["name"] for p in listed["items"]] == ["tiny-gang"]
    _, resources = _call(api, "GET", "/apis/networking.k8s.io/v1")
    entry = next(r for r in resources["resources"] if r["name"] == "networkpolicies")
    assert entry["namespaced"] and entry["kind"] == "NetworkPolicy"
