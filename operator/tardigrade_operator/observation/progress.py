"""Read the trainer's progress report from rank 0 of the running attempt."""

from __future__ import annotations

import dataclasses

import aiohttp
from tardigrade_contract import contract

from tardigrade_operator.observation.pods import PodView
from tardigrade_operator.podhttp import read_at_most, redirect_reason

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
    session: aiohttp.ClientSession, gang: list[PodView], timeout: float, token: str | None = None
) -> Progress:
    """No report when rank 0 has no address yet, is not serving, or answers nonsense.

    `timeout` bounds the whole exchange (connect, headers and body): a rank that trickles its
    answer is cut off there. `token`: the job's progress token (contract.ENV_PROGRESS_TOKEN),
    sent as a bearer token; a trainer given one answers 401 without it."""
    leader = next((p for p in gang if p.rank == 0 and p.pod_ip and p.phase == "Running"), None)
    if leader is None:
        return Progress()
    url = f"http://{leader.pod_ip}:{contract.DEFAULT_PROGRESS_PORT}/progress"
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        # aiohttp's total deadline covers the body read inside the block as well.
        async with session.get(url, headers=headers, allow_redirects=False,
                               timeout=aiohttp.ClientTimeout(total=timeout)) as response:
            refused = redirect_reason(response) or _refusal(response.status, token)
            if refused:
                return Progress(malformed=f"rank 0 ({leader.name}): {refused}",
                                refused=response.status == 401)
            if response.status != 200:
                return Progress()
            body = await read_at_most(response, MAX_REPORT_BYTES + 1)
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


def _refusal(status: int, token: str | None) -> str | None:
    """A 401 is worth a Warning: the trainer and the operator disagree on the job's token, and
    no progress is read until they agree."""
    if status != 401:
        return None
    if token:
        return "answered 401: it refused the job's progress token"
    return "answered 401: it wants a progress token and the operator sent none"
