"""Pod and container status objects in the API's JSON shape, pure."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from tardigrade_local.gke.events import now_rfc3339

# Exit codes of processes killed by a signal, the way container runtimes report them.
SIGNAL_EXIT_BASE = 128


def exit_code(returncode: int) -> int:
    """asyncio/subprocess give -N for death by signal N; runtimes report 128+N."""
    return SIGNAL_EXIT_BASE - returncode if returncode < 0 else returncode


@dataclasses.dataclass
class ContainerRecord:
    """What the kubelet knows about one container; rendered as a containerStatus."""

    name: str
    image: str
    state: dict[str, Any] = dataclasses.field(
        default_factory=lambda: {"waiting": {"reason": "ContainerCreating"}}
    )
    last_state: dict[str, Any] = dataclasses.field(default_factory=dict)
    restart_count: int = 0
    container_id: str | None = None
    # Set by probes: a readiness probe holds `ready` back, a startup probe `started`.
    ready_flag: bool = True
    started_flag: bool = True

    @property
    def running(self) -> bool:
        return "running" in self.state

    @property
    def ready(self) -> bool:
        return self.running and self.ready_flag

    @property
    def terminated(self) -> dict[str, Any] | None:
        return self.state.get("terminated")

    def wait(self, reason: str, message: str = "") -> None:
        self.state = {"waiting": {"reason": reason, **({"message": message} if message else {})}}

    def start(self, container_id: str) -> None:
        self.container_id = container_id
        self.state = {"running": {"startedAt": now_rfc3339()}}

    def terminate(self, code: int, reason: str, message: str = "") -> None:
        started = (self.state.get("running") or {}).get("startedAt")
        terminated: dict[str, Any] = {
            "exitCode": code,
            "reason": reason,
            "startedAt": started or now_rfc3339(),
            "finishedAt": now_rfc3339(),
        }
        if message:
            terminated["message"] = message
        if self.container_id:
            terminated["containerID"] = self.container_id
        self.state = {"terminated": terminated}

    def prepare_restart(self) -> None:
        """Before a restart: the terminated state becomes lastState."""
        if self.terminated is not None:
            self.last_state = {"terminated": self.terminated}
        self.restart_count += 1
        self.container_id = None

    def to_json(self) -> dict[str, Any]:
        status: dict[str, Any] = {
            "name": self.name,
            "image": self.image,
            "imageID": f"local://{self.image}",
            "state": self.state,
            "lastState": self.last_state,
            "ready": self.ready,
            "started": self.running and self.started_flag,
            "restartCount": self.restart_count,
        }
        if self.container_id:
            status["containerID"] = self.container_id
        return status


def termination_reason(code: int, oom_killed: bool) -> str:
    if oom_killed:
        return "OOMKilled"
    return "Completed" if code == 0 else "Error"


def running_phase(records: Sequence[ContainerRecord], restart_policy: str) -> str | None:
    """The phase of a pod whose kubelet still manages it; None when it is terminal.

    Terminal when every container is terminated and none will restart.
    """
    if any(r.running for r in records):
        return "Running"
    terminated = [r.terminated for r in records]
    if all(t is not None for t in terminated):
        codes = [t["exitCode"] for t in terminated if t is not None]
        if restart_policy == "Always" or (restart_policy == "OnFailure" and any(codes)):
            return "Running"
        return None
    # Waiting: before the first start it is Pending; in a restart back-off it is Running.
    if any(r.restart_count or r.last_state for r in records):
        return "Running"
    return "Pending"


def final_phase(records: Sequence[ContainerRecord]) -> str:
    codes = [(r.terminated or {}).get("exitCode", 1) for r in records]
    return "Succeeded" if all(c == 0 for c in codes) else "Failed"


def condition(kind: str, status: bool, reason: str = "", message: str = "") -> dict[str, Any]:
    cond: dict[str, Any] = {"type": kind, "status": "True" if status else "False"}
    if reason:
        cond["reason"] = reason
    if message:
        cond["message"] = message
    return cond


def merge_conditions(
    existing: Sequence[Mapping[str, Any]], desired: Sequence[Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """Desired conditions replace those of the same type; others (e.g. one the API server's
    eviction handler added) stay. lastTransitionTime changes only when status changes."""
    now = now_rfc3339()
    old = {c["type"]: c for c in existing}
    merged: list[dict[str, Any]] = []
    for cond in desired:
        prev = old.get(cond["type"])
        changed = prev is None or prev.get("status") != cond["status"]
        merged.append(
            {
                **cond,
                "lastProbeTime": None,
                "lastTransitionTime": now if changed else prev.get("lastTransitionTime", now),
            }
        )
    kinds = {c["type"] for c in desired}
    return [*merged, *(dict(c) for c in existing if c["type"] not in kinds)]


def readiness_conditions(
    records: Sequence[ContainerRecord], phase: str, initialized: bool = True
) -> list[dict[str, Any]]:
    ready = bool(records) and all(r.ready for r in records) and phase == "Running"
    not_ready = [r.name for r in records if not r.ready]
    why = ("PodCompleted" if phase in ("Succeeded", "Failed") else "ContainersNotReady")
    message = "" if ready or why == "PodCompleted" else (
        f"containers with unready status: [{' '.join(not_ready)}]"
    )
    return [
        condition("PodReadyToStartContainers", True),
        condition("Initialized", initialized, "" if initialized else "ContainersNotInitialized"),
        condition("Ready", ready, "" if ready else why, message),
        condition("ContainersReady", ready, "" if ready else why, message),
        condition("PodScheduled", True),
    ]
