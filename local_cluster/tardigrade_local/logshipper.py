"""Container logs shipped off the nodes while they are written, as GKE's logging agent ships
them to Cloud Logging.

A real kubelet removes a pod's log files once the pod is deleted (and a container's older
runs as it garbage-collects them), and the operator deletes a relaunched gang's old pods within
seconds: what a user reads afterwards is the copy their logging agent shipped. `LogShipper`
is that agent for one namespace of a local cluster: it watches the pods, follows each
container's run through the API (`GET .../pods/NAME/log?follow=true&timestamps=true`) from
when it is seen running or finished, and writes it in the kubelet's own layout and format
(`<namespace>_<pod>_<uid>/<container>/<restart count>.log`, CRI lines), so that what reads
the kubelets' files (`steplog.StepLog.from_pod_log_dirs`) reads these too.

A run is followed from its start, so nothing it wrote is missed, unless the pod is deleted
before the shipper first sees the container (a run shorter than the watch's latency); a run
that had already ended when first seen is read whole if the API still serves it
(`previous=true` once the next run started).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kubernetes
import urllib3

log = logging.getLogger(__name__)

WATCH_SECONDS = 300
# Between two chunks of a followed log. A follow the API server forwarded over a connection
# to a VM that is gone gets nothing at all, not even an end, until kube-apiserver drops that
# connection; then the follow is made again (`_follow`). A trainer quiet for longer (a
# compile, a gang waiting for a node) costs only a read of its log again from the start.
READ_TIMEOUT_SECONDS = 60.0
STATUS_TIMEOUT_SECONDS = 20.0
RETRY_SECONDS = 2.0


def cri_line(stamped: str) -> str:
    """`<RFC 3339 time> <text>` (the API's `timestamps=true` line) as a CRI log line."""
    stamp, _, text = stamped.partition(" ")
    return f"{stamp} stdout F {text}\n"


class LogShipper:
    """```
    with LogShipper(new_client, directory, "default", "tardigrade.dev/job"):
        ...  # every container run of the selected pods lands under `directory`
    ```"""

    def __init__(self, new_client: Callable[[], kubernetes.client.ApiClient], directory: Path,
                 namespace: str, label_selector: str = "") -> None:
        self.new_client = new_client
        self.directory = directory
        self.namespace = namespace
        self.label_selector = label_selector
        self._shipped: set[tuple[str, str, int]] = set()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._watch: kubernetes.watch.Watch | None = None
        self._watcher = threading.Thread(target=self._run, name="log-shipper", daemon=True)

    def __enter__(self) -> LogShipper:
        return self.start()

    def start(self) -> LogShipper:
        self.directory.mkdir(parents=True, exist_ok=True)
        self._watcher.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        if self._watch is not None:
            self._watch.stop()
        if self._watcher.ident is not None:  # started (a stop may come from a failed start)
            self._watcher.join(30)
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join(5)

    # --- watching ----------------------------------------------------------------------------
    def _run(self) -> None:
        with self.new_client() as api:
            core = kubernetes.client.CoreV1Api(api)
            while not self._stop.is_set():
                self._watch = kubernetes.watch.Watch()
                try:
                    for event in self._watch.stream(core.list_namespaced_pod, self.namespace,
                                                    label_selector=self.label_selector,
                                                    timeout_seconds=WATCH_SECONDS):
                        self._seen(event["object"])
                except Exception as err:  # the cluster may be stopping: start over or end
                    if not self._stop.is_set():
                        log.info("log shipper's watch ended (%s); watching again", err)
                        self._stop.wait(1)

    def _seen(self, pod: Any) -> None:
        for status in pod.status.container_statuses or []:
            state = status.state
            if state is None or (state.running is None and state.terminated is None):
                current = None
            else:
                current = status.restart_count
            if status.restart_count > 0 and status.last_state is not None and (
                    status.last_state.terminated is not None):
                # The run before, if it was never followed: whole, while the API keeps it.
                self._ship(pod, status.name, status.restart_count - 1, previous=True)
            if current is not None:
                self._ship(pod, status.name, current, previous=False)

    def _ship(self, pod: Any, container: str, restart: int, previous: bool) -> None:
        key = (pod.metadata.uid, container, restart)
        with self._lock:
            if key in self._shipped or self._stop.is_set():
                return
            self._shipped.add(key)
            path = (self.directory / f"{self.namespace}_{pod.metadata.name}_{pod.metadata.uid}"
                    / container / f"{restart}.log")
            thread = threading.Thread(target=self._follow,
                                      args=(pod.metadata.name, container, restart, path,
                                            previous),
                                      name=f"log-{pod.metadata.name}-{container}",
                                      daemon=True)
            self._threads.append(thread)
        thread.start()

    def _follow(self, pod: str, container: str, restart: int, path: Path,
                previous: bool) -> None:
        """Write run `restart` of the container. A read the API server could not serve
        whole (its connection to the kubelet failed or went silent: a node recreated under
        its name and address, whose old connections lead nowhere) is made again while the
        run is still the container's current one, skipping the lines already written: the
        same run reads back the same, line for line, timestamps included."""
        path.parent.mkdir(parents=True, exist_ok=True)
        written = 0
        with self.new_client() as api, open(path, "w") as out:
            core = kubernetes.client.CoreV1Api(api)
            while not self._stop.is_set():
                try:
                    response = core.read_namespaced_pod_log(
                        pod, self.namespace, container=container, follow=not previous,
                        previous=previous, timestamps=True, _preload_content=False,
                        _request_timeout=(10, READ_TIMEOUT_SECONDS))
                except (kubernetes.client.ApiException, urllib3.exceptions.HTTPError) as err:
                    log.info("log of %s/%s not read: %s", pod, container,
                             getattr(err, "reason", err))
                    if previous or not self._running(core, pod, container, restart):
                        return
                    self._stop.wait(RETRY_SECONDS)
                    continue
                with contextlib.suppress(urllib3.exceptions.HTTPError, OSError):
                    seen = 0
                    pending = b""
                    for chunk in response.stream(64 * 1024):
                        pending += chunk
                        *lines, pending = pending.split(b"\n")
                        for line in lines:
                            seen += 1
                            if seen > written:
                                out.write(cri_line(line.decode(errors="replace")))
                                written = seen
                        out.flush()
                    if pending and seen + 1 > written:
                        out.write(cri_line(pending.decode(errors="replace")))
                        written = seen + 1
                response.release_conn()
                # Ended: the run is over, or the API server's read of it failed.
                if previous or not self._running(core, pod, container, restart):
                    return
                self._stop.wait(RETRY_SECONDS)

    def _running(self, core: kubernetes.client.CoreV1Api, pod: str, container: str,
                 restart: int) -> bool:
        """Whether run `restart` of the container still runs (an unanswered read: no)."""
        try:
            found = core.read_namespaced_pod(pod, self.namespace,
                                             _request_timeout=(10, STATUS_TIMEOUT_SECONDS))
        except (kubernetes.client.ApiException, urllib3.exceptions.HTTPError):
            return False
        return any(status.name == container and status.restart_count == restart
                   and status.state is not None and status.state.running is not None
                   for status in found.status.container_statuses or [])
