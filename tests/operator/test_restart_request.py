"""The operator's restart request to a kept rank (apply/restart_requests.py): what counts as
taken."""

from __future__ import annotations

import asyncio
import socket

import aiohttp
from aiohttp import web
from tardigrade_operator.apply.restart_requests import request_restart
from tardigrade_operator.decision.plan import Trigger

PATH = "/restart-in-place"


async def _serve(handler) -> tuple[web.AppRunner, web.TCPSite, int]:
    app = web.Application()
    app.router.add_post(PATH, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, site, port


def _trigger(port: int) -> Trigger:
    return Trigger(pod="job-a1-3", url=f"http://127.0.0.1:{port}{PATH}?attempt=2",
                   world='{"attempt": 2}')


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed on leaving: nothing listens there


async def _ask(handler, answer_lost: asyncio.Event | None = None,
               sites: list[web.TCPSite] | None = None) -> bool:
    """request_restart against `handler`, serving on a port of its own."""
    runner, site, port = await _serve(handler)
    if sites is not None:
        sites.append(site)
    try:
        async with aiohttp.ClientSession() as session:
            return await request_restart(session, _trigger(port), "k", timeout=0.5)
    finally:
        if answer_lost is not None:
            answer_lost.set()
        await runner.cleanup()


async def test_a_rank_that_took_the_request_and_left_before_answering_counts_as_taken():
    taken: list[str] = []
    sites: list[web.TCPSite] = []
    answer_lost = asyncio.Event()

    async def restart(request: web.Request) -> web.StreamResponse:
        taken.append(await request.text())
        await sites[0].stop()  # the trainer exits to restart: its endpoint closes
        await answer_lost.wait()  # and its answer never comes
        return web.Response(status=202)

    assert await _ask(restart, answer_lost, sites)
    assert taken == ['{"attempt": 2}']  # taken once: the retry found the endpoint gone


async def test_a_rank_that_dropped_the_retry_after_a_lost_answer_counts_as_taken():
    tries = 0
    answer_lost = asyncio.Event()

    async def restart(request: web.Request) -> web.StreamResponse:
        nonlocal tries
        tries += 1
        if tries == 1:
            await answer_lost.wait()  # taken, the answer never comes
        assert request.transport is not None
        request.transport.abort()  # the trainer has left since
        raise web.HTTPNotFound()

    assert await _ask(restart, answer_lost)
    assert tries == 2


async def test_a_rank_not_listening_from_the_first_try_did_not_take_it(caplog):
    async with aiohttp.ClientSession() as session:
        assert not await request_restart(session, _trigger(_closed_port()), "k", timeout=0.5)
    assert "did not take the request" in caplog.text


async def test_a_rank_that_refuses_the_key_did_not_take_it():
    async def refuse(request: web.Request) -> web.StreamResponse:
        return web.Response(status=401, text="wrong key")

    assert not await _ask(refuse)


async def test_a_rank_that_accepts_took_it():
    async def accept(request: web.Request) -> web.StreamResponse:
        return web.Response(status=202)

    assert await _ask(accept)
