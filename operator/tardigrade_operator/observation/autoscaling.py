"""What a node autoscaler said about the gang's unschedulable pods, read from Events. Pure.

The cluster autoscaler reports on each pod it considered, as an Event on the pod
(cluster-autoscaler/processors/status/eventing_scale_up_processor.go, `Process`):
- `TriggeredScaleUp` ("pod triggered scale-up: [{<group> <from>-><to> (max: N)}]"): a node
  group is growing for it; the node takes minutes (GPU/TPU) to register;
- `NotTriggerScaleUp` ("pod didn't trigger scale-up: <reasons>"): no node group can take it
  (at its max size, no group whose nodes would fit, ...);
- `FailedScaleUp` (seen on GKE pods: "Node scale up in zones ... associated with this pod
  failed: GCE out of resources"; its emitter is not in the cluster-autoscaler files named
  above, so its exact wording is unverified): a scale-up was tried and the cloud could not
  deliver.
Only the newest of these for a pod counts: a later verdict replaces an earlier one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from datetime import datetime, timedelta
from typing import Any

from tardigrade_contract import contract

TRIGGERED_SCALE_UP = "TriggeredScaleUp"
NOT_TRIGGER_SCALE_UP = "NotTriggerScaleUp"
FAILED_SCALE_UP = "FailedScaleUp"
SCALE_UP_REASONS = frozenset({TRIGGERED_SCALE_UP, NOT_TRIGGER_SCALE_UP, FAILED_SCALE_UP})


@dataclasses.dataclass(frozen=True)
class ScaleUpSignal:
    """The newest autoscaler verdict on one pod."""

    reason: str  # one of SCALE_UP_REASONS
    time: datetime
    message: str = ""

    @property
    def triggered(self) -> bool:
        return self.reason == TRIGGERED_SCALE_UP

    def in_progress(self, now: datetime, wait: timedelta) -> bool:
        """A scale-up for this pod is under way and not yet overdue."""
        return self.triggered and now - self.time < wait


def parse_event(event: Mapping[str, Any]) -> tuple[str, ScaleUpSignal] | None:
    """(pod name, signal) for an autoscaler Event on a pod (API JSON, core/v1 or events.k8s.io
    field names); None for any other event."""
    reason = event.get("reason")
    regarding = event.get("involvedObject") or event.get("regarding") or {}
    if reason not in SCALE_UP_REASONS or regarding.get("kind") != "Pod":
        return None
    # A repeated event keeps its firstTimestamp and moves lastTimestamp (or series).
    stamp = (event.get("lastTimestamp") or (event.get("series") or {}).get("lastObservedTime")
             or event.get("eventTime") or event.get("firstTimestamp")
             or (event.get("metadata") or {}).get("creationTimestamp"))
    when = contract.parse_time(str(stamp or ""))
    if when is None or not regarding.get("name"):
        return None
    message = str(event.get("message") or event.get("note") or "")
    return str(regarding["name"]), ScaleUpSignal(str(reason), when, message)


def newest_signals(events: Iterable[Mapping[str, Any]]) -> dict[str, ScaleUpSignal]:
    """Pod name -> the newest autoscaler verdict on it."""
    newest: dict[str, ScaleUpSignal] = {}
    for event in events:
        parsed = parse_event(event)
        if parsed is None:
            continue
        pod, signal = parsed
        if pod not in newest or signal.time >= newest[pod].time:
            newest[pod] = signal
    return newest
