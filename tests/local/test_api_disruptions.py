"""Control-plane disruptions of the local API server: a restart and cut watch connections."""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from api_helpers import ThreadedServer, running_server, wait_for
from kubernetes import client, config, watch
from kubernetes.client.rest import ApiException

CONFIGMAPS = "/configmaps"


@pytest.fixture
def server(tmp_path) -> Iterator[ThreadedServer]:
    with running_server(tmp_path) as (srv, kubeconfig):
        srv.kubeconfig = kubeconfig  # type: ignore[attr-defined]
        yield srv


@pytest.fixture
def core(server: ThreadedServer) -> client.CoreV1Api:
    return client.CoreV1Api(config.new_client_from_config(config_file=str(server.kubeconfig)))


def configmap(name: str) -> dict:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name}}


def open_watch(server: ThreadedServer, since: str) -> tuple[threading.Thread, dict]:
    """A raw watch in a thread; `outcome["ended"]` once its connection is gone."""
    outcome: dict = {"events": []}
    url = (f"{server.url}/api/v1/namespaces/default/configmaps?watch=true"
           f"&resourceVersion={since}&timeoutSeconds=60")

    def follow() -> None:
        try:
            with urllib.request.urlopen(url, timeout=60) as resp:
                for line in resp:
                    outcome["events"].append(json.loads(line))
            outcome["ended"] = "eof"
        except (OSError, urllib.error.URLError, ValueError) as err:
            outcome["ended"] = type(err).__name__

    thread = threading.Thread(target=follow, daemon=True)
    thread.start()
    return thread, outcome


def test_cut_watches_drops_every_open_watch_and_clients_resume(server, core):
    since = core.create_namespaced_config_map("default", configmap("a")).metadata.resource_version
    threads = [open_watch(server, since) for _ in range(3)]
    wait_for(lambda: server.call(lambda: server.server.store.watcher_count(CONFIGMAPS)) == 3,
             10, "three open watches")
    assert server.call(server.server.cut_watches) == 3
    for thread, _ in threads:
        thread.join(10)
        assert not thread.is_alive(), "a cut watch kept its connection"
    assert server.call(lambda: server.server.store.watcher_count(CONFIGMAPS)) == 0
    # History is kept: a client resuming from the last version it saw misses nothing.
    core.create_namespaced_config_map("default", configmap("b"))
    events = list(watch.Watch().stream(core.list_namespaced_config_map, "default",
                                       resource_version=since, timeout_seconds=1))
    assert [e["object"].metadata.name for e in events] == ["b"]


def test_cut_watches_with_expired_history_makes_clients_relist(server, core):
    since = core.create_namespaced_config_map("default", configmap("a")).metadata.resource_version
    core.create_namespaced_config_map("default", configmap("b"))  # missed by the client
    server.call(lambda: server.server.cut_watches(expire_history=True))
    with pytest.raises(ApiException) as exc:
        list(watch.Watch().stream(core.list_namespaced_config_map, "default",
                                  resource_version=since, timeout_seconds=1))
    assert exc.value.status == 410


def test_restart_keeps_objects_and_resource_versions_like_etcd(server, core):
    created = core.create_namespaced_config_map("default", configmap("kept"))
    thread, outcome = open_watch(server, created.metadata.resource_version)
    wait_for(lambda: server.call(lambda: server.server.store.watcher_count(CONFIGMAPS)) == 1,
             10, "an open watch")
    core.create_namespaced_config_map("default", configmap("missed"))
    url = server.url
    restart = asyncio.run_coroutine_threadsafe(server.server.restart(downtime_seconds=1.0),
                                               server.loop)
    thread.join(10)
    assert "ended" in outcome, "the watch outlived the restart"
    with pytest.raises(urllib.error.URLError):  # the port refuses connections meanwhile
        urllib.request.urlopen(f"{url}/version", timeout=5)
    restart.result(10)
    assert server.url == url
    kept = core.read_namespaced_config_map("kept", "default")
    assert kept.metadata.resource_version == created.metadata.resource_version
    assert kept.metadata.uid == created.metadata.uid
    after = core.create_namespaced_config_map("default", configmap("after"))
    assert int(after.metadata.resource_version) > int(created.metadata.resource_version)
    # A fresh watch cache: resuming from before the restart is 410 Gone, so clients relist.
    with pytest.raises(ApiException) as exc:
        list(watch.Watch().stream(core.list_namespaced_config_map, "default",
                                  resource_version=created.metadata.resource_version,
                                  timeout_seconds=1))
    assert exc.value.status == 410


def test_a_pod_being_deleted_cannot_be_bound(core):
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": "leaving", "finalizers": ["example.com/keep"]},
           "spec": {"containers": [{"name": "main", "image": "local/python"}]}}
    core.create_namespaced_pod("default", pod)
    core.delete_namespaced_pod("leaving", "default")
    with pytest.raises(ApiException) as exc:
        core.create_namespaced_pod_binding("leaving", "default", {
            "apiVersion": "v1", "kind": "Binding", "metadata": {"name": "leaving"},
            "target": {"apiVersion": "v1", "kind": "Node", "name": "node-x"}},
            _preload_content=False)
    assert exc.value.status == 409
    assert "is being deleted" in exc.value.body
