"""The log shipper tails the kubelets' pod log files, as GKE's logging agent does, and keeps the
namespace's container runs in the kubelet's layout, so the readers of the kubelets' files read
them as the containers wrote them, after the kubelet removed its own."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from tardigrade_local import crilog
from tardigrade_local.logshipper import LogShipper
from tardigrade_local.steplog import StepLog

from tests.polling import wait_for


def _run_file(node: Path, namespace: str, pod: str, container: str = "trainer",
              restart: int = 0) -> Path:
    path = node / f"{namespace}_{pod}_uid-{pod}" / container / f"{restart}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def _write(path: Path, data: bytes) -> None:
    """As containerd appends a container's output."""
    with open(path, "ab") as out:
        writer = crilog.CriLogWriter(out, "stdout")
        writer.feed(data)


def _shipped(shipper: LogShipper, source: Path, node: Path) -> str:
    target = shipper.directory / source.relative_to(node)
    return crilog.text(target.read_bytes()) if target.exists() else ""


def test_whole_lines_are_shipped_as_they_come_and_outlive_the_kubelets_files(tmp_path):
    node = tmp_path / "node-1"
    shipper = LogShipper(lambda: [node], tmp_path / "shipped", "default")
    run = _run_file(node, "default", "j-a1-0")
    records = [{"event": "checkpoint_restored", "step": 4},
               {"event": "step", "step": 5, "loss": 1.25}]
    _write(run, (json.dumps(records[0]) + "\n").encode())
    shipper.ship_once()
    assert _shipped(shipper, run, node) == json.dumps(records[0]) + "\n"
    # A record half written by containerd waits for its newline.
    line = f"{json.dumps(records[1])}\n".encode()
    with open(run, "ab") as out:
        out.write(b"2026-12-07T02:40:00.000000000Z stdout F " + line[:10])
    shipper.ship_once()
    assert _shipped(shipper, run, node) == json.dumps(records[0]) + "\n"
    with open(run, "ab") as out:
        out.write(line[10:])
    shipper.ship_once()
    shipper.ship_once()  # nothing new: nothing repeated
    shutil.rmtree(node)  # the pod deleted: the kubelet removes its files
    log = StepLog.from_pod_log_dirs([shipper.directory], "default", "j")
    assert log.losses == {5: [1.25]}
    assert log.restored == [4]


def test_every_node_every_run_of_the_namespace_only(tmp_path):
    nodes = [tmp_path / "node-1"]
    shipper = LogShipper(lambda: list(nodes), tmp_path / "shipped", "default")
    first = _run_file(nodes[0], "default", "j-a1-0")
    restarted = _run_file(nodes[0], "default", "j-a1-0", restart=1)
    other = _run_file(nodes[0], "tenant", "j-a1-0")
    for path in (first, restarted, other):
        _write(path, f"from {path.parent.parent.name} run {path.name}\n".encode())
    shipper.ship_once()
    # A node that joins later (a scale-up, a recreated VM) is read from then on.
    nodes.append(tmp_path / "node-2")
    later = _run_file(nodes[1], "default", "j-a2-0")
    _write(later, b"on the new node\n")
    shipper.ship_once()
    assert _shipped(shipper, first, nodes[0]) == "from default_j-a1-0_uid-j-a1-0 run 0.log\n"
    assert _shipped(shipper, restarted, nodes[0]) == "from default_j-a1-0_uid-j-a1-0 run 1.log\n"
    assert _shipped(shipper, later, nodes[1]) == "on the new node\n"
    assert not list(shipper.directory.glob("tenant_*"))


def test_links_other_files_and_rotated_logs_are_not_read(tmp_path):
    node = tmp_path / "node-1"
    secret = tmp_path / "host-secret"
    secret.write_text("2026-12-07T02:40:00Z stdout F not for the logs\n")
    run = _run_file(node, "default", "j-a1-0")
    run.symlink_to(secret)
    os.symlink(tmp_path, node / "default_linked_uid")  # a pod folder that is a link
    rotated = run.parent / "1.log.20261207-024000"
    _write(rotated, b"rotated away\n")
    fifo = run.parent / "2.log"
    os.mkfifo(fifo)  # would block a reader that opened it
    shipper = LogShipper(lambda: [node], tmp_path / "shipped", "default")
    shipper.ship_once()
    assert [p for p in shipper.directory.rglob("*") if p.is_file()] == []


def test_the_agent_ships_in_the_background_and_a_last_pass_on_stop(tmp_path):
    node = tmp_path / "node-1"
    run = _run_file(node, "default", "j-a1-0")
    with LogShipper(lambda: [node], tmp_path / "shipped", "default") as shipper:
        _write(run, b"first\n")
        wait_for(lambda: _shipped(shipper, run, node) == "first\n", 30, "the first line shipped")
        _write(run, b"second\n")
    assert _shipped(shipper, run, node) == "first\nsecond\n"
