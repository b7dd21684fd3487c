"""Read the trainer's progress report from rank 0 of the running attempt."""

from __future__ import annotations

import json

import aiohttp
from tardigrade_trainer import contract

from tardigrade_operator.observe import PodView


async def fetch_progress(
    session: aiohttp.ClientSession, gang: list[PodView], timeout: float
) -> contract.ProgressReport | None:
    """None when rank 0 has no address yet, is not serving, or answers nonsense."""
    leader = next((p for p in gang if p.rank == 0 and p.pod_ip and p.phase == "Running"), None)
    if leader is None:
        return None
    url = f"http://{leader.pod_ip}:{contract.DEFAULT_PROGRESS_PORT}/progress"
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout)) as response:
            if response.status != 200:
                return None
            return contract.ProgressReport.from_json(await response.text())
    except (TimeoutError, aiohttp.ClientError, json.JSONDecodeError, TypeError, ValueError):
        return None
