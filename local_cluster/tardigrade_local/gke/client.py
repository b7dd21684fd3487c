"""A small asyncio client for the Kubernetes REST API, and a list+watch cache (informer).

GKE's part (the cloud's node lifecycle, the cluster autoscaler, queued provisioning, the host
maintenance handler) needs a handful of verbs on a few kinds; aiohttp keeps it on the event
loop it runs on.
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import aiohttp

log = logging.getLogger(__name__)

Obj = dict[str, Any]
MERGE_PATCH = "application/merge-patch+json"
# How long a request keeps retrying while the API server is unreachable (restarting): like
# client-go's controllers, GKE's part waits the control plane out instead of giving up.
UNREACHABLE_RETRY_SECONDS = 60.0
# 429 Too Many Requests (API Priority and Fairness, max-inflight): client-go waits the
# Retry-After the server sends and tries again, up to 10 times (rest/request.go,
# `checkWait` and `maxRetries`); so does this client.
THROTTLE_RETRIES = 10
THROTTLE_DEFAULT_WAIT_SECONDS = 1.0


class ApiError(Exception):
    def __init__(self, status: int, body: Any) -> None:
        self.status = status
        self.body = body
        reason = body.get("message") if isinstance(body, dict) else body
        super().__init__(f"HTTP {status}: {reason}")


class Throttled(Exception):
    def __init__(self, body: Any, wait_seconds: float) -> None:
        super().__init__(f"throttled; retry after {wait_seconds:g} s")
        self.body = body
        self.wait_seconds = wait_seconds


class WatchExpired(Exception):
    """410 Gone: the resourceVersion is too old; relist."""


def core_path(plural: str, namespace: str | None = None, name: str | None = None,
              sub: str | None = None) -> str:
    return group_path("v1", plural, namespace, name, sub)


def group_path(api_version: str, plural: str, namespace: str | None = None,
               name: str | None = None, sub: str | None = None) -> str:
    """The REST path of a kind in `api_version` ("v1" for the core group, "apps/v1", ...)."""
    path = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    if namespace is not None:
        path += f"/namespaces/{namespace}"
    path += f"/{plural}"
    if name is not None:
        path += f"/{name}"
    if sub is not None:
        path += f"/{sub}"
    return path


def retry_after_seconds(headers: Mapping[str, str]) -> float:
    """The wait a 429 asks for: Retry-After in whole seconds (client-go reads it so)."""
    try:
        return max(0.0, float(headers.get("Retry-After", "")))
    except ValueError:
        return THROTTLE_DEFAULT_WAIT_SECONDS


class ApiClient:
    """One identity's connection to the API server: `ssl_context` carries the CA it trusts
    and the client certificate it authenticates with."""

    def __init__(self, base_url: str, ssl_context: ssl.SSLContext | None = None,
                 user: str = "") -> None:
        self.base_url = base_url.rstrip("/")
        self.ssl_context = ssl_context
        self.user = user
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            # Watches last minutes; no total timeout, but notice a dead server.
            timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
            connector = aiohttp.TCPConnector(ssl=self.ssl_context or False, limit=0)
            self._session = aiohttp.ClientSession(timeout=timeout, connector=connector)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def request(self, method: str, path: str, body: Any = None,
                      content_type: str = "application/json",
                      params: Mapping[str, str] | None = None) -> Obj:
        delay, waited, throttled = 0.1, 0.0, 0
        while True:
            try:
                return await self._request_once(method, path, body, content_type, params)
            except Throttled as err:
                throttled += 1
                if throttled > THROTTLE_RETRIES:
                    raise ApiError(429, err.body) from None
                await asyncio.sleep(err.wait_seconds)
            except aiohttp.ClientConnectionError as err:
                # Refused, reset or dropped: the server is restarting. A write it applied
                # before the connection dropped is repeated; callers accept 404/409 answers.
                if waited >= UNREACHABLE_RETRY_SECONDS:
                    raise
                log.debug("%s %s: API server unreachable (%s); retrying", method, path, err)
                await asyncio.sleep(delay)
                waited += delay
                delay = min(delay * 2, 2.0)

    async def _request_once(self, method: str, path: str, body: Any, content_type: str,
                            params: Mapping[str, str] | None) -> Obj:
        data = None if body is None else json.dumps(body)
        headers = {"Accept": "application/json"}
        if data is not None:
            headers["Content-Type"] = content_type
        async with self.session.request(method, self.base_url + path, data=data,
                                        headers=headers, params=params) as resp:
            text = await resp.text()
            try:
                payload = json.loads(text) if text else {}
            except json.JSONDecodeError:
                payload = text
            if resp.status == 429:
                raise Throttled(payload, retry_after_seconds(resp.headers))
            if resp.status >= 400:
                raise ApiError(resp.status, payload)
            return payload if isinstance(payload, dict) else {}

    async def get(self, path: str) -> Obj | None:
        try:
            return await self.request("GET", path)
        except ApiError as err:
            if err.status == 404:
                return None
            raise

    async def create(self, path: str, body: Obj) -> Obj:
        return await self.request("POST", path, body)

    async def patch(self, path: str, body: Obj) -> Obj:
        return await self.request("PATCH", path, body, content_type=MERGE_PATCH)

    async def delete(self, path: str, grace_seconds: int | None = None) -> Obj | None:
        body: Obj = {"kind": "DeleteOptions", "apiVersion": "v1"}
        if grace_seconds is not None:
            body["gracePeriodSeconds"] = grace_seconds
        try:
            return await self.request("DELETE", path, body)
        except ApiError as err:
            if err.status == 404:
                return None
            raise

    async def watch(self, path: str, resource_version: str, timeout_seconds: int = 300,
                    params: Mapping[str, str] | None = None
                    ) -> AsyncIterator[tuple[str, Obj]]:
        query = {
            **(params or {}),
            "watch": "true",
            "resourceVersion": resource_version,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(timeout_seconds),
        }
        async with self.session.get(self.base_url + path, params=query) as resp:
            if resp.status == 410:
                raise WatchExpired()
            if resp.status == 429:
                raise Throttled(await resp.text(), retry_after_seconds(resp.headers))
            if resp.status >= 400:
                raise ApiError(resp.status, await resp.text())
            while True:
                line = await resp.content.readline()
                if not line:
                    return
                if not line.strip():
                    continue
                event = json.loads(line)
                obj = event.get("object") or {}
                if event.get("type") == "ERROR":
                    if obj.get("code") == 410:
                        raise WatchExpired()
                    raise ApiError(int(obj.get("code") or 500), obj)
                yield event["type"], obj


def object_key(obj: Mapping[str, Any]) -> tuple[str, str]:
    meta = obj["metadata"]
    return meta.get("namespace") or "", meta["name"]


class Informer:
    """Keeps `cache` equal to the server's objects at `path` and reports every change.

    `on_event(type, obj)` runs synchronously on the loop for ADDED/MODIFIED/DELETED,
    including changes found by a relist after a broken watch.
    """

    def __init__(self, client: ApiClient, path: str, on_event: Callable[[str, Obj], None],
                 params: Mapping[str, str] | None = None) -> None:
        self.client = client
        self.path = path
        self.on_event = on_event
        # e.g. {"fieldSelector": "spec.nodeName=NODE"}: what a kubelet may list and watch.
        self.params = dict(params or {})
        self.cache: dict[tuple[str, str], Obj] = {}
        self.synced = asyncio.Event()

    async def run(self) -> None:
        while True:
            try:
                version = await self._relist()
                while True:
                    async for kind, obj in self.client.watch(self.path, version,
                                                             params=self.params):
                        version = obj.get("metadata", {}).get("resourceVersion") or version
                        if kind != "BOOKMARK":
                            self._apply(kind, obj)
            except WatchExpired:
                continue
            except Throttled as err:
                await asyncio.sleep(err.wait_seconds)
            except (TimeoutError, aiohttp.ClientError, ApiError, ValueError) as err:
                log.debug("watch %s broke: %s", self.path, err)
                await asyncio.sleep(0.5)

    async def _relist(self) -> str:
        listing = await self.client.request("GET", self.path, params=self.params or None)
        fresh = {object_key(o): o for o in listing.get("items") or []}
        for key in list(self.cache):
            if key not in fresh:
                self._apply("DELETED", self.cache[key])
        for obj in fresh.values():
            self._apply("MODIFIED" if object_key(obj) in self.cache else "ADDED", obj)
        self.synced.set()
        return str((listing.get("metadata") or {}).get("resourceVersion") or "0")

    def _apply(self, kind: str, obj: Obj) -> None:
        key = object_key(obj)
        if kind == "DELETED":
            self.cache.pop(key, None)
        else:
            self.cache[key] = obj
        try:
            self.on_event(kind, obj)
        except Exception:
            log.exception("handler for %s %s failed", kind, key)
