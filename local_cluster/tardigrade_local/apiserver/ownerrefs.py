"""The OwnerReferencesPermissionEnforcement admission plugin (off upstream unless enabled).

As upstream `plugin/pkg/admission/gc/gc_admission.go` (`gcPermissionsEnforcement.Validate`):
on a create or update that changes an object's ownerReferences (pods/status excepted), the
user must be allowed to `delete` the object; and for every ownerReference that newly has
`blockOwnerDeletion: true`, to `update` the owner's `finalizers` subresource. Denials are
403s of `admission.NewForbidden`: `pods "x" is forbidden: cannot set blockOwnerDeletion if
an ownerReference refers to a resource you can't set finalizers on: <reason>, <nil>`.
OpenShift turns it on; kube-apiserver and GKE do not.
"""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

from .authn import UserInfo
from .errors import ApiError, qualified
from .requestinfo import RequestAttributes
from .resources import Registry, ResourceType

NAME = "OwnerReferencesPermissionEnforcement"
# The user of the request being served; None for the server's own writes (GC, bootstrap).
REQUEST_USER: ContextVar[UserInfo | None] = ContextVar("request_user", default=None)


def _refs(obj: dict[str, Any] | None) -> list[dict[str, Any]]:
    return list(((obj or {}).get("metadata") or {}).get("ownerReferences") or [])


def _new_blocking_refs(obj: dict[str, Any], old: dict[str, Any] | None) -> list[dict[str, Any]]:
    old_by_uid = {r.get("uid"): r for r in _refs(old)}
    out = []
    for ref in _refs(obj):
        if ref.get("blockOwnerDeletion") is not True:
            continue
        before = old_by_uid.get(ref.get("uid"))
        if before is None or before.get("blockOwnerDeletion") is not True:
            out.append(ref)
    return out


def _forbidden(rt: ResourceType, name: str, why: str) -> ApiError:
    subject = f'{qualified(rt.plural, rt.group)} "{name}"' if name else qualified(rt.plural,
                                                                                 rt.group)
    details: dict[str, Any] = {"name": name} if name else {}
    if rt.group:
        details["group"] = rt.group
    details["kind"] = rt.plural
    return ApiError(403, "Forbidden", f"{subject} is forbidden: {why}", details)


# (user, attributes, checked_by) -> (allowed, reason): the server's authorizer (access.py).
Authorize = Callable[[UserInfo, RequestAttributes, str], tuple[bool, str]]


class OwnerReferencesPermissionEnforcement:
    def __init__(self, registry: Registry, authorize: Authorize) -> None:
        self.registry = registry
        self.authorize = authorize

    def __call__(self, rt: ResourceType, obj: dict[str, Any], old: dict[str, Any] | None,
                 subresource: str | None) -> None:
        user = REQUEST_USER.get()
        if user is None or (rt.group == "" and rt.plural == "pods" and subresource == "status"):
            return
        if _refs(obj) == _refs(old):
            return
        meta = obj.get("metadata") or {}
        name, namespace = meta.get("name", ""), meta.get("namespace", "")
        delete = RequestAttributes(verb="delete", path="", resource_request=True,
                                   api_group=rt.group, api_version=rt.version,
                                   namespace=namespace, resource=rt.plural,
                                   subresource=subresource or "", name=name)
        allowed, reason = self.authorize(user, delete, NAME)
        if not allowed:
            raise _forbidden(rt, name, f"cannot set an ownerRef on a resource you can't delete: "
                                       f"{reason}, <nil>")
        for ref in _new_blocking_refs(obj, old):
            owner = self.registry.by_kind(str(ref.get("apiVersion", "")), str(ref.get("kind")))
            if owner is None:
                raise _forbidden(rt, name, (
                    f"cannot set blockOwnerDeletion in this case because cannot find "
                    f"RESTMapping for APIVersion {ref.get('apiVersion')} Kind {ref.get('kind')}"
                    f": , no matches for kind \"{ref.get('kind')}\" in version "
                    f"\"{ref.get('apiVersion')}\""))
            finalizers = RequestAttributes(verb="update", path="", resource_request=True,
                                           api_group=owner.group, api_version=owner.version,
                                           namespace=namespace,
                                           resource=owner.plural, subresource="finalizers",
                                           name=str(ref.get("name", "")))
            allowed, reason = self.authorize(user, finalizers, NAME)
            if not allowed:
                raise _forbidden(rt, name, (
                    f"cannot set blockOwnerDeletion if an ownerReference refers to a resource "
                    f"you can't set finalizers on: {reason}, <nil>"))
