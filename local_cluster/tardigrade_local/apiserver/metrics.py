"""`GET /metrics`: the request counter kube-apiserver exports, for benches that count requests.

Upstream's `apiserver_request_total` (staging/src/k8s.io/apiserver/pkg/endpoints/metrics/
metrics.go, `requestCounter`, STABLE) counts every request by verb, group, version, resource,
subresource, scope and response code (plus `dry_run` and `component`, left out here: no dry
runs, one component). Verbs are those of authorization (`requestinfo.py`: `list` and `watch`
for collection GETs, `deletecollection`), upper-cased as upstream's `canonicalVerb` and
`CleanVerb` report them (`LIST`, `WATCH`, `PATCH`; server-side apply is not told apart as
`APPLY`); non-resource requests (discovery, /version) count with their HTTP method, an empty
resource and an empty scope (`CleanScope`).
"""

from __future__ import annotations

import prometheus_client
from aiohttp import web

from .requestinfo import RequestAttributes

METRICS_PATH = "/metrics"


def _scope(attrs: RequestAttributes) -> str:
    # Upstream's CleanScope: a named object or a create is "resource", a collection
    # "namespace" or "cluster", a non-resource request "".
    if not attrs.resource_request:
        return ""
    if attrs.name or attrs.verb == "create":
        return "resource"
    return "namespace" if attrs.namespace else "cluster"


class RequestMetrics:
    def __init__(self) -> None:
        self.registry = prometheus_client.CollectorRegistry()
        self.requests = prometheus_client.Counter(
            "apiserver_request", "Counter of apiserver requests broken out for each verb, "
            "group, version, resource, scope, and HTTP response code.",
            ["verb", "group", "version", "resource", "subresource", "scope", "code"],
            registry=self.registry)

    def observe(self, attrs: RequestAttributes, code: int) -> None:
        self.requests.labels(attrs.verb.upper(), attrs.api_group, attrs.api_version, attrs.resource,
                             attrs.subresource, _scope(attrs), str(code)).inc()

    def response(self) -> web.Response:
        return web.Response(body=prometheus_client.generate_latest(self.registry),
                            headers={"Content-Type": prometheus_client.CONTENT_TYPE_LATEST})
