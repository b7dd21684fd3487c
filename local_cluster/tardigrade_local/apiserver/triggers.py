"""Which watchers an event can concern, as the API server's watch cache picks them.

Upstream, a resource's storage may register one trigger function (pods: `spec.nodeName`,
`pkg/registry/core/pod/strategy.go` NodeNameTriggerFunc, wired in
`pkg/registry/core/pod/storage/storage.go`). A watch whose field selector requires an exact
value of that field is filed under the value (`cacher.go` Cacher.Watch, indexedWatchers
.addWatcher); an event goes to the unindexed watchers and to those filed under the trigger
value of the object and of its previous version (`cacher.go` triggerValuesThreadUnsafe,
startDispatching). A kubelet's pod watch (`fieldSelector=spec.nodeName=<node>`) thus sees no
event of another node's pods: the dispatch cost per event does not grow with the nodes.
"""

from __future__ import annotations

from typing import Any

from .selectors import FieldRequirement

# Storage key ("group/plural") -> the one indexed field.
TRIGGER_FIELDS = {"/pods": "spec.nodeName"}


def watch_trigger(key: str, fields: list[FieldRequirement]) -> str | None:
    """The value a watch is filed under, or None: it sees every event of its type."""
    path = TRIGGER_FIELDS.get(key)
    if path is None:
        return None
    # fields.Selector.RequiresExactMatch (apimachinery `pkg/fields/selector.go`): the first
    # "=" term on the field; a "!=" term names no value.
    return next((r.value for r in fields if r.path == path and r.op == "="), None)


def event_triggers(key: str, obj: dict[str, Any], old: dict[str, Any] | None) -> set[str]:
    """The trigger values of an event: the object's and its previous version's."""
    path = TRIGGER_FIELDS.get(key)
    if path is None:
        return set()
    return {_value(o, path) for o in (obj, old) if o is not None}


def _value(obj: dict[str, Any], path: str) -> str:
    cur: Any = obj
    for part in path.split("."):
        cur = cur.get(part) if isinstance(cur, dict) else None
    return "" if cur is None else str(cur)
