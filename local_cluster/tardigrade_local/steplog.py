"""Follow the trainer's JSON-lines log of rank 0 across attempts (pods come and go)."""

from __future__ import annotations

import json
from typing import Any

from kubernetes.client import CoreV1Api
from kubernetes.client.exceptions import ApiException

JOB_LABEL = "tardigrade.dev/job"
RANK_LABEL = "tardigrade.dev/rank"


class StepLog:
    """Losses by step (a step trained twice keeps both), restores and saves, from `kubectl logs`.

    Call `collect()` often enough that a pod's log is read before the operator deletes the pod.
    """

    def __init__(self, core: CoreV1Api, namespace: str, job: str) -> None:
        self.core = core
        self.namespace = namespace
        self.job = job
        self.losses: dict[int, list[float]] = {}
        self.restored: list[int] = []
        self.committed: list[int] = []
        self.records: list[dict[str, Any]] = []
        self._lines_seen: dict[str, int] = {}

    def collect(self) -> None:
        try:
            pods = self.core.list_namespaced_pod(
                self.namespace, label_selector=f"{JOB_LABEL}={self.job},{RANK_LABEL}=0").items
        except ApiException:
            return
        for pod in pods:
            name = pod.metadata.name
            try:
                text = self.core.read_namespaced_pod_log(name, self.namespace)
            except ApiException:
                continue
            lines = text.splitlines()
            # The last line may be half written: read it next time.
            complete = lines if text.endswith("\n") else lines[:-1]
            for line in complete[self._lines_seen.get(name, 0):]:
                self._read(line)
            self._lines_seen[name] = len(complete)

    def _read(self, line: str) -> None:
        try:
            record = json.loads(line)
        except ValueError:
            return
        if not isinstance(record, dict):
            return
        self.records.append(record)
        event = record.get("event")
        if event == "step":
            self.losses.setdefault(int(record["step"]), []).append(float(record["loss"]))
        elif event == "checkpoint_restored":
            self.restored.append(int(record["step"]))
        elif event == "checkpoint_committed":
            self.committed.append(int(record["step"]))

    @property
    def last_step(self) -> int:
        return max(self.losses, default=0)

    def curve(self) -> dict[int, float]:
        """The loss of each step as finally trained (the last time it was trained)."""
        return {step: values[-1] for step, values in sorted(self.losses.items())}
