"""kopf, the kubernetes client and kopf's diff-base annotation read any object the API server
can store (operator/tardigrade_operator/apidecode.py).

kopf's own list-then-watch loop (`continuous_watch`) runs here against an HTTP server that
answers as an API server would with generated objects nested up to 10,000 levels and beyond:
every object arrives, none deeper than the decoding limit, each cut value marked with its
exact depth, and a line that is not JSON at all is skipped instead of ending the stream.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp.web
import kopf
import pytest
from hypothesis import given
from hypothesis import strategies as st
from kopf._cogs.clients import auth, watching
from kopf._cogs.structs import credentials, references
from tardigrade_contract.boundedjson import API_OBJECT_LIMIT, max_depth, nesting_depth
from tardigrade_local.ports import free_port
from tardigrade_operator import apidecode

from tests.fuzz import CHEAP, THROUGH_THE_API, deep_json, json_values

pytestmark = pytest.mark.fuzz

JOBS = references.Resource(group="tardigrade.dev", version="v1alpha1", plural="trainingjobs",
                           namespaced=True)


def job_text(name: str, trainer: str, annotation: str | None = None) -> str:
    """A TrainingJob as the API server would send it, `trainer` being JSON text."""
    meta: dict[str, Any] = {"name": name, "namespace": "ml", "uid": f"uid-{name}",
                            "resourceVersion": "7"}
    if annotation is not None:
        meta["annotations"] = {"tardigrade.dev/last-handled-configuration": annotation}
    body = {"apiVersion": "tardigrade.dev/v1alpha1", "kind": "TrainingJob", "metadata": meta,
            "spec": {"image": "trainer:1", "trainer": "HOLE"}}
    return json.dumps(body).replace('"HOLE"', trainer)


async def serve(lines: list[str], listed: list[str], done: asyncio.Event
                ) -> tuple[aiohttp.web.AppRunner, str]:
    async def answer(request: aiohttp.web.Request) -> aiohttp.web.StreamResponse:
        if request.query.get("watch") != "true":
            text = ('{"kind":"TrainingJobList","metadata":{"resourceVersion":"7"},"items":['
                    + ",".join(listed) + "]}")
            return aiohttp.web.Response(text=text, content_type="application/json")
        response = aiohttp.web.StreamResponse()
        response.content_type = "application/json"
        await response.prepare(request)
        for line in lines:
            await response.write(line.encode() + b"\n")
        await done.wait()  # an open stream: the test stops reading first
        return response

    app = aiohttp.web.Application()
    app.router.add_get("/apis/tardigrade.dev/v1alpha1/trainingjobs", answer)
    runner = aiohttp.web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await aiohttp.web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


async def watch_through_kopf(listed: list[str], lines: list[str], wanted: int
                             ) -> list[dict[str, Any]]:
    """What kopf's list-then-watch loop yields for these answers (its first `wanted`)."""
    apidecode.install_in_kopf()
    done = asyncio.Event()
    runner, url = await serve(lines, listed, done)
    vault = credentials.Vault()
    await vault.populate({"test": credentials.ConnectionInfo(server=url)})
    auth.vault_var.set(vault)
    settings = kopf.OperatorSettings()
    settings.networking.error_backoffs = [0.1]
    stopper: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    events: list[dict[str, Any]] = []
    stream = watching.continuous_watch(settings=settings, resource=JOBS, namespace=None,
                                       operator_pause_waiter=stopper)
    try:
        async with asyncio.timeout(60):
            async for event in stream:
                if isinstance(event, dict):
                    events.append(event)
                if len(events) == wanted:
                    break
    finally:
        stopper.set_result(None)
        done.set()
        await stream.aclose()
        await runner.cleanup()
    return events


@THROUGH_THE_API
@given(st.lists(deep_json(), min_size=1, max_size=3), json_values(6))
def test_kopf_lists_and_watches_any_depth_the_api_server_stores(deep, shallow):
    trainers = [text for text, _ in deep] + [json.dumps(shallow)]
    depths = [depth for _, depth in deep] + [nesting_depth(shallow)]
    bodies = [job_text(f"job-{i}", trainer) for i, trainer in enumerate(trainers)]
    lines = [f'{{"type":"MODIFIED","object":{body}}}' for body in bodies]
    lines.insert(1, "this line is not JSON {[")
    events = asyncio.run(watch_through_kopf(bodies, lines, 2 * len(bodies)))
    # The list's objects, then the stream's (the bad line skipped, the later ones kept).
    assert [e["object"]["metadata"]["name"] for e in events] == 2 * [
        f"job-{i}" for i in range(len(bodies))]
    for event, depth in zip(events, 2 * depths, strict=True):
        assert max_depth(json.dumps(event["object"])) <= API_OBJECT_LIMIT + 1
        assert nesting_depth(event["object"]["spec"]["trainer"]) == depth


@CHEAP
@given(st.one_of(st.text(max_size=200), deep_json().map(lambda d: d[0]),
                 json_values().map(json.dumps)))
def test_no_diff_base_annotation_fails_an_event(annotation):
    body = kopf.Body(json.loads(job_text("annotated", "{}", annotation)))
    storage = apidecode.TolerantDiffBaseStorage(prefix="tardigrade.dev",
                                                key="last-handled-configuration")
    essence = storage.fetch(body=body)
    assert essence is None or isinstance(essence, dict)


def test_kopf_as_shipped_would_fail_the_event_on_these_annotations():
    """What the tolerant storage is for: kopf's own reads these annotations with json.loads
    on every event of the object, and its error ends the operator."""
    for annotation in ("not json", "[" * 100_000):
        body = kopf.Body(json.loads(job_text("annotated", "{}", annotation)))
        storage = kopf.AnnotationsDiffBaseStorage(prefix="tardigrade.dev",
                                                  key="last-handled-configuration")
        with pytest.raises((ValueError, RecursionError)):
            storage.fetch(body=body)


@CHEAP
@given(deep_json())
def test_the_kubernetes_client_reads_any_depth(deep):
    text, depth = deep
    client = apidecode.BoundedApiClient()
    job = client.deserialize(job_text("deep", text), "object", "application/json")
    assert nesting_depth(job["spec"]["trainer"]) == depth
    assert max_depth(json.dumps(job)) <= API_OBJECT_LIMIT + 1


def test_the_kubernetes_client_still_reads_text_and_models():
    client = apidecode.BoundedApiClient()
    assert client.deserialize("plain words", "str", "text/plain") == "plain words"
    pod = client.deserialize(json.dumps({"metadata": {"name": "p"}}), "V1Pod", None)
    assert pod.metadata.name == "p"
