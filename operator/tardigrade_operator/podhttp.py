"""The operator's HTTP client for pods (progress polls, restart-in-place requests).

Whatever a pod answers is the tenant's to write, and the operator reaches pods that the
tenant cannot (its NetworkPolicy lets the operator in): so the client follows no redirect
(every request passes `allow_redirects=False`; see `redirect_reason`), keeps no cookie one
pod could set for another, reads no proxy from the environment, and asks for and decodes no
compressed body (a bounded read of a compressed body would bound nothing).
"""

from __future__ import annotations

import aiohttp

# Every request sets its own deadline for the whole exchange; this one only catches a request
# that forgot to.
BACKSTOP_SECONDS = 30.0


def pod_session() -> aiohttp.ClientSession:
    """The session the operator talks to pods with (made inside the running event loop)."""
    return aiohttp.ClientSession(
        cookie_jar=aiohttp.DummyCookieJar(),
        trust_env=False,
        auto_decompress=False,
        headers={"Accept-Encoding": "identity"},
        timeout=aiohttp.ClientTimeout(total=BACKSTOP_SECONDS),
    )


def redirect_reason(response: aiohttp.ClientResponse) -> str | None:
    """Why a 3xx answer is not taken: a rank that redirects would have the operator fetch,
    with its credentials, whatever the rank names (another job's endpoint its NetworkPolicy
    lets the operator reach). None for any other status."""
    if not 300 <= response.status < 400:
        return None
    target = (response.headers.get("Location") or "")[:200]
    return f"answered {response.status} redirect to {target!r}; not followed"


async def read_at_most(response: aiohttp.ClientResponse, limit: int) -> bytes:
    """The body up to its end or `limit` bytes, whichever comes first. (`content.read(n)`
    alone returns whatever has arrived: a body split across packets would read as cut
    short.) The request's deadline bounds how long this waits for a rank that trickles."""
    body = b""
    while len(body) < limit:
        chunk = await response.content.read(limit - len(body))
        if not chunk:
            break
        body += chunk
    return body
