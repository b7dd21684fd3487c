"""What an end-to-end test's failure report shows of its cluster: each job's status, its pods'
states and the last lines of their containers, the nodes, and the operator's log.

A failure on CI is often all there is to go on (its cluster's files are removed with it), and a
wait that timed out says only what it waited for."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from tardigrade_local import crilog

from tests.e2e.harness import NAMESPACE, Cluster, RealCluster

LOG_LINES = 12
OPERATOR_LOG_LINES = 60
NODE_LOG_LINES = 30
STEP_RECORD = '"event": "step",'  # tardigrade_trainer session.py's record of each step
STATUS_KEYS = ("phase", "attempt", "replicas", "message", "restarts")


def job_summary(job: dict[str, Any]) -> str:
    status = job.get("status") or {}
    head = {k: status[k] for k in STATUS_KEYS if k in status}
    lines = [f"job {job['metadata']['name']}: {json.dumps(head, sort_keys=True)}"]
    for condition in status.get("conditions") or []:
        lines.append(f"  condition {condition.get('type')}={condition.get('status')} "
                     f"{condition.get('reason', '')}: {condition.get('message', '')}")
    for recovery in (status.get("recoveries") or [])[-2:]:
        lines.append(f"  recovery {json.dumps(recovery, sort_keys=True)}")
    return "\n".join(lines)


def pod_summary(pod: Any) -> str:
    meta, status = pod.metadata, pod.status
    deleting = " deleting" if meta.deletion_timestamp else ""
    lines = [f"pod {meta.name} on {pod.spec.node_name}: {status.phase}{deleting} "
             f"attempt={(meta.labels or {}).get('tardigrade.dev/attempt')}"]
    for condition in status.conditions or []:
        if condition.type == "DisruptionTarget" or condition.status != "True":
            lines.append(f"  condition {condition.type}={condition.status} {condition.reason}")
    for container in status.container_statuses or []:
        lines.append(f"  container {container.name} restarts={container.restart_count} "
                     f"now={_state(container.state)} last={_state(container.last_state)}")
    return "\n".join(lines)


def _state(state: Any) -> str:
    if state is None:
        return "-"
    if state.running is not None:
        return "running"
    if state.waiting is not None:
        return f"waiting({state.waiting.reason})"
    if state.terminated is not None:
        return f"exited({state.terminated.exit_code}, {state.terminated.reason})"
    return "-"


def node_summary(node: Any) -> str:
    ready = next((c for c in node.status.conditions or [] if c.type == "Ready"), None)
    said = "?" if ready is None else f"{ready.status} ({ready.reason}: {ready.message})"
    taints = ",".join(f"{t.key}:{t.effect}" for t in node.spec.taints or [])
    return (f"node {node.metadata.name}: Ready={said} "
            f"unschedulable={bool(node.spec.unschedulable)} taints=[{taints}]")


def _not_ready(node: Any) -> bool:
    return not any(c.type == "Ready" and c.status == "True"
                   for c in node.status.conditions or [])


def node_tails(vms: Mapping[str, Any], nodes: Iterable[Any],
               lines: int = NODE_LOG_LINES) -> str:
    """For each Node that is not Ready and whose VM runs (`vms`: `RealNodeCluster.nodes`):
    which of the VM's processes have exited, and the last lines of its kubelet and
    containerd. Why a node does not come back is there, and those files go with the test's."""
    out = []
    for node in nodes:
        vm = vms.get(node.metadata.name)
        if vm is None or not _not_ready(node):
            continue
        exits = vm.exits()
        gone = ", ".join(f"{name} exited {code}" for name, code in exits.items()
                         if code is not None)
        out.append(f"--- {node.metadata.name} ({vm.directory.name}): "
                   f"{gone or f'{len(exits)} processes running'}")
        for process in ("kubelet", "containerd"):
            out.append(f"--- {process} of {node.metadata.name}")
            out.append(tail(vm.logs_dir / f"{process}.log", lines))
    return "\n".join(out)


def container_logs(cluster: Cluster) -> Iterator[tuple[str, str, Path]]:
    """(pod name, label, file) of every container log the cluster's kubelets kept, as shipped
    off the real nodes in the kubelet's layout (`<namespace>_<pod>_<uid>/<container>/
    <restart>.log`); none for a control plane without nodes."""
    if not isinstance(cluster, RealCluster):
        return
    for log_file in sorted(cluster.shipped_logs.glob("*_*_*/*/*.log")):
        pod_dir = log_file.parents[1].name
        yield (pod_dir.split("_")[1],
               f"{pod_dir}/{log_file.parent.name}/{log_file.name}", log_file)


def log_tails(logs: Iterable[tuple[str, str, Path]], names: Iterable[str],
              lines: int = LOG_LINES) -> str:
    """The last lines each container of these jobs' pods wrote, from the kubelets' files
    (pods already deleted included)."""
    wanted = tuple(f"{name}-a" for name in names)  # naming.pod_name: <job>-a<attempt>-<rank>
    out = []
    for pod, label, log_file in logs:
        if not pod.startswith(wanted):
            continue
        out.append(f"--- {label}")
        out.extend(line[:400] for line in _without_steps(
            crilog.text(log_file.read_bytes()).splitlines())[-lines:])
    return "\n".join(out)


def _without_steps(lines: list[str]) -> list[str]:
    """The lines but a trainer's step records, of which only the last says anything here."""
    steps = [i for i, line in enumerate(lines) if STEP_RECORD in line]
    dropped = set(steps[:-1])
    return [line for i, line in enumerate(lines) if i not in dropped]


def tail(path: Path, lines: int) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as err:
        return f"(unreadable: {err})"


def snapshot(cluster: Cluster, operator_log: Path | None) -> str:
    """Everything above, for every job of the cluster's namespace; never raises (a failure
    report must not fail)."""
    parts: list[str] = []
    try:
        jobs = cluster.custom.list_namespaced_custom_object(
            "tardigrade.dev", "v1alpha1", NAMESPACE, "trainingjobs")["items"]
        parts.extend(job_summary(job) for job in jobs)
        parts.extend(pod_summary(pod) for pod in cluster.core.list_namespaced_pod(
            NAMESPACE, label_selector="tardigrade.dev/job").items)
        nodes = cluster.core.list_node().items
        parts.extend(node_summary(node) for node in nodes)
        if isinstance(cluster, RealCluster):
            parts.append(node_tails(dict(cluster.real.nodes), nodes))
        parts.append(log_tails(container_logs(cluster),
                               [job["metadata"]["name"] for job in jobs]))
    except Exception as err:  # the cluster may be what broke
        parts.append(f"(the cluster could not be read: {err!r})")
    if operator_log is not None:
        parts.append(f"--- operator log\n{tail(operator_log, OPERATOR_LOG_LINES)}")
    return "\n".join(parts)
