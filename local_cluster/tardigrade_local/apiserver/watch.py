"""Watch streams: newline-delimited JSON events, replay from a resourceVersion, bookmarks."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web

from .errors import ApiError
from .resources import ResourceType
from .selectors import FieldRequirement, Requirement, fields_match, labels_match
from .store import Store, WatchEvent
from .triggers import watch_trigger

DEFAULT_TIMEOUT = 1800.0


class WatchRequest:
    def __init__(self, rt: ResourceType, namespace: str | None, labels: list[Requirement],
                 fields: list[FieldRequirement], resource_version: str | None,
                 send_initial: bool | None, bookmarks: bool, timeout: float | None,
                 bookmark_interval: float) -> None:
        self.rt = rt
        self.namespace = namespace
        self.labels = labels
        self.fields = fields
        self.resource_version = resource_version
        self.send_initial = send_initial
        self.bookmarks = bookmarks
        self.timeout = timeout
        self.bookmark_interval = bookmark_interval

    def matches(self, obj: dict[str, Any] | None) -> bool:
        return obj is not None and labels_match(self.labels, obj) and fields_match(
            self.fields, obj)


def _translate(req: WatchRequest, event: WatchEvent) -> tuple[str, dict[str, Any]] | None:
    """An object moving into/out of the selection is ADDED/DELETED for this watcher."""
    now_in = req.matches(event.obj)
    if event.type == "ADDED":
        return ("ADDED", event.obj) if now_in else None
    if event.type == "DELETED":
        return ("DELETED", event.obj) if req.matches(event.old or event.obj) else None
    was_in = req.matches(event.old)
    if now_in and was_in:
        return "MODIFIED", event.obj
    if now_in:
        return "ADDED", event.obj
    if was_in:
        return "DELETED", event.obj
    return None


def _bookmark(rt: ResourceType, rv: int, initial_end: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"resourceVersion": str(rv)}
    if initial_end:
        meta["annotations"] = {"k8s.io/initial-events-end": "true"}
    return {"type": "BOOKMARK",
            "object": {"kind": rt.kind, "apiVersion": rt.api_version, "metadata": meta}}


async def serve_watch(request: web.Request, store: Store, req: WatchRequest,
                      render: Callable[[dict[str, Any]], dict[str, Any]] | None
                      ) -> web.StreamResponse:
    """Stream events; `render` converts objects (e.g. to Tables), None sends them as stored."""
    rt = req.rt
    watcher = store.subscribe(rt.key, req.namespace, watch_trigger(rt.key, req.fields))
    if request.transport is not None:
        watcher.abort = request.transport.abort
    try:
        backlog: list[tuple[str, dict[str, Any]]] = []
        rv_text = req.resource_version
        initial = req.send_initial
        if initial is None:
            initial = rv_text in (None, "", "0")
        start_rv = store.rv
        if initial:
            for obj in store.iter(rt.key, req.namespace):
                if req.matches(obj):
                    backlog.append(("ADDED", obj))
        elif rv_text not in (None, "", "0"):
            try:
                since = int(rv_text or "0")
            except ValueError as exc:
                raise ApiError(400, "BadRequest",
                               f'invalid resource version "{rv_text}"') from exc
            events = store.replay(rt.key, req.namespace, since)
            if events is None:
                return await _gone(request, since, store)
            for event in events:
                out = _translate(req, event)
                if out:
                    backlog.append(out)
        response = web.StreamResponse(headers={"Content-Type": "application/json",
                                               "Transfer-Encoding": "chunked"})
        await response.prepare(request)
        # Drain events that raced the snapshot: the queue only has events after subscribe.
        for etype, obj in backlog:
            await _send(response, {"type": etype, "object": render(obj) if render else obj})
        if req.send_initial and req.bookmarks:
            await _send(response, _bookmark(rt, start_rv, initial_end=True))
        # The client may go away, or the connection be cut on purpose, at any write.
        with contextlib.suppress(ConnectionError):
            await _stream(response, store, watcher, req, render, start_rv if initial else None)
        return response
    finally:
        store.unsubscribe(watcher)


async def _stream(response: web.StreamResponse, store: Store, watcher: Any, req: WatchRequest,
                  render: Callable[[dict[str, Any]], dict[str, Any]] | None,
                  skip_until: int | None) -> None:
    deadline = time.monotonic() + (req.timeout if req.timeout is not None else DEFAULT_TIMEOUT)
    last_rv = store.rv
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return
        wait = min(remaining, req.bookmark_interval) if req.bookmarks else remaining
        try:
            event = await asyncio.wait_for(watcher.queue.get(), timeout=wait)
        except TimeoutError:
            if req.bookmarks and time.monotonic() < deadline:
                await _send(response, _bookmark(req.rt, max(last_rv, store.rv)))
            continue
        if event is None:  # server shutting down
            return
        if skip_until is not None and event.rv <= skip_until:
            continue  # already covered by the initial snapshot
        last_rv = event.rv
        out = _translate(req, event)
        if out and render is None:
            await response.write(event.line(out[0]))
        elif out:
            await _send(response, {"type": out[0], "object": render(out[1])})


async def _send(response: web.StreamResponse, event: dict[str, Any]) -> None:
    await response.write(json.dumps(event, separators=(",", ":")).encode() + b"\n")


async def _gone(request: web.Request, since: int, store: Store) -> web.StreamResponse:
    """A resourceVersion older than history: one ERROR event carrying a 410 Expired Status."""
    response = web.StreamResponse(headers={"Content-Type": "application/json"})
    await response.prepare(request)
    status = ApiError(410, "Expired", f"too old resource version: {since} "
                      f"({store.compacted_rv})").status()
    await _send(response, {"type": "ERROR", "object": status})
    with contextlib.suppress(ConnectionError):
        await response.write_eof()
    return response
