"""The act step of restart in place: ask each kept rank to save and restart.

Sent right after the status write and the deletes (kube.py): the request's body is the
rank's new world, which its trainer keeps for its restarted container; the kept pod's label
and annotation are patched only once the gang runs again (in_place.late_labels). The
request carries the job's restart key (contract.ENV_RESTART_KEY), from the job's Secret
(keys.py): only the operator, the job's pods and whoever may read Secrets in the job's
namespace know it; a peer that may only read pods, or one in another namespace, cannot make a
gang restart.
"""

from __future__ import annotations

import asyncio
import errno
import logging
from collections.abc import Callable

import aiohttp

from tardigrade_operator.decision.plan import Plan, Trigger
from tardigrade_operator.decision.recovery.in_place import InPlaceMemory, refused
from tardigrade_operator.podhttp import read_at_most, redirect_reason

ATTEMPTS = 3
RETRY_SECONDS = 0.5
# A trainer answers at once, but a rank's host may be busy saving: more than a progress poll.
# It bounds each try's whole exchange (connect, headers, body).
REQUEST_SECONDS = 5.0
# A refusal's text is kept for the log only.
REFUSAL_BYTES = 200


async def request_restart(session: aiohttp.ClientSession, trigger: Trigger, key: str,
                          timeout: float = REQUEST_SECONDS) -> bool:
    """True once the rank accepted (202), or already runs the attempt (200: a retry whose
    first try it took); a refusal or silence is logged. A kept rank that
    missed it is recreated by the next pass (in_place.recreate_refused); its old
    trainer still saves with the gang and leaves on its pod's SIGTERM."""
    headers = {"Authorization": f"Bearer {key}"}
    world = trigger.world.encode() if trigger.world is not None else None
    if world is not None:
        headers["Content-Type"] = "application/json"
    tries: list[str] = []  # what each try met, for the log
    unanswered = False  # a try may have reached the rank, its answer lost
    for attempt in range(ATTEMPTS):
        if attempt:
            await asyncio.sleep(RETRY_SECONDS)
        try:
            async with session.post(trigger.url, headers=headers, data=world,
                                    allow_redirects=False,
                                    timeout=aiohttp.ClientTimeout(total=timeout)) as answer:
                if answer.status in (200, 202):
                    return True
                redirected = redirect_reason(answer)
                if redirected:
                    # Not taken: only the rank itself can take its request.
                    tries.append(redirected)
                    break
                said = (await read_at_most(answer, REFUSAL_BYTES)).decode(errors="replace")
                tries.append(f"HTTP {answer.status} {said}".strip())
                if answer.status in (400, 401, 404, 413):
                    break  # wrong key, or restart in place off in that pod: no retry helps
        except (TimeoutError, aiohttp.ClientError) as err:
            if unanswered and _gone(err):
                # A kept rank's trainer stops serving only when it exits, which it does once
                # it has taken a request (or its wait ran out, tens of seconds after its save):
                # the try that went unanswered got through. Taking this as a refusal recreated
                # ranks that had restarted in place, and the gang formed with two pods for
                # each (1,024 simulated ranks on a loaded host, docs/benchmarks/recovery.md).
                logging.getLogger(__name__).info(
                    "restart in place: %s took the request (its answer was lost; it has left "
                    "to restart)", trigger.pod)
                return True
            unanswered = unanswered or isinstance(err, _UNANSWERED)
            tries.append(f"{type(err).__name__}: {err}".rstrip(": "))
    logging.getLogger(__name__).warning("restart in place: %s did not take the request: %s",
                                        trigger.pod, "; then ".join(tries))
    return False


# A try that failed after it may have been delivered: no answer in time, or the connection
# closed under it.
_UNANSWERED = (TimeoutError, aiohttp.ServerDisconnectedError)


def _gone(err: BaseException) -> bool:
    """The rank's endpoint is gone (its trainer exited): nothing listens there any more, or
    the connection was dropped unanswered (closed, or reset)."""
    if isinstance(err, aiohttp.ServerDisconnectedError):
        return True
    if isinstance(err, aiohttp.ClientConnectorError):
        return getattr(err.os_error, "errno", None) == errno.ECONNREFUSED
    return isinstance(err, aiohttp.ClientOSError) and err.errno == errno.ECONNRESET


def sender(session: aiohttp.ClientSession, plan: Plan, memory: InPlaceMemory,
           wake: asyncio.Event, key: str | None) -> Callable[[], None] | None:
    """The plan's restart requests, all at once, with the job's restart key `key` (None: the
    job's Secret is missing or not the job's, so none can be taken), for the writer to send
    from its thread between its deletes and its creates (kube.py: the requests carry the
    worlds). None when the plan has none.
    The kept ranks that did not take theirs are remembered in `memory`, and `wake` set: the
    next pass, at once, recreates them, or asks rank 0 again (in_place.recreate_refused,
    ask_again)."""
    if not plan.restart_in_place:
        return None
    loop = asyncio.get_running_loop()
    triggers = plan.restart_in_place
    attempt = plan.status.attempt

    async def ask() -> None:
        accepted = (await asyncio.gather(*(request_restart(session, trigger, key)
                                           for trigger in triggers))
                    if key is not None else [False] * len(triggers))
        asked = frozenset(t.pod for t in triggers if t.world is not None)
        if memory.answered(attempt, asked, refused(triggers, accepted)):
            wake.set()

    return lambda: asyncio.run_coroutine_threadsafe(ask(), loop).result()
