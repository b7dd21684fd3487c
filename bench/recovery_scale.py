"""Recovery from one lost host against gang size, on simulated nodes.

    python bench/recovery_scale.py [--quick] [--sizes 8,64,256,1024] [--arms recreate,in-place]
                                   [--tpu] [--out FILE] [--json FILE] [--plot FILE.png]
                                   [--with EARLIER.json]

For each gang size N (`--quick`: 8 and 64), a fresh local cluster with N + 1 simulated nodes
(`tardigrade_local.simulator`, benches only: pods without processes, one rank per node as on
TPU hosts), the real operator (this checkout, run as a ServiceAccount on the API server's TLS port
so that the audit log records its requests) and one TrainingJob of N simulated ranks. Once the
gang trains, the node of its last rank is preempted (GKE spot reclaim: DisruptionTarget,
SIGTERM, the ranks save one step), and the bench follows, from watches on the admin port:
- the operator's decision (phase Restarting), every old pod terminal, every new pod created,
  every new pod Running, the job's status back to Running (seconds from the preemption), and
  issue 18's measure of the operator's part: from its decision to every rank running in the
  new world as the simulator reports it (target <= 5 s at 1,024 ranks);
- API requests during the recovery: everyone's (`apiserver_request_total` on the API server's
  `/metrics`, non-resource requests left out) and the operator's (audit log), the operator's
  TrainingJob status writes, the kubelets' pod status writes;
- the operator's RSS and CPU seconds over the recovery; the cluster's (its processes summed:
  etcd, kube-apiserver, kube-controller-manager, kube-scheduler and the supervisor running
  the simulator's node agents) memory and CPU per simulated pod while the gang starts;
- where the machine's cores went during the recovery: the CPU seconds of the operator, the
  cluster's processes and the bench itself, the machine's busy share, and the floor they set
  (their sum over the cores): a recovery whose floor is near its time was waiting for a core.

Simulator latencies are zero (a container starts at once: `simulated_start_seconds` 0) and the
ranks step every 50 ms, so the figures are the control plane's and the operator's own; a
simulated save takes one step, far less than a real one. Two arms, each on its own fresh
cluster of the same nodes (1.36 kubelets with ContainerRestartRules, the API server's gate on):
- recreate: today's recovery (operator switch off), every pod deleted and created again: the
  baseline;
- in-place: `TARDIGRADE_RESTART_IN_PLACE=true`: the healthy ranks' pods stay and their
  trainers exit 77 and are restarted by their kubelets with the new world (from the
  operator's request; their attempt label is patched once all run again, and the bench
  waits for those patches too, so they count in the API requests); only the lost rank gets
  a new pod. A kept rank counts as running once its container runs again after that exit, whatever
  its label says yet;
- in-process: the same with `TARDIGRADE_RESTART_IN_PROCESS=true`: a kept trainer starts its
  new world in a new child of its container's main process, its container never exits, so no
  pod shows it.
  Every rank counts as running in the new world once the gang's rank 0 reports the new attempt
  on its progress port (it serves progress only once every rank met), which the bench polls
  every 20 ms from the disruption on.
The keeping arms are printed as ratios against the recreate arm of the same size.
An arm whose recovery kept no pod did not exercise restart in place: it says so and its
ratios are not printed. `--plot` draws the scaling curves of both arms (decision to every rank
running, API requests, status writes against gang size); `--with` adds the points of another
run's `--json` for sizes this run did not measure, drawn hollow and labelled as another run's.

`--tpu` measures TPU-like slices instead: the gang on simulated slice node pools of
tpu-v5p-slice 2x2x4 (4 hosts of 4 chips), one spare pool, and the preempted node takes its
whole slice with it. Two arms per size, in the same run: `every host` (the operator does not
watch nodes, so it cannot learn a leader's pool and every host carries the exclusive inter-pod
terms) is the baseline; `leader first` (the default: each slice's worker 0 with the terms, its
followers created once it is placed, pinned to its pool by node selector) is printed against it
as ratios. The local scheduler checks inter-pod terms pod by pod, not with the kube-scheduler's
PreFilter maps, so its CPU is no measure of the kube-scheduler's: that ratio is printed for
what it is and judges no target; what the arms do show is the latency the second wave adds.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / d) for d in ("operator", "trainer_image", "local_cluster")]

from tardigrade_contract import contract  # noqa: E402
from tardigrade_local.cluster import LocalCluster, simulated_nodes  # noqa: E402
from tardigrade_local.gke.tpuslices import SliceShape, slice_nodes  # noqa: E402

NS = "default"
JOB = "scale"
SIZES = [8, 64, 256, 1024]
QUICK_SIZES = [8, 64]
OPERATOR_ACCOUNT = "tardigrade-bench"
STEP_SECONDS = 0.05
ARMS = ("recreate", "in-place", "in-process")
KEEPING_ARMS = ("in-place", "in-process")  # the arms judged against recreate
KUBELET = {"kubelet_version": "v1.36.0", "feature_gates": {"ContainerRestartRules": True}}
TPU_SHAPE = SliceShape("tpu-v5p-slice", "2x2x4", 4)
TPU_ARMS = {"every host": False, "leader first": True}  # arm -> the operator watches nodes
OPERATOR_PART = "operator's part: decision to every rank running s"
OPERATOR_PART_TARGET_S = 5.0  # issue 18 point 6, at 1,024 ranks


def tpu_nodes(replicas: int) -> list[Any]:
    """Simulated slice pools for `replicas` hosts, and one spare pool to recover onto."""
    pools = replicas // TPU_SHAPE.hosts() + 1
    return [dataclasses.replace(node, simulated=True, capacity={**node.capacity, "cpu": "1",
                                                               "memory": "8Gi"})
            for pool in range(pools) for node in slice_nodes(f"slice-{pool}", TPU_SHAPE)]


def job(replicas: int, checkpoint: Path, tpu: bool = False) -> dict[str, Any]:
    body = _job(replicas, checkpoint)
    if tpu:
        body["spec"]["accelerator"] = {"kind": "tpu", "type": TPU_SHAPE.accelerator,
                                       "topology": TPU_SHAPE.topology,
                                       "count": TPU_SHAPE.chips_per_host}
    return body


def _job(replicas: int, checkpoint: Path) -> dict[str, Any]:
    return {
        "apiVersion": "tardigrade.dev/v1alpha1", "kind": "TrainingJob",
        "metadata": {"name": JOB, "namespace": NS},
        "spec": {"replicas": replicas, "image": "ghcr.io/tardigrade-dev/tardigrade-trainer:0.1.0",
                 # One rank per host: each node has one CPU to give.
                 "resources": {"requests": {"cpu": "1", "memory": "1Gi"}},
                 "trainer": {"steps": 10_000_000, "step_seconds": STEP_SECONDS},
                 "checkpoint": {"path": str(checkpoint), "interval": {"steps": 100},
                                "saveOnPreemption": True},
                 "failurePolicy": {"maxRestarts": 10, "backoffSeconds": 0}},
    }


class Watcher:
    """One raw watch (admin port: neither audited nor counted as the operator's); calls
    `on_event(type, object)` for each event, from a thread."""

    def __init__(self, url: str, on_event: Callable[[str, dict[str, Any]], None],
                 context: ssl.SSLContext | None = None) -> None:
        self.url = url
        self.on_event = on_event
        self.context = context
        self.stopped = False
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while not self.stopped:
            try:
                with urllib.request.urlopen(self.url, timeout=3600,
                                            context=self.context) as stream:
                    for line in stream:
                        event = json.loads(line)
                        self.on_event(event["type"], event["object"])
            except Exception:
                if self.stopped:
                    return
                time.sleep(0.5)


class Timeline:
    """What the watches saw, with times; `wait` polls a predicate over it."""

    def __init__(self, replicas: int) -> None:
        self.replicas = replicas
        self.lock = threading.Lock()
        self.pods: dict[str, dict[str, Any]] = {}
        self.job: dict[str, Any] = {}
        self.marks: dict[str, float] = {}
        self.restarts_before: dict[str, int] = {}
        self.reported_attempt = 0  # the newest attempt rank 0 reported (ProgressPoller)

    def on_pod(self, kind: str, pod: dict[str, Any]) -> None:
        with self.lock:
            name = pod["metadata"]["name"]
            if kind == "DELETED":
                self.pods.pop(name, None)
            else:
                self.pods[name] = pod

    def on_job(self, kind: str, obj: dict[str, Any]) -> None:
        with self.lock:
            self.job = obj

    def attempt_pods(self, attempt: int) -> list[dict[str, Any]]:
        label = "tardigrade.dev/attempt"
        return [p for p in self.pods.values()
                if p["metadata"].get("labels", {}).get(label) == str(attempt)]

    def running(self, attempt: int) -> int:
        return sum((p.get("status") or {}).get("phase") == "Running"
                   and not p["metadata"].get("deletionTimestamp")
                   for p in self.attempt_pods(attempt))

    def restarted(self, attempt: int) -> int:
        """Ranks of `attempt` whose trainer runs in its world: a new pod's, or a kept pod's
        container running again after an exit 77 since the disruption (`restarts_before`).
        A kept pod is not judged by its attempt label: the operator patches it only once the
        whole gang runs again; the request carries the world the trainer restarts on (a
        stale one would exit 77 again and wait out the kubelet's back-off, not run)."""
        count = 0
        for pod in self.pods.values():
            name = pod["metadata"]["name"]
            if pod["metadata"].get("deletionTimestamp"):
                continue
            statuses = (pod.get("status") or {}).get("containerStatuses") or [{}]
            state, last = statuses[0].get("state") or {}, statuses[0].get("lastState") or {}
            new = name.rsplit("-", 2)[1] == f"a{attempt}"
            exit_code = (last.get("terminated") or {}).get("exitCode")
            kept = (name in self.restarts_before and exit_code == contract.EXIT_RESTART_IN_PLACE
                    and int(statuses[0].get("restartCount") or 0) > self.restarts_before[name])
            if "running" in state and (new or kept):
                count += 1
        return count

    def note_restarts(self) -> None:
        """Each pod's container restarts before the disruption (see `restarted`)."""
        with self.lock:
            self.restarts_before = {
                p["metadata"]["name"]: int(((p.get("status") or {}).get("containerStatuses")
                                            or [{}])[0].get("restartCount") or 0)
                for p in self.pods.values()}

    def status(self) -> dict[str, Any]:
        return self.job.get("status") or {}

    def wait_all(self, predicates: dict[str, Callable[[], bool]],
                 timeout: float) -> dict[str, float]:
        """When each predicate first held, all watched at once (their order differs between
        arms: in place, ranks may run again before the lost rank's old pod is gone)."""
        deadline = time.monotonic() + timeout
        while True:
            with self.lock:
                now = time.monotonic()
                for what, predicate in predicates.items():
                    if what not in self.marks and predicate():
                        self.marks[what] = now
                if all(what in self.marks for what in predicates):
                    return {what: self.marks[what] for what in predicates}
            if now > deadline:
                missing = [w for w in predicates if w not in self.marks]
                raise TimeoutError(f"timed out waiting for {', '.join(missing)}")
            time.sleep(0.02)

    def wait(self, what: str, predicate: Callable[[], bool], timeout: float) -> float:
        deadline = time.monotonic() + timeout
        while True:
            with self.lock:
                if predicate():
                    now = time.monotonic()
                    self.marks.setdefault(what, now)
                    return self.marks[what]
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out waiting for {what}")
            time.sleep(0.02)


class ProgressPoller:
    """Rank 0's progress report, every 20 ms, as the operator reads it: records the newest
    attempt it names in `timeline.reported_attempt`."""

    def __init__(self, url: str, timeline: Timeline) -> None:
        self.url = url
        self.timeline = timeline
        self.stopped = False
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while not self.stopped:
            try:
                with urllib.request.urlopen(self.url, timeout=2) as answer:
                    report = contract.ProgressReport.from_json(answer.read().decode())
                with self.timeline.lock:
                    self.timeline.reported_attempt = max(self.timeline.reported_attempt,
                                                         report.attempt or 0)
            except (OSError, ValueError):
                pass  # between two gangs rank 0 does not serve
            time.sleep(0.02)


def request_counts(cluster: LocalCluster) -> Counter[tuple[str, str, str]]:
    """(verb, resource, subresource) -> requests so far, resource requests only
    (kube-apiserver's `apiserver_request_total`)."""
    text = cluster.api_metrics()
    counts: Counter[tuple[str, str, str]] = Counter()
    for family in text_string_to_metric_families(text):
        if family.name != "apiserver_request":
            continue
        for sample in family.samples:
            if sample.name.endswith("_total") and sample.labels["resource"]:
                key = (sample.labels["verb"], sample.labels["resource"],
                       sample.labels["subresource"])
                counts[key] += int(sample.value)
    return counts


def audit_lines(path: Path, user: str) -> list[dict[str, Any]]:
    """The user's requests, one audit event each (the one at ResponseComplete: a watch also
    logs its ResponseStarted)."""
    events = []
    with open(path) as f:
        for line in f:
            event = json.loads(line)
            if event["user"]["username"] == user and event.get("stage") == "ResponseComplete":
                events.append(event)
    return events


CORES = psutil.cpu_count() or 1


def busy_cpu() -> float:
    """CPU seconds the whole machine has spent busy, all cores together (steal counts: the
    hypervisor gave the core to someone else)."""
    times = psutil.cpu_times()._asdict()
    return float(sum(times.get(k, 0.0) for k in ("user", "nice", "system", "irq", "softirq",
                                                 "steal")))


def cpu_seconds(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return float(times.user + times.system)


class ClusterProcesses:
    """The local cluster's processes together (the supervisor with the simulator's node
    agents, etcd, kube-apiserver, kube-controller-manager, kube-scheduler): CPU seconds and
    RSS, summed."""

    def __init__(self, cluster: LocalCluster) -> None:
        self.procs = [psutil.Process(pid) for pid in cluster.processes().values()]

    def cpu(self) -> float:
        return sum(cpu_seconds(p) for p in self.procs)

    def rss(self) -> int:
        return sum(p.memory_info().rss for p in self.procs)


def run_size(replicas: int, workdir: Path, timeout: float, arm: str = "recreate",
             tpu: bool = False, watch_nodes: bool = True) -> dict[str, float | str]:
    state = workdir / f"gang-{replicas}-{arm}{'-tpu' if tpu else ''}{'' if watch_nodes else '-nw'}"
    nodes = [dataclasses.replace(n, **KUBELET) for n in (
        tpu_nodes(replicas) if tpu
        else simulated_nodes(replicas + 1, capacity={"cpu": "1", "memory": "8Gi"}))]
    user = f"system:serviceaccount:{NS}:{OPERATOR_ACCOUNT}"
    in_place = arm in KEEPING_ARMS
    in_process = arm == "in-process"
    with LocalCluster(state / "cluster", nodes=nodes, with_gcs=False, api_proxy=False,
                      feature_gates="ContainerRestartRules=true") as cluster:
        cluster_proc = ClusterProcesses(cluster)
        tls = cluster.admin_ssl_context()
        kubeconfig = cluster.service_account_kubeconfig(NS, OPERATOR_ACCOUNT,
                                                        state / "operator.kubeconfig")
        env = {**cluster.client_env(), "KUBECONFIG": str(kubeconfig),
               "TARDIGRADE_METRICS_PORT": "0",
               "TARDIGRADE_RESTART_IN_PLACE": "true" if in_place else "false",
               "TARDIGRADE_RESTART_IN_PROCESS": "true" if in_process else "false",
               "TARDIGRADE_WATCH_NODES": "true" if watch_nodes else "false"}
        log = open(state / "operator.log", "wb")  # noqa: SIM115 - the operator's, closed below
        operator = subprocess.Popen(
            [sys.executable, "-m", "tardigrade_operator.cli", "operator", "run", "-n", NS,
             "--standalone", "--health-port", "0"], env=env, stdout=log,
            stderr=subprocess.STDOUT)
        timeline = Timeline(replicas)
        api = cluster.info["direct_api_url"]
        watchers: list[Watcher | ProgressPoller] = [
            Watcher(f"{api}/api/v1/namespaces/{NS}/pods?watch=true&timeoutSeconds=3600"
                    f"&labelSelector=tardigrade.dev/job%3D{JOB}", timeline.on_pod, tls),
            Watcher(f"{api}/apis/tardigrade.dev/v1alpha1/namespaces/{NS}/trainingjobs"
                    f"?watch=true&timeoutSeconds=3600", timeline.on_job, tls),
        ]
        try:
            op = psutil.Process(operator.pid)
            cluster_rss0, cluster_cpu0 = cluster_proc.rss(), cluster_proc.cpu()
            body = json.dumps(job(replicas, state / "checkpoints", tpu)).encode()
            request = urllib.request.Request(
                f"{api}/apis/tardigrade.dev/v1alpha1/namespaces/{NS}/trainingjobs", data=body,
                headers={"Content-Type": "application/json"}, method="POST")
            urllib.request.urlopen(request, timeout=60, context=tls).read()
            launched = time.monotonic()
            timeline.wait("gang running", lambda: timeline.running(
                int(timeline.status().get("attempt", 1))) == replicas, timeout)
            started_in = time.monotonic() - launched
            cluster_rss1, cluster_cpu1 = cluster_proc.rss(), cluster_proc.cpu()
            # Trained and reported: the operator has read rank 0's progress.
            timeline.wait("progress", lambda: (timeline.status().get("step") or 0) > 0
                          and timeline.status().get("phase") == "Running", timeout)
            attempt = int(timeline.status().get("attempt", 0))
            with timeline.lock:
                victim = next(p for p in timeline.attempt_pods(attempt)
                              if p["metadata"]["labels"]["tardigrade.dev/rank"]
                              == str(replicas - 1))
            node = victim["spec"]["nodeName"]
            requests0 = request_counts(cluster)
            audited0 = len(audit_lines(cluster.layout.audit_log, user))
            op_cpu0, op_rss0 = cpu_seconds(op), op.memory_info().rss
            cluster_cpu_r0, bench_cpu0, machine0 = (cluster_proc.cpu(),
                                                    cpu_seconds(psutil.Process()), busy_cpu())
            timeline.note_restarts()
            with timeline.lock:
                leader = next(p for p in timeline.attempt_pods(attempt)
                              if p["metadata"]["labels"]["tardigrade.dev/rank"] == "0")
            poller = ProgressPoller(f"http://{leader['status']['podIP']}:"
                                    f"{contract.DEFAULT_PROGRESS_PORT}/progress", timeline)
            watchers.append(poller)
            # Restarted in process, a kept rank leaves no trace in its pod: rank 0's report
            # of the new attempt says every rank met in it.
            every_rank_running = (
                (lambda: timeline.reported_attempt >= attempt + 1) if in_process
                else (lambda: timeline.restarted(attempt + 1) == replicas))
            t0 = time.monotonic()
            cluster.preempt_node(node)
            marks = timeline.wait_all({
                "decision (phase Restarting)":
                    lambda: timeline.status().get("phase") in ("Restarting", "Running")
                    and int(timeline.status().get("restarts", {}).get("total", 0)) > 0,
                # Recreate: every old pod terminal; in place: the lost rank's alone.
                "old pods gone (terminal)": lambda: all(
                    (p.get("status") or {}).get("phase") in ("Succeeded", "Failed")
                    for p in timeline.attempt_pods(attempt)),
                "every rank's pod in the new attempt":
                    lambda: len(timeline.attempt_pods(attempt + 1)) == replicas,
                "every rank running in the new world": every_rank_running,
                "job status Running":
                    lambda: timeline.status().get("phase") == "Running"
                    and int(timeline.status().get("attempt", 0)) == attempt + 1,
            }, timeout)
            recovery = (timeline.status().get("recoveries") or [{}])[-1]
            op_cpu1, op_rss1 = cpu_seconds(op), op.memory_info().rss
            cluster_cpu_r1, bench_cpu1, machine1 = (cluster_proc.cpu(),
                                                    cpu_seconds(psutil.Process()), busy_cpu())
            window = time.monotonic() - t0
            requests1 = request_counts(cluster)
            operator_events = audit_lines(cluster.layout.audit_log, user)[audited0:]
            with timeline.lock:
                relaunched = [p["spec"] for p in timeline.attempt_pods(attempt + 1)]
        finally:
            for watcher in watchers:
                watcher.stopped = True
            operator.terminate()
            operator.wait(30)
            log.close()
    delta = requests1 - requests0
    op_verbs = Counter(e["verb"] for e in operator_events)
    status_writes = sum(1 for e in operator_events
                        if e.get("objectRef", {}).get("resource") == "trainingjobs"
                        and e["objectRef"].get("subresource") == "status"
                        and e["verb"] in ("patch", "update"))
    result: dict[str, float | str] = {f"{k} s": v - t0 for k, v in marks.items()}
    # Issue 18's measure: from the operator's decision to every rank's pod started in the new
    # world as the simulator reports it (its own latencies are zero, so this is the
    # operator's and the control plane's time).
    result[OPERATOR_PART] = (marks["every rank running in the new world"]
                             - marks["decision (phase Restarting)"])
    result.update({
        "pods kept (restarted in place)": int(recovery.get("keptPods") or 0),
        "API requests, everyone": sum(delta.values()),
        "API requests, operator": len(operator_events),
        "operator creates / deletes / patches":
            f"{op_verbs['create']} / {op_verbs['delete']} / {op_verbs['patch']}",
        "operator TrainingJob status writes": status_writes,
        "kubelet pod status writes": sum(v for (verb, res, sub), v in delta.items()
                                         if res == "pods" and sub == "status"),
        "operator CPU s during recovery": op_cpu1 - op_cpu0,
        # The simulator's own latencies are zero, but its work is not: every simulated kubelet
        # and trainer shares this machine's cores with the operator. The busier the machine,
        # the more of the operator's part is waiting for a core.
        "cluster CPU s during recovery": cluster_cpu_r1 - cluster_cpu_r0,
        "bench CPU s during recovery": bench_cpu1 - bench_cpu0,
        "machine busy during recovery, % of all cores": 100 * (machine1 - machine0) / (
            window * CORES),
        "CPU floor: (operator + cluster + bench CPU) / cores s": (
            op_cpu1 - op_cpu0 + cluster_cpu_r1 - cluster_cpu_r0 + bench_cpu1 - bench_cpu0)
            / CORES,
        "operator RSS MiB after recovery": op_rss1 / 2**20,
        "operator RSS MiB before": op_rss0 / 2**20,
        "cluster RSS KiB per simulated pod": (cluster_rss1 - cluster_rss0) / 1024 / replicas,
        "cluster CPU ms per simulated pod start": (cluster_cpu1 - cluster_cpu0) * 1000 / replicas,
        "gang start s (create to all Running)": started_in,
        # What the arm exercised: how the relaunched hosts were kept on their slices.
        "relaunched hosts with inter-pod terms": sum(
            "podAffinity" in (spec.get("affinity") or {}) for spec in relaunched),
        "relaunched hosts pinned by pool selector": sum(
            "cloud.google.com/gke-nodepool" in (spec.get("nodeSelector") or {})
            for spec in relaunched),
    })
    return result


def format_value(value: float | str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, int):
        return str(value)
    return f"{value:.2f}" if abs(value) < 100 else f"{value:.0f}"


RATIOS = ("every rank running in the new world s", OPERATOR_PART, "job status Running s",
          "API requests, everyone", "API requests, operator", "operator TrainingJob status writes",
          "kubelet pod status writes")


def ratio_lines(results: dict[str, dict[int, dict[str, float | str]]]) -> list[str]:
    """Each keeping arm / recreate, per size, for sizes both arms measured in this run."""
    base = results.get("recreate") or {}
    lines: list[str] = []
    for arm in KEEPING_ARMS:
        other = results.get(arm) or {}
        for size in sorted(set(base) & set(other)):
            if not other[size]["pods kept (restarted in place)"]:
                lines.append(f"gang of {size}: the {arm} arm kept no pod, so it did not "
                             "exercise restart in place; no ratio judged")
                continue
            ratios = []
            for measure in RATIOS:
                b, o = float(base[size][measure]), float(other[size][measure])
                ratios.append(f"{measure} {o / b:.2f}x" if b else f"{measure} n/a")
            lines.append(f"gang of {size}, {arm} / recreate: " + "; ".join(ratios))
    return lines


def target_lines(results: Results) -> list[str]:
    """Issue 18 point 6 on each keeping arm: met or missed, per size measured."""
    lines = []
    for arm in KEEPING_ARMS:
        for size, column in sorted((results.get(arm) or {}).items()):
            if not column["pods kept (restarted in place)"]:
                continue
            part = float(column[OPERATOR_PART])
            verdict = ("the target is judged at 1,024 ranks" if size != 1024
                       else "met" if part <= OPERATOR_PART_TARGET_S else "missed")
            lines.append(f"gang of {size}, {arm}: decision to every rank running {part:.2f} s "
                         f"(target <= {OPERATOR_PART_TARGET_S:.0f} s: {verdict})")
    return lines


def tpu_table(sizes: list[int], workdir: Path, timeout: float) -> list[str]:
    """Both slice-placement arms per size; leader first as ratios of every host."""
    lines = []
    for size in sizes:
        if size % TPU_SHAPE.hosts():
            lines.append(f"gang of {size}: not measured (not whole slices of "
                         f"{TPU_SHAPE.hosts()} hosts)")
            continue
        arms: dict[str, dict[str, float | str]] = {}
        for arm, watch_nodes in TPU_ARMS.items():
            print(f"TPU gang of {size}, {arm}: starting", flush=True)
            try:
                arms[arm] = run_size(size, workdir, timeout, tpu=True,
                                      watch_nodes=watch_nodes)
            except TimeoutError as err:
                lines.append(f"TPU gang of {size}, {arm}: not measured ({err})")
        if len(arms) < len(TPU_ARMS):
            continue
        base, lead = arms["every host"], arms["leader first"]
        exercised = (lead["relaunched hosts pinned by pool selector"]
                     == size - size // TPU_SHAPE.hosts()
                     and base["relaunched hosts with inter-pod terms"] == size)
        lines += [f"TPU gang of {size} ({size // TPU_SHAPE.hosts()} slices of "
                  f"{TPU_SHAPE.topology}): every host | leader first | ratio",
                  "|---|---|---|---|"]
        for measure, value in base.items():
            other = lead[measure]
            ratio = (f"{float(other) / float(value):.2f}"
                     if exercised and not isinstance(value, str) and value else "-")
            lines.append(f"| {measure} | {format_value(value)} | {format_value(other)} "
                         f"| {ratio} |")
        if not exercised:
            lines.append("the arms did not place hosts as they should (see the last two "
                         "rows): no ratio is judged")
    lines.append("cluster CPU is the local scheduler's, which checks inter-pod terms pod by "
                 "pod: not a measure of the kube-scheduler's PreFilter cost, no target judged")
    return lines


Results = dict[str, dict[int, dict[str, float | str]]]  # arm -> gang size -> measures
PLOTTED = ((OPERATOR_PART, "decision to every rank running, s"),
           ("API requests, everyone", "API requests per recovery (everyone)"),
           ("operator TrainingJob status writes", "operator TrainingJob status writes"))


def load_results(path: Path) -> Results:
    """Results a run wrote with --json (JSON keys are strings)."""
    raw = json.loads(path.read_text())
    return {arm: {int(size): column for size, column in columns.items()}
            for arm, columns in raw.items()}


def plot(results: Results, path: Path, earlier: Results | None = None) -> None:
    """Scaling curves of both arms; points from another run (--with) are drawn hollow and
    labelled so: they are not ratios of this run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(PLOTTED), figsize=(13, 3.8))
    styles = {"recreate": ("o", "--", "tab:red"), "in-place": ("s", "-", "tab:blue"),
              "in-process": ("^", "-", "tab:green")}
    for axis, (measure, title) in zip(axes, PLOTTED, strict=True):
        for arm, (marker, line, color) in styles.items():
            points = sorted((size, float(c[measure]))
                            for size, c in (results.get(arm) or {}).items() if measure in c)
            if points:
                axis.plot(*zip(*points, strict=True), marker=marker, linestyle=line,
                          color=color, label=arm)
            old = sorted((size, float(c[measure]))
                         for size, c in ((earlier or {}).get(arm) or {}).items()
                         if measure in c and size not in (results.get(arm) or {}))
            if old:
                axis.plot(*zip(*old, strict=True), marker=marker, linestyle="none",
                          markerfacecolor="none", color=color, label=f"{arm} (other run)")
        if measure == OPERATOR_PART:
            axis.axhline(OPERATOR_PART_TARGET_S, color="grey", linewidth=0.8, linestyle=":",
                         label="target at 1,024 ranks")
        axis.set_xscale("log", base=2)
        axis.set_xlabel("gang size (simulated ranks)")
        axis.set_title(title, fontsize=10)
        axis.grid(alpha=0.3)
    axes[0].set_yscale("log")
    axes[1].set_yscale("log")
    axes[2].set_ylim(bottom=0)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="gangs of 8 and 64 only")
    parser.add_argument("--sizes", default=None, help="comma-separated gang sizes")
    parser.add_argument("--timeout", type=float, default=900.0,
                        help="seconds any one stage may take before the size is given up")
    parser.add_argument("--arms", default=",".join(ARMS),
                        help=f"comma-separated arms among {', '.join(ARMS)}")
    parser.add_argument("--tpu", action="store_true",
                        help="TPU-like slices: every host with the terms vs leader first")
    parser.add_argument("--out", type=Path, default=None, help="also write the table here")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--plot", type=Path, default=None,
                        help="write the scaling curves (PNG) of both arms here")
    parser.add_argument("--with", dest="earlier", type=Path, action="append", default=[],
                        help="results (--json) of another run to draw, hollow, in --plot")
    parser.add_argument("--replot", type=Path, default=None,
                        help="measure nothing: draw --plot from these results (--json)")
    args = parser.parse_args()
    if args.replot is not None:
        if args.plot is None:
            parser.error("--replot needs --plot")
        plot(load_results(args.replot), args.plot, _earlier(args.earlier))
        return
    arms = [a for a in args.arms.split(",") if a]
    unknown = sorted(set(arms) - set(ARMS))
    if unknown:
        parser.error(f"--arms: unknown {unknown}; choose among {', '.join(ARMS)}")
    sizes = ([int(s) for s in args.sizes.split(",")] if args.sizes
             else QUICK_SIZES if args.quick else SIZES)
    workdir = Path(tempfile.mkdtemp(prefix="tardigrade-recovery-scale-"))
    load_before = os.getloadavg()
    if args.tpu:
        text = "\n".join([f"load average before {load_before[0]:.1f}",
                          *tpu_table(sizes, workdir, args.timeout),
                          f"load average after {os.getloadavg()[0]:.1f}"])
        print("\n" + text)
        if args.out is not None:
            args.out.write_text(text + "\n")
        return
    results: Results = {arm: {} for arm in arms}
    skipped: list[str] = []
    for size in sizes:
        for arm in arms:
            print(f"gang of {size}, {arm}: starting", flush=True)
            try:
                column = run_size(size, workdir, args.timeout, arm)
            except TimeoutError as err:
                skipped.append(f"gang of {size}, {arm}: not measured ({err})")
                print(skipped[-1], flush=True)
                continue
            results[arm][size] = column
            print(f"gang of {size}, {arm}: " + "; ".join(
                f"{k} {format_value(v)}" for k, v in column.items()), flush=True)
    lines = [f"load average before {load_before[0]:.1f}, after {os.getloadavg()[0]:.1f}"]
    for arm, columns in results.items():
        if not columns:
            continue
        lines += ["", f"arm: {arm}",
                  "| gang size | " + " | ".join(str(c) for c in columns) + " |",
                  "|---|" + "---|" * len(columns)]
        for measure in next(iter(columns.values())):
            lines.append(f"| {measure} | " + " | ".join(
                format_value(column[measure]) for column in columns.values()) + " |")
        per_rank = [f"{size}: {float(c['API requests, everyone']) / size:.1f}"
                    for size, c in columns.items()]
        lines.append(f"API requests per rank (everyone): {', '.join(per_rank)}")
    lines += ratio_lines(results)
    lines += target_lines(results)
    lines += skipped
    text = "\n".join(lines)
    print("\n" + text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    if args.plot is not None:
        plot(results, args.plot, _earlier(args.earlier))


def _earlier(paths: list[Path]) -> Results:
    earlier: Results = {}
    for path in paths:
        for arm, columns in load_results(path).items():
            earlier.setdefault(arm, {}).update(columns)
    return earlier


if __name__ == "__main__":
    main()
