"""The admin's rule that TrainingJobs carry a Kueue queue label (chart value
`kueue.requireQueueName`): Tardigrade's counterpart of Kueue's `manageJobsWithoutQueueName`
with its `managedJobsNamespaceSelector`, for a kind Kueue does not integrate itself. Pure.

Without the rule a job lacking `kueue.x-k8s.io/queue-name` runs outside any quota. With it, such
a job in a covered namespace is held before its first launch (no pods, no Workload) and told how
to get in line; the label added, the next pass queues it in Kueue as any labelled job. A gang
that already launched before the rule was turned on is not stopped: stopping training that ran
legitimately would lose work for a policy that was not in force when it started; it simply
finishes (or is relabelled by its owner).
"""

from __future__ import annotations

import dataclasses
import json
import re

from tardigrade_operator.api.types import TrainingJobStatus

SETTING = "kueue.requireQueueName"
ENV = "TARDIGRADE_REQUIRE_QUEUE_NAME"
REASON = "QueueNameRequired"
# A namespace name (DNS-1123 label).
_NAMESPACE = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


@dataclasses.dataclass(frozen=True)
class QueueNameRule:
    """Where a job must name a LocalQueue: nowhere (the default), everywhere, or in the
    listed namespaces."""

    everywhere: bool = False
    namespaces: frozenset[str] = frozenset()

    def covers(self, namespace: str) -> bool:
        return self.everywhere or namespace in self.namespaces

    @classmethod
    def parse(cls, value: str | None) -> QueueNameRule:
        """The env var as the chart renders it (toJson): `false`, `true` or a JSON list of
        namespace names; empty is the default (off). ValueError names the setting."""
        if value is None or not value.strip():
            return cls()
        try:
            parsed = json.loads(value)
        except ValueError:
            parsed = None
        if isinstance(parsed, bool):
            return cls(everywhere=parsed)
        if isinstance(parsed, list) and all(isinstance(n, str) for n in parsed):
            bad = [n for n in parsed if not _NAMESPACE.match(n)]
            if not bad:
                return cls(namespaces=frozenset(parsed))
            raise ValueError(f"{ENV} ({SETTING}): {', '.join(map(repr, bad))} is not a "
                             "namespace name (lowercase letters, digits and '-', at most 63)")
        raise ValueError(f"{ENV}={value!r} ({SETTING}): expected false, true (every namespace) "
                         'or a JSON list of namespace names, e.g. ["team-a", "team-b"]')


def held_for_queue_name(rule: QueueNameRule, namespace: str, queue: str | None,
                        launched: bool) -> bool:
    """Whether the rule holds this job: in a covered namespace, without a queue label, and
    never launched (a gang that ran before the rule was on is left to run)."""
    return queue is None and not launched and rule.covers(namespace)


def launched_outside_kueue(status: TrainingJobStatus) -> bool:
    """Whether the job's gang was launched outside Kueue: the rule leaves such a gang to run.
    One that ran under Kueue (`status.queue` set) or that the rule already holds (phase
    Queued) and then lost its queue label is held: a label removed must not be a way around
    the quota."""
    return status.attempt > 0 and status.queue is None and status.phase != "Queued"


def fix_message(namespace: str) -> str:
    """What the owner of a held job is told to do."""
    return (f"this namespace requires TrainingJobs to queue in Kueue: add the label "
            f"kueue.x-k8s.io/queue-name: <a LocalQueue of namespace {namespace}> to the "
            f"TrainingJob, or ask the cluster admin (chart value {SETTING})")
