"""What the demo leaves behind: the loss-curve picture, the table of recoveries and where the
job's wall time went (its goodput account)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


@dataclasses.dataclass
class Marker:
    """A recovery drawn on the loss curve, at the step its new gang resumed from."""

    step: int
    label: str
    cause: str = ""


def recovery_markers(recoveries: Sequence[Mapping[str, Any]]) -> list[Marker]:
    """The markers for a job's recorded recoveries (`status.recoveries`, camelCase).

    Each goes at the checkpoint step the relaunched gang restored (`restoreStep`): after a
    save on notice that is the step every rank saved at, which is where the curve really
    broke, not the step the demo happened to have read from the log when it acted.
    """
    markers = []
    for index, recovery in enumerate(recoveries):
        where = f"status.recoveries[{index}]"
        cause = recovery.get("cause")
        if not isinstance(cause, str) or not cause:
            raise ValueError(f"{where}.cause: expected the recovery's cause (e.g. "
                             f"'Preemption'), got {cause!r}")
        restored = _count(recovery.get("restoreStep"), f"{where}.restoreStep")
        lost = _count(recovery.get("stepsLost"), f"{where}.stepsLost") or 0
        step = restored or 0
        if cause == "Resize":
            label = (f"resize {_replicas(recovery.get('fromReplicas'))} -> "
                     f"{_replicas(recovery.get('toReplicas'))} at step {step}")
        elif restored is None:
            label = f"{cause.lower()}: no checkpoint, restarted from step 0"
        elif lost == 0:
            label = f"{cause.lower()} save at step {step}"
        else:
            label = (f"{cause.lower()} at step {step + lost}, resumed from step {step} "
                     f"({lost} steps lost)")
        markers.append(Marker(step, label, cause))
    return markers


def _count(value: Any, field: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{field}: expected a step count (an integer >= 0), got {value!r}")
    return value


def _replicas(value: Any) -> str:
    return "?" if value is None else str(value)


MARKER_COLORS = {"Preemption": "tab:red", "Resize": "tab:orange"}


def plot_losses(curve: dict[int, float], reference: dict[int, float], markers: list[Marker],
                path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # no display here, and none needed
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(9, 4.8), dpi=110)
    if reference:
        # Wide and pale underneath: where the two runs agree, the blue line sits inside it.
        axis.plot(list(reference), list(reference.values()), color="0.6", linewidth=5,
                  alpha=0.45, solid_capstyle="round", label="reference (undisturbed)", zorder=1)
    axis.plot(list(curve), list(curve.values()), color="tab:blue", linewidth=1.3,
              label="with preemption and resize", zorder=2)
    for marker in markers:
        color = MARKER_COLORS.get(marker.cause, "k")
        axis.axvline(marker.step, color=color, linestyle=":", linewidth=1.5)
        axis.annotate(marker.label, xy=(marker.step, 1.0), xycoords=("data", "axes fraction"),
                      xytext=(4, -14), textcoords="offset points", color=color, fontsize=9)
    axis.set_xlabel("step")
    axis.set_ylabel("training loss")
    axis.set_title("Tardigrade: the loss curve continues through a preemption and a resize")
    axis.grid(alpha=0.3)
    axis.legend(loc="lower left")
    figure.tight_layout()
    # What the picture shows, machine-readable, for whoever checks it (tests, CI).
    description = {"final_step": max(curve, default=0),
                   "markers": [{"step": m.step, "label": m.label} for m in markers],
                   "reference_steps": len(reference)}
    figure.savefig(path, metadata={"Description": json.dumps(description)})
    plt.close(figure)
    return path


def table_rows(job: dict[str, Any]) -> list[dict[str, Any]]:
    status = job.get("status") or {}
    rows = [{"attempt": 1, "cause": "launch", "replicas": (status.get("recoveries") or [{}])[0]
             .get("fromReplicas", status.get("replicas")), "restored step": "-",
             "steps lost": "-", "downtime (s)": "-"}]
    for recovery in status.get("recoveries") or []:
        rows.append({
            "attempt": recovery.get("attempt"),
            "cause": recovery.get("cause"),
            "replicas": recovery.get("toReplicas"),
            "restored step": recovery.get("restoreStep", "-"),
            "steps lost": recovery.get("stepsLost", "-"),
            "downtime (s)": recovery.get("downtimeSeconds", "-"),
        })
    return rows


def write_table(job: dict[str, Any], reference: dict[str, Any], curve: dict[int, float],
                reference_curve: dict[int, float], markers: list[Marker], path: Path) -> Path:
    rows = table_rows(job)
    headers = list(rows[0])
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(row[h]) for h in headers) + " |" for row in rows]
    status = job.get("status") or {}
    final_step = max(curve, default=0)
    final, ref_final = curve.get(final_step), reference_curve.get(final_step)
    lost = sum(int(r.get("stepsLost") or 0) for r in status.get("recoveries") or [])
    lines += [
        "",
        f"- final step: {final_step} (phase {status.get('phase')})",
        f"- final loss: {final:.4f}" if final is not None else "- final loss: -",
        f"- reference final loss: {ref_final:.4f}" if ref_final is not None
        else "- reference final loss: -",
        f"- steps lost in total: {lost}",
        f"- restarts: {status.get('restarts')}",
    ]
    # The same steps the picture marks, so the two cannot disagree.
    lines += [f"- marked on the curve: {marker.label}" for marker in markers]
    lines += goodput_lines(status.get("goodput"))
    path.write_text("\n".join(lines) + "\n")
    return path


def goodput_lines(account: Any) -> list[str]:
    """Where the job's wall time went (`status.goodput`, camelCase), as a table: the buckets
    in the order the operator writes them, which add up to the wall time."""
    if not isinstance(account, Mapping) or not isinstance(account.get("seconds"), Mapping):
        return ["", "- goodput: no account recorded"]
    wall = _seconds(account.get("wallSeconds"), "status.goodput.wallSeconds")
    fraction = _seconds(account.get("fraction"), "status.goodput.fraction")
    lines = ["", f"Goodput: {fraction:.1%} of {wall:.1f} s wall time", "",
             "| bucket | seconds | share |", "|---|---|---|"]
    for bucket, value in account["seconds"].items():
        seconds = _seconds(value, f"status.goodput.seconds.{bucket}")
        share = seconds / wall if wall else 0.0
        lines.append(f"| {bucket} | {seconds:.1f} | {share:.1%} |")
    return lines


def _seconds(value: Any, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise ValueError(f"{field} must be a number >= 0, got {value!r:.40}")
    return float(value)
