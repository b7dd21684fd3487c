"""Whether the pods a job's pod index lacks are only the ones this operator just created.

A pass that finds fewer ranks in the index than it launched asks the API server before it
calls them gone (the index may lag). Right after a launch it always lags: the pods' ADDED
events come after the creates' answers, and under load seconds after. Asking then costs one
pod list per launching job per pass (a thousand jobs launching: the API server's busiest
request). Pods this operator created, whose creates succeeded and which the index has not
shown yet, exist or their events are on the way and wake the job; past
`INDEX_GRACE_SECONDS`, or once the index has shown a pod and lost it, the API server is asked.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from tardigrade_operator import naming

# How long an index may lag behind our own creates before the API server is asked.
INDEX_GRACE_SECONDS = 10.0


@dataclasses.dataclass(frozen=True)
class Created:
    """The pods one pass created (all creates answered), by attempt, and when."""

    names_by_attempt: Mapping[int, frozenset[str]]
    at: float  # the event loop's clock
    # Those the index has shown since: one missing again is gone (deleted), not awaited.
    seen: frozenset[str] = frozenset()

    def saw(self, names: Iterable[str]) -> Created:
        new = self.seen | frozenset(names)
        return self if new == self.seen else dataclasses.replace(self, seen=new)


def created(pods: Iterable[Mapping[str, Any]], at: float) -> Created | None:
    """What a plan's `create_pods` made, once the writer has created them all."""
    by_attempt: dict[int, set[str]] = {}
    for pod in pods:
        meta = pod.get("metadata") or {}
        attempt = str((meta.get("labels") or {}).get(naming.LABEL_ATTEMPT, ""))
        if attempt.isdigit() and meta.get("name"):
            by_attempt.setdefault(int(attempt), set()).add(str(meta["name"]))
    if not by_attempt:
        return None
    return Created({a: frozenset(n) for a, n in by_attempt.items()}, at)


def awaiting_own_creates(last: Created | None, attempt: int, indexed: Iterable[str],
                         replicas: int, now: float, grace: float = INDEX_GRACE_SECONDS) -> bool:
    """The index shows `indexed` (names of the attempt's pods): do the pods we created for
    the attempt within `grace` make up the rest of its `replicas`?"""
    if last is None or now - last.at > grace:
        return False
    ours = last.names_by_attempt.get(attempt)
    if not ours:
        return False
    seen = set(indexed)
    return len(seen) + len(ours - seen - last.seen) >= replicas
