"""Container logs shipped off the nodes while they are written, as GKE's logging agent ships
them to Cloud Logging.

A real kubelet removes a pod's log files once the pod is deleted, and the operator deletes a
relaunched gang's old pods within seconds: what a user reads afterwards is the copy their
logging agent shipped. On GKE that agent (a DaemonSet of fluent-bit) tails the files the
kubelet writes on each node (`/var/log/pods/<namespace>_<pod>_<uid>/<container>/<restart
count>.log`, CRI lines) and ships each line once. `LogShipper` is that agent for one namespace
of a local cluster: every `POLL_SECONDS` it reads what each node's pod log files gained and
appends it, whole lines only, to the same layout under its own directory, so that what reads
the kubelets' files (`steplog.StepLog.from_pod_log_dirs`) reads these too.

It reads the node's files, not the API: the API's `pods/log` goes through kube-apiserver's
connection to the kubelet, and a node recreated under its name and address left that
connection hanging for minutes while the new pod ran (shipped logs stayed empty). Lines a
container writes within `POLL_SECONDS` of its pod's removal may be missed, as an agent that
had not yet read them misses them; a node's files outlive its VM here (retired nodes' folders
stay), so what a node had written before it was lost is shipped.

The files are read, never followed: links and anything but regular files are skipped (a pod
writes under the folder of its own log, through containerd, not us). Rotated files
(`<n>.log.<time>`, kubelet's containerLogMaxSize, 10 MiB by default) are not shipped.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

log = logging.getLogger(__name__)

POLL_SECONDS = 0.2


class _Tail:
    """One source file's shipped length, and the file it was read from (a new inode starts
    over)."""

    def __init__(self, inode: int) -> None:
        self.inode = inode
        self.offset = 0


class LogShipper:
    """```
    with LogShipper(lambda: [node.pod_logs_dir for node in cluster.all_nodes()],
                    directory, "default"):
        ...  # every container run of the namespace's pods lands under `directory`
    ```"""

    def __init__(self, log_dirs: Callable[[], Iterable[Path]], directory: Path,
                 namespace: str) -> None:
        self.log_dirs = log_dirs
        self.directory = directory
        self.namespace = namespace
        self._tails: dict[Path, _Tail] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="log-shipper", daemon=True)

    def __enter__(self) -> LogShipper:
        return self.start()

    def start(self) -> LogShipper:
        self.directory.mkdir(parents=True, exist_ok=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """Ends the agent, after a last pass (what was written until now is shipped)."""
        self._stop.set()
        if self._thread.ident is not None:  # started (a stop may come from a failed start)
            self._thread.join(30)
        self.ship_once()

    def _run(self) -> None:
        while not self._stop.wait(POLL_SECONDS):
            try:
                self.ship_once()
            except Exception:  # a node's folder that went away mid-pass: the next pass
                log.debug("log shipper's pass failed", exc_info=True)

    def ship_once(self) -> None:
        """One pass over every node's pod log files of the namespace."""
        with self._lock:
            for logs in list(self.log_dirs()):
                for source, relative in self._runs(logs):
                    self._ship(source, self.directory / relative)

    def _runs(self, logs: Path) -> Iterable[tuple[Path, Path]]:
        try:
            pods = [entry for entry in os.scandir(logs)
                    if entry.name.startswith(f"{self.namespace}_")
                    and entry.is_dir(follow_symlinks=False)]
        except OSError:
            return
        for pod in pods:
            try:
                containers = [entry for entry in os.scandir(pod.path)
                              if entry.is_dir(follow_symlinks=False)]
                for container in containers:
                    for run in os.scandir(container.path):
                        if run.name.endswith(".log") and run.name[:-4].isdigit():
                            yield (Path(run.path),
                                   Path(pod.name) / container.name / run.name)
            except OSError:  # removed with its pod meanwhile
                continue

    def _ship(self, source: Path, target: Path) -> None:
        try:
            # Non-blocking: a FIFO in its place would hold the open until a writer came.
            fd = os.open(source, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            return
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                return
            tail = self._tails.get(source)
            if tail is None or tail.inode != info.st_ino:
                tail = self._tails[source] = _Tail(info.st_ino)
            if info.st_size <= tail.offset:
                return
            os.lseek(fd, tail.offset, os.SEEK_SET)
            gained = b""
            while len(gained) < info.st_size - tail.offset:
                chunk = os.read(fd, info.st_size - tail.offset - len(gained))
                if not chunk:
                    break
                gained += chunk
        finally:
            os.close(fd)
        whole = gained[:gained.rfind(b"\n") + 1]  # a line still being written waits
        if not whole:
            return
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target, "ab") as out:
            out.write(whole)
        tail.offset += len(whole)
