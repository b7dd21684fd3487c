"""A rank's malformed progress report is ignored with one Warning and never wedges the job."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web
from tardigrade_contract import contract
from tardigrade_operator.observation.pods import PodView
from tardigrade_operator.observation.progress import fetch_progress

from tests.operator.fake_cluster import FakeCluster, spec

MALFORMED = [
    ('{"step": "7"}', "step must be a non-negative integer"),
    ('{"step": -3}', "step must be a non-negative integer"),
    ('{"step": true}', "step must be a non-negative integer"),
    ('{"step": 7.5}', "step must be a non-negative integer"),
    ('{"loss": 1.0}', "step is required"),
    ('{"step": 7, "checkpoint_time": "yesterday"}', "checkpoint_time must be an RFC 3339"),
    # No zone: compared with the operator's aware clock, it would raise on every pass.
    ('{"step": 7, "checkpoint_time": "2026-01-02T03:04:05"}', "checkpoint_time must be"),
    ('{"step": 7, "checkpoint_step": "5"}', "checkpoint_step must be a non-negative"),
    ('{"step": 7, "checkpoint_path": 5}', "checkpoint_path must be a string"),
    ('{"step": 7, "loss": "low"}', "loss must be a number"),
    ('{"step": 7, "total_steps": "10"}', "total_steps must be a non-negative integer"),
    ('[7]', "must be a JSON object"),
    ("step=7", "not JSON"),
    ('{"step": 7, "loss": {"value": 1.5}}', "one flat JSON object"),
    ('{"a":' * 5000 + "1" + "}" * 5000, "one flat JSON object"),
    ('{"step": 7, "checkpoint_path": "gs://b/[x]{y}"', "not JSON"),
]


@pytest.mark.parametrize(("text", "says"), MALFORMED, ids=[m[1] for m in MALFORMED])
def test_malformed_reports_name_the_field(text, says):
    with pytest.raises(contract.MalformedReport, match=says):
        contract.ProgressReport.from_json(text)


def test_valid_reports_parse_and_a_diverging_loss_is_dropped():
    report = contract.ProgressReport.from_json(
        '{"step": 7, "loss": NaN, "checkpoint_step": 5, "checkpoint_time": '
        '"2026-01-02T03:04:05Z", "unknown": 1}')
    assert report == contract.ProgressReport(step=7, loss=None, checkpoint_step=5,
                                             checkpoint_time="2026-01-02T03:04:05Z")


@pytest.mark.parametrize("text", ['{"reason": "Failed", "step": "7"}',
                                  '{"reason": "Failed", "checkpoint_step": -1}',
                                  '{"reason": 5}'])
def test_malformed_termination_messages_count_as_none(text):
    assert contract.TerminationMessage.from_json(text) is None


def launched() -> FakeCluster:
    cluster = FakeCluster(spec())
    cluster.reconcile()
    cluster.run_all()
    cluster.reconcile()
    assert cluster.status.phase == "Running"
    return cluster


def warnings(cluster: FakeCluster) -> list[str]:
    return [e.message for plan in cluster.plans for e in plan.events
            if e.reason == "MalformedProgressReport"]


def test_decide_warns_once_and_keeps_reconciling():
    cluster = launched()
    cluster.progress = contract.ProgressReport(step=12)
    cluster.reconcile()
    cluster.progress, cluster.progress_error = None, "rank 0 (tiny-a1-0): step must be ..."
    for _ in range(5):
        cluster.advance(2)
        cluster.reconcile()
    assert len(warnings(cluster)) == 1
    assert cluster.status.phase == "Running" and cluster.status.step == 12
    assert cluster.status.ignored_progress_report.startswith("rank 0 (tiny-a1-0)")
    cluster.progress, cluster.progress_error = contract.ProgressReport(step=20), None
    cluster.reconcile()
    assert cluster.status.step == 20 and cluster.status.ignored_progress_report is None
    # A new episode of malformed reports is worth a new warning.
    cluster.progress, cluster.progress_error = None, "rank 0 (tiny-a1-0): loss must be ..."
    cluster.reconcile()
    assert len(warnings(cluster)) == 2


@contextlib.asynccontextmanager
async def rank_zero(answers: list[str]) -> AsyncIterator[str]:
    """A progress endpoint on a loopback address of its own, answering `answers` in turn."""
    async def progress(_: web.Request) -> web.Response:
        return web.Response(text=answers.pop(0) if len(answers) > 1 else answers[0],
                            content_type="application/json")

    app = web.Application()
    app.router.add_get("/progress", progress)
    runner = web.AppRunner(app)
    await runner.setup()
    address = f"127.{random.randint(100, 250)}.{random.randint(0, 250)}.{random.randint(2, 250)}"
    site = web.TCPSite(runner, address, contract.DEFAULT_PROGRESS_PORT)
    await site.start()
    try:
        yield address
    finally:
        await runner.cleanup()


async def test_malformed_reports_through_the_progress_path_warn_once():
    cluster = launched()
    answers = ['{"step": "7"}', '{"step": "8"}', '{"step": 9, "checkpoint_time": "soon"}',
               '{"step": 9, "checkpoint_path": "' + "x" * 70_000 + '"}', '{"step": 10}']
    async with rank_zero(answers) as address, aiohttp.ClientSession() as session:
        leader = PodView(name="tiny-a1-0", attempt=1, rank=0, phase="Running", pod_ip=address)
        for _ in range(5):
            fetched = await fetch_progress(session, [leader], timeout=5)
            cluster.progress, cluster.progress_error = fetched.report, fetched.malformed
            cluster.advance(2)
            await asyncio.to_thread(cluster.reconcile)
    assert warnings(cluster) == [
        "rank 0 (tiny-a1-0): step must be a non-negative integer (got '7'); its reports are "
        "ignored until a valid one comes"]
    assert cluster.status.step == 10 and cluster.status.ignored_progress_report is None
    assert cluster.status.phase == "Running"
