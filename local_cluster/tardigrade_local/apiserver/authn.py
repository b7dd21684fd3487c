"""Who sent a request: bearer tokens to users, as kube-apiserver's authenticators do.

- The admin token (a static token, as upstream's `--token-auth-file`) is user `admin` in
  group `system:masters`, which upstream authorizes before any other authorizer.
- Service-account tokens are JWTs the server issues through the TokenRequest API
  (`POST /api/v1/namespaces/{ns}/serviceaccounts/{name}/token`, what a kubelet asks for a
  pod's projected token). Upstream signs them with its `--service-account-signing-key-file`
  (RS256/ES256) and checks them in `pkg/serviceaccount/jwt.go` (`Validate`) and
  `pkg/serviceaccount/claims.go` (audience, expiry, and that the ServiceAccount and the
  bound pod still exist with the same uid). Here the key is an HMAC key (HS256): only this
  server verifies them, so no public key needs publishing. The user is
  `system:serviceaccount:<ns>:<name>`, groups `system:serviceaccounts`,
  `system:serviceaccounts:<ns>`, `system:authenticated`.
- No token: `system:anonymous` in `system:unauthenticated` (anonymous auth is on by
  default upstream); authorization then decides.
- A token nobody recognises: 401 with the Status body `Unauthorized`.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from .errors import ApiError
from .meta import parse_time
from .store import Store

SUPERUSER_GROUP = "system:masters"
AUTHENTICATED = "system:authenticated"
ANONYMOUS_USER = "system:anonymous"
UNAUTHENTICATED = "system:unauthenticated"
SA_PREFIX = "system:serviceaccount:"
SA_GROUP = "system:serviceaccounts"
# kubeadm's default `--service-account-issuer`; the API audiences default to the issuer.
ISSUER = "https://kubernetes.default.svc.cluster.local"
# TokenRequest's default and minimum expirationSeconds (pkg/apis/authentication/validation).
DEFAULT_EXPIRATION_SECONDS = 3600
MIN_EXPIRATION_SECONDS = 600
_SA_KEY = "/serviceaccounts"
_POD_KEY = "/pods"


@dataclass(frozen=True)
class UserInfo:
    name: str
    groups: tuple[str, ...] = ()
    uid: str = ""


ANONYMOUS = UserInfo(ANONYMOUS_USER, (UNAUTHENTICATED,))
ADMIN = UserInfo("admin", (SUPERUSER_GROUP, AUTHENTICATED))


def unauthorized() -> ApiError:
    # What kube-apiserver answers (`responsewriters.Unauthorized`) for a bad credential.
    return ApiError(401, "Unauthorized", "Unauthorized")


def service_account_user(namespace: str, name: str, uid: str = "") -> UserInfo:
    return UserInfo(f"{SA_PREFIX}{namespace}:{name}",
                    (SA_GROUP, f"{SA_GROUP}:{namespace}", AUTHENTICATED), uid)


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


@dataclass
class Keys:
    """The server's secrets: the admin token and the service-account signing key."""

    admin_token: str = field(default_factory=lambda: secrets.token_urlsafe(32))
    signing_key: str = field(default_factory=lambda: secrets.token_urlsafe(32))

    def as_json(self) -> dict[str, str]:
        return {"adminToken": self.admin_token, "signingKey": self.signing_key}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Keys:
        return cls(str(data["adminToken"]), str(data["signingKey"]))


class Authenticator:
    def __init__(self, store: Store, keys: Keys) -> None:
        self.store = store
        self.keys = keys

    # ---- issuing ----------------------------------------------------------------------------
    def _sign(self, signing_input: str) -> str:
        digest = hmac.new(self.keys.signing_key.encode(), signing_input.encode(),
                          hashlib.sha256).digest()
        return _b64(digest)

    def issue(self, account: dict[str, Any], audiences: list[str], expiration_seconds: int,
              pod: dict[str, Any] | None = None) -> tuple[str, int]:
        """A signed token for `account` (optionally bound to `pod`); returns (token, exp)."""
        meta = account["metadata"]
        now = int(time.time())
        exp = now + expiration_seconds
        private: dict[str, Any] = {
            "namespace": meta["namespace"],
            "serviceaccount": {"name": meta["name"], "uid": meta.get("uid", "")},
        }
        if pod is not None:
            private["pod"] = {"name": pod["metadata"]["name"], "uid": pod["metadata"]["uid"]}
        claims = {"aud": audiences or [ISSUER], "exp": exp, "iat": now, "nbf": now,
                  "iss": ISSUER, "sub": f"{SA_PREFIX}{meta['namespace']}:{meta['name']}",
                  "jti": secrets.token_hex(8), "kubernetes.io": private}
        header = {"alg": "HS256", "typ": "JWT"}
        signing_input = (_b64(json.dumps(header, separators=(",", ":")).encode()) + "." +
                         _b64(json.dumps(claims, separators=(",", ":")).encode()))
        return f"{signing_input}.{self._sign(signing_input)}", exp

    # ---- checking ---------------------------------------------------------------------------
    def authenticate(self, authorization: str | None) -> UserInfo:
        if not authorization:
            return ANONYMOUS
        scheme, _, token = authorization.partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise unauthorized()
        if hmac.compare_digest(token, self.keys.admin_token):
            return ADMIN
        user = self._service_account(token)
        if user is None:
            raise unauthorized()
        return user

    def _claims(self, token: str) -> dict[str, Any] | None:
        pieces = token.split(".")
        if len(pieces) != 3:
            return None
        signing_input = f"{pieces[0]}.{pieces[1]}"
        if not hmac.compare_digest(self._sign(signing_input), pieces[2]):
            return None
        try:
            claims = json.loads(_unb64(pieces[1]))
        except ValueError:
            return None
        return claims if isinstance(claims, dict) else None

    def review(self, token: str, audiences: list[str]) -> tuple[UserInfo, list[str],
                                                               dict[str, list[str]]] | None:
        """A TokenReview's answer: the user, the requested audiences the token is for, and
        the user's extra (`pkg/serviceaccount/claims.go`: the bound pod's name and uid, and
        the token's id); None when the token is not valid for any of `audiences`."""
        claims = self._claims(token)
        user = self._service_account(token, tuple(audiences), claims)
        if user is None or claims is None:
            return None
        token_audiences = claims.get("aud") or []
        if not isinstance(token_audiences, list):
            token_audiences = [token_audiences]
        matched = [a for a in audiences if a in token_audiences]
        extra: dict[str, list[str]] = {
            "authentication.kubernetes.io/credential-id": [f"JTI={claims.get('jti', '')}"]}
        pod = (claims.get("kubernetes.io") or {}).get("pod")
        if pod is not None:
            extra["authentication.kubernetes.io/pod-name"] = [str(pod.get("name", ""))]
            extra["authentication.kubernetes.io/pod-uid"] = [str(pod.get("uid", ""))]
        return user, matched, extra

    def _service_account(self, token: str, audiences: tuple[str, ...] = (ISSUER,),
                         claims: dict[str, Any] | None = None) -> UserInfo | None:
        claims = self._claims(token) if claims is None else claims
        if claims is None or claims.get("iss") != ISSUER:
            return None
        token_audiences = claims.get("aud") or []
        if not isinstance(token_audiences, list):
            token_audiences = [token_audiences]
        # The token must be meant for one of the audiences asked about (jwt.go: the
        # authenticator's audiences, which a TokenReview's spec.audiences replace).
        if not set(audiences) & set(token_audiences):
            return None
        if int(claims.get("exp") or 0) <= time.time():
            return None
        private = claims.get("kubernetes.io") or {}
        namespace = private.get("namespace", "")
        sa_ref = private.get("serviceaccount") or {}
        account = self.store.peek(_SA_KEY, namespace, sa_ref.get("name", ""))
        # claims.go: the ServiceAccount must still exist, with the uid the token was made for.
        if account is None or account["metadata"].get("uid") != sa_ref.get("uid"):
            return None
        pod_ref = private.get("pod")
        if pod_ref is not None:
            pod = self.store.peek(_POD_KEY, namespace, pod_ref.get("name", ""))
            if pod is None or pod["metadata"].get("uid") != pod_ref.get("uid"):
                return None
            # A terminating pod keeps its token through its grace period, plus 60 s.
            deleted = pod["metadata"].get("deletionTimestamp")
            deleted_at = parse_time(deleted) if deleted else None
            if deleted_at is not None and deleted_at.timestamp() < time.time() - 60:
                return None
        return service_account_user(namespace, sa_ref["name"], account["metadata"]["uid"])
