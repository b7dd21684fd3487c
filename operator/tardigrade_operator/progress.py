"""Read the trainer's progress report from rank 0 of the running attempt."""

from __future__ import annotations

import dataclasses

import aiohttp
from tardigrade_trainer import contract

from tardigrade_operator.observe import PodView

# A report is a handful of numbers; a rank that sends more is not read further.
MAX_REPORT_BYTES = 64 * 1024


@dataclasses.dataclass(frozen=True)
class Progress:
    report: contract.ProgressReport | None = None
    # Why rank 0's answer was ignored: it broke the contract (a step as a string...).
    malformed: str | None = None
    # Rank 0 refused the token (401): the job's Secret may hold other values now (keys.py).
    refused: bool = False


async def fetch_progress(
    session: aiohttp.ClientSession, gang: list[PodView], timeout: float,
    token: str | None = None,
) -> Progress:
    """No report when rank 0 has no address yet, is not serving, or answers nonsense.
    `token`: the job's progress token (contract.ENV_PROGRESS_TOKEN), sent as a bearer token."""
    leader = next((p for p in gang if p.rank == 0 and p.pod_ip and p.phase == "Running"), None)
    if leader is None:
        return Progress()
    url = f"http://{leader.pod_ip}:{contract.DEFAULT_PROGRESS_PORT}/progress"
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        async with session.get(url, headers=headers,
                               timeout=aiohttp.ClientTimeout(total=timeout)) as response:
            if response.status == 401:
                return Progress(refused=True)
            if response.status != 200:
                return Progress()
            body = await response.content.read(MAX_REPORT_BYTES + 1)
    except (TimeoutError, aiohttp.ClientError):
        return Progress()
    if len(body) > MAX_REPORT_BYTES:
        return Progress(malformed=f"rank 0 ({leader.name}): progress report is larger than "
                                  f"{MAX_REPORT_BYTES} bytes")
    text = body.decode("utf-8", errors="replace")
    try:
        return Progress(report=contract.ProgressReport.from_json(text))
    except contract.MalformedReport as err:
        return Progress(malformed=f"rank 0 ({leader.name}): {err}")
