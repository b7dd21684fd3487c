"""HTTP glue: parse the URL into (resource type, namespace, name, subresource) and dispatch."""

from __future__ import annotations

import base64
import copy
import json
import logging
from dataclasses import dataclass
from typing import Any

from aiohttp import ClientError, ClientSession, ClientTimeout, web

from . import apply, decoding, discovery, eviction, openapi, patch, protobuf, tables
from .access import Access
from .core import Core, Warnings
from .errors import ApiError, bad_request, method_not_allowed, not_found, not_found_resource
from .hostcheck import check_host
from .metrics import METRICS_PATH, RequestMetrics
from .requestinfo import request_attributes
from .resources import ResourceType
from .review import self_subject_access_review
from .scale import scale_get, scale_update
from .selectors import fields_match, labels_match, parse_field_selector, parse_label_selector
from .store import Store
from .tokenrequest import token_request
from .tokenreview import token_review
from .validation import check_request_size
from .watch import WatchRequest, serve_watch

log = logging.getLogger(__name__)


@dataclass
class Target:
    rt: ResourceType | None
    group: str
    version: str
    namespace: str | None
    name: str | None
    subresource: str | None
    legacy_watch: bool


def _json(body: Any, status: int = 200, warnings: list[str] | None = None) -> web.Response:
    headers = {"Content-Type": "application/json"}
    resp = web.Response(body=json.dumps(body, separators=(",", ":")).encode(), status=status,
                        headers=headers)
    for w in warnings or []:
        # RFC 7234 warn-text is a quoted-string: escape quotes or clients drop the header.
        text = w.replace("\\", "\\\\").replace('"', '\\"')
        resp.headers.add("Warning", f'299 - "{text}"')
    return resp


def _number(text: str, name: str) -> float:
    try:
        return float(text)
    except ValueError as exc:
        raise bad_request(f'invalid value for {name}: "{text}"') from exc


def _media_types(rt: ResourceType) -> tuple[str, ...]:
    return decoding.BUILTIN_MEDIA_TYPES if rt.builtin else decoding.CUSTOM_MEDIA_TYPES


def _partial(obj: dict[str, Any]) -> dict[str, Any]:
    """The metadata-only form that metadata clients (and the real GC) ask for."""
    return {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1",
            "metadata": obj["metadata"]}


def error_response(err: ApiError) -> web.Response:
    return _json(err.status(), err.code)


class Handlers:
    def __init__(self, core: Core, store: Store, access: Access,
                 bookmark_interval: float = 10.0) -> None:
        self.core = core
        self.store = store
        self.registry = core.registry
        self.access = access
        self.bookmark_interval = bookmark_interval
        self.metrics = RequestMetrics()

    # ---- routing ----------------------------------------------------------------------------
    def _parse(self, path: str) -> Target | None:
        parts = [p for p in path.split("/") if p]
        if not parts:
            return None
        if parts[0] == "api" and len(parts) >= 2:
            group, version, rest = "", parts[1], parts[2:]
        elif parts[0] == "apis" and len(parts) >= 3:
            group, version, rest = parts[1], parts[2], parts[3:]
        else:
            return None
        legacy = False
        if rest and rest[0] == "watch":
            legacy, rest = True, rest[1:]
        if not rest:
            return Target(None, group, version, None, None, None, legacy)
        ns = None
        if rest[0] == "namespaces" and len(rest) >= 3:
            candidate = self.registry.get(group, version, rest[2])
            if candidate is not None and candidate.namespaced:
                ns, rest = rest[1], rest[2:]
        rt = self.registry.get(group, version, rest[0])
        if rt is None or len(rest) > 3:
            return Target(None, group, version, ns, None, None, legacy)
        name = rest[1] if len(rest) > 1 else None
        sub = rest[2] if len(rest) > 2 else None
        return Target(rt, group, version, ns, name, sub, legacy)

    # ---- entry point --------------------------------------------------------------------------
    async def dispatch(self, request: web.Request) -> web.StreamResponse:
        code = 500
        try:
            response = await self._serve(request)
            code = response.status
            return response
        except web.HTTPException as err:
            code = err.status
            raise
        finally:
            self.metrics.observe(
                request_attributes(request.method, request.path, request.query), code)

    async def _serve(self, request: web.Request) -> web.StreamResponse:
        try:
            check_host(request.headers.get("Host"))
            self.access.admit(request)
            if request.path == METRICS_PATH and request.method == "GET":
                return self.metrics.response()
            return await self._dispatch(request)
        except ApiError as err:
            return error_response(err)
        except (ConnectionResetError, web.HTTPException):
            raise
        except Exception as exc:  # a bug here must not take the server down
            log.exception("internal error on %s %s", request.method, request.path)
            return error_response(ApiError(500, "InternalError",
                                           f"Internal error occurred: {exc}"))

    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        path = request.path
        if path in ("/healthz", "/livez", "/readyz"):
            return web.Response(text="ok")
        if path == "/version":
            return _json(discovery.VERSION_INFO)
        if path in ("/api", "/apis"):
            if discovery.wants_aggregated(request.headers.get("Accept", "")):
                resp = _json(discovery.aggregated(self.registry, core=path == "/api"))
                resp.headers["Content-Type"] = discovery.AGGREGATED_V2
                resp.headers["Vary"] = "Accept"
                return resp
            if path == "/api":
                return _json(discovery.api_versions())
            return _json(discovery.api_group_list(self.registry))
        if path.startswith("/openapi/"):
            return openapi.serve(request, self.registry)
        parts = [p for p in path.split("/") if p]
        if len(parts) == 2 and parts[0] == "apis":
            group = discovery.api_group(self.registry, parts[1])
            if group is None:
                raise not_found_resource()
            return _json(group)
        target = self._parse(path)
        if target is None:
            raise not_found_resource()
        if target.rt is None:
            if target.name is None and target.namespace is None and request.method == "GET":
                doc = discovery.resource_list(self.registry, target.group, target.version)
                if doc is not None and path.rstrip("/").count("/") == (2 if not target.group
                                                                        else 3):
                    return _json(doc)
            raise not_found_resource()
        return await self._resource(request, target)

    async def _body(self, request: web.Request,
                    accepted: tuple[str, ...] = decoding.BUILTIN_MEDIA_TYPES) -> Any:
        check_request_size(request.content_length or 0)
        ctype = decoding.require_media_type(request.headers.get("Content-Type"), accepted)
        raw = await request.read()
        check_request_size(len(raw))
        if ctype == decoding.PROTOBUF:
            return protobuf.decode(raw)
        if not raw:
            raise bad_request("the body of the request was empty")
        return patch.parse_body(raw, ctype)

    async def _resource(self, request: web.Request, t: Target) -> web.StreamResponse:
        rt = t.rt
        assert rt is not None
        q = request.query
        method = request.method
        ns = t.namespace if rt.namespaced else None
        if rt.namespaced and t.name is not None and ns is None and method != "GET":
            raise not_found_resource()
        dry_run = "All" in q.getall("dryRun", [])
        field_validation = q.get("fieldValidation", "Warn")
        warnings = Warnings()
        if t.name is None:
            if t.subresource:
                raise not_found_resource()
            if method == "GET":
                if t.legacy_watch or q.get("watch") in ("true", "1"):
                    return await self._watch(request, rt, ns)
                return self._list(request, rt, ns)
            if method == "POST" and rt.kind == "SelfSubjectAccessReview":
                body = await self._body(request)
                return _json(self_subject_access_review(self.access, body), 201)
            if method == "POST" and rt.kind == "TokenReview":
                body = await self._body(request)
                return _json(token_review(self.access.authenticator, body), 201)
            if method == "POST":
                body = await self._body(request, _media_types(rt))
                created = self.core.create(rt, ns, body, dry_run=dry_run,
                                           field_validation=field_validation, warnings=warnings)
                return _json(created, 201, warnings)
            if method == "DELETE":
                return self._delete_collection(request, rt, ns, dry_run)
            raise method_not_allowed()
        name = t.name
        nskey = ns or ""
        sub = t.subresource
        if t.legacy_watch:
            return await self._watch(request, rt, ns, name)
        if sub not in (None, "status", "scale") and sub not in rt.extra_subresources:
            raise not_found_resource()
        if sub == "status" and not rt.status_subresource:
            raise not_found_resource()
        if sub == "scale" and rt.scale is None:
            raise not_found_resource()
        if method == "GET":
            if sub == "log":
                return await self._pod_log(request, rt, nskey, name)
            if sub == "scale":
                return _json(scale_get(rt, self.core.get(rt, nskey, name)))
            obj = self.core.get(rt, nskey, name)
            return self._render_one(request, rt, obj)
        if method == "PUT":
            body = await self._body(request, _media_types(rt))
            if sub == "scale":
                return _json(scale_update(self.core, rt, nskey, name, body, None, dry_run))
            updated = self.core.update(rt, nskey, name, body, subresource=sub, dry_run=dry_run,
                                       field_validation=field_validation, warnings=warnings)
            return _json(updated, 200, warnings)
        if method == "PATCH":
            return await self._patch(request, rt, nskey, name, sub, dry_run, field_validation,
                                     warnings)
        if method == "DELETE":
            if sub is not None:
                raise method_not_allowed()
            options = await self._delete_options(request)
            grace = q.get("gracePeriodSeconds")
            deleted = self.core.delete(
                rt, nskey, name, options, dry_run=dry_run,
                propagation=q.get("propagationPolicy"),
                grace_period=int(_number(grace, "gracePeriodSeconds")) if grace else None)
            return _json(deleted)
        if method == "POST" and sub == "eviction":
            return await self._evict(request, rt, nskey, name, dry_run)
        if method == "POST" and sub == "binding":
            return await self._bind(request, rt, nskey, name)
        if method == "POST" and sub == "token":
            body = await self._body(request)
            return _json(token_request(self.store, self.access.authenticator, nskey, name,
                                       body), 201)
        raise method_not_allowed()

    # ---- reads -----------------------------------------------------------------------------------
    def _render_one(self, request: web.Request, rt: ResourceType,
                    obj: dict[str, Any]) -> web.Response:
        if "as=PartialObjectMetadata;" in request.headers.get("Accept", "") + ";":
            return _json(_partial(obj))
        if tables.wants_table(request.headers.get("Accept", "")):
            include = request.query.get("includeObject", "Metadata")
            return _json(tables.to_table(rt, [obj], {"resourceVersion":
                                                     obj["metadata"]["resourceVersion"]},
                                         include))
        return _json(obj)

    def _selected(self, request: web.Request, rt: ResourceType,
                  ns: str | None) -> list[dict[str, Any]]:
        labels = parse_label_selector(request.query.get("labelSelector"))
        fields = parse_field_selector(request.query.get("fieldSelector"), rt.field_labels)
        return [o for o in self.store.iter(rt.key, ns)
                if labels_match(labels, o) and fields_match(fields, o)]

    def _list(self, request: web.Request, rt: ResourceType, ns: str | None) -> web.Response:
        q = request.query
        items = self._selected(request, rt, ns)
        start = 0
        if q.get("continue"):
            try:
                token = json.loads(base64.b64decode(q["continue"]))
                start = int(token["start"])
            except (ValueError, KeyError, TypeError) as exc:
                raise bad_request("continue key is not valid: illegal base64 data") from exc
        limit = int(_number(q.get("limit") or "0", "limit"))
        meta: dict[str, Any] = {"resourceVersion": str(self.store.rv)}
        page = items[start:]
        if limit > 0 and len(page) > limit:
            page = page[:limit]
            meta["continue"] = base64.b64encode(json.dumps(
                {"rv": self.store.rv, "start": start + limit}).encode()).decode()
            meta["remainingItemCount"] = len(items) - start - limit
        accept = request.headers.get("Accept", "")
        if tables.wants_table(accept):
            return _json(tables.to_table(rt, page, meta, q.get("includeObject", "Metadata")))
        if "as=PartialObjectMetadataList" in accept:
            return _json({"kind": "PartialObjectMetadataList", "apiVersion": "meta.k8s.io/v1",
                          "metadata": meta, "items": [_partial(o) for o in page]})
        # Splice the cached JSON of each object instead of serializing the list again.
        head = json.dumps({"kind": rt.list_kind, "apiVersion": rt.api_version,
                           "metadata": meta}, separators=(",", ":"))
        body = (head[:-1] + ',"items":[').encode() + b",".join(
            self.store.encoded(rt.key, o) for o in page) + b"]}"
        return web.Response(body=body, headers={"Content-Type": "application/json"})

    @staticmethod
    def _versioned(rt: ResourceType, obj: dict[str, Any]) -> dict[str, Any]:
        if obj.get("apiVersion") == rt.api_version:
            return obj
        out = dict(obj)
        out["apiVersion"] = rt.api_version
        return out

    async def _watch(self, request: web.Request, rt: ResourceType, ns: str | None,
                     name: str | None = None) -> web.StreamResponse:
        q = request.query
        fields = parse_field_selector(q.get("fieldSelector"), rt.field_labels)
        if name is not None:
            fields = [*fields, *parse_field_selector(f"metadata.name={name}", ())]
        send_initial = q.get("sendInitialEvents")
        timeout = q.get("timeoutSeconds")
        req = WatchRequest(
            rt, ns, parse_label_selector(q.get("labelSelector")), fields,
            q.get("resourceVersion"),
            None if send_initial is None else send_initial == "true",
            q.get("allowWatchBookmarks") == "true",
            float(timeout) if timeout and _number(timeout, "timeoutSeconds") > 0 else None,
            self.bookmark_interval)
        accept = request.headers.get("Accept", "")
        if tables.wants_table(accept):
            include = q.get("includeObject", "Metadata")
            sent_columns = False

            def render(obj: dict[str, Any]) -> dict[str, Any]:
                nonlocal sent_columns
                table = tables.to_table(rt, [self._versioned(rt, obj)],
                                        {"resourceVersion": obj["metadata"]["resourceVersion"]},
                                        include, with_columns=not sent_columns)
                sent_columns = True
                return table
            return await serve_watch(request, self.store, req, render)
        # Objects are stored in the one version each kind is served in: send them as stored.
        return await serve_watch(request, self.store, req, None)

    # ---- writes ----------------------------------------------------------------------------------
    async def _patch(self, request: web.Request, rt: ResourceType, ns: str, name: str,
                     sub: str | None, dry_run: bool, field_validation: str,
                     warnings: Warnings) -> web.Response:
        ctype = decoding.require_media_type(request.headers.get("Content-Type"),
                                            patch.PATCH_TYPES)
        body = await self._body(request, patch.PATCH_TYPES)
        if sub == "scale":
            return _json(scale_update(self.core, rt, ns, name, body, ctype, dry_run))
        current = self.core.store.get(rt.key, ns, name)
        ident = (rt.key, ns, name)
        if ctype == patch.APPLY:
            manager = apply.require_manager(request.query.get("fieldManager"))
            if current is None:
                if not isinstance(body, dict):
                    raise bad_request("the applied configuration is not an object")
                owned = apply.owned_paths(body)
                body.setdefault("metadata", {}).setdefault("name", name)
                created = self.core.create(rt, ns or None, body, dry_run=dry_run,
                                           field_validation=field_validation,
                                           warnings=warnings)
                if not dry_run:
                    self.store.applied[ident] = {manager: owned}
                return _json(created, 201, warnings)
            previous = self.store.applied.get(ident, {}).get(manager, set())
            patched, owned = apply.apply(current, body, rt.builtin, previous)
        elif current is None:
            raise not_found(rt.plural, rt.group, name)
        else:
            patched = patch.apply_patch(current, body, ctype, rt.builtin)
            owned = None
        if not isinstance(patched, dict):
            raise bad_request("the patch did not produce an object")
        # A resourceVersion the patch itself sets acts as a precondition (kopf, kubectl).
        meta = patched.setdefault("metadata", {})
        if not isinstance(meta, dict):
            raise bad_request("metadata must be an object")
        if meta.get("resourceVersion") in (None, ""):
            meta["resourceVersion"] = current["metadata"]["resourceVersion"]
        updated = self.core.update(rt, ns, name, patched, subresource=sub, dry_run=dry_run,
                                   field_validation=field_validation, warnings=warnings,
                                   current=current)
        if owned is not None and not dry_run:
            self.store.applied.setdefault(ident, {})[
                request.query.get("fieldManager", "")] = owned
        return _json(updated, 200, warnings)

    async def _delete_options(self, request: web.Request) -> dict[str, Any]:
        if not request.can_read_body:
            return {}
        raw = await request.read()
        if not raw.strip():
            return {}
        ctype = decoding.require_media_type(request.headers.get("Content-Type"),
                                            decoding.BUILTIN_MEDIA_TYPES)
        body = protobuf.decode(raw) if ctype == decoding.PROTOBUF else patch.parse_body(raw, ctype)
        if not isinstance(body, dict):
            raise bad_request("the body of the request was not DeleteOptions")
        return body

    def _delete_collection(self, request: web.Request, rt: ResourceType, ns: str | None,
                           dry_run: bool) -> web.Response:
        items = [copy.deepcopy(o) for o in self._selected(request, rt, ns)]
        for obj in items:
            meta = obj["metadata"]
            try:
                self.core.delete(rt, meta.get("namespace", ""), meta["name"], dry_run=dry_run,
                                 propagation=request.query.get("propagationPolicy"))
            except ApiError as err:
                if err.code != 404:
                    raise
        return _json({"kind": rt.list_kind, "apiVersion": rt.api_version,
                      "metadata": {"resourceVersion": str(self.store.rv)}, "items": items})

    async def _evict(self, request: web.Request, rt: ResourceType, ns: str, name: str,
                     dry_run: bool) -> web.Response:
        body = await self._body(request)
        eviction.evict(self.core, rt, ns, name, body, dry_run)
        return _json({"kind": "Status", "apiVersion": "v1", "metadata": {},
                      "status": "Success", "code": 201}, 201)

    async def _bind(self, request: web.Request, rt: ResourceType, ns: str,
                    name: str) -> web.Response:
        body = await self._body(request)
        node = ((body or {}).get("target") or {}).get("name") if isinstance(body, dict) else None
        if not node:
            raise bad_request("Binding target name is required")
        pod = self.core.store.get(rt.key, ns, name)
        if pod is None:
            raise not_found(rt.plural, rt.group, name)
        if pod["metadata"].get("deletionTimestamp"):
            raise ApiError(409, "Conflict", f"pod {name} is being deleted, cannot be assigned "
                           f"to a host", {"name": name, "kind": "pods/binding"})
        if pod["spec"].get("nodeName"):
            raise ApiError(409, "Conflict", f'Operation cannot be fulfilled on pods/binding '
                           f'"{name}": pod {name} is already assigned to node '
                           f'"{pod["spec"]["nodeName"]}"', {"name": name, "kind": "pods/binding"})
        pod["spec"]["nodeName"] = node
        self.core.store.put(rt.key, pod, "MODIFIED")
        return _json({"kind": "Status", "apiVersion": "v1", "metadata": {},
                      "status": "Success", "code": 201}, 201)

    # ---- logs: proxied to the pod's kubelet, as the real server does ------------------------
    async def _pod_log(self, request: web.Request, rt: ResourceType, ns: str,
                       name: str) -> web.StreamResponse:
        pod = self.core.get(rt, ns, name)
        containers = [c["name"] for c in pod["spec"].get("containers") or []]
        container = request.query.get("container") or (containers[0] if len(containers) == 1
                                                       else None)
        if container is None:
            raise bad_request(f"a container name must be specified for pod {name}, choose one "
                              f"of: [{' '.join(containers)}]")
        if container not in containers:
            raise bad_request(f"container {container} is not valid for pod {name}")
        node_name = pod["spec"].get("nodeName")
        node = self.store.peek("/nodes", "", node_name) if node_name else None
        if node is None:
            raise bad_request(f'container "{container}" in pod "{name}" is waiting to start: '
                              f"ContainerCreating")
        status = node.get("status", {})
        port = (status.get("daemonEndpoints") or {}).get("kubeletEndpoint", {}).get("Port")
        address = next((a["address"] for a in status.get("addresses") or []
                        if a.get("type") == "InternalIP"), "127.0.0.1")
        if not port:
            raise ApiError(500, "InternalError", f"node {node_name} has no kubelet endpoint")
        url = f"http://{address}:{port}/containerLogs/{ns}/{name}/{container}"
        params = {k: v for k, v in request.query.items() if k != "container"}
        response = web.StreamResponse(headers={"Content-Type": "text/plain"})
        try:
            async with ClientSession(timeout=ClientTimeout(total=None, sock_connect=5)) as s, \
                    s.get(url, params=params) as upstream:
                if upstream.status != 200:
                    text = await upstream.text()
                    raise ApiError(upstream.status if upstream.status >= 400 else 500,
                                   "BadRequest" if upstream.status == 400 else "InternalError",
                                   text.strip())
                await response.prepare(request)
                async for chunk in upstream.content.iter_any():
                    await response.write(chunk)
        except ClientError as exc:
            raise ApiError(500, "InternalError", f"Get \"{url}\": {exc}") from exc
        return response
