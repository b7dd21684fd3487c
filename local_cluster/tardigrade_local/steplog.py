"""Follow the trainer's JSON-lines log of rank 0 across attempts (pods come and go)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import urllib3
from kubernetes.client import CoreV1Api
from kubernetes.client.exceptions import ApiException

from tardigrade_local import crilog

JOB_LABEL = "tardigrade.dev/job"
RANK_LABEL = "tardigrade.dev/rank"
ATTEMPT_LABEL = "tardigrade.dev/attempt"
# Each read's bound. The API server serves a pod's log from its node's kubelet: a read caught
# by the node's end (a spot VM gone, its connections never closed) would otherwise wait
# forever, the caller with it; a read cut off is made again at the next `collect`.
READ_TIMEOUT_SECONDS = 20.0


class StepLog:
    """Losses by step (a step trained twice keeps both), restores and saves, from `kubectl logs`.

    Call `collect()` often enough that a pod's log is read before the operator deletes the pod.
    Every record gets the `attempt` of the pod that wrote it.
    """

    def __init__(self, core: CoreV1Api | None, namespace: str, job: str) -> None:
        self.core = core
        self.namespace = namespace
        self.job = job
        self.losses: dict[int, list[float]] = {}
        self.restored: list[int] = []
        self.committed: list[int] = []
        self.records: list[dict[str, Any]] = []
        self._lines_seen: dict[str, int] = {}  # by pod name and restart count
        self._restarts_seen: dict[str, int] = {}

    @classmethod
    def from_pod_log_dirs(cls, pod_log_dirs: Iterable[Path], namespace: str, job: str
                          ) -> StepLog:
        """The complete log, from real kubelets' files (`<pod logs dir>/<namespace>_<pod>_
        <uid>/<container>/<restart count>.log`, one run each) under any number of nodes'
        directories, gone nodes' too, or as `logshipper.py` ships them: it still has the
        logs of pods already deleted and of nodes that are gone, which the API can no longer
        serve, and every run of a restarted container."""
        steplog = cls(None, namespace, job)
        pod_name = re.compile(rf"{re.escape(namespace)}_{re.escape(job)}-a(\d+)-0_[^_]+")
        pod_dirs = [(int(m.group(1)), d) for logs in pod_log_dirs
                    for d in logs.glob(f"{namespace}_{job}-a*-0_*")
                    if (m := pod_name.fullmatch(d.name))]
        for attempt, pod_dir in sorted(pod_dirs):
            runs = sorted((int(f.stem), f) for f in pod_dir.glob("*/*.log") if f.stem.isdigit())
            for _, log_file in runs:
                for line in crilog.text(log_file.read_bytes()).splitlines():
                    steplog._read(line, attempt)
        return steplog

    def collect(self) -> None:
        if self.core is None:
            return
        try:
            pods = self.core.list_namespaced_pod(
                self.namespace, label_selector=f"{JOB_LABEL}={self.job},{RANK_LABEL}=0",
                _request_timeout=READ_TIMEOUT_SECONDS).items
        except (ApiException, urllib3.exceptions.HTTPError):
            return
        for pod in pods:
            name = pod.metadata.name
            attempt = int((pod.metadata.labels or {}).get(ATTEMPT_LABEL, 0))
            restarts = max((s.restart_count or 0 for s in
                            (pod.status.container_statuses if pod.status else None) or []),
                           default=0)
            seen = self._restarts_seen.get(name, 0)
            if restarts > seen:
                # Restarted in its pod since the last read: finish the run before (the kubelet
                # keeps only the one before the current), then read the new one from the start.
                self._read_log(name, f"{name}#{restarts - 1}", attempt, previous=True)
                self._restarts_seen[name] = restarts
            self._read_log(name, f"{name}#{restarts}", attempt, previous=False)

    def _read_log(self, name: str, key: str, attempt: int, previous: bool) -> None:
        if self.core is None:
            return
        try:
            # An empty log comes back as None from the client.
            text = self.core.read_namespaced_pod_log(
                name, self.namespace, previous=previous,
                _request_timeout=READ_TIMEOUT_SECONDS) or ""
        except (ApiException, urllib3.exceptions.HTTPError):
            return
        lines = text.splitlines()
        # The last line may be half written: read it next time.
        complete = lines if text.endswith("\n") or previous else lines[:-1]
        for line in complete[self._lines_seen.get(key, 0):]:
            self._read(line, attempt)
        self._lines_seen[key] = len(complete)

    def _read(self, line: str, attempt: int) -> None:
        try:
            record = json.loads(line)
        except ValueError:
            return
        if not isinstance(record, dict):
            return
        record.setdefault("attempt", attempt)
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
