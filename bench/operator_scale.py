"""Operator reaction latency and footprint on the local cluster.

    python bench/operator_scale.py [--jobs 10,50,100,200] [--kills 20]

For each job count N: N one-replica TrainingJobs whose pods are simulated (a sleeping Python
process, no JAX), the operator's resident memory and CPU in steady state, its reconcile passes
(rate and duration, from its own `tardigrade_reconcile_duration_seconds` histogram), then
`--kills` pods SIGKILLed one by one and the time from the moment a watching client sees the pod
fail to the moment the operator has created its replacement. Baselines measured in the same
run: the operator's memory with no jobs, and the API server's round trip for creating one pod
(the floor of any reaction). Targets: reaction p99 < 2 s, memory < 300 MiB at 200 jobs.
Prints one table at the end: a row per measure, a column per job count.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import kubernetes
import psutil
from kubernetes import watch
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / d) for d in ("operator", "trainer_image", "local_cluster")]

from tardigrade_local.cluster import LocalCluster  # noqa: E402
from tardigrade_local.kubelet import NodeConfig  # noqa: E402

NS = "default"
SLEEPER = ["python", "-c", "import signal, time; signal.pause()"]


def job(name: str) -> dict:
    return {
        "apiVersion": "tardigrade.dev/v1alpha1", "kind": "TrainingJob",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"replicas": 1, "image": "python:3.11-slim", "command": SLEEPER,
                 "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}},
                 "checkpoint": {"path": f"/tmp/bench/{name}"},
                 "failurePolicy": {"retryableExitCodes": [137], "backoffSeconds": 0}},
    }


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def sample(proc: psutil.Process, seconds: float) -> tuple[float, float]:
    """(RSS MiB, CPU % of one core) of the operator over `seconds`."""
    proc.cpu_percent(None)
    time.sleep(seconds)
    return proc.memory_info().rss / 2**20, proc.cpu_percent(None)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


Histogram = tuple[float, float, dict[float, float]]  # count, sum, cumulative count by bound


def reconcile_histogram(port: int) -> Histogram:
    """The operator's reconcile-duration histogram, scraped from its metrics endpoint."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    count, total, buckets = 0.0, 0.0, {}
    for family in text_string_to_metric_families(text):
        if family.name != "tardigrade_reconcile_duration_seconds":
            continue
        for sample_ in family.samples:
            if sample_.name.endswith("_count"):
                count = sample_.value
            elif sample_.name.endswith("_sum"):
                total = sample_.value
            elif sample_.name.endswith("_bucket"):
                buckets[float(sample_.labels["le"])] = sample_.value
    return count, total, buckets


def reconcile_stats(before: Histogram, after: Histogram, seconds: float
                    ) -> tuple[float, float, float]:
    """(passes per second, mean seconds, bucket bound holding the p99) between two scrapes."""
    count = after[0] - before[0]
    if count <= 0:
        return 0.0, float("nan"), float("nan")
    p99 = next(bound for bound in sorted(after[2])
               if after[2][bound] - before[2].get(bound, 0.0) >= 0.99 * count)
    return count / seconds, (after[1] - before[1]) / count, p99


class ReplacementClock:
    """Watches pods; for each failed pod, when its job's next attempt appeared."""

    def __init__(self, core: kubernetes.client.CoreV1Api) -> None:
        self.core = core
        self.failed_at: dict[str, float] = {}  # job -> when the failure was seen
        # A failed pod keeps sending events (status writes, its deletion) after its
        # replacement appeared, and every re-watch lists all pods as ADDED again: only the
        # first Failed of a pod starts the clock, only a pod never seen before stops it.
        self.seen: set[str] = set()
        self.failed: set[str] = set()
        self.latencies: list[float] = []
        self.events = threading.Condition()
        self._stop = False
        threading.Thread(target=self._run, daemon=True).start()

    def stop(self) -> None:
        self._stop = True

    def _run(self) -> None:
        while not self._stop:
            try:
                self._follow()
            except Exception:
                if self._stop:
                    return  # the cluster is going away with the bench

    def _follow(self) -> None:
        stream = watch.Watch().stream(self.core.list_namespaced_pod, NS,
                                      label_selector="tardigrade.dev/job",
                                      timeout_seconds=30)
        for event in stream:
            pod = event["object"]
            jobname = pod.metadata.labels["tardigrade.dev/job"]
            name = pod.metadata.name
            now = time.monotonic()
            with self.events:
                new = name not in self.seen
                self.seen.add(name)
                if pod.status.phase == "Failed" and name not in self.failed:
                    self.failed.add(name)
                    self.failed_at.setdefault(jobname, now)
                elif event["type"] == "ADDED" and new and jobname in self.failed_at:
                    self.latencies.append(now - self.failed_at.pop(jobname))
                    self.events.notify_all()

    def wait_replaced(self, count: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with self.events:
            while len(self.latencies) < count:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"only {len(self.latencies)}/{count} pods replaced")
                self.events.wait(left)


def create_pod_round_trip(core: kubernetes.client.CoreV1Api, repeats: int = 20) -> float:
    times = []
    for i in range(repeats):
        body = {"metadata": {"name": f"rt-{i}"}, "spec": {"nodeName": "nowhere",
                "containers": [{"name": "c", "image": "python"}]}}
        started = time.monotonic()
        core.create_namespaced_pod(NS, body)
        times.append(time.monotonic() - started)
        core.delete_namespaced_pod(f"rt-{i}", NS, grace_period_seconds=0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", default="10,50,100,200")
    parser.add_argument("--kills", type=int, default=20)
    args = parser.parse_args()
    counts = [int(c) for c in args.jobs.split(",")]
    state = Path(tempfile.mkdtemp(prefix="tardigrade-bench-"))
    nodes = [NodeConfig(f"local-node-{i}", capacity={"cpu": "64", "memory": "256Gi",
                                                    "pods": "500"}) for i in range(1, 3)]
    with LocalCluster(state / "cluster", nodes=nodes, with_gcs=False) as cluster:
        client = kubernetes.config.new_client_from_config(config_file=str(cluster.kubeconfig))
        core = kubernetes.client.CoreV1Api(client)
        custom = kubernetes.client.CustomObjectsApi(client)
        metrics_port = free_port()
        env = {**os.environ, **cluster.client_env(),
               "TARDIGRADE_METRICS_PORT": str(metrics_port),
               "TARDIGRADE_RESYNC_SECONDS": "2",
               "PYTHONPATH": os.pathsep.join(str(REPO / d) for d in
                                             ("operator", "trainer_image", "local_cluster"))}
        operator = subprocess.Popen(
            [sys.executable, "-m", "tardigrade_operator.cli", "operator", "run", "-n", NS,
             "--standalone", "--health-port", "0"], env=env,
            stdout=open(state / "operator.log", "wb"), stderr=subprocess.STDOUT)  # noqa: SIM115
        clock: ReplacementClock | None = None
        try:
            proc = psutil.Process(operator.pid)
            time.sleep(5)
            base_rss, base_cpu = sample(proc, 10)
            round_trip = create_pod_round_trip(core)
            clock = ReplacementClock(core)
            baseline = (f"baseline: operator with 0 jobs {base_rss:.0f} MiB, {base_cpu:.1f}% "
                        f"CPU; API create-pod round trip {round_trip * 1000:.1f} ms")
            print(baseline, flush=True)
            columns: dict[int, dict[str, str]] = {}
            created = 0
            for count in counts:
                for i in range(created, count):
                    custom.create_namespaced_custom_object(
                        "tardigrade.dev", "v1alpha1", NS, "trainingjobs", job(f"sim-{i}"))
                created = count
                deadline = time.monotonic() + 600
                while time.monotonic() < deadline:
                    jobs = custom.list_namespaced_custom_object(
                        "tardigrade.dev", "v1alpha1", NS, "trainingjobs")["items"]
                    if sum((j.get("status") or {}).get("phase") == "Running"
                           for j in jobs) == count:
                        break
                    time.sleep(1)
                else:
                    raise TimeoutError(f"{count} jobs did not all reach Running")
                histogram = reconcile_histogram(metrics_port)
                rss, cpu = sample(proc, 15)
                rate, mean, p99_bound = reconcile_stats(
                    histogram, reconcile_histogram(metrics_port), 15)
                before = len(clock.latencies)
                for k in range(args.kills):
                    victim = f"sim-{(k * 7) % count}"
                    pods = core.list_namespaced_pod(
                        NS, label_selector=f"tardigrade.dev/job={victim}").items
                    live = [p for p in pods if p.status.phase == "Running"
                            and not p.metadata.deletion_timestamp]
                    if not live:
                        continue
                    cluster.crash_pod(NS, live[-1].metadata.name)
                    clock.wait_replaced(before + 1, 60)
                    before = len(clock.latencies)
                    time.sleep(0.3)
                recent = clock.latencies[-args.kills:]
                p50, p99 = percentile(recent, 0.5), percentile(recent, 0.99)
                columns[count] = {
                    "operator RSS MiB (x idle)": f"{rss:.0f} ({rss / base_rss:.2f}x)",
                    "operator CPU % of one core": f"{cpu:.1f}",
                    "reconcile passes / s": f"{rate:.1f}",
                    "reconcile pass mean ms (p99 <= ms)": f"{mean * 1000:.1f} "
                                                          f"({p99_bound * 1000:g})",
                    "reaction p50 s": f"{p50:.2f}",
                    "reaction p99 s (x API round trip)": f"{p99:.2f} "
                                                         f"({p99 / round_trip:.0f}x)",
                }
                print(f"{count} jobs: " + "; ".join(f"{k} {v}" for k, v in
                                                    columns[count].items()), flush=True)
            print(f"\n{baseline}")
            print("| jobs | " + " | ".join(str(c) for c in columns) + " |")
            print("|---|" + "---|" * len(columns))
            for measure in next(iter(columns.values())):
                print(f"| {measure} | "
                      + " | ".join(column[measure] for column in columns.values()) + " |")
        finally:
            if clock is not None:
                clock.stop()
            operator.terminate()
            operator.wait(30)


if __name__ == "__main__":
    main()
