"""Request attributes for authorization: verb, API group, resource, subresource, namespace, name.

Follows upstream `RequestInfoFactory.NewRequestInfo`
(staging/src/k8s.io/apiserver/pkg/endpoints/request/requestinfo.go): paths shorter than
`/api/{version}/{resource}` or `/apis/{group}/{version}/{resource}` (discovery, /version,
/healthz, /openapi) are non-resource requests whose verb is the lower-cased HTTP method; the
legacy `/watch/` prefix makes the verb `watch`; a GET without a name is `list`, or `watch`
with `?watch=true`; a DELETE without a name is `deletecollection`; `/namespaces/{ns}/status`
and `/namespaces/{ns}/finalize` are subresources of the namespace itself; a list or watch
with the field selector `metadata.name=x` names `x` (so `resourceNames` rules apply to it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

_API_PREFIXES = ("api", "apis")
_METHOD_VERBS = {"POST": "create", "GET": "get", "HEAD": "get", "PUT": "update",
                 "PATCH": "patch", "DELETE": "delete"}
_NAMESPACE_SUBRESOURCES = ("status", "finalize")


@dataclass(frozen=True)
class RequestAttributes:
    verb: str
    path: str
    resource_request: bool
    api_group: str = ""
    api_version: str = ""
    namespace: str = ""
    resource: str = ""
    subresource: str = ""
    name: str = ""

    @property
    def combined_resource(self) -> str:
        """`pods` or `pods/status`: what an RBAC rule's `resources` entry is compared with."""
        return f"{self.resource}/{self.subresource}" if self.subresource else self.resource


def _name_from_field_selector(selector: str | None) -> str:
    """The name a `metadata.name=x` (or `==`) term requires; "" if the selector names none."""
    for term in (selector or "").split(","):
        key, sep, value = term.replace("==", "=").partition("=")
        if sep and key.strip() == "metadata.name" and not key.endswith("!"):
            return value.strip()
    return ""


def request_attributes(method: str, path: str, query: Mapping[str, str]) -> RequestAttributes:
    parts = [p for p in path.split("/") if p]
    non_resource = RequestAttributes(verb=method.lower(), path=path, resource_request=False)
    if len(parts) < 3 or parts[0] not in _API_PREFIXES:
        return non_resource
    rest = parts[1:]
    group = ""
    if parts[0] == "apis":
        if len(rest) < 3:
            return non_resource
        group, rest = rest[0], rest[1:]
    version, rest = rest[0], rest[1:]
    verb = _METHOD_VERBS.get(method.upper(), method.lower())
    if rest and rest[0] == "watch":
        verb, rest = "watch", rest[1:]
    namespace = ""
    if rest and rest[0] == "namespaces" and len(rest) > 1:
        namespace = rest[1]
        if len(rest) > 2 and rest[2] not in _NAMESPACE_SUBRESOURCES:
            rest = rest[2:]
    resource = rest[0] if rest else ""
    name = rest[1] if len(rest) > 1 else ""
    subresource = rest[2] if len(rest) > 2 else ""
    if not name and verb == "get":
        verb = "watch" if query.get("watch") in ("true", "1") else "list"
    if not name and verb in ("list", "watch"):
        name = _name_from_field_selector(query.get("fieldSelector"))
    if not name and verb == "delete":
        verb = "deletecollection"
    return RequestAttributes(verb=verb, path=path, resource_request=True, api_group=group,
                             api_version=version, namespace=namespace, resource=resource,
                             subresource=subresource, name=name)
