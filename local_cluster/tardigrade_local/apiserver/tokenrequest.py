"""The TokenRequest API: `POST /api/v1/namespaces/{ns}/serviceaccounts/{name}/token`.

As upstream `pkg/registry/core/serviceaccount/storage/token.go` (`TokenREST.Create`): the
ServiceAccount must exist; `spec.expirationSeconds` defaults to 3600 and may not be under
600 (`pkg/apis/authentication/validation`); a `boundObjectRef` to a Pod must name an existing
pod (uid checked when given) and ties the token's life to it. A kubelet asks for 3607 s
(`WarnOnlyBoundTokenExpirationSeconds`); with `--service-account-extend-token-expiration`
(on by default) the server then signs a token valid for a year and still reports the
requested expiry, so old clients that never reread the file keep working.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from .authn import (
    DEFAULT_EXPIRATION_SECONDS,
    ISSUER,
    MIN_EXPIRATION_SECONDS,
    Authenticator,
)
from .errors import FieldCause, bad_request, cause_invalid, cause_not_supported, invalid, not_found
from .meta import now_rfc3339
from .store import Store

KUBELET_EXPIRATION_SECONDS = 3607
EXTENDED_EXPIRATION_SECONDS = 365 * 24 * 3600
_GROUP = "authentication.k8s.io"


def _spec_errors(spec: dict[str, Any]) -> list[FieldCause]:
    errors: list[FieldCause] = []
    seconds = spec.get("expirationSeconds", DEFAULT_EXPIRATION_SECONDS)
    if not isinstance(seconds, int) or seconds < MIN_EXPIRATION_SECONDS:
        errors.append(cause_invalid("spec.expirationSeconds", seconds,
                                    "may not specify a duration less than 10 minutes"))
    elif seconds > 1 << 32:
        errors.append(cause_invalid("spec.expirationSeconds", seconds,
                                    "may not specify a duration larger than 2^32 seconds"))
    ref = spec.get("boundObjectRef")
    if ref is not None and ref.get("kind") not in ("Pod", "Secret", "Node"):
        errors.append(cause_not_supported("spec.boundObjectRef.kind", ref.get("kind"),
                                          ["Pod", "Node", "Secret"]))
    return errors


def token_request(store: Store, authenticator: Authenticator, namespace: str, name: str,
                  body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise bad_request("the body of the request was not a TokenRequest")
    account = store.peek("/serviceaccounts", namespace, name)
    if account is None:
        raise not_found("serviceaccounts", "", name)
    spec = dict(body.get("spec") or {})
    errors = _spec_errors(spec)
    if errors:
        raise invalid("TokenRequest", _GROUP, name, errors)
    seconds = int(spec.get("expirationSeconds", DEFAULT_EXPIRATION_SECONDS))
    ref = spec.get("boundObjectRef")
    pod = None
    if ref is not None and ref.get("kind") == "Pod":
        pod = store.peek("/pods", namespace, ref.get("name", ""))
        if pod is None or (ref.get("uid") and ref["uid"] != pod["metadata"]["uid"]):
            raise not_found("pods", "", ref.get("name", ""))
    valid_for = (EXTENDED_EXPIRATION_SECONDS
                 if pod is not None and seconds == KUBELET_EXPIRATION_SECONDS else seconds)
    audiences = list(spec.get("audiences") or [ISSUER])
    token, _ = authenticator.issue(account, audiences, valid_for, pod)
    expires = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=seconds)
    spec.update(audiences=audiences, expirationSeconds=seconds)
    return {"kind": "TokenRequest", "apiVersion": f"{_GROUP}/v1",
            "metadata": {"name": name, "namespace": namespace,
                         "creationTimestamp": now_rfc3339()},
            "spec": spec,
            "status": {"token": token,
                       "expirationTimestamp": expires.strftime("%Y-%m-%dT%H:%M:%SZ")}}
