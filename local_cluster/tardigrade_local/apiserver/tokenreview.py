"""TokenReview: "is this token valid, and whose is it?" (`POST /apis/authentication.k8s.io/v1/
tokenreviews`).

As upstream `pkg/registry/authentication/tokenreview/storage.go` (`REST.Create`): the review is
answered, never stored; an empty `spec.token` is a 400 ("token is required for TokenReview in
authentication"); `spec.audiences` (default: the API server's own audience, the issuer)
replaces the authenticator's audiences, and `status.audiences` lists those the token is valid
for. A token that does not authenticate gives `status.authenticated: false`, not an error.
`status.user.extra` carries what `pkg/serviceaccount/claims.go` adds for a pod-bound token:
`authentication.kubernetes.io/pod-name`, `.../pod-uid` and `.../credential-id`. The caller
needs `create tokenreviews` (RBAC; upstream's `system:auth-delegator` role has it).
"""

from __future__ import annotations

from typing import Any

from .authn import ISSUER, Authenticator
from .errors import bad_request

_GROUP = "authentication.k8s.io"


def token_review(authenticator: Authenticator, body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise bad_request("the body of the request was not a TokenReview")
    spec = dict(body.get("spec") or {})
    token = spec.get("token")
    if not isinstance(token, str) or not token:
        raise bad_request("token is required for TokenReview in authentication")
    audiences = [str(a) for a in spec.get("audiences") or []] or [ISSUER]
    answer = authenticator.review(token, audiences)
    status: dict[str, Any] = {"user": {}}
    if answer is None:
        status.update(authenticated=False, error="[invalid bearer token, service account "
                      "token has been invalidated]")
    else:
        user, matched, extra = answer
        status.update(authenticated=True, audiences=matched, user={
            "username": user.name, "uid": user.uid, "groups": list(user.groups),
            "extra": extra})
    return {"kind": "TokenReview", "apiVersion": f"{_GROUP}/v1",
            "metadata": {"creationTimestamp": None}, "spec": spec, "status": status}
