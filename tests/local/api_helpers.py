"""Shared pieces of the API server tests: a server on a background loop, real kubectl
binaries, and polling helpers. Fixtures here are imported by the test_api_* modules."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml
from tardigrade_local.apiserver import ApiServer

from tests.polling import wait_for  # noqa: F401  (re-exported for the test modules)

REPO = Path(__file__).resolve().parents[2]
T = TypeVar("T")


class ThreadedServer:
    """An ApiServer running on its own event loop thread, for synchronous tests."""

    def __init__(self, **kwargs: Any) -> None:
        self.loop = asyncio.new_event_loop()
        self.server = ApiServer(**kwargs)
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def start(self) -> ThreadedServer:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(10)
        return self

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)

    def call(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the server's loop (the store is not thread-safe)."""
        async def run() -> T:
            return fn()
        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(10)

    @property
    def url(self) -> str:
        return self.server.url


@contextlib.contextmanager
def running_server(tmp: Path, **kwargs: Any) -> Iterator[tuple[ThreadedServer, Path]]:
    threaded = ThreadedServer(**kwargs).start()
    try:
        yield threaded, threaded.server.write_kubeconfig(tmp / "kubeconfig")
    finally:
        threaded.stop()


@pytest.fixture(scope="module")
def api(tmp_path_factory) -> Iterator[ThreadedServer]:
    with running_server(tmp_path_factory.mktemp("api"), bookmark_interval=0.5) as (srv, kc):
        srv.kubeconfig = kc  # type: ignore[attr-defined]
        yield srv


def find_kubectls() -> list[Path]:
    """kubectl binaries to test with: $TARDIGRADE_KUBECTL, else what .ci/ installed."""
    listed = os.environ.get("TARDIGRADE_KUBECTL")
    if listed:
        return [Path(p) for p in listed.split(os.pathsep) if p]
    cache = Path(os.environ.get("TARDIGRADE_KUBE_CLIENTS", REPO / ".ci" / "cache"))
    return [p for p in (cache / "kubectl", cache / "kubectl-1.20") if p.exists()]


def require_kubectls() -> list[Path]:
    found = find_kubectls()
    if not found:
        message = ("no kubectl found: run .ci/install-kube-clients.sh .ci/cache or set "
                   "TARDIGRADE_KUBECTL")
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    if os.environ.get("CI") == "true" and len(found) < 2 and "TARDIGRADE_KUBECTL" not in os.environ:
        pytest.fail(f"CI must test both kubectl versions; found only {found}")
    return found


def kubectl_ids() -> list[str]:
    return [p.name for p in find_kubectls()] or ["kubectl-missing"]


class Kubectl:
    def __init__(self, binary: Path, kubeconfig: Path) -> None:
        self.binary = binary
        self.env = {**os.environ, "KUBECONFIG": str(kubeconfig),
                    "HOME": str(kubeconfig.parent)}

    @property
    def old(self) -> bool:
        return self.binary.name.endswith("1.20")

    def run(self, *args: str, input: str | None = None, check: bool = True,
            timeout: float = 30) -> subprocess.CompletedProcess[str]:
        done = subprocess.run([str(self.binary), *args], env=self.env, input=input,
                              capture_output=True, text=True, timeout=timeout)
        if check and done.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed ({done.returncode}):\n"
                                 f"{done.stdout}\n{done.stderr}")
        return done

    def __call__(self, *args: str, input: str | None = None, timeout: float = 30) -> str:
        return self.run(*args, input=input, timeout=timeout).stdout

    def apply(self, *docs: dict[str, Any], server_side: bool = False) -> str:
        text = yaml.safe_dump_all(list(docs))
        args = ["apply", "-f", "-"] + (["--server-side"] if server_side else [])
        return self(*args, input=text)

    def get_json(self, *args: str) -> dict[str, Any]:
        return json.loads(self("get", *args, "-o", "json"))

    def fails(self, *args: str, input: str | None = None) -> str:
        done = self.run(*args, input=input, check=False)
        assert done.returncode != 0, f"kubectl {' '.join(args)} should fail: {done.stdout}"
        return done.stderr




def widget_crd(**version_extra: Any) -> dict[str, Any]:
    """A small CRD exercising the schema features the real server enforces."""
    schema = {
        "type": "object",
        "properties": {
            "spec": {
                "type": "object",
                "required": ["image"],
                "x-kubernetes-validations": [
                    {"rule": "self.replicas <= self.maxReplicas",
                     "message": "replicas must not exceed maxReplicas"},
                    {"rule": "self.image == oldSelf.image", "message": "image is immutable"},
                ],
                "properties": {
                    "image": {"type": "string", "minLength": 1, "maxLength": 64},
                    "replicas": {"type": "integer", "minimum": 1, "default": 1},
                    "maxReplicas": {"type": "integer", "maximum": 100, "default": 10},
                    "policy": {"type": "string", "enum": ["Always", "Never"],
                               "default": "Always"},
                    "port": {"x-kubernetes-int-or-string": True},
                    "labels": {"type": "object",
                               "additionalProperties": {"type": "string", "maxLength": 8}},
                    "extra": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
                    "resources": {
                        "type": "object",
                        "properties": {"cpu": {"type": "number", "exclusiveMinimum": True,
                                               "minimum": 0}},
                    },
                    "args": {"type": "array", "maxItems": 3, "items": {"type": "string"}},
                    "volumes": {
                        "type": "array",
                        "x-kubernetes-list-type": "map",
                        "x-kubernetes-list-map-keys": ["name"],
                        "items": {"type": "object", "required": ["name"],
                                  "properties": {"name": {"type": "string"},
                                                 "size": {"type": "integer"}}},
                    },
                },
            },
            "status": {
                "type": "object",
                "properties": {
                    "phase": {"type": "string"},
                    "replicas": {"type": "integer"},
                    "selector": {"type": "string"},
                    "conditions": {"type": "array", "items": {
                        "type": "object", "x-kubernetes-preserve-unknown-fields": True}},
                },
            },
        },
    }
    version = {
        "name": "v1", "served": True, "storage": True,
        "schema": {"openAPIV3Schema": schema},
        "subresources": {"status": {}, "scale": {
            "specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas",
            "labelSelectorPath": ".status.selector"}},
        "additionalPrinterColumns": [
            {"name": "Replicas", "type": "integer", "jsonPath": ".spec.replicas"},
            {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
            {"name": "Ready", "type": "string",
             "jsonPath": '.status.conditions[?(@.type=="Ready")].status'},
            {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
        ],
        **version_extra,
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
        "metadata": {"name": "widgets.example.dev"},
        "spec": {"group": "example.dev", "scope": "Namespaced",
                 "names": {"plural": "widgets", "singular": "widget", "kind": "Widget",
                           "shortNames": ["wg"]},
                 "versions": [version]},
    }


def widget(name: str, namespace: str = "default", **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "example.dev/v1", "kind": "Widget",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"image": "busybox", **spec}}
