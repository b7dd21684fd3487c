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
enforces on real clusters without anybody cordoning anything. Every launch carries that
affinity while a lead time is set, not only a migration's: a gang put on a node due for
maintenance within the lead would only be moved again at once.

A multi-host TPU slice is interrupted whole: "When a host event happens to the VM within a TPU
slice, the entire slice gets interrupted" (GKE "Manage GKE node disruption for GPUs and TPUs";
Cloud TPU "Failure recovery of TPU instances": a multi-host slice is recovered or rescheduled
as a unit). A slice is one node pool (rendering/slice_placement.py), so for such gangs
maintenance is judged per pool: a rank moves when any node of its pool is due, and a launch
keeps off every pool with a node due before its horizon (`NotIn` on the pool label), not only
off that node.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from tardigrade_operator.observation.pods import PodView
from tardigrade_operator.rendering.slice_placement import NODE_POOL_LABEL

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
    # node -> node pool, for gangs whose pool is one TPU slice (judged per pool); None: per node
    pools: Mapping[str, str] | None = None

    def due_node(self, pod: PodView) -> tuple[str, datetime] | None:
        """(node, start) of the maintenance within the lead time that stops the pod: on its
        own node, or, judged per pool, on the earliest due node of its node's pool."""
        if self.lead <= timedelta(0) or not pod.node_name or not pod.active or pod.deleting:
            return None
        candidates = [pod.node_name]
        pool = None if self.pools is None else self.pools.get(pod.node_name)
        if pool is not None and self.pools is not None:
            candidates = [n for n in self.scheduled if self.pools.get(n) == pool]
        due = sorted((self.scheduled[n], n) for n in candidates
                     if n in self.scheduled and self.scheduled[n] - self.now <= self.lead)
        return None if not due else (due[0][1], due[0][0])

    def due(self, pod: PodView) -> datetime | None:
        """The start of the maintenance within the lead time that stops the pod."""
        found = self.due_node(pod)
        return None if found is None else found[1]

    def describe(self, pods: list[PodView]) -> str:
        parts = []
        for pod in pods:
            found = self.due_node(pod)
            if found is None:
                continue
            node, start = found
            left = (start - self.now).total_seconds()
            when = f"in {left:.0f}s" if left >= 0 else f"{-left:.0f}s ago"
            where = f"node {pod.node_name}"
            if node != pod.node_name:
                pool = (self.pools or {}).get(node)
                where += (f", whose TPU slice (node pool {pool}) goes with node {node} "
                          f"(host maintenance scheduled {when}, {start.isoformat()})")
                parts.append(f"{pod.name} on {where}")
                continue
            parts.append(f"{pod.name} on {where} (host maintenance scheduled {when}, "
                         f"{start.isoformat()})")
        return ("moving the gang before host maintenance: " + "; ".join(parts)
                + f" (lead time {self.lead.total_seconds():g}s)")


def avoid_until(recorded: datetime, lead: timedelta) -> int:
    """Epoch seconds before which a launch recorded at `recorded` keeps off maintenance: the
    same horizon the decision looked ahead, so a gang is not put where it would be moved from
    at once. Derived from the recorded time, so a replayed launch renders the same pods."""
    return int((recorded + lead).timestamp())


def pools_due(scheduled: Mapping[str, datetime], pools: Mapping[str, str],
              not_before: int) -> list[str]:
    """The node pools with a node whose maintenance starts before `not_before` (epoch)."""
    return sorted({pools[node] for node, start in scheduled.items()
                   if node in pools and start.timestamp() <= not_before})


def avoid_affinity(not_before: int, pools: Sequence[str] = ()) -> dict[str, Any]:
    """Required node affinity: nodes with no maintenance scheduled, or scheduled after
    `not_before` (terms are ORed; Gt compares the label as an integer), and, for TPU slices,
    outside `pools` (whole pools with a node due before then)."""
    outside = ([{"key": NODE_POOL_LABEL, "operator": "NotIn", "values": list(pools)}]
               if pools else [])
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [
            {"matchExpressions": [{"key": SCHEDULED_MAINTENANCE_LABEL,
                                   "operator": "DoesNotExist"}, *outside]},
            {"matchExpressions": [{"key": SCHEDULED_MAINTENANCE_LABEL, "operator": "Gt",
                                   "values": [str(not_before)]}, *outside]},
        ]}}}
