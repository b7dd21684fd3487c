"""The operator remembers which kept ranks did not take their restart request
(apply/restart_requests.py), for the next pass to recreate them (in_place.recreate_refused)."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web
from tardigrade_contract import contract
from tardigrade_operator.api.types import TrainingJobStatus
from tardigrade_operator.apply import restart_requests
from tardigrade_operator.decision.plan import Plan, Trigger
from tardigrade_operator.observation.job_memory import JobState

KEY = "the-job-s-restart-key"


@contextlib.asynccontextmanager
async def rank(status: int, seen: list[str] | None = None) -> AsyncIterator[str]:
    """A trainer's restart endpoint on a loopback address of its own, answering `status` to
    the job's key; each request's query goes to `seen`."""
    async def restart(request: web.Request) -> web.Response:
        if seen is not None:
            seen.append(request.query_string)
        if request.headers.get("Authorization") != f"Bearer {KEY}":
            return web.Response(status=401, text="wrong key")
        return web.Response(status=status, text={202: "", 200: "already"}.get(status, "no"))

    app = web.Application()
    app.router.add_post(contract.RESTART_IN_PLACE_PATH, restart)
    runner = web.AppRunner(app)
    await runner.setup()
    address = f"127.{random.randint(100, 250)}.{random.randint(0, 250)}.{random.randint(2, 250)}"
    await web.TCPSite(runner, address, contract.DEFAULT_PROGRESS_PORT).start()
    try:
        yield f"http://{address}:{contract.DEFAULT_PROGRESS_PORT}{contract.RESTART_IN_PLACE_PATH}"
    finally:
        await runner.cleanup()


async def test_kept_ranks_that_refuse_their_request_are_remembered_for_the_next_pass():
    async with rank(202) as taker, rank(200) as restarted, rank(401) as refuser, \
            rank(401) as leaver, aiohttp.ClientSession() as session:
        plan = Plan(status=TrainingJobStatus(attempt=2), restart_in_place=[
            Trigger("j-a1-0", taker, world='{"attempt": 2}'),
            # Runs attempt 2 already: it took an earlier try whose answer was lost.
            Trigger("j-a1-3", restarted, world='{"attempt": 2}'),
            Trigger("j-a1-2", refuser, world='{"attempt": 2}'),
            # A rank that goes gets no world: its refusal needs no follow-up.
            Trigger("j-a1-1", leaver)])
        state = JobState()
        ask = restart_requests.sender(session, plan, state.in_place, state.wake, KEY)
        assert ask is not None
        await asyncio.to_thread(ask)  # as the writer calls it, from its thread
    assert state.in_place.refused_in(2) == {"j-a1-2"}
    assert state.wake.is_set()  # the next pass comes at once


async def test_nothing_is_remembered_when_every_kept_rank_takes_its_request():
    async with rank(202) as taker, aiohttp.ClientSession() as session:
        plan = Plan(status=TrainingJobStatus(attempt=2), restart_in_place=[
            Trigger("j-a1-0", taker, world='{"attempt": 2}')])
        state = JobState()
        ask = restart_requests.sender(session, plan, state.in_place, state.wake, KEY)
        assert ask is not None
        await asyncio.to_thread(ask)
    assert state.in_place.refused_in(2) == frozenset() and not state.wake.is_set()


async def test_without_the_job_s_key_no_request_is_sent_and_the_kept_ranks_count_as_refused():
    """The job's Secret is missing or someone else's: nothing to send, and the next pass
    recreates the kept ranks rather than wait for them."""
    asked: list[str] = []
    async with rank(202, asked) as taker, aiohttp.ClientSession() as session:
        plan = Plan(status=TrainingJobStatus(attempt=2), restart_in_place=[
            Trigger("j-a1-2", taker, world='{"attempt": 2}')])
        state = JobState()
        ask = restart_requests.sender(session, plan, state.in_place, state.wake, None)
        assert ask is not None
        await asyncio.to_thread(ask)
    assert asked == []
    assert state.in_place.refused_in(2) == {"j-a1-2"} and state.wake.is_set()
