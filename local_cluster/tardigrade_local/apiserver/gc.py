"""The garbage collector: ownerReferences, cascading deletion, and namespace cleanup.

Like kube-controller-manager's GC it works from the event stream, after the fact: deleting
an owner in the background returns at once and dependents disappear shortly after.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
from typing import Any

from .core import CRD_KEY, NAMESPACE_KEY, Core
from .crds import CLEANUP_FINALIZER
from .errors import ApiError
from .resources import ResourceType
from .store import WatchEvent

log = logging.getLogger(__name__)


class GarbageCollector:
    def __init__(self, core: Core) -> None:
        self.core = core
        self.store = core.store
        self._pending: asyncio.Queue[WatchEvent] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self.store.listeners.append(self._pending.put_nowait)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while True:
            event = await self._pending.get()
            try:
                self.process(event)
            except Exception:  # one bad object must not stop collection
                log.exception("garbage collection of %s failed", event.obj["metadata"])

    # ---- lookups ---------------------------------------------------------------------------
    def _type_of(self, key: str) -> ResourceType | None:
        group, _, plural = key.partition("/")
        for rt in self.core.registry.all():
            if rt.group == group and rt.plural == plural:
                return rt
        return None

    def _uid_exists(self, uid: str) -> bool:
        return self.store.by_uid(uid) is not None

    def _dependents(self, uid: str) -> list[tuple[str, dict[str, Any]]]:
        return self.store.dependents(uid)

    def _delete(self, key: str, obj: dict[str, Any], propagation: str) -> None:
        rt = self._type_of(key)
        if rt is None:
            return
        meta = obj["metadata"]
        try:
            self.core.delete(rt, meta.get("namespace", ""), meta["name"],
                             {"preconditions": {"uid": meta["uid"]}}, propagation=propagation)
        except ApiError as err:
            if err.code not in (404, 409):
                raise

    def _update_meta(self, key: str, obj: dict[str, Any], **changes: Any) -> None:
        rt = self._type_of(key)
        if rt is None:
            return
        fresh = copy.deepcopy(obj)
        for field, value in changes.items():
            if value is None:
                fresh["metadata"].pop(field, None)
            else:
                fresh["metadata"][field] = value
        meta = fresh["metadata"]
        with contextlib.suppress(ApiError):
            self.core.update(rt, meta.get("namespace", ""), meta["name"], fresh, current=obj)

    # ---- the rules ---------------------------------------------------------------------------
    def process(self, event: WatchEvent) -> None:
        obj = event.obj
        meta = obj["metadata"]
        uid = meta.get("uid")
        if event.type == "DELETED":
            self._owner_gone(uid)
        elif meta.get("deletionTimestamp"):
            finalizers = meta.get("finalizers") or []
            if "orphan" in finalizers:
                self._orphan(event.key, obj)
            elif "foregroundDeletion" in finalizers:
                self._foreground(event.key, obj)
        if event.type == "ADDED" and meta.get("ownerReferences"):
            self._check_owners_exist(event.key, obj)
        # A dependent that went away may unblock owners waiting in foreground deletion.
        for ref in meta.get("ownerReferences") or []:
            if event.type == "DELETED" or meta.get("deletionTimestamp"):
                self._recheck_foreground_owner(ref.get("uid"))
        if event.key == CRD_KEY and meta.get("deletionTimestamp"):
            self._crd_cleanup(obj)
        elif event.type == "DELETED":
            rt = self._type_of(event.key)
            crd = (self.store.peek(CRD_KEY, "", f"{rt.plural}.{rt.group}")
                   if rt is not None and not rt.builtin else None)
            if crd is not None and crd["metadata"].get("deletionTimestamp"):
                self._crd_cleanup(crd)
        namespace = meta.get("namespace")
        if event.key == NAMESPACE_KEY and meta.get("deletionTimestamp"):
            self._namespace(meta["name"])
        elif namespace and event.type == "DELETED":
            ns_obj = self.store.peek(NAMESPACE_KEY, "", namespace)
            if ns_obj is not None and ns_obj["metadata"].get("deletionTimestamp"):
                self._namespace(namespace)

    def _owner_gone(self, uid: str | None) -> None:
        if not uid:
            return
        for key, dep in self._dependents(uid):
            refs = dep["metadata"].get("ownerReferences") or []
            others = [r for r in refs if r.get("uid") != uid]
            if others and any(self._uid_exists(r.get("uid", "")) for r in others):
                self._update_meta(key, dep, ownerReferences=others)
            else:
                self._delete(key, copy.deepcopy(dep), "Background")

    def _orphan(self, key: str, owner: dict[str, Any]) -> None:
        uid = owner["metadata"]["uid"]
        for dep_key, dep in self._dependents(uid):
            refs = [r for r in dep["metadata"].get("ownerReferences") or []
                    if r.get("uid") != uid]
            self._update_meta(dep_key, dep, ownerReferences=refs or None)
        fresh = self.store.get(key, owner["metadata"].get("namespace", ""),
                               owner["metadata"]["name"])
        if fresh is not None:
            finalizers = [f for f in fresh["metadata"].get("finalizers") or [] if f != "orphan"]
            self._update_meta(key, fresh, finalizers=finalizers or None)

    def _foreground(self, key: str, owner: dict[str, Any]) -> None:
        uid = owner["metadata"]["uid"]
        for dep_key, dep in self._dependents(uid):
            if not dep["metadata"].get("deletionTimestamp"):
                self._delete(dep_key, copy.deepcopy(dep), "Foreground")
        self._finish_foreground(key, owner)

    def _finish_foreground(self, key: str, owner: dict[str, Any]) -> None:
        uid = owner["metadata"]["uid"]
        blocking = [d for _, d in self._dependents(uid)
                    if any(r.get("uid") == uid and r.get("blockOwnerDeletion")
                           for r in d["metadata"].get("ownerReferences") or [])]
        if blocking:
            return
        fresh = self.store.get(key, owner["metadata"].get("namespace", ""),
                               owner["metadata"]["name"])
        if fresh is None:
            return
        finalizers = [f for f in fresh["metadata"].get("finalizers") or []
                      if f != "foregroundDeletion"]
        self._update_meta(key, fresh, finalizers=finalizers or None)

    def _recheck_foreground_owner(self, uid: str | None) -> None:
        if not uid:
            return
        found = self.store.by_uid(uid)
        if found is not None:
            key, obj = found
            meta = obj["metadata"]
            if meta.get("deletionTimestamp") and "foregroundDeletion" in (
                    meta.get("finalizers") or []):
                self._finish_foreground(key, copy.deepcopy(obj))

    def _check_owners_exist(self, key: str, obj: dict[str, Any]) -> None:
        refs = obj["metadata"].get("ownerReferences") or []
        if refs and not any(self._uid_exists(r.get("uid", "")) for r in refs):
            # Every owner is absent: the real GC deletes such dependents.
            self._delete(key, copy.deepcopy(obj), "Background")

    def _crd_cleanup(self, crd: dict[str, Any]) -> None:
        """Delete every custom resource of a terminating CRD, then let the CRD go."""
        if CLEANUP_FINALIZER not in (crd["metadata"].get("finalizers") or []):
            return
        spec = crd["spec"]
        key = f"{spec['group']}/{spec['names']['plural']}"
        remaining = [copy.deepcopy(o) for o in self.store.iter(key)]
        for obj in remaining:
            if not obj["metadata"].get("deletionTimestamp"):
                self._delete(key, obj, "Background")
        if not any(True for _ in self.store.iter(key)):
            fresh = self.store.get(CRD_KEY, "", crd["metadata"]["name"])
            if fresh is not None:
                finalizers = [f for f in fresh["metadata"].get("finalizers") or []
                              if f != CLEANUP_FINALIZER]
                self._update_meta(CRD_KEY, fresh, finalizers=finalizers or None)

    def _namespace(self, name: str) -> None:
        remaining = 0
        for key in self.store.type_keys():
            if key == NAMESPACE_KEY:
                continue
            for obj in list(self.store.iter(key, name)):
                remaining += 1
                if not obj["metadata"].get("deletionTimestamp"):
                    self._delete(key, copy.deepcopy(obj), "Background")
        if remaining == 0 or not any(True for key in self.store.type_keys() if key != NAMESPACE_KEY
                                     for _ in self.store.iter(key, name)):
            self.core.finish_namespace(name)
