"""Waiting for CustomResourceDefinitions to be served, shared by our CRDs and Kueue's."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable

import aiohttp


class NotEstablished(Exception):
    """A CRD was not Established in time; the message carries its last conditions."""


async def wait_established(session: aiohttp.ClientSession, crd_base: str, names: Iterable[str],
                           timeout: float) -> None:
    """Until every named CRD has condition Established=True (its kind is served from then)."""
    deadline = time.monotonic() + timeout
    for name in names:
        while True:
            async with session.get(f"{crd_base}/{name}") as resp:
                conditions = ((await resp.json()).get("status") or {}).get("conditions") or []
            if any(c.get("type") == "Established" and c.get("status") == "True"
                   for c in conditions):
                break
            if time.monotonic() > deadline:
                raise NotEstablished(f"CRD {name} not Established: {conditions}")
            await asyncio.sleep(0.05)
