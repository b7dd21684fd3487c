"""The operator talks to pods on its own terms: it follows no redirect a rank answers, ends
each exchange at its deadline however slowly a rank answers, and sends the job's progress
token (podhttp.py, progress.py, apply/restart_requests.py)."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from aiohttp import web
from tardigrade_contract import contract
from tardigrade_operator.apply.restart_requests import ATTEMPTS, RETRY_SECONDS, request_restart
from tardigrade_operator.decision.plan import Trigger
from tardigrade_operator.observation.pods import PodView
from tardigrade_operator.observation.progress import fetch_progress
from tardigrade_operator.podhttp import pod_session

PORT = contract.DEFAULT_PROGRESS_PORT
VICTIM_REPORT = contract.ProgressReport(step=41, loss=0.5, checkpoint_step=40,
                                        checkpoint_path="gs://victim-bucket/ckpt/40")
REDIRECTS = [301, 302, 303, 307, 308]
# What a call may run past its deadline: the event loop's wake-up and the connection's close.
SLACK_SECONDS = 0.5


def _address() -> str:
    """A loopback address of its own (all of 127/8 is local), so that every server can listen
    on the progress port as a rank does."""
    return f"127.{random.randint(100, 250)}.{random.randint(0, 250)}.{random.randint(2, 250)}"


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@contextlib.asynccontextmanager
async def serving(routes: dict[tuple[str, str], Handler]) -> AsyncIterator[str]:
    """An HTTP server on the progress port of a fresh loopback address; yields the address."""
    app = web.Application()
    for (method, path), handler in routes.items():
        app.router.add_route(method, path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    address = _address()
    await web.TCPSite(runner, address, PORT).start()
    try:
        yield address
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def victim() -> AsyncIterator[tuple[str, list[web.Request]]]:
    """Another job's rank 0: it would answer anyone (the operator may reach it) with a report
    worth stealing, and counts who asked."""
    asked: list[web.Request] = []

    async def answer(request: web.Request) -> web.StreamResponse:
        asked.append(request)
        if request.method == "POST":
            return web.Response(status=202)
        return web.Response(text=VICTIM_REPORT.to_json(), content_type="application/json")

    async with serving({("GET", "/progress"): answer,
                        ("POST", contract.RESTART_IN_PLACE_PATH): answer}) as address:
        yield address, asked


def _leader(address: str) -> PodView:
    return PodView(name="attacker-a1-0", attempt=1, rank=0, phase="Running", pod_ip=address)


@pytest.mark.parametrize("status", REDIRECTS)
async def test_a_rank_that_redirects_the_progress_poll_gets_no_report_and_nobody_is_asked(
        status: int) -> None:
    async with victim() as (target, asked):
        async def redirect(_: web.Request) -> web.StreamResponse:
            return web.Response(status=status,
                                headers={"Location": f"http://{target}:{PORT}/progress"})

        async with serving({("GET", "/progress"): redirect}) as attacker, pod_session() as s:
            fetched = await fetch_progress(s, [_leader(attacker)], timeout=2, token="t0k")
    assert fetched.report is None
    assert fetched.malformed == (f"rank 0 (attacker-a1-0): answered {status} redirect to "
                                 f"'http://{target}:{PORT}/progress'; not followed")
    assert asked == []


@pytest.mark.parametrize("status", REDIRECTS)
async def test_a_rank_that_redirects_the_restart_request_did_not_take_it(status: int) -> None:
    async with victim() as (target, asked):
        async def redirect(_: web.Request) -> web.StreamResponse:
            return web.Response(status=status, headers={
                "Location": f"http://{target}:{PORT}{contract.RESTART_IN_PLACE_PATH}?attempt=2"})

        tries = 0

        async def counted(request: web.Request) -> web.StreamResponse:
            nonlocal tries
            tries += 1
            return await redirect(request)

        async with serving({("POST", contract.RESTART_IN_PLACE_PATH): counted}) as attacker, \
                pod_session() as s:
            trigger = Trigger(pod="attacker-a1-3", world='{"attempt": 2}',
                              url=f"http://{attacker}:{PORT}{contract.RESTART_IN_PLACE_PATH}"
                                  f"?attempt=2")
            taken = await request_restart(s, trigger, "k", timeout=2)
    assert not taken
    assert asked == []
    assert tries == 1  # a redirect is no rank's answer a retry could change


@contextlib.asynccontextmanager
async def trickling(head: bytes, body: bytes, every: float) -> AsyncIterator[str]:
    """A rank that sends `head` at once, then `body` one byte every `every` seconds."""
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        with contextlib.suppress(ConnectionError):
            writer.write(head)
            for i in range(len(body)):
                await writer.drain()
                writer.write(body[i:i + 1])
                await asyncio.sleep(every)  # the rank's pace, not a wait in the test
            await writer.drain()
        writer.close()

    address = _address()
    server = await asyncio.start_server(serve, address, PORT)
    try:
        yield address
    finally:
        server.close()
        await server.wait_closed()


def _head(status: str, length: int) -> bytes:
    return (f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()


async def test_a_rank_that_trickles_its_report_is_cut_off_at_the_poll_s_deadline() -> None:
    report = VICTIM_REPORT.to_json().encode()
    async with trickling(_head("200 OK", len(report)), report, every=0.1) as address, \
            pod_session() as s:
        started = time.monotonic()
        fetched = await fetch_progress(s, [_leader(address)], timeout=1.0)
        took = time.monotonic() - started
    assert fetched.report is None and fetched.malformed is None
    # The whole report would take len(report) / 10 seconds: it was the deadline that ended it.
    assert len(report) * 0.1 > 3
    assert 1.0 - 0.05 <= took <= 1.0 + SLACK_SECONDS


async def test_a_report_that_arrives_in_pieces_within_the_deadline_is_read_whole() -> None:
    report = VICTIM_REPORT.to_json().encode()
    async with trickling(_head("200 OK", len(report)), report, every=0.005) as address, \
            pod_session() as s:
        fetched = await fetch_progress(s, [_leader(address)], timeout=10)
    assert fetched.report == VICTIM_REPORT


async def test_a_rank_that_trickles_its_refusal_is_cut_off_at_each_try_s_deadline() -> None:
    refusal = b"x" * 1000
    async with trickling(_head("503 Busy", len(refusal)), refusal, every=0.1) as address, \
            pod_session() as s:
        trigger = Trigger(pod="slow-a1-3", world=None,
                          url=f"http://{address}:{PORT}{contract.RESTART_IN_PLACE_PATH}?attempt=2")
        started = time.monotonic()
        taken = await request_restart(s, trigger, "k", timeout=0.5)
        took = time.monotonic() - started
    assert not taken
    assert took <= ATTEMPTS * 0.5 + (ATTEMPTS - 1) * RETRY_SECONDS + SLACK_SECONDS


async def test_the_poll_sends_the_job_s_progress_token_only_when_given_one() -> None:
    seen: list[str | None] = []

    async def progress(request: web.Request) -> web.StreamResponse:
        seen.append(request.headers.get("Authorization"))
        return web.Response(text='{"step": 3}', content_type="application/json")

    async with serving({("GET", "/progress"): progress}) as address, pod_session() as s:
        with_token = await fetch_progress(s, [_leader(address)], timeout=5, token="s3cret")
        without = await fetch_progress(s, [_leader(address)], timeout=5)
    assert with_token.report == without.report == contract.ProgressReport(step=3)
    assert seen == ["Bearer s3cret", None]


@pytest.mark.parametrize(("token", "says"), [
    ("wrong", "answered 401: it refused the job's progress token"),
    (None, "answered 401: it wants a progress token and the operator sent none")])
async def test_a_rank_that_refuses_the_poll_s_token_is_reported(token: str | None,
                                                                says: str) -> None:
    async def refuse(_: web.Request) -> web.StreamResponse:
        return web.Response(status=401)

    async with serving({("GET", "/progress"): refuse}) as address, pod_session() as s:
        fetched = await fetch_progress(s, [_leader(address)], timeout=5, token=token)
    assert fetched.report is None
    assert fetched.malformed == f"rank 0 (attacker-a1-0): {says}"


async def test_a_cookie_one_rank_sets_is_never_sent_back_and_no_compression_is_asked() -> None:
    seen: list[tuple[str | None, str | None]] = []

    async def progress(request: web.Request) -> web.StreamResponse:
        seen.append((request.headers.get("Cookie"), request.headers.get("Accept-Encoding")))
        response = web.Response(text='{"step": 3}', content_type="application/json")
        response.set_cookie("tracked", "yes")
        return response

    async with serving({("GET", "/progress"): progress}) as address, pod_session() as s:
        for _ in range(2):
            await fetch_progress(s, [_leader(address)], timeout=5)
    assert seen == [(None, "identity"), (None, "identity")]
