"""A TrainingJob's recovery timeline, for `tardigrade timeline` and `kubectl tardigrade`."""

from __future__ import annotations

from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from tardigrade_operator.api.types import TrainingJobStatus


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
    return Group(summary(name, status), timeline_table(name, status))


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
    }


def _dash(value: object) -> str:
    return "-" if value is None else str(value)
