"""Every API object the operator and the CLI read is decoded with its nesting bounded.

The API server stores JSON nested up to 10,000 levels; Python's `json` and the code that
reads its results recurse per level (tardigrade_contract.boundedjson says why raising limits
is no fix). Three clients read API objects here, and each decodes through `boundedjson`:

- kopf (the watch streams, their initial lists, and the answers to its patches): kopf
  1.45.2 decodes watch lines with `json.loads` in `kopf._cogs.clients.api.stream` and every
  other answer with aiohttp's `ClientResponse.json` from `api.request`'s response. kopf has
  no hook for either, so `install_in_kopf` swaps the `json` that module names and wraps its
  `request` (tests/operator/test_apidecode.py holds kopf to both).
- the kubernetes client (the operator's writer, the CLI): `BoundedApiClient`.
- raw answers read with `_preload_content=False` (kube.py): `loads`.

And one decode hides inside kopf's event processing: on every event of every object it
watches, kopf reads its diff base from an annotation (`tardigrade.dev/last-handled-
configuration`) with `json.loads`. Anyone who may annotate a TrainingJob, or a pod with the
job label, can write any string there; kopf's error throttler then fails every event of that
object, once a second with a traceback, so the job is never reconciled nor told why (and the
pod never indexed). `TolerantDiffBaseStorage` reads it bounded and takes anything but a JSON
object as no diff base.

A value cut out is left as a marker, so a TrainingJob nested too deep still reaches its
reconcile pass, which fails that one job naming the field (api/types.py).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import types
from typing import Any

import kopf
import kubernetes
from tardigrade_contract import boundedjson

log = logging.getLogger(__name__)

# What kopf's watch stream yields for a line that is not JSON at all: kopf logs and skips
# events of a type it does not know. One bad line must not end the stream (kopf would end
# the operator, and the same line after a restart would end it again).
UNDECODABLE = "TardigradeUndecodable"


def loads(text: str | bytes) -> Any:
    return boundedjson.loads(text)


def _watch_line(text: str | bytes) -> Any:
    try:
        return boundedjson.loads(text)
    except ValueError as err:
        log.error("a watch event that is not JSON was skipped (%s): %.200r", err, text)
        return {"type": UNDECODABLE, "object": {}}


def install_in_kopf() -> None:
    """Make kopf decode every answer of the API server through `boundedjson` (idempotent)."""
    from kopf._cogs.clients import api

    if getattr(api.request, "_tardigrade_bounded", False):
        return
    api.json = types.SimpleNamespace(loads=_watch_line, dumps=json.dumps)  # type: ignore[attr-defined]
    original = api.request

    @functools.wraps(original)
    async def request(*args: Any, **kwargs: Any) -> Any:
        response = await original(*args, **kwargs)
        # kopf's get/post/patch/delete return `await response.json()`.
        response.json = functools.partial(response.json, loads=loads)
        return response

    request._tardigrade_bounded = True  # type: ignore[attr-defined]
    api.request = request  # type: ignore[assignment]


class BoundedApiClient(kubernetes.client.ApiClient):  # type: ignore[misc]
    """The kubernetes client, decoding answers through `boundedjson`."""

    def deserialize(self, response_text: Any, response_type: Any, content_type: Any) -> Any:
        if isinstance(response_text, (str, bytes)) and response_text:
            # Not JSON: the client decides by the content type, as before.
            with contextlib.suppress(ValueError):
                response_text = boundedjson.bound(response_text)
        return super().deserialize(response_text, response_type, content_type)


def use_bounded_client() -> None:
    """Make every kubernetes API object created without a client use a BoundedApiClient on
    the default configuration (call after loading it)."""
    kubernetes.client.ApiClient.set_default(BoundedApiClient())


class TolerantDiffBaseStorage(kopf.AnnotationsDiffBaseStorage):  # type: ignore[misc]
    """kopf's annotation diff base, read so that no annotation value can fail an event."""

    def fetch(self, *, body: kopf.Body) -> Any:
        for key in self.make_keys(self.key, body=body):
            encoded = body.metadata.annotations.get(key, None)
            if encoded is None:
                continue
            try:
                decoded = boundedjson.loads(encoded)
            except ValueError:
                decoded = None
            if isinstance(decoded, dict):
                return decoded
            log.warning("%s/%s: annotation %s is not a JSON object; ignored",
                        body.metadata.namespace, body.metadata.name, key)
        return None
