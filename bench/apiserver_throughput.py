"""API server throughput: list/patch rates and watch fan-out with 1,000 objects, 20 watchers.

Runs the server in its own process (as in the local cluster) and drives it over HTTP:
    python bench/apiserver_throughput.py [--objects 1000] [--watchers 20] [--patches 2000]
Prints requests/s and p50/p99 latencies for create, patch and list, and for watch delivery
(time from a patch's answer to each watcher receiving the event).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parents[1]


def start_server() -> tuple[subprocess.Popen[str], str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(REPO / "local_cluster"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "tardigrade_local.apiserver", "--port", "0"],
                            env=env, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    return proc, line.strip().rsplit(" ", 1)[-1]


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


def report(name: str, latencies: list[float], elapsed: float, unit: str = "req") -> None:
    print(f"{name:<22} {len(latencies):>6} {unit:<3} {len(latencies) / elapsed:>9.0f} {unit}/s  "
          f"p50 {pct(latencies, 0.5):7.2f} ms  p99 {pct(latencies, 0.99):7.2f} ms")


async def run_batch(session, make_request, count: int, concurrency: int) -> tuple[list[float],
                                                                                  float]:
    latencies: list[float] = []
    queue = iter(range(count))

    async def worker() -> None:
        for i in queue:
            t0 = time.perf_counter()
            async with make_request(session, i) as resp:
                await resp.read()
                assert resp.status < 300, (resp.status, await resp.text())
            latencies.append(time.perf_counter() - t0)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return latencies, time.perf_counter() - start


async def main(args: argparse.Namespace) -> None:
    proc, url = start_server()
    try:
        base = f"{url}/api/v1/namespaces/default/configmaps"
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            lat, el = await run_batch(session, lambda s, i: s.post(base, json={
                "metadata": {"name": f"obj-{i}", "labels": {"bench": "yes"}},
                "data": {"i": str(i)}}), args.objects, args.concurrency)
            report("create", lat, el)

            sent: dict[str, float] = {}
            delivered: list[float] = []
            ready = asyncio.Event()
            started = 0

            async def watcher() -> None:
                nonlocal started
                async with session.get(base, params={"watch": "true", "resourceVersion":
                                                     rv, "timeoutSeconds": "600"},
                                       timeout=aiohttp.ClientTimeout(total=None)) as resp:
                    started += 1
                    if started == args.watchers:
                        ready.set()
                    async for line in resp.content:
                        event = json.loads(line)
                        key = event["object"]["metadata"]["resourceVersion"]
                        if key in sent:
                            delivered.append(time.perf_counter() - sent[key])

            async with session.get(base, params={"limit": "1"}) as resp:
                rv = (await resp.json())["metadata"]["resourceVersion"]
            tasks = [asyncio.create_task(watcher()) for _ in range(args.watchers)]
            await asyncio.wait_for(ready.wait(), 30)

            def patch(s, i):
                ctx = s.patch(f"{base}/obj-{i % args.objects}",
                              data=json.dumps({"data": {"n": str(i)}}),
                              headers={"Content-Type": "application/merge-patch+json"})
                return _Timed(ctx, sent)

            lat, el = await run_batch(session, patch, args.patches, args.concurrency)
            report("patch (20 watching)", lat, el)
            expected = args.patches * args.watchers
            deadline = time.monotonic() + 60
            while len(delivered) < expected and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            report("watch delivery", delivered, el, "evt")
            print(f"{'watch events':<22} {len(delivered):>6} of {expected} delivered")

            # Delivery latency at a steady rate, which the burst above cannot show: there the
            # backlog of the watchers (in this one client process) dominates.
            delivered.clear()
            rate_start = time.perf_counter()
            for i in range(args.steady_patches):
                target = rate_start + i / args.rate
                await asyncio.sleep(max(0.0, target - time.perf_counter()))
                async with patch(session, i):
                    pass
            expected = args.steady_patches * args.watchers
            deadline = time.monotonic() + 30
            while len(delivered) < expected and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            report(f"watch @{args.rate}/s", delivered, time.perf_counter() - rate_start, "evt")
            for t in tasks:
                t.cancel()

            lat, el = await run_batch(session, lambda s, i: s.get(
                base, params={"labelSelector": "bench=yes"}), args.lists, 4)
            report(f"list ({args.objects} objs)", lat, el)
            lat, el = await run_batch(session, lambda s, i: s.get(
                f"{base}/obj-{i % args.objects}"), args.patches, args.concurrency)
            report("get", lat, el)
    finally:
        proc.terminate()
        proc.wait(10)


class _Timed:
    """Wraps a request context to note when its answer (and resourceVersion) arrived."""

    def __init__(self, ctx, sent: dict[str, float]) -> None:
        self.ctx = ctx
        self.sent = sent

    async def __aenter__(self):
        resp = await self.ctx.__aenter__()
        body = await resp.read()
        rv = json.loads(body)["metadata"]["resourceVersion"]
        self.sent[rv] = time.perf_counter()
        return resp

    async def __aexit__(self, *exc):
        return await self.ctx.__aexit__(*exc)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--objects", type=int, default=1000)
    parser.add_argument("--watchers", type=int, default=20)
    parser.add_argument("--patches", type=int, default=2000)
    parser.add_argument("--lists", type=int, default=50)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rate", type=int, default=100, help="patches/s in the steady phase")
    parser.add_argument("--steady-patches", type=int, default=300)
    asyncio.run(main(parser.parse_args()))
