"""`tardigrade demo`: the whole story on one laptop, in a few minutes.

A local cluster and the operator come up; examples/trainingjob.yaml is applied; a node is
preempted mid-run; the job is scaled to another replica count; it finishes. An identical job
runs undisturbed on a node of its own as the reference. Left behind: a loss-curve PNG with the
disruptions marked and the reference overlaid, and a table of what happened.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import subprocess
import time
from pathlib import Path
from typing import Any

import kubernetes
import yaml
from rich.console import Console

from tardigrade_local.cluster import LocalCluster, operator_command, repo_root
from tardigrade_local.demo_report import Marker, plot_losses, recovery_markers, write_table
from tardigrade_local.gke.disruptions import REGULAR_POD_SHUTDOWN_GRACE_SECONDS
from tardigrade_local.gke.nodes import NodeConfig
from tardigrade_local.steplog import StepLog

NAMESPACE = "default"
REFERENCE_NODE = "local-reference"
REFERENCE_TAINT = {"key": "tardigrade.dev/reference", "value": "true", "effect": "NoSchedule"}


@dataclasses.dataclass(frozen=True)
class DemoSettings:
    steps: int = 300
    preempt_at: int = 100
    resize_at: int = 200
    resize_to: int = 3
    # What a GKE spot reclaim gives a trainer pod: 15 s of the 30 s notice.
    grace_seconds: float = REGULAR_POD_SHUTDOWN_GRACE_SECONDS
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


def reference_job(job: dict[str, Any]) -> dict[str, Any]:
    """The same training on a node nobody disturbs."""
    ref = copy.deepcopy(job)
    name = f"{job['metadata']['name']}-reference"
    ref["metadata"]["name"] = name
    ref["spec"]["checkpoint"]["path"] = job["spec"]["checkpoint"]["path"] + "-reference"
    ref["spec"]["podTemplate"] = {
        **ref["spec"].get("podTemplate", {}),
        "nodeSelector": {"kubernetes.io/hostname": REFERENCE_NODE},
        "tolerations": [{**REFERENCE_TAINT, "operator": "Equal"}],
    }
    return ref


def run_demo(out_dir: Path, settings: DemoSettings, console: Console) -> DemoResult:
    out_dir.mkdir(parents=True, exist_ok=True)
    job = demo_job(settings.steps)
    reference = reference_job(job)
    name, ref_name = job["metadata"]["name"], reference["metadata"]["name"]
    # Room for the resized gang next to the reference: three ordinary nodes, one tainted.
    nodes = [NodeConfig(f"local-node-{i}") for i in range(1, 4)]
    nodes.append(NodeConfig(REFERENCE_NODE, labels={"kubernetes.io/hostname": REFERENCE_NODE},
                            taints=(REFERENCE_TAINT,)))
    operator = operator_command(namespace=NAMESPACE, resync_seconds=1)
    state = out_dir / ".tardigrade-demo"
    console.print(f"[bold]Starting the local cluster[/] (state in {state})")
    with LocalCluster(state, nodes=nodes, operator_command=operator,
                      shutdown_grace_seconds=settings.grace_seconds) as cluster:
        env = cluster.client_env()
        client = kubernetes.config.new_client_from_config(config_file=str(cluster.kubeconfig))
        core = kubernetes.client.CoreV1Api(client)
        custom = kubernetes.client.CustomObjectsApi(client)

        def kubectl(*args: str, stdin: str | None = None) -> None:
            console.print(f"[cyan]$ kubectl {' '.join(args)}[/]")
            subprocess.run(["kubectl", *args], env={**env}, input=stdin, text=True,
                           check=True, capture_output=True)

        kubectl("apply", "-f", "-", stdin=yaml.safe_dump(job))
        kubectl("apply", "-f", "-", stdin=yaml.safe_dump(reference))
        log, ref_log = StepLog(core, NAMESPACE, name), StepLog(core, NAMESPACE, ref_name)
        # When the demo acts: the markers come afterwards from the job's recorded recoveries,
        # at the steps the gang saved at, not at the step last read from the log here.
        preempted = resized = False
        seen_events: set[str] = set()
        started = time.monotonic()
        status: dict[str, Any] = {}
        ref_status: dict[str, Any] = {}
        while True:
            if time.monotonic() - started > settings.timeout_seconds:
                raise RuntimeError("the demo did not finish in time; see the operator log in "
                                   f"{state / 'operator.log'}")
            log.collect()
            ref_log.collect()
            status = _status(custom, name)
            ref_status = _status(custom, ref_name)
            _print_events(console, core, name, seen_events)
            _print_progress(console, started, status, ref_status, log)
            if not preempted and log.last_step >= settings.preempt_at:
                node = _node_of_rank(core, name, rank=1)
                if node:
                    console.print(f"[bold red]Preempting node {node}[/] (spot reclaim, "
                                  f"{settings.grace_seconds:.0f}s grace)")
                    cluster.preempt_node(node, grace_seconds=settings.grace_seconds,
                                         replace_after_seconds=2)
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
        # The curves from the kubelets' files: a gang's last lines before its pods were deleted
        # (at the preemption, at the resize) can fall between two polls of the API.
        log = StepLog.from_container_logs(cluster.layout, NAMESPACE, name)
        ref_log = StepLog.from_container_logs(cluster.layout, NAMESPACE, ref_name)
        job_obj = custom.get_namespaced_custom_object(
            "tardigrade.dev", "v1alpha1", NAMESPACE, "trainingjobs", name)
        ref_obj = custom.get_namespaced_custom_object(
            "tardigrade.dev", "v1alpha1", NAMESPACE, "trainingjobs", ref_name)
    markers = recovery_markers((job_obj.get("status") or {}).get("recoveries") or [])
    plot = plot_losses(log.curve(), ref_log.curve(), markers, out_dir / "tardigrade-demo.png")
    table = write_table(job_obj, ref_obj, log.curve(), ref_log.curve(), markers,
                        out_dir / "tardigrade-demo.md")
    (out_dir / "tardigrade-demo.json").write_text(json.dumps({
        "job": job_obj.get("status"), "reference": ref_obj.get("status"),
        "markers": [dataclasses.asdict(m) for m in markers],
        "losses": log.curve(), "reference_losses": ref_log.curve(),
    }, indent=2, default=str))
    return DemoResult(job_obj, ref_obj, log.curve(), ref_log.curve(), markers, plot, table)


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
