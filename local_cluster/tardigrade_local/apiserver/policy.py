"""The default roles every cluster starts with, from upstream's bootstrap policy.

`plugin/pkg/auth/authorizer/rbac/bootstrappolicy/policy.go` (`ClusterRoles`,
`ClusterRoleBindings`): discovery and version/health paths for everyone who authenticated,
the version/health paths also for anonymous requests, self-reviews for every user, and
`cluster-admin` for `system:masters`. Created when the server authorizes with RBAC, as the
RBAC storage's post-start hook does; objects that exist are left alone.
"""

from __future__ import annotations

from typing import Any

from .authn import AUTHENTICATED, SUPERUSER_GROUP, UNAUTHENTICATED
from .core import Core

_LABELS = {"kubernetes.io/bootstrapping": "rbac-defaults"}
_ANNOTATIONS = {"rbac.authorization.kubernetes.io/autoupdate": "true"}
_PUBLIC_INFO = ["/healthz", "/livez", "/readyz", "/version", "/version/"]

CLUSTER_ROLES: dict[str, list[dict[str, Any]]] = {
    "cluster-admin": [
        {"apiGroups": ["*"], "resources": ["*"], "verbs": ["*"]},
        {"nonResourceURLs": ["*"], "verbs": ["*"]},
    ],
    "system:discovery": [
        {"nonResourceURLs": ["/api", "/api/*", "/apis", "/apis/*", "/healthz", "/livez",
                             "/openapi", "/openapi/*", "/readyz", "/version", "/version/"],
         "verbs": ["get"]},
    ],
    "system:public-info-viewer": [{"nonResourceURLs": _PUBLIC_INFO, "verbs": ["get"]}],
    "system:basic-user": [
        {"apiGroups": ["authorization.k8s.io"],
         "resources": ["selfsubjectaccessreviews", "selfsubjectrulesreviews"],
         "verbs": ["create"]},
        {"apiGroups": ["authentication.k8s.io"], "resources": ["selfsubjectreviews"],
         "verbs": ["create"]},
    ],
}

CLUSTER_ROLE_BINDINGS: dict[str, list[str]] = {
    "cluster-admin": [SUPERUSER_GROUP],
    "system:discovery": [AUTHENTICATED],
    "system:public-info-viewer": [AUTHENTICATED, UNAUTHENTICATED],
    "system:basic-user": [AUTHENTICATED],
}


def _meta(name: str) -> dict[str, Any]:
    return {"name": name, "labels": dict(_LABELS), "annotations": dict(_ANNOTATIONS)}


def ensure_bootstrap_policy(core: Core) -> None:
    group = "rbac.authorization.k8s.io"
    roles = core.registry.get(group, "v1", "clusterroles")
    bindings = core.registry.get(group, "v1", "clusterrolebindings")
    assert roles is not None and bindings is not None
    for name, rules in CLUSTER_ROLES.items():
        if core.store.peek(roles.key, "", name) is None:
            core.create(roles, None, {"apiVersion": f"{group}/v1", "kind": "ClusterRole",
                                      "metadata": _meta(name), "rules": rules})
    for name, groups in CLUSTER_ROLE_BINDINGS.items():
        if core.store.peek(bindings.key, "", name) is None:
            core.create(bindings, None, {
                "apiVersion": f"{group}/v1", "kind": "ClusterRoleBinding",
                "metadata": _meta(name),
                "roleRef": {"apiGroup": group, "kind": "ClusterRole", "name": name},
                "subjects": [{"apiGroup": group, "kind": "Group", "name": g} for g in groups]})
