"""API-backed volumes: projected (service-account tokens, ConfigMaps, Secrets, the downward
API), configMap, secret and downwardAPI volumes, written and kept fresh as a kubelet does.

Upstream: `pkg/volume/projected/projected.go` (`collectData`) gathers every source of a
projected volume into one payload: for a `serviceAccountToken` source a TokenRequest for the
pod's ServiceAccount with the source's `audience` (empty: the API server's own audiences),
`expirationSeconds` (default 3600) and a `boundObjectRef` to the pod; for `configMap` and
`secret` the object's keys (all, or `items` with their paths; a missing object or key is an
error unless `optional`); for `downwardAPI` the items' `fieldRef` values. The kubelet's
`AtomicWriter` swaps the whole payload in. `pkg/kubelet/token/token_manager.go`
(`requiresRefresh`) fetches a new token once it is older than 80% of its lifetime or than 24
hours, and the volume is rewritten, so a process that rereads the file keeps a valid token.

Every pod kube-apiserver admits gets one such volume, `kube-api-access-<random>`, from the
ServiceAccount admission plugin (`plugin/pkg/admission/serviceaccount/admission.go`,
`TokenVolumeSource`: a token of 3607 s, the `kube-root-ca.crt` ConfigMap's `ca.crt`, and the
namespace from the downward API), mounted at /var/run/secrets/kubernetes.io/serviceaccount.

Pod processes share this machine's filesystem (see credentials.py), so a volume cannot appear
at its `mountPath`: it is written into the pod's directory, and the container's environment
and arguments that name a path under the mount point are pointed there (volumes.py).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tardigrade_local.gke.client import ApiClient, ApiError, core_path
from tardigrade_local.kubelet.credentials import service_account_name
from tardigrade_local.kubelet.env import EnvError, field_value

DEFAULT_EXPIRATION_SECONDS = 3600
MAX_TOKEN_AGE_SECONDS = 24 * 3600
REFRESH_FRACTION = 0.8
REFRESH_CHECK_SECONDS = 10.0
API_SOURCES = ("projected", "configMap", "secret", "downwardAPI")


@dataclasses.dataclass(frozen=True)
class TokenFile:
    volume: str
    path: str  # inside the volume
    audience: str | None
    expiration_seconds: int


def token_files(pod_spec: Mapping[str, Any]) -> list[TokenFile]:
    out = []
    for volume in pod_spec.get("volumes") or []:
        for source in (volume.get("projected") or {}).get("sources") or []:
            token = source.get("serviceAccountToken")
            if token is not None:
                out.append(TokenFile(volume["name"], token["path"], token.get("audience"),
                                     int(token.get("expirationSeconds")
                                         or DEFAULT_EXPIRATION_SECONDS)))
    return out


def requires_refresh(issued: float, expires: float, now: float) -> bool:
    """token_manager.go `requiresRefresh` (without its jitter): 80% of the life, or 24 h."""
    ttl = expires - issued
    return now >= expires or now >= issued + REFRESH_FRACTION * ttl or \
        now >= issued + MAX_TOKEN_AGE_SECONDS


def volume_dir(pod_dir: Path, volume: str) -> Path:
    return pod_dir / "volumes" / volume


def is_api_volume(volume: Mapping[str, Any]) -> bool:
    return any(source in volume for source in API_SOURCES)


def _decoded(obj: Mapping[str, Any], secret: bool) -> dict[str, bytes]:
    data = {k: base64.b64decode(v) if secret else str(v).encode()
            for k, v in (obj.get("data") or {}).items()}
    data.update({k: base64.b64decode(v) for k, v in (obj.get("binaryData") or {}).items()})
    return data


def _pick(kind: str, name: str, data: Mapping[str, bytes] | None,
          items: list[Mapping[str, Any]] | None, optional: bool) -> dict[str, bytes]:
    """`collectData` for one ConfigMap or Secret source: its keys, or `items` by path."""
    if data is None:
        if optional:
            return {}
        raise EnvError(f'{kind} "{name}" not found')
    if not items:
        return dict(data)
    out = {}
    for item in items:
        if item["key"] not in data:
            if optional:
                continue
            raise EnvError(f'configmap references non-existent config key: {item["key"]}'
                           if kind == "configmap" else
                           f'references non-existent secret key: {item["key"]}')
        out[item.get("path") or item["key"]] = data[item["key"]]
    return out


class ApiVolumes:
    """Writes a pod's API-backed volumes, then keeps their tokens fresh until `stop`."""

    def __init__(self, client: ApiClient, pod: Mapping[str, Any], pod_dir: Path) -> None:
        self.client = client
        self.pod = pod
        self.pod_dir = pod_dir
        self.namespace = pod["metadata"].get("namespace") or "default"
        self.volumes = [v for v in pod["spec"].get("volumes") or [] if is_api_volume(v)]
        self._lifetimes: dict[TokenFile, tuple[float, float]] = {}
        self._task: asyncio.Task[None] | None = None

    async def write_all(self) -> None:
        for volume in self.volumes:
            await self._write_volume(volume)
        if self._lifetimes and self._task is None:
            self._task = asyncio.create_task(self._refresh_forever())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _object(self, plural: str, name: str) -> Mapping[str, Any] | None:
        try:
            return await self.client.get(core_path(plural, self.namespace, name))
        except ApiError as err:
            raise EnvError(f"failed to fetch {plural[:-1]} {name!r}: {err}") from err

    async def _source_files(self, volume: str, source: Mapping[str, Any]
                            ) -> dict[str, bytes]:
        if "serviceAccountToken" in source:
            token = source["serviceAccountToken"]
            token_file = TokenFile(volume, token["path"], token.get("audience"),
                                   int(token.get("expirationSeconds")
                                       or DEFAULT_EXPIRATION_SECONDS))
            return {token_file.path: (await self._token(token_file)).encode()}
        if "configMap" in source:
            ref = source["configMap"]
            obj = await self._object("configmaps", ref["name"])
            return _pick("configmap", ref["name"], None if obj is None else _decoded(obj, False),
                         ref.get("items"), bool(ref.get("optional")))
        if "secret" in source:
            ref = source["secret"]
            name = ref.get("name") or ref.get("secretName")
            obj = await self._object("secrets", name)
            return _pick("secret", name, None if obj is None else _decoded(obj, True),
                         ref.get("items"), bool(ref.get("optional")))
        if "downwardAPI" in source:
            out = {}
            for item in source["downwardAPI"].get("items") or []:
                if "fieldRef" in item:
                    out[item["path"]] = field_value(self.pod, item["fieldRef"]["fieldPath"]
                                                    ).encode()
                else:
                    raise EnvError("downwardAPI resourceFieldRef items are not modelled here")
            return out
        kind = next(iter(source), "unknown")
        raise EnvError(f"projected {kind} sources are not modelled by the local kubelet")

    async def _write_volume(self, volume: Mapping[str, Any]) -> None:
        name = volume["name"]
        if "projected" in volume:
            sources = (volume["projected"] or {}).get("sources") or []
        elif "configMap" in volume:
            sources = [{"configMap": volume["configMap"]}]
        elif "secret" in volume:
            sources = [{"secret": volume["secret"]}]
        else:
            sources = [{"downwardAPI": volume["downwardAPI"]}]
        files: dict[str, bytes] = {}
        for source in sources:
            files.update(await self._source_files(name, source))
        target = volume_dir(self.pod_dir, name)
        for relative, data in files.items():
            path = target / relative
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.tmp")
            tmp.write_bytes(data)
            tmp.chmod(0o600 if "token" in relative else 0o644)
            tmp.replace(path)  # atomically, as the kubelet's AtomicWriter swaps the data dir
        target.mkdir(parents=True, exist_ok=True)

    async def _token(self, token_file: TokenFile) -> str:
        meta = self.pod["metadata"]
        spec: dict[str, Any] = {
            "expirationSeconds": token_file.expiration_seconds,
            "boundObjectRef": {"kind": "Pod", "apiVersion": "v1", "name": meta["name"],
                               "uid": meta.get("uid", "")}}
        if token_file.audience:
            spec["audiences"] = [token_file.audience]
        path = core_path("serviceaccounts", self.namespace,
                         service_account_name(self.pod["spec"]), "token")
        try:
            answer = await self.client.create(path, {
                "apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec})
        except ApiError as err:
            raise EnvError(f"failed to fetch token for volume {token_file.volume}: {err}") \
                from err
        now = time.time()
        self._lifetimes[token_file] = (now, now + token_file.expiration_seconds)
        return str(answer["status"]["token"])

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(REFRESH_CHECK_SECONDS)
            now = time.time()
            due = {f.volume for f, (issued, expires) in self._lifetimes.items()
                   if requires_refresh(issued, expires, now)}
            for volume in self.volumes:
                if volume["name"] in due:
                    with contextlib.suppress(EnvError):  # kept, and retried on the next pass
                        await self._write_volume(volume)
