"""Kubernetes RBAC: may this user do this request? As upstream's RBAC authorizer.

- Rule matching: `pkg/apis/rbac/v1/evaluation_helpers.go` (`VerbMatches`, `APIGroupMatches`,
  `ResourceMatches` with `*` and `*/subresource`, `ResourceNameMatches`,
  `NonResourceURLMatches` with a trailing `*`); `RulesAllow`/`RuleAllows` in
  `plugin/pkg/auth/authorizer/rbac/rbac.go`.
- Which rules apply: `DefaultRuleResolver.VisitRulesFor` and `appliesToUser` in
  `pkg/registry/rbac/validation/rule.go`: every ClusterRoleBinding, then (for a namespaced
  request) the RoleBindings of the request's namespace, each to a Role of that namespace or
  to a ClusterRole; subjects are a User name, a Group the user is in, or a ServiceAccount
  (its namespace defaults to the binding's).
- A binding whose role does not exist contributes an error, which ends up in the denial's
  reason as `RBAC: clusterrole.rbac.authorization.k8s.io "x" not found` (rbac.go `Authorize`).
- Members of `system:masters` are allowed before RBAC is asked
  (`authorizerfactory.NewPrivilegedGroups` in staging/src/k8s.io/apiserver/pkg/authorization/
  authorizerfactory/builtin.go, first in kube-apiserver's authorizer chain).
- Aggregated ClusterRoles (`aggregationRule`) are not computed: nothing here uses them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from .authn import SA_PREFIX, SUPERUSER_GROUP, UserInfo
from .errors import ApiError
from .requestinfo import RequestAttributes
from .store import Store

GROUP = "rbac.authorization.k8s.io"
ROLES = f"{GROUP}/roles"
CLUSTER_ROLES = f"{GROUP}/clusterroles"
ROLE_BINDINGS = f"{GROUP}/rolebindings"
CLUSTER_ROLE_BINDINGS = f"{GROUP}/clusterrolebindings"

Rule = dict[str, Any]


# ---- evaluation_helpers.go -----------------------------------------------------------------
def verb_matches(rule: Rule, verb: str) -> bool:
    return any(v in ("*", verb) for v in rule.get("verbs") or [])


def api_group_matches(rule: Rule, group: str) -> bool:
    return any(g in ("*", group) for g in rule.get("apiGroups") or [])


def resource_matches(rule: Rule, combined_resource: str, subresource: str) -> bool:
    for resource in rule.get("resources") or []:
        if resource in ("*", combined_resource):
            return True
        if subresource and resource == f"*/{subresource}":
            return True
    return False


def resource_name_matches(rule: Rule, name: str) -> bool:
    names = rule.get("resourceNames") or []
    return not names or name in names


def non_resource_url_matches(rule: Rule, path: str) -> bool:
    for url in rule.get("nonResourceURLs") or []:
        if url in ("*", path):
            return True
        if url.endswith("*") and path.startswith(url.rstrip("*")):
            return True
    return False


def rule_allows(attrs: RequestAttributes, rule: Rule) -> bool:
    if attrs.resource_request:
        return (verb_matches(rule, attrs.verb) and api_group_matches(rule, attrs.api_group)
                and resource_matches(rule, attrs.combined_resource, attrs.subresource)
                and resource_name_matches(rule, attrs.name))
    return verb_matches(rule, attrs.verb) and non_resource_url_matches(rule, attrs.path)


# ---- rule.go ---------------------------------------------------------------------------------
def applies_to(user: UserInfo, subject: dict[str, Any], binding_namespace: str) -> bool:
    kind = subject.get("kind")
    name = subject.get("name", "")
    if kind == "User":
        return user.name == name
    if kind == "Group":
        return name in user.groups
    if kind == "ServiceAccount":
        namespace = subject.get("namespace") or binding_namespace
        return bool(namespace) and user.name == f"{SA_PREFIX}{namespace}:{name}"
    return False


class RBACAuthorizer:
    def __init__(self, store: Store) -> None:
        self.store = store

    def _role_rules(self, role_ref: dict[str, Any],
                    binding_namespace: str) -> tuple[list[Rule], str | None]:
        kind = role_ref.get("kind")
        name = role_ref.get("name", "")
        if kind == "ClusterRole":
            role = self.store.peek(CLUSTER_ROLES, "", name)
            missing = f'clusterrole.{GROUP} "{name}" not found'
        elif kind == "Role" and binding_namespace:
            role = self.store.peek(ROLES, binding_namespace, name)
            missing = f'role.{GROUP} "{name}" not found'
        else:
            return [], f"unsupported role reference kind: {kind!r}"
        if role is None:
            return [], missing
        return list(role.get("rules") or []), None

    def _bindings(self, namespace: str) -> Iterator[tuple[dict[str, Any], str]]:
        for binding in self.store.iter(CLUSTER_ROLE_BINDINGS):
            yield binding, ""
        if namespace:
            for binding in self.store.iter(ROLE_BINDINGS, namespace):
                yield binding, namespace

    def rules_for(self, user: UserInfo, namespace: str
                  ) -> tuple[list[tuple[Rule, str]], list[str]]:
        """Every rule that applies to `user` in `namespace` ("" = cluster scope) with the
        binding it comes from (described as rule.go's describers do), and errors."""
        rules: list[tuple[Rule, str]] = []
        errors: list[str] = []
        for binding, binding_ns in self._bindings(namespace):
            subject = next((s for s in binding.get("subjects") or []
                            if applies_to(user, s, binding_ns)), None)
            if subject is None:
                continue
            ref = binding.get("roleRef") or {}
            found, error = self._role_rules(ref, binding_ns)
            name = binding["metadata"]["name"] + (f"/{binding_ns}" if binding_ns else "")
            source = (f'{"RoleBinding" if binding_ns else "ClusterRoleBinding"} "{name}" of '
                      f'{ref.get("kind")} "{ref.get("name")}" to '
                      f'{_describe(subject, binding_ns)}')
            rules += [(rule, source) for rule in found]
            if error:
                errors.append(error)
        return rules, errors

    def authorize(self, user: UserInfo, attrs: RequestAttributes) -> tuple[bool, str]:
        """(allowed, reason), reasons as rbac.go's: `RBAC: allowed by <binding>` or the
        errors met on the way to a denial."""
        if SUPERUSER_GROUP in user.groups:
            return True, ""
        rules, errors = self.rules_for(user, attrs.namespace)
        for rule, source in rules:
            if rule_allows(attrs, rule):
                return True, f"RBAC: allowed by {source}"
        return False, _aggregate(errors)


def _describe(subject: dict[str, Any], binding_namespace: str) -> str:
    name = subject.get("name", "")
    if subject.get("kind") == "ServiceAccount":
        name = f'{name}/{subject.get("namespace") or binding_namespace}'
    return f'{subject.get("kind")} "{name}"'


def _aggregate(errors: Iterable[str]) -> str:
    """utilerrors.NewAggregate's text: one error as is, several as `[a, b]`."""
    unique = list(dict.fromkeys(errors))
    if not unique:
        return ""
    return "RBAC: " + (unique[0] if len(unique) == 1 else "[" + ", ".join(unique) + "]")


def forbidden(user: UserInfo, attrs: RequestAttributes, reason: str) -> ApiError:
    """The 403 of `responsewriters.Forbidden` + `forbiddenMessage` (staging/src/k8s.io/
    apiserver/pkg/endpoints/handlers/responsewriters/errors.go) wrapped by
    `apierrors.NewForbidden` (apimachinery/pkg/api/errors/errors.go)."""
    if not attrs.resource_request:
        message = f'User "{user.name}" cannot {attrs.verb} path "{attrs.path}"'
    else:
        scope = (f'in the namespace "{attrs.namespace}"' if attrs.namespace
                 else "at the cluster scope")
        message = (f'User "{user.name}" cannot {attrs.verb} resource '
                   f'"{attrs.combined_resource}" in API group "{attrs.api_group}" {scope}')
    if reason:
        message = f"{message}: {reason}"
    if not attrs.resource_request:
        return ApiError(403, "Forbidden", f"forbidden: {message}", {})
    qualified = f"{attrs.resource}.{attrs.api_group}" if attrs.api_group else attrs.resource
    details: dict[str, Any] = {}
    if attrs.name:
        details["name"] = attrs.name
        message = f'{qualified} "{attrs.name}" is forbidden: {message}'
    else:
        message = f"{qualified} is forbidden: {message}"
    if attrs.api_group:
        details["group"] = attrs.api_group
    details["kind"] = attrs.resource
    return ApiError(403, "Forbidden", message, details)
