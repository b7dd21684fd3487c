"""The gate every request passes before it is served: authenticate, authorize, audit.

As kube-apiserver's handler chain (`DefaultBuildHandlerChain` in staging/src/k8s.io/apiserver/
pkg/server/config.go): `WithAuthentication` (a bad credential is 401), then
`WithAuthorization` (a denial is 403). The authorization mode is upstream's flag
`--authorization-mode`: `AlwaysAllow` (kube-apiserver's default, what a bare server here uses)
or `RBAC` (what the local cluster runs, like kubeadm's `Node,RBAC`; the kubelets and
controllers here use the admin credential, so the Node authorizer has nothing to add).

A server with a TLS port authenticates and authorizes only there; its plain-HTTP port is then
what kube-apiserver's `--insecure-port` was up to 1.19 (`InsecureSuperuser` in
staging/src/k8s.io/apiserver/pkg/server/options/deprecated_insecure_serving.go): every
request is user `system:unsecured` in `system:masters`. kubectl and helm send no bearer token
over plain HTTP at all (client-go's clientcmd applies a kubeconfig's credentials only when
`restclient.IsConfigTransportTLS`), so the local cluster gives users, its kubelets and its
controllers that port, and pods the TLS port.

With an audit log, every decision is written as one JSON line shaped like an
`audit.k8s.io/v1` Event at level Metadata (user, verb, objectRef, the annotations
`authorization.k8s.io/decision` and `authorization.k8s.io/reason`), which tests read to find
which calls a component made and whether any was denied. Its policy leaves out requests of
`system:masters` (an audit Policy rule `level: None` for that group): the kubelets and
controllers make most requests, and they are always allowed.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import IO, Any

from aiohttp import web

from .authn import AUTHENTICATED, SUPERUSER_GROUP, Authenticator, UserInfo
from .meta import micro_now
from .ownerrefs import REQUEST_USER
from .rbac import RBACAuthorizer, forbidden
from .requestinfo import RequestAttributes, request_attributes

MODES = ("AlwaysAllow", "RBAC")
# Set on the plain-HTTP app of a server that also has a TLS port.
UNSECURED = web.AppKey("unsecured", bool)
INSECURE_SUPERUSER = UserInfo("system:unsecured", (SUPERUSER_GROUP, AUTHENTICATED))


class AuditLog:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] = path.open("a", buffering=1)

    def record(self, user: UserInfo, attrs: RequestAttributes, allowed: bool,
               reason: str, checked_by: str = "") -> None:
        if SUPERUSER_GROUP in user.groups:
            return
        event: dict[str, Any] = {
            "kind": "Event", "apiVersion": "audit.k8s.io/v1", "level": "Metadata",
            "auditID": str(uuid.uuid4()), "stage": "RequestReceived",
            "requestURI": attrs.path, "verb": attrs.verb,
            "user": {"username": user.name, "groups": list(user.groups)},
            "requestReceivedTimestamp": micro_now(),
            "annotations": {"authorization.k8s.io/decision": "allow" if allowed else "forbid",
                            "authorization.k8s.io/reason": reason},
        }
        if attrs.resource_request:
            ref = {"resource": attrs.resource, "namespace": attrs.namespace,
                   "name": attrs.name, "apiGroup": attrs.api_group,
                   "apiVersion": attrs.api_version, "subresource": attrs.subresource}
            event["objectRef"] = {k: v for k, v in ref.items() if v}
        if checked_by:
            # A check an admission plugin made, not the request's own authorization.
            event["annotations"]["tardigrade.dev/checked-by"] = checked_by
        self._file.write(json.dumps(event, separators=(",", ":")) + "\n")

    def close(self) -> None:
        self._file.close()


class Access:
    def __init__(self, authenticator: Authenticator, mode: str = "AlwaysAllow",
                 audit: AuditLog | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"authorization mode {mode!r} is not one of {', '.join(MODES)}")
        self.authenticator = authenticator
        self.mode = mode
        self.rbac = RBACAuthorizer(authenticator.store) if mode == "RBAC" else None
        self.audit = audit

    def admit(self, request: web.Request) -> UserInfo:
        """The request's user; raises the 401 or 403 the real server would answer."""
        if request.app.get(UNSECURED):
            REQUEST_USER.set(INSECURE_SUPERUSER)
            return INSECURE_SUPERUSER
        user = self.authenticator.authenticate(request.headers.get("Authorization"))
        # Admission plugins that authorize (ownerrefs.py) read it; each request is a task.
        REQUEST_USER.set(user)
        attrs = request_attributes(request.method, request.path, request.query)
        allowed, reason = self.authorize(user, attrs)
        if not allowed:
            raise forbidden(user, attrs, reason)
        return user

    def authorize(self, user: UserInfo, attrs: RequestAttributes,
                  checked_by: str = "") -> tuple[bool, str]:
        """(allowed, reason) under the server's mode, recorded in the audit log."""
        allowed, reason = (True, "") if self.rbac is None else self.rbac.authorize(user, attrs)
        if self.audit is not None:
            self.audit.record(user, attrs, allowed, reason, checked_by)
        return allowed, reason
