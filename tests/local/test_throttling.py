"""429 Too Many Requests, as kube-apiserver's API Priority and Fairness sends it while a
thousand ranks review their peers at once: the API client of GKE's part (its cloud, cluster
autoscaler, queued provisioning and maintenance handler, `gke/client.py`) and the trainers'
TokenReview wait the Retry-After and try again, as client-go does, instead of failing."""

from __future__ import annotations

import asyncio
import http.server
import json
import threading
import time
from collections.abc import Iterator

import pytest
from aiohttp import web
from tardigrade_local.gke import client as gke_client
from tardigrade_sdk import peerauth


class Throttling:
    """Answers 429 with `Retry-After: wait` to the first `refusals` requests, then 200."""

    def __init__(self, refusals: int, wait: str = "1") -> None:
        self.refusals = refusals
        self.wait = wait
        self.times: list[float] = []

    def answer(self) -> tuple[int, dict[str, str], bytes]:
        self.times.append(time.monotonic())
        if len(self.times) <= self.refusals:
            return 429, {"Retry-After": self.wait}, b'{"kind":"Status","code":429}'
        return 200, {}, json.dumps({"status": {"authenticated": True}}).encode()


async def _serve(throttle: Throttling) -> tuple[web.AppRunner, str]:
    async def handler(request: web.Request) -> web.Response:
        status, headers, body = throttle.answer()
        return web.Response(status=status, headers=headers, body=body,
                            content_type="application/json")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


def test_gkes_client_waits_out_429s_for_their_retry_after():
    throttle = Throttling(refusals=2, wait="1")

    async def run() -> dict:
        runner, url = await _serve(throttle)
        client = gke_client.ApiClient(url)
        try:
            return await client.request("GET", "/api/v1/nodes/n")
        finally:
            await client.close()
            await runner.cleanup()

    assert asyncio.run(run()) == {"status": {"authenticated": True}}
    gaps = [b - a for a, b in zip(throttle.times, throttle.times[1:], strict=False)]
    assert len(throttle.times) == 3 and all(gap >= 0.95 for gap in gaps), gaps


def test_gkes_client_gives_up_after_client_gos_retries():
    throttle = Throttling(refusals=100, wait="0")

    async def run() -> None:
        runner, url = await _serve(throttle)
        client = gke_client.ApiClient(url)
        try:
            await client.request("GET", "/api/v1/nodes/n")
        finally:
            await client.close()
            await runner.cleanup()

    with pytest.raises(gke_client.ApiError, match="429"):
        asyncio.run(run())
    assert len(throttle.times) == gke_client.THROTTLE_RETRIES + 1


@pytest.fixture
def review_server() -> Iterator[tuple[Throttling, str]]:
    throttle = Throttling(refusals=3, wait="1")

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # kept connections, as rank 0's reviews use

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            status, headers, body = throttle.answer()
            self.send_response(status)
            for key, value in {**headers, "Content-Length": str(len(body))}.items():
                self.send_header(key, value)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield throttle, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()


def test_rank_0s_token_review_waits_out_429s_on_its_kept_connection(review_server):
    throttle, url = review_server
    access = peerauth.ApiAccess(url, "rank-0-token", None)
    kept = peerauth.KeptConnections(access)
    status = peerauth.review(access, "peer-token", post=kept.post)
    assert status == {"authenticated": True}
    gaps = [b - a for a, b in zip(throttle.times, throttle.times[1:], strict=False)]
    assert len(throttle.times) == 4 and all(gap >= 0.95 for gap in gaps), gaps
