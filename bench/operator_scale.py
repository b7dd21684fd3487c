"""Many one-replica jobs on one operator: its steady-state cost and how fast it reacts.

    python bench/operator_scale.py [--jobs 10,200,1000] [--arms fixed,adaptive]
                                   [--changes 20] [--kills 20] [--settle 150] [--sample 30]
                                   [--fixed-up-to N] [--out FILE.json] [--plot FILE.png]

N one-replica TrainingJobs (cumulative over `--jobs`) on simulated nodes of the local cluster
(`simulator/`, benches only: pods without processes, each rank a `simgang.TrainerRank` that
steps every 50 ms and serves `/progress` on its pod IP, so the operator reads real HTTP
progress as from a trainer). Simulated, with zero latency: a container's start (no image pull, no
process), the trainer itself; real: the API server (CEL validation included), the kubelets'
pod lifecycle and status writes, the scheduler, the operator process and its HTTP reads. The
first arm of each N launches the new jobs: `running_after_s` is from the first create to every
job Running. At each N, each arm is the same operator code started afresh on the same jobs:
- `fixed`, the **baseline**: the loop before event-driven pacing (`TARDIGRADE_PACING=fixed`):
  every job passes every 2 s (`TARDIGRADE_RESYNC_SECONDS`) and reads rank 0 each time;
- `adaptive`: passes on events, reads progress with a back-off up to 60 s (pacing.py).
Once every job runs and `--settle` seconds have passed (the adaptive back-off doubles from 2 s
and needs ~2 min to reach its longest interval; the fixed arm settles 15 s at most), over
`--sample` seconds: the
operator's resident memory, its CPU (% of one core), its reconcile passes per second and their
duration (its own `tardigrade_reconcile_duration_seconds` histogram; the p99 is the bucket
holding it). Then reactions, one job at a time, timed by watches in this process:
- a change to a job (its spec's failurePolicy.backoffResetSeconds, a new generation) -> the
  operator's first action on it (its status write with the new observedGeneration);
- a pod SIGKILLed, from its Failed event -> the operator's first action (the failure recorded:
  status.restarts.total written) and -> the replacement pod created.
The reaction p99 judged is the worse of the two first actions.
Also the API server's create-pod round trip (the floor of any reaction) and the operator idle
with no job. Targets at 1,000 jobs (adaptive): CPU < 25% of a core, reaction p99 < 1 s,
memory < 300 MiB. An arm whose reactions timed out says so and judges no target. With
`--fixed-up-to N` the fixed arm runs only up to N jobs (it saturates beyond), and the bench
says that no baseline was measured at the larger counts.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kubernetes
import psutil
from kubernetes import watch
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / d) for d in ("operator", "trainer_image", "local_cluster")]

from tardigrade_local.cluster import LocalCluster, simulated_nodes  # noqa: E402
from tardigrade_local.ports import free_port  # noqa: E402

NS = "default"
GROUP, VERSION, PLURAL = "tardigrade.dev", "v1alpha1", "trainingjobs"
PODS_PER_NODE = 500
TARGETS = {"cpu": 25.0, "reaction_p99": 1.0, "rss": 300.0}
SIMULATED = (
    "simulated: nodes and pods without processes (simulator/simulated.py), a container starts "
    "at once (simulated_start_seconds 0: no image pull, no process start-up), a trainer rank "
    "is a simgang.TrainerRank stepping every 50 ms; real: the API server, the kubelets' pod "
    "lifecycle and status writes, the scheduler, the operator process and its HTTP progress "
    "reads")


def job(name: str, checkpoints: Path) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "TrainingJob",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"replicas": 1, "image": "ghcr.io/tardigrade-dev/tardigrade-trainer:0.1.0",
                 "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}},
                 "trainer": {"steps": 1_000_000_000, "step_seconds": 0.05},
                 # No commit during the bench: marker files for 1,000 jobs are not the point.
                 "checkpoint": {"path": str(checkpoints / name),
                                "interval": {"steps": 1_000_000_000}},
                 # A SIGKILLed rank is a failure relaunched at once (no retry backoff).
                 "failurePolicy": {"backoffSeconds": 0, "maxRestarts": 1000}},
    }


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def sample(proc: psutil.Process, seconds: float) -> tuple[float, float]:
    """(RSS MiB, CPU % of one core) of the operator over `seconds`."""
    proc.cpu_percent(None)
    time.sleep(seconds)
    return proc.memory_info().rss / 2**20, proc.cpu_percent(None)


Histogram = tuple[float, float, dict[float, float]]  # count, sum, cumulative count by bound


def reconcile_histogram(port: int) -> Histogram:
    """The operator's reconcile-duration histogram, scraped from its metrics endpoint."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as resp:
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


class Follower:
    """One watch, re-opened whenever it ends; `on_event(type, object)` runs in its thread
    under `self.changed`, which is notified after each event."""

    def __init__(self, list_call: Callable[..., Any], on_event: Callable[[str, Any], None],
                 **kwargs: Any) -> None:
        self.list_call, self.on_event, self.kwargs = list_call, on_event, kwargs
        self.changed = threading.Condition()
        self.stopped = False
        threading.Thread(target=self._run, daemon=True).start()

    def stop(self) -> None:
        self.stopped = True

    def _run(self) -> None:
        while not self.stopped:
            try:
                for event in watch.Watch().stream(self.list_call, timeout_seconds=600,
                                                  **self.kwargs):
                    with self.changed:
                        self.on_event(event["type"], event["object"])
                        self.changed.notify_all()
            except Exception:
                if self.stopped:
                    return  # the cluster is going away with the bench
                time.sleep(0.5)

    def wait(self, done: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        with self.changed:
            while not done():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(what)
                self.changed.wait(left)


class ReplacementClock:
    """For each failed pod, when its job's next pod appeared."""

    def __init__(self, core: kubernetes.client.CoreV1Api) -> None:
        self.failed_at: dict[str, float] = {}  # job -> when the failure was seen
        # A failed pod keeps sending events (status writes, its deletion) after its
        # replacement appeared, and every re-watch lists all pods as ADDED again: only the
        # first Failed of a pod starts the clock, only a pod never seen before stops it.
        self.seen: set[str] = set()
        self.failed: set[str] = set()
        self.failed_seen: dict[str, float] = {}  # pod -> when it was first seen Failed
        self.latencies: list[float] = []
        self.follower = Follower(core.list_namespaced_pod, self._on_event, namespace=NS,
                                 label_selector="tardigrade.dev/job")

    def _on_event(self, kind: str, pod: Any) -> None:
        jobname = pod.metadata.labels["tardigrade.dev/job"]
        name = pod.metadata.name
        now = time.monotonic()
        new = name not in self.seen
        self.seen.add(name)
        if pod.status.phase == "Failed" and name not in self.failed:
            self.failed.add(name)
            self.failed_seen[name] = now
            self.failed_at.setdefault(jobname, now)
        elif kind == "ADDED" and new and jobname in self.failed_at:
            self.latencies.append(now - self.failed_at.pop(jobname))


class JobClock:
    """Each job's status as last seen, and when its observedGeneration and its restart count
    first showed each value: the operator's first action on a change and on a failure."""

    def __init__(self, custom: kubernetes.client.CustomObjectsApi) -> None:
        self.status: dict[str, dict[str, Any]] = {}
        self.seen: dict[tuple[str, str, int], float] = {}
        self.follower = Follower(custom.list_namespaced_custom_object, self._on_event,
                                 group=GROUP, version=VERSION, namespace=NS, plural=PLURAL)

    def _on_event(self, kind: str, body: dict[str, Any]) -> None:
        name = body["metadata"]["name"]
        status = body.get("status") or {}
        self.status[name] = status
        now = time.monotonic()
        self.seen.setdefault((name, "generation", int(status.get("observedGeneration") or 0)),
                             now)
        restarts = int((status.get("restarts") or {}).get("total") or 0)
        self.seen.setdefault((name, "restarts", restarts), now)

    def restarts(self, name: str) -> int:
        return int((self.status.get(name, {}).get("restarts") or {}).get("total") or 0)

    def running(self, count: int) -> bool:
        return sum(s.get("phase") == "Running" for s in self.status.values()) >= count


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


class Operator:
    """The operator of this checkout as a subprocess, with one pacing arm."""

    def __init__(self, cluster: LocalCluster, arm: str, log: Path) -> None:
        self.metrics_port = free_port()
        env = {**os.environ, **cluster.client_env(),
               "TARDIGRADE_METRICS_PORT": str(self.metrics_port),
               "TARDIGRADE_RESYNC_SECONDS": "2", "TARDIGRADE_PACING": arm,
               "PYTHONPATH": os.pathsep.join(str(REPO / d) for d in
                                             ("operator", "trainer_image", "local_cluster"))}
        self.log = open(log, "ab")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tardigrade_operator.cli", "operator", "run", "-n", NS,
             "--standalone", "--health-port", "0"], env=env, stdout=self.log,
            stderr=subprocess.STDOUT)
        self.proc = psutil.Process(self.process.pid)

    def wait_metrics(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                reconcile_histogram(self.metrics_port)
                return
            except OSError:
                if time.monotonic() > deadline or self.process.poll() is not None:
                    raise
                time.sleep(0.5)

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(30)
        self.log.close()


CHANGES = itertools.count(601)  # backoffResetSeconds values, new at every change


def react_to_changes(custom: kubernetes.client.CustomObjectsApi, jobs: JobClock, count: int,
                     changes: int, round_: int, timeout: float) -> tuple[list[float], int]:
    """Spec change -> observedGeneration written, job by job; (latencies, timeouts)."""
    latencies, missed = [], 0
    for k in range(changes):
        name = f"sim-{(k * 37 + round_ * 11) % count}"
        patch = {"spec": {"failurePolicy": {"backoffResetSeconds": next(CHANGES)}}}
        started = time.monotonic()
        body = custom.patch_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, name, patch)
        key = (name, "generation", int(body["metadata"]["generation"]))
        try:
            jobs.follower.wait(lambda key=key: key in jobs.seen, timeout, name)
        except TimeoutError:
            missed += 1
            continue
        latencies.append(jobs.seen[key] - started)
        time.sleep(0.2)
    return latencies, missed


def react_to_kills(core: kubernetes.client.CoreV1Api, cluster: LocalCluster, jobs: JobClock,
                   clock: ReplacementClock, count: int, kills: int, round_: int,
                   timeout: float) -> tuple[list[float], list[float], int]:
    """Pod SIGKILLed -> the failure recorded (restart count written) and -> the replacement
    created, job by job; (first-action latencies, replacement latencies, timeouts). Both are
    timed from the Failed pod event this process saw."""
    acted, replaced, missed = [], [], 0
    for k in range(kills):
        victim = f"sim-{(k * 7 + round_ * 13) % count}"
        pods = core.list_namespaced_pod(NS, label_selector=f"tardigrade.dev/job={victim}").items
        live = [p for p in pods if p.status.phase == "Running"
                and not p.metadata.deletion_timestamp]
        if not live:
            continue
        before = len(clock.latencies)
        key = (victim, "restarts", jobs.restarts(victim) + 1)
        cluster.crash_pod(NS, live[-1].metadata.name)
        try:
            clock.follower.wait(lambda before=before: len(clock.latencies) > before, timeout,
                                victim)
            jobs.follower.wait(lambda key=key: key in jobs.seen, timeout, victim)
        except TimeoutError:
            missed += 1
            continue
        replaced.append(clock.latencies[-1])
        failed_at = clock.failed_seen[live[-1].metadata.name]
        acted.append(jobs.seen[key] - failed_at)
        time.sleep(0.3)
    return acted, replaced, missed


def measure_arm(cluster: LocalCluster, arm: str, count: int, round_: int, args: Any,
                state: Path, core: Any, custom: Any, jobs: JobClock,
                clock: ReplacementClock, created_at: float) -> dict[str, Any]:
    operator = Operator(cluster, arm, state / f"operator-{arm}-{count}.log")
    try:
        operator.wait_metrics()
        jobs.follower.wait(lambda: jobs.running(count), args.start_timeout,
                           f"{count} jobs Running under the {arm} operator")
        # The first arm of a round launches the new jobs; a later one finds them Running.
        running_after = time.monotonic() - created_at
        time.sleep(args.settle if arm != "fixed" else min(args.settle, 15.0))
        before = reconcile_histogram(operator.metrics_port)
        rss, cpu = sample(operator.proc, args.sample)
        rate, mean, p99_bound = reconcile_stats(
            before, reconcile_histogram(operator.metrics_port), args.sample)
        changed, changes_missed = react_to_changes(custom, jobs, count, args.changes, round_,
                                                   args.reaction_timeout)
        acted, killed, kills_missed = react_to_kills(core, cluster, jobs, clock, count,
                                                     args.kills, round_, args.reaction_timeout)
        rss = max(rss, operator.proc.memory_info().rss / 2**20)
    finally:
        operator.stop()
    row: dict[str, Any] = {
        "arm": arm, "jobs": count, "running_after_s": running_after,
        "rss_mib": rss, "cpu_percent": cpu,
        "passes_per_s": rate, "pass_mean_ms": mean * 1000, "pass_p99_le_ms": p99_bound * 1000,
        "change_p50_s": percentile(changed, 0.5) if changed else math.nan,
        "change_p99_s": percentile(changed, 0.99) if changed else math.nan,
        "fail_p50_s": percentile(acted, 0.5) if acted else math.nan,
        "fail_p99_s": percentile(acted, 0.99) if acted else math.nan,
        "kill_p50_s": percentile(killed, 0.5) if killed else math.nan,
        "kill_p99_s": percentile(killed, 0.99) if killed else math.nan,
        "reactions_timed_out": changes_missed + kills_missed,
    }
    row["reaction_p99_s"] = max(row["change_p99_s"], row["fail_p99_s"])
    print(json.dumps(row), flush=True)
    return row


def verdict(row: dict[str, Any]) -> str:
    if row["reactions_timed_out"]:
        return (f"{row['reactions_timed_out']} reactions timed out: this arm judges no "
                "target")
    worst = max(row["change_p99_s"], row["fail_p99_s"])
    checks = [("CPU", row["cpu_percent"] < TARGETS["cpu"]),
              ("reaction p99", worst < TARGETS["reaction_p99"]),
              ("memory", row["rss_mib"] < TARGETS["rss"])]
    return ", ".join(f"{name} {'met' if ok else 'MISSED'}" for name, ok in checks)


def table(rows: list[dict[str, Any]], baseline: str) -> str:
    counts = sorted({r["jobs"] for r in rows})
    arms = [a for a in ("fixed", "adaptive") if any(r["arm"] == a for r in rows)]
    by = {(r["arm"], r["jobs"]): r for r in rows}
    lines = [baseline, "", "| jobs | arm | RSS MiB | CPU % of a core (x fixed) | passes/s "
             "(x fixed) | pass mean ms (p99 <= ms) | change -> action p50 / p99 s | "
             "pod failed -> action p50 / p99 s | pod failed -> replacement p50 / p99 s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for count in counts:
        for arm in arms:
            row = by.get((arm, count))
            if row is None:
                continue
            base = by.get(("fixed", count))
            cpu_ratio = (f" ({row['cpu_percent'] / base['cpu_percent']:.2f}x)"
                         if base and arm != "fixed" and base["cpu_percent"] else "")
            pass_ratio = (f" ({row['passes_per_s'] / base['passes_per_s']:.3f}x)"
                          if base and arm != "fixed" and base["passes_per_s"] else "")
            lines.append(
                f"| {count} | {arm} | {row['rss_mib']:.0f} | {row['cpu_percent']:.1f}"
                f"{cpu_ratio} | {row['passes_per_s']:.1f}{pass_ratio} | "
                f"{row['pass_mean_ms']:.1f} ({row['pass_p99_le_ms']:g}) | "
                f"{row['change_p50_s']:.2f} / {row['change_p99_s']:.2f} | "
                f"{row['fail_p50_s']:.2f} / {row['fail_p99_s']:.2f} | "
                f"{row['kill_p50_s']:.2f} / {row['kill_p99_s']:.2f} |")
    top = max(counts)
    for arm in arms:
        if (arm, top) in by:
            lines.append(f"\n{arm} at {top} jobs: {verdict(by[(arm, top)])}")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(17, 3.8))
    measures = [("cpu_percent", "operator CPU, % of one core", TARGETS["cpu"]),
                ("rss_mib", "operator RSS, MiB", TARGETS["rss"]),
                ("passes_per_s", "reconcile passes / s", None),
                ("reaction_p99_s", "reaction p99 s (change or failure -> first action)",
                 TARGETS["reaction_p99"])]
    for axis, (key, title, target) in zip(axes, measures, strict=True):
        for arm, style in (("fixed", "o--"), ("adaptive", "s-")):
            points = sorted((r["jobs"], r[key]) for r in rows if r["arm"] == arm)
            if points:
                label = "fixed 2 s loop (baseline)" if arm == "fixed" else "event-driven"
                axis.plot(*zip(*points, strict=True), style, label=label)
        if target is not None:
            axis.axhline(target, color="grey", linewidth=0.8, linestyle=":",
                         label="target at 1,000 jobs")
        axis.set_xscale("log")
        axis.set_xlabel("one-replica jobs")
        axis.set_title(title, fontsize=10)
        axis.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", default="10,200,1000")
    parser.add_argument("--arms", default="fixed,adaptive")
    parser.add_argument("--changes", type=int, default=20)
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--settle", type=float, default=150.0,
                        help="seconds after every job runs before sampling")
    parser.add_argument("--sample", type=float, default=30.0)
    # Launching 1,000 jobs on the shared 2-core machine takes about 6 min (load average 8-9).
    parser.add_argument("--start-timeout", type=float, default=2400.0)
    parser.add_argument("--reaction-timeout", type=float, default=30.0)
    # The fixed loop passes every job every 2 s: at 1,000 jobs it saturates the operator (and
    # the machine the bench shares with the cluster), so its figures there measure the queue.
    parser.add_argument("--fixed-up-to", type=int, default=0,
                        help="run the fixed arm only at job counts up to this (0: all)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args()
    counts = [int(c) for c in args.jobs.split(",")]
    arms = args.arms.split(",")
    state = Path(tempfile.mkdtemp(prefix="tardigrade-bench-"))
    # One node more than the pods need: a replacement may come before its failed pod goes.
    nodes = simulated_nodes(1 + math.ceil(max(counts) / PODS_PER_NODE),
                            capacity={"cpu": "64", "memory": "256Gi",
                                      "pods": str(PODS_PER_NODE)})
    rows: list[dict[str, Any]] = []
    # No API proxy: the operator talks to kube-apiserver directly, as in a cluster.
    with LocalCluster(state / "cluster", nodes=nodes, with_gcs=False, api_proxy=False
                      ) as cluster:
        client = kubernetes.config.new_client_from_config(config_file=str(cluster.kubeconfig))
        core = kubernetes.client.CoreV1Api(client)
        custom = kubernetes.client.CustomObjectsApi(client)
        jobs = JobClock(custom)
        clock = ReplacementClock(core)
        idle = Operator(cluster, "adaptive", state / "operator-idle.log")
        try:
            idle.wait_metrics()
            time.sleep(5)
            base_rss, base_cpu = sample(idle.proc, 10)
        finally:
            idle.stop()
        round_trip = create_pod_round_trip(core)
        baseline = (f"baseline: operator with 0 jobs {base_rss:.0f} MiB, {base_cpu:.1f}% CPU; "
                    f"API create-pod round trip {round_trip * 1000:.1f} ms")
        print(baseline, flush=True)
        print(SIMULATED, flush=True)
        created = 0
        try:
            for round_, count in enumerate(counts):
                created_at = time.monotonic()
                for i in range(created, count):
                    custom.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL,
                                                           job(f"sim-{i}", state / "ckpt"))
                print(f"{count - created} jobs created in {time.monotonic() - created_at:.0f} s "
                      f"(load average {os.getloadavg()[0]:.1f})", flush=True)
                created = count
                for arm in arms:
                    if arm == "fixed" and args.fixed_up_to and count > args.fixed_up_to:
                        print(f"fixed arm not run at {count} jobs (--fixed-up-to "
                              f"{args.fixed_up_to}): no baseline at this count", flush=True)
                        continue
                    rows.append(measure_arm(cluster, arm, count, round_, args, state, core,
                                            custom, jobs, clock, created_at))
                    created_at = time.monotonic()
        finally:
            jobs.follower.stop()
            clock.follower.stop()
    report = table(rows, baseline)
    print("\n" + report)
    if args.out:
        args.out.write_text(json.dumps({"baseline": {"rss_mib": base_rss, "cpu": base_cpu,
                                                     "round_trip_s": round_trip},
                                        "rows": rows}, indent=1) + "\n")
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
