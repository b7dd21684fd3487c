"""Host maintenance announced ahead on GKE GPU/TPU nodes: which ranks to move, and where not to
put them. Pure.

GPU and TPU VMs cannot live-migrate, so a host maintenance event terminates the node. From GKE
1.31.1-gke.2008000 on, GKE labels such a node with the event's scheduled start as Unix epoch
seconds, `cloud.google.com/scheduled-maintenance-time`, while the maintenance is upcoming and
not yet active (GKE "Monitor maintenance events", "Manage AI-optimized GKE clusters"; sources in
local_cluster/README.md, "Scheduled host maintenance"). A gang on such a node is moved before
the window on the gang's own terms: every rank saves on SIGTERM, and the relaunch keeps off
nodes whose maintenance comes before the relaunch's own horizon, with the required node
affinity GKE documents for this label (`DoesNotExist`, or `Gt` an epoch), which the scheduler
enforces on real clusters without anybody cordoning anything.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

from tardigrade_operator.observe import PodView

SCHEDULED_MAINTENANCE_LABEL = "cloud.google.com/scheduled-maintenance-time"

# (resourceVersion, label value) of one Node object, as the operator's node index keeps it.
MaintenanceEntry = tuple[int, str]


def scheduled_start(value: str | None) -> datetime | None:
    """The label's Unix epoch seconds as a time; None for a missing or unreadable value (a
    label nobody can read schedules nothing)."""
    if value is None or not value.strip().isdigit():
        return None
    return datetime.fromtimestamp(int(value.strip()), UTC)


def scheduled_nodes(entries: Iterable[tuple[str, list[MaintenanceEntry]]]
                    ) -> dict[str, datetime]:
    """Node name -> scheduled maintenance start, from the newest Node object of each name."""
    out: dict[str, datetime] = {}
    for node, values in entries:
        if not values:
            continue
        start = scheduled_start(max(values)[1])
        if start is not None:
            out[node] = start
    return out


@dataclasses.dataclass(frozen=True)
class MaintenanceWatch:
    scheduled: Mapping[str, datetime]  # node -> scheduled maintenance start
    now: datetime
    lead: timedelta  # move a gang this long before its node's maintenance; 0: never

    def due(self, pod: PodView) -> datetime | None:
        """The start of the maintenance that the pod's node has within the lead time."""
        if self.lead <= timedelta(0) or not pod.node_name or not pod.active or pod.deleting:
            return None
        start = self.scheduled.get(pod.node_name)
        if start is None or start - self.now > self.lead:
            return None
        return start

    def describe(self, pods: list[PodView]) -> str:
        parts = []
        for pod in pods:
            start = self.due(pod)
            if start is None:
                continue
            left = (start - self.now).total_seconds()
            when = f"in {left:.0f}s" if left >= 0 else f"{-left:.0f}s ago"
            parts.append(f"{pod.name} on node {pod.node_name} (host maintenance scheduled {when}, "
                         f"{start.isoformat()})")
        return ("moving the gang before host maintenance: " + "; ".join(parts)
                + f" (lead time {self.lead.total_seconds():g}s)")


def avoid_until(recorded: datetime, lead: timedelta) -> int:
    """Epoch seconds before which a relaunch recorded at `recorded` keeps off maintenance: the
    same horizon the decision looked ahead, so a gang is not put where it would be moved from
    at once. Derived from the recorded time, so a replayed launch renders the same pods."""
    return int((recorded + lead).timestamp())


def avoid_affinity(not_before: int) -> dict[str, Any]:
    """Required node affinity: nodes with no maintenance scheduled, or scheduled after
    `not_before` (terms are ORed; Gt compares the label as an integer)."""
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [
            {"matchExpressions": [{"key": SCHEDULED_MAINTENANCE_LABEL,
                                   "operator": "DoesNotExist"}]},
            {"matchExpressions": [{"key": SCHEDULED_MAINTENANCE_LABEL, "operator": "Gt",
                                   "values": [str(not_before)]}]},
        ]}}}
