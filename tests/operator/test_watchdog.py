"""A dead watch stream fails the operator's liveness endpoint, so the kubelet restarts it."""

from __future__ import annotations

import asyncio
import json
import sys

import aiohttp
import kopf
import tardigrade_operator.handlers  # noqa: F401  (registers the probe)
from kopf._core.engines import probing  # the liveness endpoint `kopf run --liveness` serves
from tardigrade_local.ports import free_port
from tardigrade_operator import watchdog


async def healthz(url: str) -> tuple[int, str]:
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        return response.status, await response.text()


async def test_a_watcher_that_died_fails_healthz_and_a_cancelled_one_does_not():
    watchdog.track_tasks(asyncio.get_running_loop())
    url = f"http://127.0.0.1:{free_port()}/healthz"
    ready = asyncio.Event()
    reporter = asyncio.create_task(probing.health_reporter(
        url, memo=kopf.Memo(), indices={}, registry=kopf.get_default_registry(),
        settings=kopf.OperatorSettings(), ready_flag=ready))
    try:
        await asyncio.wait_for(ready.wait(), 10)
        code, body = await healthz(url)
        assert code == 200 and json.loads(body)["watch_streams"] == "ok"

        # kopf's orchestrator names its watcher tasks so; one stopped by kopf is cancelled.
        stopped = asyncio.create_task(asyncio.sleep(60), name="watcher for pods@gone-ns")
        await asyncio.sleep(0)
        stopped.cancel()

        async def parse_a_deep_event() -> None:
            json.loads("[" * (sys.getrecursionlimit() + 10))

        died = asyncio.create_task(parse_a_deep_event(),
                                   name="watcher for trainingjobs.v1alpha1.tardigrade.dev@ml")
        await asyncio.gather(stopped, died, return_exceptions=True)
        assert watchdog.dead_watchers() == ["trainingjobs.v1alpha1.tardigrade.dev@ml: "
                                            "RecursionError"]
        # kopf caches probe results for 10 s; a fresh reporter asks at once.
        reporter.cancel()
        await asyncio.gather(reporter, return_exceptions=True)
        ready.clear()
        reporter = asyncio.create_task(probing.health_reporter(
            url, memo=kopf.Memo(), indices={}, registry=kopf.get_default_registry(),
            settings=kopf.OperatorSettings(), ready_flag=ready))
        await asyncio.wait_for(ready.wait(), 10)
        code, _ = await healthz(url)
        assert code == 500
    finally:
        reporter.cancel()
        await asyncio.gather(reporter, return_exceptions=True)
