"""Pod watches filed by spec.nodeName, as the watch cache files them: an event reaches the
watches of its pod's node (now or before), the unindexed ones, and no other."""

from __future__ import annotations

from typing import Any

from tardigrade_local.apiserver.selectors import parse_field_selector
from tardigrade_local.apiserver.store import Store, Watcher
from tardigrade_local.apiserver.triggers import watch_trigger

PODS = "/pods"


def pod(name: str, node: str = "") -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "default"},
            "spec": {"nodeName": node} if node else {}}


def drained(watcher: Watcher) -> list[tuple[str, str]]:
    events = []
    while not watcher.queue.empty():
        event = watcher.queue.get_nowait()
        assert event is not None
        events.append((event.type, event.obj["metadata"]["name"]))
    return events


def trigger(key: str, selector: str) -> str | None:
    return watch_trigger(key, parse_field_selector(selector, ("spec.nodeName", "status.phase")))


def test_a_watch_is_filed_under_an_exact_node_name_only() -> None:
    assert trigger(PODS, "spec.nodeName=node-a") == "node-a"
    assert trigger(PODS, "status.phase!=Succeeded,spec.nodeName==node-a") == "node-a"
    assert trigger(PODS, "spec.nodeName=") == ""  # the scheduler's unbound pods
    assert trigger(PODS, "spec.nodeName!=node-a") is None
    assert trigger(PODS, "status.phase=Running") is None
    assert trigger("/configmaps", "metadata.name=x") is None


def test_events_reach_the_node_watches_they_concern() -> None:
    store = Store()
    node_a = store.subscribe(PODS, None, "node-a")
    node_b = store.subscribe(PODS, None, "node-b")
    unbound = store.subscribe(PODS, "default", "")
    everyone = store.subscribe(PODS, None)
    other_type = store.subscribe("/configmaps", None)

    store.put(PODS, pod("p"), "ADDED")
    store.put(PODS, pod("p", "node-a"), "MODIFIED")  # bound: old value "", new "node-a"
    store.put(PODS, pod("q", "node-b"), "ADDED")
    store.remove(PODS, "default", "p")

    assert drained(node_a) == [("MODIFIED", "p"), ("DELETED", "p")]
    assert drained(node_b) == [("ADDED", "q")]
    assert drained(unbound) == [("ADDED", "p"), ("MODIFIED", "p")]
    assert drained(everyone) == [("ADDED", "p"), ("MODIFIED", "p"), ("ADDED", "q"),
                                 ("DELETED", "p")]
    assert drained(other_type) == []
    assert store.watcher_count(PODS) == 4

    store.unsubscribe(node_a)
    store.put(PODS, pod("r", "node-a"), "ADDED")
    assert drained(node_a) == []
    assert store.watcher_count(PODS) == 3
