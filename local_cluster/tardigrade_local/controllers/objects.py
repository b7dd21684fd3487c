"""Pure functions the workload controllers share: ownership, selectors, times, templates."""

from __future__ import annotations

import copy
import datetime as dt
import json
from collections.abc import Iterable, Mapping
from typing import Any

from tardigrade_local.apiserver.selectors import labels_match, selector_from_match

Obj = dict[str, Any]

HASH_LABEL = "pod-template-hash"
REVISION_ANNOTATION = "deployment.kubernetes.io/revision"
DESIRED_REPLICAS_ANNOTATION = "deployment.kubernetes.io/desired-replicas"
MAX_REPLICAS_ANNOTATION = "deployment.kubernetes.io/max-replicas"
# The alphabet of k8s.io/apimachinery's rand.SafeEncodeString (no vowels, no look-alikes).
_SAFE_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"


def rfc3339(when: dt.datetime) -> str:
    return when.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(value: str | None) -> dt.datetime | None:
    if not value:
        return None
    try:
        return dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None


def controller_ref(owner: Mapping[str, Any]) -> Obj:
    meta = owner["metadata"]
    return {"apiVersion": owner.get("apiVersion", "apps/v1"), "kind": owner["kind"],
            "name": meta["name"], "uid": meta["uid"], "controller": True,
            "blockOwnerDeletion": True}


def controlled_by(obj: Mapping[str, Any], owner: Mapping[str, Any]) -> bool:
    uid = owner["metadata"].get("uid")
    return any(ref.get("controller") and ref.get("uid") == uid
               for ref in obj["metadata"].get("ownerReferences") or [])


def owned(objs: Iterable[Obj], owner: Mapping[str, Any]) -> list[Obj]:
    """Objects in the owner's namespace that it controls and its selector still selects."""
    namespace = owner["metadata"].get("namespace")
    reqs = selector_from_match((owner.get("spec") or {}).get("selector") or {})
    return [o for o in objs if o["metadata"].get("namespace") == namespace
            and controlled_by(o, owner) and labels_match(reqs, o)]


def template_hash(template: Mapping[str, Any], collision_count: int = 0) -> str:
    """The `pod-template-hash` label value: FNV-1a (32 bit) of the template, written in the
    alphabet of rand.SafeEncodeString like upstream. Upstream hashes Go's printed struct, so
    the values differ from a real cluster's; what matters is that equal templates agree."""
    data = json.dumps(template, sort_keys=True, separators=(",", ":")).encode()
    if collision_count:
        data += str(collision_count).encode()
    value = 0x811C9DC5
    for byte in data:
        value = ((value ^ byte) * 0x01000193) & 0xFFFFFFFF
    return "".join(_SAFE_ALPHABET[ord(ch) % len(_SAFE_ALPHABET)] for ch in str(value))


def without_hash(template: Mapping[str, Any]) -> Obj:
    """A pod template with the pod-template-hash label removed, for comparisons."""
    out = copy.deepcopy(dict(template))
    meta = out.setdefault("metadata", {})
    labels = {k: v for k, v in (meta.get("labels") or {}).items() if k != HASH_LABEL}
    if labels:
        meta["labels"] = labels
    else:
        meta.pop("labels", None)
    for key in [k for k, v in meta.items() if v in ({}, None)]:
        meta.pop(key)
    return out


def pod_ready(pod: Mapping[str, Any]) -> tuple[bool, dt.datetime | None]:
    """Whether the pod's Ready condition is True, and since when."""
    for cond in (pod.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Ready":
            return cond.get("status") == "True", parse_time(cond.get("lastTransitionTime"))
    return False, None


def is_active(pod: Mapping[str, Any]) -> bool:
    """Counts towards a ReplicaSet's replicas: not finished and not being deleted."""
    phase = (pod.get("status") or {}).get("phase")
    return phase not in ("Succeeded", "Failed") and not pod["metadata"].get("deletionTimestamp")


def condition(kind: str, status: bool, reason: str, message: str, now: dt.datetime,
              previous: Mapping[str, Any] | None, refresh: bool = False) -> Obj:
    """A workload condition. lastTransitionTime moves when the status flips; lastUpdateTime
    when status, reason or message change, or when `refresh` says progress was made."""
    text = "True" if status else "False"
    stamp = rfc3339(now)
    prev = dict(previous or {})
    flipped = prev.get("status") != text
    changed = flipped or (prev.get("reason"), prev.get("message")) != (reason, message)
    return {
        "type": kind, "status": text,
        "lastUpdateTime": stamp if changed or refresh else prev.get("lastUpdateTime", stamp),
        "lastTransitionTime": stamp if flipped else prev.get("lastTransitionTime", stamp),
        "reason": reason, "message": message,
    }
