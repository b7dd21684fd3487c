"""The local API server's request attributes and RBAC authorizer, as upstream's (unit level)."""

from __future__ import annotations

from typing import Any

import pytest
from tardigrade_local.apiserver import ApiServer
from tardigrade_local.apiserver.authn import ADMIN, ANONYMOUS, service_account_user
from tardigrade_local.apiserver.rbac import forbidden, rule_allows
from tardigrade_local.apiserver.requestinfo import RequestAttributes, request_attributes

RBAC = "rbac.authorization.k8s.io/v1"
TJ = "/apis/tardigrade.dev/v1alpha1"


# ---- requestinfo.go ---------------------------------------------------------------------------
@pytest.mark.parametrize(("method", "path", "query", "expected"), [
    ("GET", "/api/v1/namespaces/ml/pods", {}, ("list", "", "pods", "", "ml", "")),
    ("GET", "/api/v1/namespaces/ml/pods", {"watch": "true"},
     ("watch", "", "pods", "", "ml", "")),
    ("GET", "/api/v1/watch/namespaces/ml/pods/p", {}, ("watch", "", "pods", "", "ml", "p")),
    ("GET", "/api/v1/pods", {"fieldSelector": "metadata.name=p"},
     ("list", "", "pods", "", "", "p")),
    ("GET", "/api/v1/namespaces/ml/pods/p/log", {}, ("get", "", "pods", "log", "ml", "p")),
    ("POST", "/api/v1/namespaces/ml/pods/p/eviction", {},
     ("create", "", "pods", "eviction", "ml", "p")),
    ("PATCH", f"{TJ}/namespaces/ml/trainingjobs/j/status", {},
     ("patch", "tardigrade.dev", "trainingjobs", "status", "ml", "j")),
    ("PUT", f"{TJ}/namespaces/ml/trainingjobs/j/scale", {},
     ("update", "tardigrade.dev", "trainingjobs", "scale", "ml", "j")),
    ("DELETE", "/api/v1/namespaces/ml/pods", {}, ("deletecollection", "", "pods", "", "ml", "")),
    ("DELETE", "/api/v1/namespaces/ml/pods/p", {}, ("delete", "", "pods", "", "ml", "p")),
    # A namespace's own subresources keep the namespace as the resource.
    ("PUT", "/api/v1/namespaces/ml/finalize", {},
     ("update", "", "namespaces", "finalize", "ml", "ml")),
    ("GET", "/api/v1/namespaces/ml", {}, ("get", "", "namespaces", "", "ml", "ml")),
    ("GET", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", {},
     ("list", "apiextensions.k8s.io", "customresourcedefinitions", "", "", "")),
])
def test_request_attributes_follow_requestinfo(method, path, query, expected):
    attrs = request_attributes(method, path, query)
    assert attrs.resource_request
    assert (attrs.verb, attrs.api_group, attrs.resource, attrs.subresource, attrs.namespace,
            attrs.name) == expected


@pytest.mark.parametrize("path", ["/version", "/healthz", "/api", "/api/v1", "/apis",
                                  "/apis/apps", "/apis/apps/v1", "/openapi/v3"])
def test_short_paths_are_non_resource_requests(path):
    attrs = request_attributes("GET", path, {})
    assert not attrs.resource_request
    assert (attrs.verb, attrs.path) == ("get", path)


# ---- evaluation_helpers.go ---------------------------------------------------------------------
def _attrs(verb: str, group: str, resource: str, sub: str = "", name: str = "",
           namespace: str = "ml") -> RequestAttributes:
    return RequestAttributes(verb=verb, path="/x", resource_request=True, api_group=group,
                             namespace=namespace, resource=resource, subresource=sub, name=name)


POD_RULE = {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list"]}
RULE_TABLE: list[tuple[dict[str, Any], RequestAttributes, bool]] = [
    (POD_RULE, _attrs("get", "", "pods"), True),
    (POD_RULE, _attrs("watch", "", "pods"), False),
    (POD_RULE, _attrs("get", "apps", "pods"), False),
    # A resource does not grant its subresources...
    (POD_RULE, _attrs("get", "", "pods", "log"), False),
    ({"apiGroups": [""], "resources": ["pods/log"], "verbs": ["get"]},
     _attrs("get", "", "pods", "log"), True),
    # ... nor a subresource its resource.
    ({"apiGroups": [""], "resources": ["pods/status"], "verbs": ["patch"]},
     _attrs("patch", "", "pods"), False),
    ({"apiGroups": ["*"], "resources": ["*/status"], "verbs": ["patch"]},
     _attrs("patch", "tardigrade.dev", "trainingjobs", "status"), True),
    ({"apiGroups": ["*"], "resources": ["*/status"], "verbs": ["patch"]},
     _attrs("patch", "tardigrade.dev", "trainingjobs", "scale"), False),
    ({"apiGroups": ["*"], "resources": ["*"], "verbs": ["*"]},
     _attrs("deletecollection", "x.io", "things", "finalizers"), True),
    ({"apiGroups": ["tardigrade.dev"], "resources": ["trainingjobs/finalizers"],
      "verbs": ["update"]},
     _attrs("update", "tardigrade.dev", "trainingjobs", "finalizers", "j"), True),
    ({"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["update"],
      "resourceNames": ["mine"]}, _attrs("update", "coordination.k8s.io", "leases", "", "mine"),
     True),
    ({"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["update"],
      "resourceNames": ["mine"]}, _attrs("update", "coordination.k8s.io", "leases", "", "other"),
     False),
    # resourceNames cannot restrict an unnamed request (list, create).
    ({"apiGroups": [""], "resources": ["pods"], "verbs": ["list"], "resourceNames": ["p"]},
     _attrs("list", "", "pods"), False),
    ({"nonResourceURLs": ["/apis/*"], "verbs": ["get"]},
     RequestAttributes(verb="get", path="/apis/apps/v1", resource_request=False), True),
    ({"nonResourceURLs": ["/version"], "verbs": ["get"]},
     RequestAttributes(verb="get", path="/version/", resource_request=False), False),
    # A resource rule never matches a path, nor a path rule a resource.
    ({"apiGroups": ["*"], "resources": ["*"], "verbs": ["*"]},
     RequestAttributes(verb="get", path="/healthz", resource_request=False), False),
    ({"nonResourceURLs": ["*"], "verbs": ["*"]}, _attrs("get", "", "pods"), False),
]


@pytest.mark.parametrize(("rule", "attrs", "allowed"), RULE_TABLE)
def test_rule_matching_follows_evaluation_helpers(rule, attrs, allowed):
    assert rule_allows(attrs, rule) is allowed


# ---- rule.go: which bindings apply --------------------------------------------------------------
@pytest.fixture
def server() -> ApiServer:
    api = ApiServer(authorization_mode="RBAC")
    api.core.bootstrap()
    for ns in ("ml", "lab"):
        api.create_object("v1", "Namespace", {"metadata": {"name": ns}})
    api.create_object(RBAC, "ClusterRole", {
        "metadata": {"name": "pod-reader"},
        "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list"]}]})
    api.create_object(RBAC, "Role", {
        "metadata": {"name": "job-writer", "namespace": "ml"},
        "rules": [{"apiGroups": ["tardigrade.dev"], "resources": ["trainingjobs/status"],
                   "verbs": ["patch"]}]})
    return api


def _bind(api: ApiServer, namespace: str | None, role_kind: str, role: str,
          subjects: list[dict[str, str]]) -> None:
    kind = "RoleBinding" if namespace else "ClusterRoleBinding"
    meta: dict[str, str] = {"name": f"{role}-{len(subjects)}"}
    if namespace:
        meta["namespace"] = namespace
    api.create_object(RBAC, kind, {
        "metadata": meta, "subjects": subjects,
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": role_kind, "name": role}})


SA = service_account_user("ops", "op")


def _allowed(api: ApiServer, user: Any, attrs: RequestAttributes) -> bool:
    assert api.access.rbac is not None
    return api.access.rbac.authorize(user, attrs)[0]


def test_role_binding_grants_only_in_its_namespace_and_cluster_binding_everywhere(server):
    _bind(server, "ml", "ClusterRole", "pod-reader",
          [{"kind": "ServiceAccount", "name": "op", "namespace": "ops"}])
    assert _allowed(server, SA, _attrs("list", "", "pods", namespace="ml"))
    assert not _allowed(server, SA, _attrs("list", "", "pods", namespace="lab"))
    assert not _allowed(server, SA, _attrs("list", "", "pods", namespace=""))
    _bind(server, None, "ClusterRole", "pod-reader", [{"kind": "Group", "name":
                                                        "system:serviceaccounts:ops"}])
    for namespace in ("ml", "lab", ""):
        assert _allowed(server, SA, _attrs("list", "", "pods", namespace=namespace))


def test_role_binding_to_a_role_and_subject_kinds(server):
    _bind(server, "ml", "Role", "job-writer", [{"kind": "User", "name": "alice"},
                                               {"kind": "ServiceAccount", "name": "op"}])
    status = _attrs("patch", "tardigrade.dev", "trainingjobs", "status", "j")
    alice = type(SA)("alice", ("system:authenticated",))
    assert _allowed(server, alice, status)
    # A ServiceAccount subject without a namespace means the binding's namespace.
    assert _allowed(server, service_account_user("ml", "op"), status)
    assert not _allowed(server, SA, status)
    assert not _allowed(server, alice, _attrs("patch", "tardigrade.dev", "trainingjobs",
                                              name="j"))


def test_masters_are_allowed_anything_and_anonymous_only_public_info(server):
    from tardigrade_local.apiserver.policy import ensure_bootstrap_policy

    ensure_bootstrap_policy(server.core)
    assert _allowed(server, ADMIN, _attrs("delete", "", "nodes", name="n", namespace=""))
    version = RequestAttributes(verb="get", path="/version", resource_request=False)
    discovery = RequestAttributes(verb="get", path="/apis/apps/v1", resource_request=False)
    assert _allowed(server, ANONYMOUS, version)
    assert not _allowed(server, ANONYMOUS, discovery)
    assert _allowed(server, SA, discovery)
    assert not _allowed(server, SA, _attrs("list", "", "pods"))


def test_an_allow_names_the_binding_as_rbac_go_does(server):
    _bind(server, "ml", "ClusterRole", "pod-reader",
          [{"kind": "ServiceAccount", "name": "op", "namespace": "ops"}])
    assert server.access.rbac is not None
    assert server.access.rbac.authorize(SA, _attrs("get", "", "pods")) == (
        True, 'RBAC: allowed by RoleBinding "pod-reader-1/ml" of ClusterRole "pod-reader" to '
              'ServiceAccount "op/ops"')


def test_a_binding_to_a_missing_role_is_named_in_the_reason(server):
    _bind(server, "ml", "Role", "gone", [{"kind": "ServiceAccount", "name": "op",
                                          "namespace": "ops"}])
    assert server.access.rbac is not None
    allowed, reason = server.access.rbac.authorize(SA, _attrs("list", "", "pods"))
    assert not allowed
    assert reason == 'RBAC: role.rbac.authorization.k8s.io "gone" not found'


# ---- responsewriters/errors.go -------------------------------------------------------------------
def test_forbidden_messages_have_the_real_shape():
    err = forbidden(SA, _attrs("list", "", "pods"), "")
    assert (err.code, err.reason) == (403, "Forbidden")
    assert err.message == ('pods is forbidden: User "system:serviceaccount:ops:op" cannot list '
                           'resource "pods" in API group "" in the namespace "ml"')
    err = forbidden(SA, _attrs("update", "tardigrade.dev", "trainingjobs", "finalizers", "j"),
                    "")
    assert err.message == (
        'trainingjobs.tardigrade.dev "j" is forbidden: User "system:serviceaccount:ops:op" '
        'cannot update resource "trainingjobs/finalizers" in API group "tardigrade.dev" in the '
        'namespace "ml"')
    assert err.details == {"name": "j", "group": "tardigrade.dev", "kind": "trainingjobs"}
    err = forbidden(ANONYMOUS, _attrs("list", "", "nodes", namespace=""), "")
    assert err.message == ('nodes is forbidden: User "system:anonymous" cannot list resource '
                           '"nodes" in API group "" at the cluster scope')
    err = forbidden(ANONYMOUS, RequestAttributes(verb="get", path="/apis",
                                                 resource_request=False), "")
    assert err.message == 'forbidden: User "system:anonymous" cannot get path "/apis"'
