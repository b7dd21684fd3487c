"""Restart in process (attempts.py): the container's main process keeps its imports and runs
each attempt in a child; the kubelet sees one process that never exits until the last
attempt ends, with that attempt's exit code or signal."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from tardigrade_contract import contract
from tardigrade_sdk import attempts

from tests.polling import wait_for

# A stand-in for a trainer: attempt 1 is released into attempt 2 (the operator's request
# leaves the world in the pod); attempt 2 ends as argv[2] says.
ATTEMPTS = """
import json, os, signal, sys, time
from tardigrade_contract import contract
from tardigrade_sdk import attempts, inplace, phases
phases.mark("imports_done")
attempts.run_attempts()
env = contract.TrainerEnvironment.from_env(inplace.newest_world(os.environ))
print(json.dumps({"pid": os.getpid(), "keeper": os.getppid(), "attempt": env.attempt,
                  "marks": phases.marks(), "now": time.time()}), flush=True)
if env.attempt == 1:
    with open(os.path.join(env.restart_in_place_dir, inplace.WORLD_FILE), "w") as f:
        f.write(sys.argv[1])
    os._exit(attempts.EXIT_NEXT_ATTEMPT)
if sys.argv[2] == "exit":
    os._exit(75)
if sys.argv[2] == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
signal.signal(signal.SIGTERM, lambda *_: os._exit(42))
print("waiting", flush=True)
while True:
    signal.pause()
"""


def _environ(tmp_path: Path, on: bool = True) -> dict[str, str]:
    world = {"attempt": 2, "numProcesses": 2, "processId": 1,
             "coordinatorAddress": "j-a1-0.j:8476", "restoreStep": "latest"}
    environ = {**os.environ, contract.ENV_ATTEMPT: "1", contract.ENV_NUM_PROCESSES: "2",
               contract.ENV_PROCESS_ID: "1", contract.ENV_CHECKPOINT_PATH: "gs://b/run",
               contract.ENV_RESTART_IN_PLACE_DIR: str(tmp_path),
               contract.ENV_RESTART_IN_PROCESS: "true" if on else "false"}
    environ["WORLD_JSON"] = json.dumps(world)
    return environ


def _start(tmp_path: Path, ending: str) -> subprocess.Popen[str]:
    environ = _environ(tmp_path)
    return subprocess.Popen([sys.executable, "-c", ATTEMPTS, environ["WORLD_JSON"], ending],
                            env=environ, stdout=subprocess.PIPE, text=True)


def _lines(proc: subprocess.Popen[str], count: int) -> list[dict]:
    assert proc.stdout is not None
    found = []
    while len(found) < count:
        line = proc.stdout.readline()
        assert line, f"the keeper's output ended after {found}"
        found.append(json.loads(line) if line.startswith("{") else line.strip())
    return found


def test_each_attempt_is_a_new_child_of_the_same_keeper_which_exits_as_the_last_did(tmp_path):
    before = time.time()
    keeper = _start(tmp_path, "exit")
    first, second = _lines(keeper, 2)
    assert keeper.wait(timeout=60) == 75
    assert (first["attempt"], second["attempt"]) == (1, 2)
    assert first["keeper"] == second["keeper"] == keeper.pid
    assert len({first["pid"], second["pid"], keeper.pid}) == 3
    # The first attempt counts from the container's start and keeps the keeper's imports; a
    # later one starts at its fork, its imports done then.
    assert before - 1 <= first["marks"]["process_started"] < first["marks"]["imports_done"]
    assert first["now"] <= second["marks"]["process_started"] <= second["now"]
    assert second["marks"]["imports_done"] == pytest.approx(
        second["marks"]["process_started"], abs=0.001)


def test_the_stop_signal_sent_to_the_keeper_alone_reaches_the_running_attempt(tmp_path):
    keeper = _start(tmp_path, "wait")
    *_, waiting = _lines(keeper, 3)
    assert waiting == "waiting"
    keeper.send_signal(signal.SIGTERM)  # as a runtime stops a container: its PID 1 only
    assert keeper.wait(timeout=60) == 42


def test_an_attempt_killed_by_a_signal_kills_its_keeper_by_the_same(tmp_path):
    keeper = _start(tmp_path, "kill")
    _lines(keeper, 2)
    assert keeper.wait(timeout=60) == -signal.SIGKILL


def test_an_attempt_dies_with_its_keeper(tmp_path):
    keeper = _start(tmp_path, "wait")
    _, second, _ = _lines(keeper, 3)
    keeper.kill()
    keeper.wait(timeout=60)
    wait_for(lambda: not psutil.pid_exists(second["pid"])
             or psutil.Process(second["pid"]).status() == psutil.STATUS_ZOMBIE,
             timeout=30, what="the orphaned attempt to die")


def test_restart_in_process_wants_its_switch_and_the_pods_directory(tmp_path):
    assert attempts.wanted(_environ(tmp_path))
    assert not attempts.wanted(_environ(tmp_path, on=False))
    no_dir = {k: v for k, v in _environ(tmp_path).items()
              if k != contract.ENV_RESTART_IN_PLACE_DIR}
    assert not attempts.wanted(no_dir)
