"""Authentication and RBAC on the TLS port: TokenRequest tokens, 401/403 bodies, real kubectl.

The server runs as the local cluster runs it: RBAC on its TLS port, its plain port the
all-powerful insecure port that the admin kubeconfig names.
"""

from __future__ import annotations

import itertools
import json
import ssl
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from api_helpers import ThreadedServer, find_kubectls, require_kubectls, running_server

RBAC = "rbac.authorization.k8s.io/v1"
UNAUTHORIZED = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                "message": "Unauthorized", "reason": "Unauthorized", "code": 401}


@pytest.fixture(scope="module")
def rbac_api(tmp_path_factory) -> Iterator[tuple[ThreadedServer, Path]]:
    tmp = tmp_path_factory.mktemp("rbac")
    with running_server(tmp, authorization_mode="RBAC", audit_log=tmp / "audit.log",
                        secure_port=0, pki_dir=tmp / "pki",
                        admission_plugins=("OwnerReferencesPermissionEnforcement",)) as (
            server, kubeconfig):
        server.create = lambda *a, **kw: server.call(  # type: ignore[attr-defined]
            lambda: server.server.create_object(*a, **kw))
        yield server, kubeconfig


def call(server: ThreadedServer, method: str, path: str, token: str | None = None,
         body: Any = None) -> tuple[int, dict[str, Any]]:
    headers = {"Accept": "application/json", "Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    data = None if body is None else json.dumps(body).encode()
    secure_url, ca_pem = server.server.secure_url, server.server.ca_pem
    assert secure_url and ca_pem
    req = urllib.request.Request(secure_url + path, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10,
                                    context=ssl.create_default_context(cadata=ca_pem)) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def admin(server: ThreadedServer, method: str, path: str,
          body: Any = None) -> dict[str, Any]:
    status, answer = call(server, method, path, server.server.admin_token, body)
    assert status < 300, answer
    return answer


def new_account(server: ThreadedServer, namespace: str, name: str) -> None:
    admin(server, "POST", "/api/v1/namespaces", {"metadata": {"name": namespace}})
    admin(server, "POST", f"/api/v1/namespaces/{namespace}/serviceaccounts",
          {"metadata": {"name": name}})


def token_for(server: ThreadedServer, namespace: str, name: str, **spec: Any) -> str:
    answer = admin(server, "POST", f"/api/v1/namespaces/{namespace}/serviceaccounts/{name}/token",
                   {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                    "spec": spec})
    assert answer["kind"] == "TokenRequest"
    return str(answer["status"]["token"])


def test_the_plain_port_is_the_insecure_superuser_port(rbac_api):
    server, _ = rbac_api
    req = urllib.request.Request(server.url + "/api/v1/namespaces/kube-system/secrets",
                                 headers={"Authorization": "Bearer not-a-token"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        assert json.loads(resp.read())["kind"] == "SecretList"


def test_a_token_the_server_did_not_issue_is_401(rbac_api):
    server, _ = rbac_api
    for token in ("tardigrade-local", "a.b.c", server.server.admin_token + "x"):
        assert call(server, "GET", "/api/v1/namespaces", token) == (401, UNAUTHORIZED)


def test_anonymous_sees_version_but_not_discovery_or_objects(rbac_api):
    server, _ = rbac_api
    assert call(server, "GET", "/version")[0] == 200
    status, answer = call(server, "GET", "/apis")
    assert (status, answer["message"]) == (
        403, 'forbidden: User "system:anonymous" cannot get path "/apis"')
    status, answer = call(server, "GET", "/api/v1/namespaces/default/pods")
    assert status == 403
    assert answer == {
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": 'pods is forbidden: User "system:anonymous" cannot list resource "pods" in '
                   'API group "" in the namespace "default"',
        "reason": "Forbidden", "details": {"kind": "pods"}, "code": 403}


def test_service_account_token_is_authorized_by_role_bindings(rbac_api, tmp_path):
    server, _ = rbac_api
    new_account(server, "team-a", "reader")
    token = token_for(server, "team-a", "reader")
    assert call(server, "GET", "/apis", token)[0] == 200  # system:discovery
    status, answer = call(server, "GET", "/api/v1/namespaces/team-a/pods", token)
    assert (status, answer["message"]) == (403, (
        'pods is forbidden: User "system:serviceaccount:team-a:reader" cannot list resource '
        '"pods" in API group "" in the namespace "team-a"'))
    server.create(RBAC, "Role", {"metadata": {"name": "pods", "namespace": "team-a"},
                                 "rules": [{"apiGroups": [""], "resources": ["pods"],
                                            "verbs": ["list"]}]})
    server.create(RBAC, "RoleBinding", {
        "metadata": {"name": "reader-pods", "namespace": "team-a"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "pods"},
        "subjects": [{"kind": "ServiceAccount", "name": "reader", "namespace": "team-a"}]})
    assert call(server, "GET", "/api/v1/namespaces/team-a/pods", token)[0] == 200
    assert call(server, "GET", "/api/v1/namespaces/default/pods", token)[0] == 403
    assert call(server, "GET", "/api/v1/namespaces/team-a/pods/x/log", token)[0] == 403
    # The account goes: its tokens stop working, even once an account of that name is back.
    admin(server, "DELETE", "/api/v1/namespaces/team-a/serviceaccounts/reader")
    assert call(server, "GET", "/api/v1/namespaces/team-a/pods", token) == (401, UNAUTHORIZED)
    admin(server, "POST", "/api/v1/namespaces/team-a/serviceaccounts",
          {"metadata": {"name": "reader"}})
    assert call(server, "GET", "/api/v1/namespaces/team-a/pods", token)[0] == 401
    assert call(server, "GET", "/api/v1/namespaces/team-a/pods",
                token_for(server, "team-a", "reader"))[0] == 200


def test_a_pod_bound_token_dies_with_its_pod(rbac_api):
    server, _ = rbac_api
    new_account(server, "team-b", "worker")
    pod = admin(server, "POST", "/api/v1/namespaces/team-b/pods", {
        "metadata": {"name": "p"}, "spec": {"serviceAccountName": "worker",
                                            "containers": [{"name": "c", "image": "i"}]}})
    ref = {"kind": "Pod", "apiVersion": "v1", "name": "p", "uid": pod["metadata"]["uid"]}
    token = token_for(server, "team-b", "worker", boundObjectRef=ref, expirationSeconds=3607)
    assert call(server, "GET", "/apis", token)[0] == 200
    admin(server, "DELETE", "/api/v1/namespaces/team-b/pods/p")  # unbound: removed at once
    assert call(server, "GET", "/apis", token)[0] == 401


def test_token_request_checks_its_input(rbac_api):
    server, _ = rbac_api
    path = "/api/v1/namespaces/default/serviceaccounts/default/token"
    status, answer = call(server, "POST", path, server.server.admin_token,
                          {"spec": {"expirationSeconds": 10}})
    assert (status, answer["message"]) == (422, (
        'TokenRequest.authentication.k8s.io "default" is invalid: spec.expirationSeconds: '
        "Invalid value: 10: may not specify a duration less than 10 minutes"))
    status, answer = call(server, "POST", path.replace("/default/token", "/nobody/token"),
                          server.server.admin_token, {"spec": {}})
    assert (status, answer["message"]) == (404, 'serviceaccounts "nobody" not found')
    # Asking for a token is itself authorized: serviceaccounts/token, verb create.
    status, answer = call(server, "POST", path, token_for(server, "default", "default"),
                          {"spec": {}})
    assert status == 403
    assert 'cannot create resource "serviceaccounts/token"' in answer["message"]


_grants = itertools.count()


def _grant(server: ThreadedServer, namespace: str, account: str,
           rules: list[dict[str, Any]]) -> None:
    name = f"{account}-{next(_grants)}"
    server.create(RBAC, "Role", {"metadata": {"name": name, "namespace": namespace},
                                 "rules": rules})
    server.create(RBAC, "RoleBinding", {
        "metadata": {"name": name, "namespace": namespace},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": account}]})


def test_block_owner_deletion_needs_update_on_the_owners_finalizers(rbac_api):
    server, _ = rbac_api
    new_account(server, "team-d", "ctl")
    owner = admin(server, "POST", "/api/v1/namespaces/team-d/configmaps",
                  {"metadata": {"name": "owner"}})
    ref = {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner",
           "uid": owner["metadata"]["uid"], "controller": True, "blockOwnerDeletion": True}
    token = token_for(server, "team-d", "ctl")

    def create(name: str, owner_ref: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        return call(server, "POST", "/api/v1/namespaces/team-d/services", token,
                    {"metadata": {"name": name, "ownerReferences": [owner_ref]},
                     "spec": {"clusterIP": "None", "ports": [{"port": 80}]}})

    _grant(server, "team-d", "ctl", [{"apiGroups": [""], "resources": ["services"],
                                      "verbs": ["create"]}])
    status, answer = create("a", ref)
    assert (status, answer["message"]) == (403, (
        'services "a" is forbidden: cannot set an ownerRef on a resource you can\'t delete: '
        ', <nil>'))
    _grant(server, "team-d", "ctl", [{"apiGroups": [""], "resources": ["services"],
                                      "verbs": ["create", "delete"]}])
    assert create("b", {**ref, "blockOwnerDeletion": False})[0] == 201
    status, answer = create("c", ref)
    assert (status, answer["message"]) == (403, (
        'services "c" is forbidden: cannot set blockOwnerDeletion if an ownerReference refers '
        "to a resource you can't set finalizers on: , <nil>"))
    _grant(server, "team-d", "ctl", [
        {"apiGroups": [""], "resources": ["services"], "verbs": ["create", "delete"]},
        {"apiGroups": [""], "resources": ["configmaps/finalizers"], "verbs": ["update"]}])
    assert create("c", ref)[0] == 201
    # The admin is not asked: system:masters may do anything.
    assert admin(server, "POST", "/api/v1/namespaces/team-d/configmaps",
                 {"metadata": {"name": "child", "ownerReferences": [ref]}})


def test_audit_log_records_each_decision_of_non_admins(rbac_api, tmp_path):
    server, kubeconfig = rbac_api
    new_account(server, "team-c", "auditee")
    token = token_for(server, "team-c", "auditee")
    call(server, "PATCH", "/api/v1/namespaces/team-c/pods/p/status", token, {})
    lines = [json.loads(line) for line in (kubeconfig.parent / "audit.log").read_text()
             .splitlines()]
    mine = [e for e in lines if e["user"]["username"] == "system:serviceaccount:team-c:auditee"]
    assert [(e["verb"], e["objectRef"], e["annotations"]["authorization.k8s.io/decision"])
            for e in mine] == [("patch", {"resource": "pods", "namespace": "team-c",
                                          "name": "p", "apiVersion": "v1",
                                          "subresource": "status"}, "forbid")]
    assert not [e for e in lines if "system:masters" in e["user"]["groups"]]


@pytest.mark.parametrize("binary", find_kubectls() or [None],
                         ids=[p.name for p in find_kubectls()] or ["kubectl-missing"])
def test_kubectl_with_a_service_account_token_gets_the_real_403(rbac_api, binary):
    require_kubectls()
    server, kubeconfig = rbac_api
    namespace = f"kubectl-{binary.name.replace('.', '-')}"
    new_account(server, namespace, "viewer")
    env = {"KUBECONFIG": str(kubeconfig), "HOME": str(kubeconfig.parent),
           "PATH": "/usr/bin:/bin"}
    current = find_kubectls()[0]  # `kubectl create token` is 1.24+
    created = subprocess.run([str(current), "create", "token", "viewer", "-n", namespace],
                             env=env, capture_output=True, text=True, timeout=30)
    assert created.returncode == 0, created.stderr
    secure = server.server.write_kubeconfig(kubeconfig.parent / "secure.kubeconfig",
                                            url=server.server.secure_url,
                                            ca_pem=server.server.ca_pem)
    done = subprocess.run([str(binary), f"--kubeconfig={secure}",
                           f"--token={created.stdout.strip()}", "get", "pods", "-n", namespace],
                          env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 1
    assert done.stderr.strip() == (
        f'Error from server (Forbidden): pods is forbidden: User "system:serviceaccount:'
        f'{namespace}:viewer" cannot list resource "pods" in API group "" in the namespace '
        f'"{namespace}"')


@pytest.mark.parametrize("binary", find_kubectls() or [None],
                         ids=[p.name for p in find_kubectls()] or ["kubectl-missing"])
def test_kubectl_auth_can_i_asks_the_authorizer(rbac_api, binary):
    require_kubectls()
    server, kubeconfig = rbac_api
    namespace = f"can-i-{binary.name.replace('.', '-')}"
    new_account(server, namespace, "asker")
    secure = server.server.write_kubeconfig(kubeconfig.parent / "secure.kubeconfig",
                                            url=server.server.secure_url,
                                            ca_pem=server.server.ca_pem)
    token = token_for(server, namespace, "asker")

    def can_i(*args: str) -> tuple[int, str]:
        done = subprocess.run([str(binary), f"--kubeconfig={secure}", f"--token={token}",
                               "auth", "can-i", *args, "-n", namespace],
                              capture_output=True, text=True, timeout=30,
                              env={"HOME": str(kubeconfig.parent), "PATH": "/usr/bin:/bin"})
        return done.returncode, done.stdout.strip()

    assert can_i("watch", "deployments.apps") == (1, "no")
    _grant(server, namespace, "asker", [{"apiGroups": ["apps"], "resources": ["deployments"],
                                         "verbs": ["watch"]}])
    assert can_i("watch", "deployments.apps") == (0, "yes")
    assert can_i("watch", "deployments") == (0, "yes")
    assert can_i("patch", "deployments.apps", "--subresource=status") == (1, "no")
