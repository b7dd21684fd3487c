"""The failure report's view of a cluster (diagnostics.py), from client objects and files."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from kubernetes.client import (
    V1ContainerState,
    V1ContainerStateRunning,
    V1ContainerStateTerminated,
    V1ContainerStateWaiting,
    V1ContainerStatus,
    V1Node,
    V1NodeCondition,
    V1NodeSpec,
    V1NodeStatus,
    V1ObjectMeta,
    V1Pod,
    V1PodCondition,
    V1PodSpec,
    V1PodStatus,
    V1Taint,
)
from tardigrade_local.crilog import CriLogWriter

from tests.e2e import diagnostics


def test_a_job_shows_its_phase_attempt_conditions_and_last_recovery() -> None:
    job = {"metadata": {"name": "j"}, "status": {
        "phase": "Recovering", "attempt": 2, "ignored": "x",
        "conditions": [{"type": "Ready", "status": "False", "reason": "Launching",
                        "message": "waiting for 1 pod"}],
        "recoveries": [{"cause": "Preemption", "attempt": 1}, {"cause": "Resize"},
                       {"cause": "Preemption", "attempt": 2}]}}
    text = diagnostics.job_summary(job)
    assert text.splitlines()[0] == 'job j: {"attempt": 2, "phase": "Recovering"}'
    assert "condition Ready=False Launching: waiting for 1 pod" in text
    assert '"attempt": 1' not in text and text.count("recovery ") == 2


def test_a_pod_shows_its_node_disruption_and_each_containers_states() -> None:
    pod = V1Pod(
        metadata=V1ObjectMeta(name="j-a1-0", labels={"tardigrade.dev/attempt": "1"},
                              deletion_timestamp="2026-12-04T00:00:00Z"),
        spec=V1PodSpec(node_name="new-a", containers=[]),
        status=V1PodStatus(
            phase="Running",
            conditions=[V1PodCondition(type="Ready", status="True"),
                        V1PodCondition(type="DisruptionTarget", status="True",
                                       reason="TerminationByKubelet")],
            container_statuses=[V1ContainerStatus(
                name="trainer", image="i", image_id="", ready=False, restart_count=1,
                state=V1ContainerState(waiting=V1ContainerStateWaiting(
                    reason="CrashLoopBackOff")),
                last_state=V1ContainerState(terminated=V1ContainerStateTerminated(
                    exit_code=77, reason="Error")))]))
    lines = diagnostics.pod_summary(pod).splitlines()
    assert lines[0] == "pod j-a1-0 on new-a: Running deleting attempt=1"
    assert lines[1] == "  condition DisruptionTarget=True TerminationByKubelet"
    assert lines[2] == ("  container trainer restarts=1 now=waiting(CrashLoopBackOff) "
                        "last=exited(77, Error)")
    assert len(lines) == 3  # a true Ready says nothing
    running = V1ContainerState(running=V1ContainerStateRunning())
    assert diagnostics._state(running) == "running" and diagnostics._state(None) == "-"


def test_a_node_shows_readiness_cordon_and_taints() -> None:
    node = V1Node(metadata=V1ObjectMeta(name="n"),
                  spec=V1NodeSpec(unschedulable=True, taints=[V1Taint(
                      key="node.kubernetes.io/not-ready", effect="NoExecute")]),
                  status=V1NodeStatus(conditions=[V1NodeCondition(
                      type="Ready", status="Unknown", reason="NodeStatusUnknown",
                      message="Kubelet stopped posting node status.")]))
    assert diagnostics.node_summary(node) == (
        "node n: Ready=Unknown (NodeStatusUnknown: Kubelet stopped posting node status.) "
        "unschedulable=True taints=[node.kubernetes.io/not-ready:NoExecute]")


def _node(name: str, ready: str) -> V1Node:
    return V1Node(metadata=V1ObjectMeta(name=name), spec=V1NodeSpec(),
                  status=V1NodeStatus(conditions=[V1NodeCondition(type="Ready",
                                                                  status=ready)]))


def test_node_tails_show_the_running_vms_of_nodes_not_ready(tmp_path: Path) -> None:
    vms = {}
    for name in ("ready", "down", "nolog"):
        directory = tmp_path / f"{name}.2"
        (directory / "logs").mkdir(parents=True)
        exits = {"kubelet": None, "containerd": 137 if name == "down" else None}
        vms[name] = SimpleNamespace(directory=directory, logs_dir=directory / "logs",
                                    exits=lambda exits=exits: exits)
        if name != "nolog":
            for process in ("kubelet", "containerd"):
                (directory / "logs" / f"{process}.log").write_text(
                    "".join(f"{process} {name} {i}\n" for i in range(50)))
    nodes = [_node("ready", "True"), _node("down", "False"), _node("nolog", "Unknown"),
             _node("gone", "Unknown")]  # a Node whose VM is not running: no log to read
    text = diagnostics.node_tails(vms, nodes, lines=2).splitlines()
    assert text[:7] == ["--- down (down.2): containerd exited 137",
                        "--- kubelet of down", "kubelet down 48", "kubelet down 49",
                        "--- containerd of down", "containerd down 48", "containerd down 49"]
    assert text[7] == "--- nolog (nolog.2): 2 processes running"
    assert text[8] == "--- kubelet of nolog" and text[9].startswith("(unreadable: ")
    assert len(text) == 12


def _logs(pods_dir: Path) -> list[tuple[str, str, Path]]:
    """(pod, label, file) tuples, as `container_logs` yields them."""
    return [(d.name.split("_", 1)[1], f"{d.name}/trainer.log", d / "trainer.log")
            for d in sorted(pods_dir.iterdir())]


def test_log_tails_read_the_last_lines_of_the_jobs_pods_only(tmp_path: Path) -> None:
    for pod, lines in (("default_j-a1-0", 20), ("default_jx-a1-0", 3)):
        (tmp_path / pod).mkdir()
        with open(tmp_path / pod / "trainer.log", "wb") as out:
            writer = CriLogWriter(out, "stdout")
            writer.feed(b"".join(f"line {i}\n".encode() for i in range(lines)))
    text = diagnostics.log_tails(_logs(tmp_path), ["j"], lines=2).splitlines()
    assert text == ["--- default_j-a1-0/trainer.log", "line 18", "line 19"]


def test_log_tails_keep_only_the_last_step_record(tmp_path: Path) -> None:
    (tmp_path / "default_j-a1-0").mkdir()
    records = [{"event": "start"}, *({"event": "step", "step": s} for s in range(1, 30)),
               {"event": "preempted", "step": 29}]
    with open(tmp_path / "default_j-a1-0" / "trainer.log", "wb") as out:
        CriLogWriter(out, "stdout").feed(
            b"".join(json.dumps(r).encode() + b"\n" for r in records))
    text = diagnostics.log_tails(_logs(tmp_path), ["j"]).splitlines()[1:]
    assert [json.loads(line) for line in text] == [records[0], records[-2], records[-1]]


def test_an_unreadable_operator_log_is_said_not_raised(tmp_path: Path) -> None:
    assert diagnostics.tail(tmp_path / "missing.log", 5).startswith("(unreadable:")
