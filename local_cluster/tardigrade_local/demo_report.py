"""What the demo leaves behind: the loss-curve picture and the table of recoveries."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any


@dataclasses.dataclass
class Marker:
    """A disruption drawn on the loss curve, at the step it happened."""

    step: int
    label: str


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
    colors = {"preemption": "tab:red", "resize": "tab:orange"}
    for marker in markers:
        color = next((c for key, c in colors.items() if marker.label.startswith(key)), "k")
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
                reference_curve: dict[int, float], path: Path) -> Path:
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
    path.write_text("\n".join(lines) + "\n")
    return path
