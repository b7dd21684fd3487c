"""A TrainingJob's recovery timeline and goodput account, for `tardigrade timeline` and
`kubectl tardigrade`."""

from __future__ import annotations

from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from tardigrade_operator.api.types import TrainingJobStatus
from tardigrade_operator.decision.goodput import buckets


def timeline_table(name: str, status: TrainingJobStatus) -> Table:
    table = Table(title=f"TrainingJob {name}: recoveries", title_justify="left")
    for column in ("attempt", "cause", "detected", "replicas", "restored step", "steps lost",
                   "downtime", "reason"):
        table.add_column(column, overflow="fold")
    for recovery in status.recoveries:
        replicas = (f"{recovery.from_replicas} -> {recovery.to_replicas}"
                    if recovery.from_replicas != recovery.to_replicas
                    else str(recovery.to_replicas))
        table.add_row(
            str(recovery.attempt),
            recovery.cause,
            recovery.time.strftime("%H:%M:%S"),
            replicas,
            _dash(recovery.restore_step),
            _dash(recovery.steps_lost),
            "-" if recovery.downtime_seconds is None else f"{recovery.downtime_seconds:.1f}s",
            recovery.reason,
        )
    return table


# The goodput buckets in the order a job's time passes through them.
BUCKET_LABELS = {
    "queued": "waiting for capacity or admission",
    "podStart": "pods starting",
    "acceleratorStart": "trainer and accelerator start",
    "restore": "restoring the checkpoint",
    "compile": "compiling the step",
    "checkpointStall": "loop blocked by saves",
    "lostSteps": "steps lost to disruptions",
    "productive": "productive training",
    "other": "other (stopping, backoff, operator reaction, untracked)",
}


def goodput_table(name: str, status: TrainingJobStatus) -> Table | Text:
    """The job's wall time by bucket (status.goodput, decision/goodput.py)."""
    account = status.goodput
    if account is None:
        return Text("goodput: no account yet")
    wall = account.wall_seconds
    table = Table(title=f"TrainingJob {name}: goodput {account.fraction:.1%} of "
                  f"{wall:.1f}s wall time (to {account.accounted_until:%H:%M:%S})",
                  title_justify="left")
    for column in ("bucket", "seconds", "share", "what"):
        table.add_column(column, overflow="fold")
    for bucket, seconds in buckets(account).items():
        share = seconds / wall if wall else 0.0
        table.add_row(bucket, f"{seconds:.1f}", f"{share:.1%}", BUCKET_LABELS[bucket])
    return table


def summary(name: str, status: TrainingJobStatus) -> Text:
    restarts = status.restarts
    checkpoint = status.last_checkpoint
    lines = [
        f"{name}: {status.phase}, attempt {status.attempt}, {status.replicas} replicas, "
        f"step {_dash(status.step)}"
        + (f"/{status.total_steps}" if status.total_steps else ""),
        f"last checkpoint: {'-' if checkpoint is None else checkpoint.step}"
        + (f" at {checkpoint.path}" if checkpoint and checkpoint.path else ""),
        f"restarts: {restarts.preemptions} preemptions, {restarts.failures} failures, "
        f"{restarts.resizes} resizes, {restarts.retries} retries, "
        f"{restarts.rejections} node rejections",
        f"steps lost: {sum(r.steps_lost or 0 for r in status.recoveries)}, downtime: "
        f"{sum(r.downtime_seconds or 0 for r in status.recoveries):.1f}s",
    ]
    if status.loss is not None:
        lines.append(f"loss: {status.loss:.4f}")
    if status.message:
        lines.append(f"message: {status.message}")
    return Text("\n".join(lines))


def render(job: dict[str, Any]) -> Group:
    name = job.get("metadata", {}).get("name", "?")
    status = TrainingJobStatus.model_validate(job.get("status") or {})
    return Group(summary(name, status), timeline_table(name, status),
                 goodput_table(name, status))


def as_json(job: dict[str, Any]) -> dict[str, Any]:
    """The same facts for scripts (`-o json`): camelCase, as in the TrainingJob's status."""
    meta = job.get("metadata") or {}
    status = TrainingJobStatus.model_validate(job.get("status") or {})
    wire = status.model_dump(by_alias=True, exclude_none=True, mode="json")
    return {
        "namespace": meta.get("namespace"),
        "name": meta.get("name"),
        **{key: wire[key] for key in ("phase", "attempt", "replicas", "step", "totalSteps",
                                      "loss", "lastCheckpoint", "restarts", "message",
                                      "conditions") if key in wire},
        "stepsLost": sum(r.steps_lost or 0 for r in status.recoveries),
        "downtimeSeconds": round(sum(r.downtime_seconds or 0 for r in status.recoveries), 3),
        "recoveries": wire["recoveries"],
        **({"goodput": wire["goodput"]} if "goodput" in wire else {}),
    }


def _dash(value: object) -> str:
    return "-" if value is None else str(value)
