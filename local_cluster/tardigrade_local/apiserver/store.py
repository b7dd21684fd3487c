"""Objects, the one global resourceVersion counter, and the event history watches replay.

Everything runs on one asyncio loop, so the store needs no locks: each write is one
synchronous step that bumps the counter, stores the object and fans the event out.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import triggers


@dataclass(frozen=True)
class WatchEvent:
    type: str  # ADDED, MODIFIED, DELETED
    key: str  # resource type key, "group/plural"
    rv: int
    obj: dict[str, Any]
    old: dict[str, Any] | None
    # Serialized watch lines by event type, shared by all watchers of this event.
    encoded: dict[str, bytes] = field(default_factory=dict, compare=False, hash=False)

    def line(self, event_type: str) -> bytes:
        raw = self.encoded.get(event_type)
        if raw is None:
            raw = json.dumps({"type": event_type, "object": self.obj},
                             separators=(",", ":")).encode() + b"\n"
            self.encoded[event_type] = raw
        return raw


def clone(obj: Any) -> Any:
    """A deep copy of a JSON value (several times faster than copy.deepcopy)."""
    return json.loads(json.dumps(obj))


class Watcher:
    """One open watch: a queue the store pushes into, filtered by resource type."""

    # A watcher this far behind is cut off, as the real server does with slow watchers; the
    # client re-watches from the last resourceVersion it saw.
    MAX_BACKLOG = 50_000

    def __init__(self, key: str, namespace: str | None, trigger: str | None = None) -> None:
        self.key = key
        self.namespace = namespace
        # The value of its type's indexed field this watch requires (triggers.py), if any.
        self.trigger = trigger
        self.queue: asyncio.Queue[WatchEvent | None] = asyncio.Queue()
        self.cut_off = False
        # Drops the watch's connection without a clean end (set by the HTTP layer).
        self.abort: Callable[[], None] | None = None

    def offer(self, event: WatchEvent) -> None:
        if self.cut_off:
            return
        if self.queue.qsize() >= self.MAX_BACKLOG:
            self.cut_off = True
            self.queue.put_nowait(None)
            return
        self.queue.put_nowait(event)

    def wants(self, event: WatchEvent) -> bool:
        if event.key != self.key:
            return False
        return self.namespace is None or event.obj["metadata"].get("namespace") == self.namespace


ObjKey = tuple[str, str, str]  # (type key, namespace or "", name)


class Store:
    def __init__(self, history_size: int = 10_000) -> None:
        self._objects: dict[str, dict[tuple[str, str], dict[str, Any]]] = {}
        # Serialized form of stored objects, filled on first read; objects never change in
        # place, so an entry is valid until the object is replaced.
        self._encoded: dict[str, dict[tuple[str, str], bytes]] = {}
        # uid -> where the object lives, and owner uid -> its dependents (for the GC).
        self._by_uid: dict[str, ObjKey] = {}
        self._dependents: dict[str, set[ObjKey]] = {}
        # Server-side apply: (type key, namespace, name) -> field manager -> owned paths.
        self.applied: dict[ObjKey, dict[str, set[tuple[str, ...]]]] = {}
        self.rv = 1
        self.history: deque[WatchEvent] = deque(maxlen=history_size)
        # The oldest resourceVersion a watch may resume from; older ones get 410 Gone.
        self.compacted_rv = 1
        # Type key -> trigger value (None: unindexed) -> open watches (triggers.py).
        self._watchers: dict[str, dict[str | None, set[Watcher]]] = {}
        self.listeners: list[Callable[[WatchEvent], None]] = []
        self.dirty = False

    # ---- reads -------------------------------------------------------------------------
    def get(self, key: str, namespace: str, name: str) -> dict[str, Any] | None:
        obj = self._objects.get(key, {}).get((namespace, name))
        return clone(obj) if obj is not None else None

    def peek(self, key: str, namespace: str, name: str) -> dict[str, Any] | None:
        """The stored object itself (no copy): callers must not mutate it."""
        return self._objects.get(key, {}).get((namespace, name))

    def iter(self, key: str, namespace: str | None = None) -> Iterator[dict[str, Any]]:
        """Stored objects (not copies) in (namespace, name) order."""
        bucket = self._objects.get(key, {})
        for ns_name in sorted(bucket):
            if namespace is None or ns_name[0] == namespace:
                yield bucket[ns_name]

    def by_uid(self, uid: str) -> tuple[str, dict[str, Any]] | None:
        """(type key, stored object) for a uid, or None."""
        where = self._by_uid.get(uid)
        if where is None:
            return None
        obj = self._objects.get(where[0], {}).get((where[1], where[2]))
        return (where[0], obj) if obj is not None else None

    def dependents(self, owner_uid: str) -> list[tuple[str, dict[str, Any]]]:
        out = []
        for key, ns, name in sorted(self._dependents.get(owner_uid, ())):
            obj = self._objects.get(key, {}).get((ns, name))
            if obj is not None:
                out.append((key, obj))
        return out

    def _index(self, key: str, obj: dict[str, Any] | None, old: dict[str, Any] | None) -> None:
        for o, add in ((old, False), (obj, True)):
            if o is None:
                continue
            meta = o["metadata"]
            where = (key, meta.get("namespace", ""), meta["name"])
            if meta.get("uid"):
                if add:
                    self._by_uid[meta["uid"]] = where
                else:
                    self._by_uid.pop(meta["uid"], None)
            for ref in meta.get("ownerReferences") or []:
                deps = self._dependents.setdefault(ref.get("uid", ""), set())
                if add:
                    deps.add(where)
                else:
                    deps.discard(where)

    def encoded(self, key: str, obj: dict[str, Any]) -> bytes:
        """The JSON of a stored object (as yielded by `iter`), cached."""
        meta = obj["metadata"]
        ident = (meta.get("namespace", ""), meta["name"])
        bucket = self._encoded.setdefault(key, {})
        raw = bucket.get(ident)
        if raw is None:
            raw = json.dumps(obj, separators=(",", ":")).encode()
            bucket[ident] = raw
        return raw

    def type_keys(self) -> list[str]:
        return list(self._objects)

    # ---- writes ------------------------------------------------------------------------
    def next_rv(self) -> int:
        self.rv += 1
        return self.rv

    def put(self, key: str, obj: dict[str, Any], event_type: str) -> dict[str, Any]:
        """Store `obj` under a fresh resourceVersion and tell watchers. Returns a copy."""
        meta = obj["metadata"]
        ident = (meta.get("namespace", ""), meta["name"])
        bucket = self._objects.setdefault(key, {})
        old = bucket.get(ident)
        rv = self.next_rv()
        meta["resourceVersion"] = str(rv)
        stored = clone(obj)
        bucket[ident] = stored
        self._encoded.get(key, {}).pop(ident, None)
        self._index(key, stored, old)
        self._emit(WatchEvent(event_type, key, rv, stored, old))
        return obj

    def remove(self, key: str, namespace: str, name: str) -> dict[str, Any] | None:
        bucket = self._objects.get(key, {})
        old = bucket.pop((namespace, name), None)
        if old is None:
            return None
        self._encoded.get(key, {}).pop((namespace, name), None)
        self._index(key, None, old)
        self.applied.pop((key, namespace, name), None)
        rv = self.next_rv()
        gone = clone(old)
        gone["metadata"]["resourceVersion"] = str(rv)
        self._emit(WatchEvent("DELETED", key, rv, gone, old))
        return clone(gone)

    def drop_type(self, key: str) -> None:
        for obj in self._objects.get(key, {}).values():
            self._index(key, None, obj)
        self._objects.pop(key, None)
        self._encoded.pop(key, None)

    def _emit(self, event: WatchEvent) -> None:
        self.dirty = True
        if len(self.history) == self.history.maxlen:
            self.compacted_rv = self.history[0].rv
        self.history.append(event)
        for watcher in self._candidates(event):
            if watcher.wants(event):
                watcher.offer(event)
        for listener in self.listeners:
            listener(event)

    def compact(self) -> None:
        """Forget all history (tests use it to provoke 410 Gone)."""
        self.history.clear()
        self.compacted_rv = self.rv

    # ---- watch -------------------------------------------------------------------------
    def subscribe(self, key: str, namespace: str | None, trigger: str | None = None) -> Watcher:
        watcher = Watcher(key, namespace, trigger)
        self._watchers.setdefault(key, {}).setdefault(trigger, set()).add(watcher)
        return watcher

    def unsubscribe(self, watcher: Watcher) -> None:
        by_trigger = self._watchers.get(watcher.key, {})
        filed = by_trigger.get(watcher.trigger)
        if filed is not None:
            filed.discard(watcher)
            if not filed:
                del by_trigger[watcher.trigger]

    def _candidates(self, event: WatchEvent) -> list[Watcher]:
        """The watches an event can concern: its type's unindexed ones and those filed under
        the trigger value of the object or of its previous version."""
        by_trigger = self._watchers.get(event.key)
        if not by_trigger:
            return []
        found = list(by_trigger.get(None, ()))
        for value in triggers.event_triggers(event.key, event.obj, event.old):
            found.extend(by_trigger.get(value, ()))
        return found

    def _all_watchers(self) -> list[Watcher]:
        return [w for by_trigger in self._watchers.values() for filed in by_trigger.values()
                for w in filed]

    def watcher_count(self, key: str) -> int:
        """Open watches on one resource type (lets tests know a client is listening)."""
        return sum(len(filed) for filed in self._watchers.get(key, {}).values())

    def close_watchers(self) -> None:
        for watcher in self._all_watchers():
            watcher.queue.put_nowait(None)

    def cut_watchers(self) -> int:
        """Drop every open watch connection abruptly, as a network blip or a restarting
        server does; clients must re-watch (or relist). Returns how many were cut."""
        cut = self._all_watchers()
        for watcher in cut:
            watcher.cut_off = True
            if watcher.abort is not None:
                watcher.abort()
            watcher.queue.put_nowait(None)
        return len(cut)

    def replay(self, key: str, namespace: str | None, since: int) -> list[WatchEvent] | None:
        """Events after `since`, or None when history no longer reaches back that far."""
        if since < self.compacted_rv:
            return None
        return [e for e in self.history
                if e.rv > since and e.key == key
                and (namespace is None or e.obj["metadata"].get("namespace") == namespace)]

    # ---- persistence -------------------------------------------------------------------
    def snapshot(self, path: Path) -> None:
        data = {"resourceVersion": self.rv,
                "objects": {key: list(bucket.values()) for key, bucket in self._objects.items()},
                "applied": [[*ident, manager, sorted(list(p) for p in paths)]
                            for ident, managers in self.applied.items()
                            for manager, paths in managers.items()]}
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, path)
        self.dirty = False

    def restore(self, path: Path) -> list[dict[str, Any]]:
        """Load a snapshot; returns the CRDs in it so the caller can register their kinds."""
        data = json.loads(path.read_text())
        self.rv = int(data["resourceVersion"])
        # Watches from before the restart cannot be resumed, like after an etcd compaction.
        self.compacted_rv = self.rv
        for key, objs in data["objects"].items():
            bucket = self._objects.setdefault(key, {})
            for obj in objs:
                meta = obj["metadata"]
                bucket[(meta.get("namespace", ""), meta["name"])] = obj
                self._index(key, obj, None)
        for key, ns, name, manager, paths in data.get("applied", []):
            self.applied.setdefault((key, ns, name), {})[manager] = {tuple(p) for p in paths}
        return list(self._objects.get("apiextensions.k8s.io/customresourcedefinitions",
                                      {}).values())
