"""SelfSubjectAccessReview: "may I?" (what `kubectl auth can-i` asks).

As upstream `pkg/registry/authorization/selfsubjectaccessreview/rest.go`: the review is
answered, never stored; exactly one of `spec.resourceAttributes` and
`spec.nonResourceAttributes`; the requesting user is checked with the server's authorizer
(`authorizationutil.ResourceAttributesFrom` / `NonResourceAttributesFrom`); `status.allowed`
and `status.reason` come from it.
"""

from __future__ import annotations

from typing import Any

from .access import Access
from .errors import FieldCause, bad_request, invalid
from .ownerrefs import REQUEST_USER
from .requestinfo import RequestAttributes

_GROUP = "authorization.k8s.io"
_ONE_OF = "exactly one of nonResourceAttributes or resourceAttributes must be specified"


def self_subject_access_review(access: Access, body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise bad_request("the body of the request was not a SelfSubjectAccessReview")
    spec = body.get("spec") or {}
    resource = spec.get("resourceAttributes")
    non_resource = spec.get("nonResourceAttributes")
    if (resource is None) == (non_resource is None):
        raise invalid("SelfSubjectAccessReview", _GROUP, "", [FieldCause(
            "spec.resourceAttributes", "FieldValueInvalid",
            f"Invalid value: \"null\": {_ONE_OF}")])
    if resource is not None:
        attrs = RequestAttributes(
            verb=resource.get("verb", ""), path="", resource_request=True,
            api_group=resource.get("group", ""), api_version=resource.get("version", ""),
            namespace=resource.get("namespace", ""), resource=resource.get("resource", ""),
            subresource=resource.get("subresource", ""), name=resource.get("name", ""))
    else:
        attrs = RequestAttributes(verb=non_resource.get("verb", ""),
                                  path=non_resource.get("path", ""), resource_request=False)
    user = REQUEST_USER.get()
    allowed, reason = (True, "") if user is None or access.rbac is None else \
        access.rbac.authorize(user, attrs)
    status: dict[str, Any] = {"allowed": allowed}
    if reason:
        status["reason"] = reason
    return {"kind": "SelfSubjectAccessReview", "apiVersion": f"{_GROUP}/v1",
            "metadata": {"creationTimestamp": None}, "spec": spec, "status": status}
