"""`tardigrade demo`: the whole story on real nodes (Linux, root), in a few minutes.

A cluster of real nodes comes up (`RealNodeCluster`: real kubelets and containerd, the
control plane, the GCS emulator); the operator is installed with helm from the registry's
image (restart in place on, as the chart offers it); examples/trainingjob.yaml is applied on
the registry's trainer image, checkpointing to `gs://` on the emulator through its Service
(`clustergcs.py`); a spot node is reclaimed mid-run; the job is scaled to another replica
count; it finishes. An identical job runs undisturbed on the on-demand node as the reference.
Nodes: `real-1` on-demand, running the operator and the reference; `real-2` and `real-3`
spot, where the job runs. The reclaim is GKE's: the VM of rank 1's node shuts down through
its kubelet's graceful node shutdown (the regular pods' 15 s) and is not recreated, so the
job resumes, then grows to `resize_to` ranks, on the spot node left.

Left behind: a loss-curve PNG with the disruptions marked and the reference overlaid, and a
table of what happened. The loss curves come from every run of the jobs' containers, shipped
off the nodes while they are written (`LogShipper`, GKE's logging agent's part): a real
kubelet removes a deleted pod's logs within its next garbage collection, and the operator
deletes pods at each recovery.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import kubernetes
import yaml
from rich.console import Console

from tardigrade_local import realcluster
from tardigrade_local.cluster import repo_root
from tardigrade_local.clustergcs import env_vars
from tardigrade_local.demo_report import Marker, plot_losses, recovery_markers, write_table
from tardigrade_local.gke.disruptions import REGULAR_POD_SHUTDOWN_GRACE_SECONDS, Disruptor
from tardigrade_local.logshipper import LogShipper
from tardigrade_local.realcluster import SPOT_LABEL, RealNodeCluster, plan_nodes
from tardigrade_local.steplog import StepLog

NAMESPACE = "default"


@dataclasses.dataclass(frozen=True)
class DemoSettings:
    steps: int = 300
    preempt_at: int = 100
    resize_at: int = 200
    resize_to: int = 3
    timeout_seconds: float = 900.0

    @classmethod
    def quick(cls) -> DemoSettings:
        return cls(steps=90, preempt_at=30, resize_at=60)


@dataclasses.dataclass
class DemoResult:
    job: dict[str, Any]
    reference: dict[str, Any]
    curve: dict[int, float]
    reference_curve: dict[int, float]
    markers: list[Marker]
    plot: Path
    table: Path


def demo_job(steps: int) -> dict[str, Any]:
    job = yaml.safe_load((repo_root() / "examples" / "trainingjob.yaml").read_text())
    job["metadata"]["namespace"] = NAMESPACE
    job["spec"]["trainer"]["steps"] = steps
    return job


REFERENCE_NODE = "real-1"
SPOT_NODES = 2
# Requests small enough for `resize_to` ranks on the one spot node the reclaim leaves (a real
# node's capacity is this machine's CPUs).
RESOURCES = {"requests": {"cpu": "300m", "memory": "512Mi"}, "limits": {"memory": "3Gi"}}
HELM_VALUES = ("--set", "operator.restartInPlace=true",
               # Rank 0's progress read every 2 s, not backed off to 60 s: steps are short.
               "--set", "operator.progressMaxIntervalSeconds=2")


def real_jobs(image: str, bucket: str, gcs_env: dict[str, str], steps: int
              ) -> tuple[dict[str, Any], dict[str, Any]]:
    """The example and its reference, on the registry's trainer image, checkpointing to the
    emulator's bucket: the job on the spot nodes, the reference on the on-demand node."""
    job = demo_job(steps)
    spec = job["spec"]
    spec.update(image=image, resources=copy.deepcopy(RESOURCES), env=env_vars(gcs_env))
    name = job["metadata"]["name"]
    spec["checkpoint"]["path"] = f"gs://{bucket}/checkpoints/{name}"
    reference = copy.deepcopy(job)
    reference["metadata"]["name"] = f"{name}-reference"
    reference["spec"]["checkpoint"]["path"] = f"gs://{bucket}/checkpoints/{name}-reference"
    spec["podTemplate"] = {**spec.get("podTemplate", {}), "nodeSelector": {SPOT_LABEL: "true"}}
    reference["spec"]["podTemplate"] = {
        **reference["spec"].get("podTemplate", {}),
        "nodeSelector": {"kubernetes.io/hostname": REFERENCE_NODE}}
    return job, reference


def committed_steps(gcs_url: str, bucket: str, prefix: str) -> list[int]:
    """The steps whose commit marker is in the bucket under `prefix`."""
    query = urllib.parse.urlencode({"prefix": f"{prefix}/"})
    with urllib.request.urlopen(f"{gcs_url}/storage/v1/b/{bucket}/o?{query}",
                                timeout=10) as response:
        names = [item["name"] for item in json.load(response).get("items", [])]
    return sorted(int(n.split("/")[-2].removeprefix("step_")) for n in names
                  if n.endswith("/metadata.json") and n.split("/")[-2].startswith("step_"))


def run_demo(out_dir: Path, settings: DemoSettings, console: Console) -> DemoResult:
    out_dir.mkdir(parents=True, exist_ok=True)
    # Short: a node's directory under it must keep the kubelet's socket paths within limits.
    state = Path(tempfile.mkdtemp(prefix="tardigrade-demo-"))
    try:
        return _run(out_dir, state, settings, console)
    finally:
        realcluster.clear_state(state)


def _run(out_dir: Path, state: Path, settings: DemoSettings, console: Console) -> DemoResult:
    console.print(f"[bold]Starting a cluster of real nodes[/] (state in {state})")
    real = RealNodeCluster(state / "c", plan_nodes(1, SPOT_NODES))
    real.start(progress=lambda what: console.print(f"  [dim]{what}[/]"))
    shipper = LogShipper(real.pod_logs_dirs, state / "logs", NAMESPACE)
    try:
        console.print("[bold]Installing the operator[/] (helm, the registry's image)")
        real.install_operator(*HELM_VALUES)
        env = {**os.environ, "KUBECONFIG": str(real.kubeconfig)}
        job, reference = real_jobs(real.images["trainer-cpu"], realcluster.GCS_BUCKET,
                                   real.gcs_pod_env(), settings.steps)
        name, ref_name = job["metadata"]["name"], reference["metadata"]["name"]
        client = kubernetes.config.new_client_from_config(config_file=str(real.kubeconfig))
        core = kubernetes.client.CoreV1Api(client)
        custom = kubernetes.client.CustomObjectsApi(client)

        def kubectl(*args: str, stdin: str | None = None) -> None:
            console.print(f"[cyan]$ kubectl {' '.join(args)}[/]")
            subprocess.run(["kubectl", *args], env=env, input=stdin, text=True, check=True,
                           capture_output=True)

        shipper.start()  # before the jobs' first pods: it reads every container run
        kubectl("apply", "-f", "-", stdin=yaml.safe_dump(job))
        kubectl("apply", "-f", "-", stdin=yaml.safe_dump(reference))
        log = StepLog(core, NAMESPACE, name)
        preempted = resized = False
        seen_events: set[str] = set()
        started = time.monotonic()
        status: dict[str, Any] = {}
        ref_status: dict[str, Any] = {}
        while True:
            if time.monotonic() - started > settings.timeout_seconds:
                raise RuntimeError("the demo did not finish in time; the operator's log: "
                                   "kubectl -n tardigrade-system logs deploy/tardigrade")
            log.collect()
            status = _status(custom, name)
            ref_status = _status(custom, ref_name)
            _print_events(console, core, name, seen_events)
            _print_progress(console, started, status, ref_status, log)
            if not preempted and log.last_step >= settings.preempt_at:
                node = _node_of_rank(core, name, rank=1)
                if node:
                    console.print(f"[bold red]Preempting node {node}[/] (spot reclaim: the "
                                  "kubelet's graceful node shutdown, "
                                  f"{REGULAR_POD_SHUTDOWN_GRACE_SECONDS:.0f}s for the pods)")
                    Disruptor(real.cluster.info["control_url"]).preempt_node(node)
                    preempted = True
            if preempted and not resized \
                    and log.last_step >= settings.resize_at and status.get("phase") == "Running":
                console.print(f"[bold yellow]Scaling to {settings.resize_to} replicas[/]")
                kubectl("scale", f"trainingjob/{name}", f"--replicas={settings.resize_to}")
                resized = True
            phases = (status.get("phase"), ref_status.get("phase"))
            if "Failed" in phases:
                raise RuntimeError(f"a job failed: {status.get('message') or ref_status}")
            if phases == ("Succeeded", "Succeeded"):
                break
            time.sleep(0.5)
        shipper.stop()
        files = StepLog.from_pod_log_dirs([shipper.directory], NAMESPACE, name)
        ref_files = StepLog.from_pod_log_dirs([shipper.directory], NAMESPACE, ref_name)
        # What the API served while the pods lived fills in what the shipper may have missed
        # (lines written just before a pod's removal).
        curve = {**log.curve(), **files.curve()}
        ref_curve = ref_files.curve()
        job_obj = custom.get_namespaced_custom_object(
            "tardigrade.dev", "v1alpha1", NAMESPACE, "trainingjobs", name)
        ref_obj = custom.get_namespaced_custom_object(
            "tardigrade.dev", "v1alpha1", NAMESPACE, "trainingjobs", ref_name)
        checkpoints = committed_steps(real.gcs_url, realcluster.GCS_BUCKET,
                                      f"checkpoints/{name}")
        console.print(f"Committed checkpoints in gs://{realcluster.GCS_BUCKET}/checkpoints/"
                      f"{name} (the emulator): steps {checkpoints}")
        console.print("[bold]Stopping the cluster[/]")
    finally:
        shipper.stop()
        real.stop()
    curve = dict(sorted(curve.items()))
    markers = recovery_markers((job_obj.get("status") or {}).get("recoveries") or [])
    plot = plot_losses(curve, ref_curve, markers, out_dir / "tardigrade-demo.png")
    table = write_table(job_obj, ref_obj, curve, ref_curve, markers,
                        out_dir / "tardigrade-demo.md")
    (out_dir / "tardigrade-demo.json").write_text(json.dumps({
        "job": job_obj.get("status"), "reference": ref_obj.get("status"),
        "markers": [dataclasses.asdict(m) for m in markers],
        "losses": curve, "reference_losses": ref_curve,
        "checkpoints": {"path": job["spec"]["checkpoint"]["path"], "committed": checkpoints},
    }, indent=2, default=str))
    return DemoResult(job_obj, ref_obj, curve, ref_curve, markers, plot, table)


def _status(custom: Any, name: str) -> dict[str, Any]:
    try:
        obj = custom.get_namespaced_custom_object(
            "tardigrade.dev", "v1alpha1", NAMESPACE, "trainingjobs", name)
    except kubernetes.client.exceptions.ApiException:
        return {}
    return obj.get("status") or {}


def _node_of_rank(core: Any, job: str, rank: int) -> str | None:
    pods = core.list_namespaced_pod(
        NAMESPACE, label_selector=f"tardigrade.dev/job={job},tardigrade.dev/rank={rank}").items
    running = [p for p in pods if p.status.phase == "Running" and p.spec.node_name]
    return running[-1].spec.node_name if running else None


def _print_events(console: Console, core: Any, job: str, seen: set[str]) -> None:
    events = core.list_namespaced_event(
        NAMESPACE, field_selector=f"involvedObject.name={job}").items
    for event in sorted(events, key=lambda e: str(e.metadata.creation_timestamp)):
        if event.metadata.uid in seen:
            continue
        seen.add(event.metadata.uid)
        color = "yellow" if event.type == "Warning" else "green"
        console.print(f"  [{color}]event[/] {event.reason}: {event.message}")


_last_line: dict[str, str] = {}


def _print_progress(console: Console, started: float, status: dict[str, Any],
                    ref_status: dict[str, Any], log: StepLog) -> None:
    line = (f"phase={status.get('phase', '-')} attempt={status.get('attempt', '-')} "
            f"replicas={status.get('replicas', '-')} step={log.last_step} "
            f"checkpoint={(status.get('lastCheckpoint') or {}).get('step', '-')} | "
            f"ref step={ref_status.get('step', '-')}")
    if _last_line.get("line") != line:
        _last_line["line"] = line
        console.print(f"[dim]{time.monotonic() - started:6.1f}s[/] {line}")
