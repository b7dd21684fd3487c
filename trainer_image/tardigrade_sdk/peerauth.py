"""Who is knocking at the rendezvous: each rank's projected service-account token, reviewed.

Every rank's pod mounts a service-account token with the audience `tardigrade.dev/rendezvous`
(the operator renders the projected volume; the kubelet refreshes the file). A rank sends it
in its hello; rank 0 asks the API server about it (TokenReview, `create tokenreviews` for the
pod's ServiceAccount; the chart grants it) and admits the hello only if the token is valid
for that audience, belongs to a ServiceAccount of the job's namespace, and is bound to the pod
that holds that rank of this job (`<job>-a<attempt>-<rank>`; the attempt in the pod name may be
older than the gang's when healthy pods are kept). A token is bound to its pod: it stops being
valid once the pod is gone, and a pod of another job or namespace cannot get one that passes.

Standard library only (urllib, ssl, json; yaml for a kubeconfig), like the rest of the trainer
start-up path.
"""

from __future__ import annotations

import base64
import dataclasses
import http.client
import json
import os
import re
import ssl
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from tardigrade_contract import boundedjson
from tardigrade_contract.contract import RENDEZVOUS_AUDIENCE

IN_CLUSTER_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
POD_NAME_EXTRA = "authentication.kubernetes.io/pod-name"
REVIEW_SECONDS = 5.0
REVIEW_ATTEMPTS = 3
REVIEW_RETRY_SECONDS = 0.5
# 429s are retried this often, each after the Retry-After it names (capped).
THROTTLE_RETRIES = 10
MAX_RETRY_AFTER = 10.0
# A service-account JWT is 1-2 KB; a hello field longer than this is not one.
MAX_TOKEN_BYTES = 8192


class PeerAuthError(RuntimeError):
    """Peers cannot be authenticated as configured (no token mounted, no API access, or not
    allowed to review tokens): retrying the same way fails the same way."""


@dataclasses.dataclass(frozen=True)
class ApiAccess:
    server: str
    token: str
    ca_pem: str | None = None


def api_access(environ: Mapping[str, str] | None = None) -> ApiAccess:
    """This pod's own API credentials: in-cluster first, then KUBECONFIG (the local cluster's
    kubelet hands pods a kubeconfig instead of the fixed in-cluster mount)."""
    env = os.environ if environ is None else environ
    host, port = env.get("KUBERNETES_SERVICE_HOST"), env.get("KUBERNETES_SERVICE_PORT")
    token_file = IN_CLUSTER_DIR / "token"
    if host and port and token_file.exists():
        ca = IN_CLUSTER_DIR / "ca.crt"
        server = f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"
        return ApiAccess(server, token_file.read_text().strip(),
                         ca.read_text() if ca.exists() else None)
    kubeconfig = env.get("KUBECONFIG")
    if kubeconfig:
        return _from_kubeconfig(Path(kubeconfig.split(os.pathsep)[0]))
    raise PeerAuthError(
        "rank 0 has no API server credentials to review its peers' tokens with (neither "
        "in-cluster nor KUBECONFIG): mount the service-account token (automountService"
        "AccountToken), or for a trainer run outside a cluster set "
        "TARDIGRADE_RENDEZVOUS_INSECURE=true")


def _from_kubeconfig(path: Path) -> ApiAccess:
    import yaml

    config = yaml.safe_load(path.read_text()) or {}
    current = config.get("current-context")
    context = next((c["context"] for c in config.get("contexts") or []
                    if c.get("name") == current), {})
    cluster = next((c["cluster"] for c in config.get("clusters") or []
                    if c.get("name") == context.get("cluster")), {})
    user = next((u["user"] for u in config.get("users") or []
                 if u.get("name") == context.get("user")), {})
    ca_pem = None
    if cluster.get("certificate-authority-data"):
        ca_pem = base64.b64decode(cluster["certificate-authority-data"]).decode()
    elif cluster.get("certificate-authority"):
        ca_pem = Path(cluster["certificate-authority"]).read_text()
    token = user.get("token") or (Path(user["tokenFile"]).read_text().strip()
                                  if user.get("tokenFile") else "")
    if not cluster.get("server") or not token:
        raise PeerAuthError(f"kubeconfig {path} names no server or bearer token")
    return ApiAccess(cluster["server"], token, ca_pem)


Post = Callable[[str, bytes, Mapping[str, str]], tuple[int, bytes]]


def review(access: ApiAccess, token: str, audience: str = RENDEZVOUS_AUDIENCE,
           timeout: float = REVIEW_SECONDS, post: Post | None = None,
           attempts: int = REVIEW_ATTEMPTS) -> dict[str, Any]:
    """The API server's verdict on `token` (a TokenReview's status). `post`: how to send it
    (a KeptConnections' post); by default over a connection for this review alone.

    A review the API server did not answer in time, or answered 429 or 5xx, is asked again,
    `attempts` times in all: a refused hello costs the whole gang a relaunch, and a busy API
    server is the usual cause (it was, on a loaded two-core machine)."""
    path = "/apis/authentication.k8s.io/v1/tokenreviews"
    body = json.dumps({"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview",
                       "spec": {"token": token, "audiences": [audience]}}).encode()
    headers = {"Authorization": f"Bearer {access.token}", "Content-Type": "application/json",
               "Accept": "application/json"}
    send = post or KeptConnections(access, timeout).post
    failure = "no attempt"
    for attempt in range(1, max(1, attempts) + 1):
        if attempt > 1:
            time.sleep(REVIEW_RETRY_SECONDS)
        try:
            code, raw = send(path, body, headers)
        except (OSError, http.client.HTTPException) as err:
            failure = f"TokenReview failed: {err}"
            continue
        if code in (401, 403):
            raise PeerAuthError(
                f"the API server refused rank 0's TokenReview ({code}): the trainer's "
                "ServiceAccount needs `create tokenreviews` (chart value trainerTokenReview."
                "enabled grants it)")
        if code == 429 or code >= 500:
            failure = f"TokenReview failed: HTTP {code}"
            continue
        if code >= 300:
            return {"authenticated": False, "error": f"TokenReview failed: HTTP {code}"}
        try:
            data = boundedjson.loads(raw)
        except ValueError as err:
            return {"authenticated": False, "error": f"TokenReview failed: {err}"}
        return dict(data.get("status") or {}) if isinstance(data, dict) else {}
    # A passing outage: this hello is refused, the rank gives up with a retryable peer
    # timeout, and the next attempt tries again.
    return {"authenticated": False, "error": f"{failure} ({attempts} attempts)"}


def rejection(status: Mapping[str, Any], namespace: str, job: str, rank: int,
              audience: str = RENDEZVOUS_AUDIENCE) -> str | None:
    """Why a reviewed token may not hold `rank` of `job` (None: it may)."""
    if status.get("authenticated") is not True:
        return f"token not valid ({status.get('error') or 'not authenticated'})"
    # Each field's type is checked: an answer of another shape refuses the hello, it does not
    # raise in the review thread (which would end the rendezvous).
    audiences = status.get("audiences")
    if not isinstance(audiences, list) or audience not in audiences:
        return f"token not issued for audience {audience}"
    user = status.get("user")
    user = user if isinstance(user, dict) else {}
    username = str(user.get("username") or "")
    if not username.startswith(f"system:serviceaccount:{namespace}:"):
        return f"token of {username!r}, not of a ServiceAccount of namespace {namespace}"
    extra = user.get("extra")
    pods = extra.get(POD_NAME_EXTRA) if isinstance(extra, dict) else None
    pods = pods if isinstance(pods, list) else []
    expected = re.compile(rf"^{re.escape(job)}-a[0-9]+-{rank}$")
    if len(pods) != 1 or not expected.match(str(pods[0])):
        return (f"token bound to pod {pods[0] if pods else None!r}, not to the pod of rank "
                f"{rank} of job {job}")
    return None


class TokenReviewer:
    """Rank 0's check of a hello: `check(hello, rank)` is None or why it is refused. Safe to
    call from several threads (the rendezvous reviews hellos concurrently); each thread keeps
    one connection to the API server, so a review costs one round trip, not a TCP and TLS
    handshake as well: a gang of 1,024 ranks asks 1,023 reviews at every start."""

    def __init__(self, namespace: str, job: str, access: ApiAccess | None = None) -> None:
        self.namespace = namespace
        self.job = job
        self.access = access if access is not None else api_access()
        self._connections = KeptConnections(self.access)

    def check(self, hello: Mapping[str, Any], rank: int) -> str | None:
        token = hello.get("token")
        if not isinstance(token, str) or not token:
            return "no token in hello"
        if len(token) > MAX_TOKEN_BYTES:
            return "token too long"
        return rejection(review(self.access, token, post=self._connections.post),
                         self.namespace, self.job, rank)


class KeptConnections:
    """One kept-alive HTTP(S) connection to the API server per calling thread."""

    def __init__(self, access: ApiAccess, timeout: float = REVIEW_SECONDS) -> None:
        url = urllib.parse.urlsplit(access.server)
        self._https = url.scheme == "https"
        self._host, self._port = url.hostname or "", url.port
        self._context = ssl.create_default_context(cadata=access.ca_pem) if self._https \
            else None
        self._timeout = timeout
        self._local = threading.local()

    def post(self, path: str, body: bytes, headers: Mapping[str, str]) -> tuple[int, bytes]:
        """The answer's status and body. A kept connection the server has closed meanwhile
        is replaced once; errors of the fresh one are raised (OSError, HTTPException). A 429
        (API Priority and Fairness sheds load while a thousand ranks ask at once) is waited
        out for its Retry-After and sent again, up to THROTTLE_RETRIES times, as client-go
        does (rest/request.go, `checkWait`, `maxRetries` 10)."""
        for _ in range(THROTTLE_RETRIES):
            status, answer, wait = self._post_once(path, body, headers)
            if status != 429:
                return status, answer
            time.sleep(wait)
        return self._post_once(path, body, headers)[:2]

    def _post_once(self, path: str, body: bytes, headers: Mapping[str, str]
                   ) -> tuple[int, bytes, float]:
        for fresh in (False, True):
            connection = self._connection(fresh)
            try:
                connection.request("POST", path, body=body, headers=dict(headers))
                answer = connection.getresponse()
                return answer.status, answer.read(1 << 20), _retry_after(answer)
            except (OSError, http.client.HTTPException):
                connection.close()
                self._local.connection = None
                if fresh:
                    raise
        raise AssertionError("unreachable")

    def _connection(self, fresh: bool) -> http.client.HTTPConnection:
        kept = getattr(self._local, "connection", None)
        if kept is None or fresh:
            kept = (http.client.HTTPSConnection(self._host, self._port, timeout=self._timeout,
                                                context=self._context) if self._https
                    else http.client.HTTPConnection(self._host, self._port,
                                                    timeout=self._timeout))
            self._local.connection = kept
        return kept


def _retry_after(answer: http.client.HTTPResponse) -> float:
    """Seconds a 429 asks the client to wait (Retry-After in whole seconds)."""
    try:
        return min(max(0.0, float(answer.getheader("Retry-After") or 1)), MAX_RETRY_AFTER)
    except ValueError:
        return 1.0


def read_token(path: str) -> str:
    """The current token (the kubelet rewrites the file before it expires)."""
    return Path(path).read_text().strip()
