"""Checking a request's `Authorization: Bearer <secret>` header against a secret the pod holds."""

from __future__ import annotations

import hmac


def matches(authorization: str | None, secret: str) -> bool:
    """True when the header carries exactly `secret`, compared in constant time (a caller
    that times the answers learns nothing of the secret)."""
    scheme, _, given = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(
        given.strip().encode("utf-8", "surrogateescape"), secret.encode())
