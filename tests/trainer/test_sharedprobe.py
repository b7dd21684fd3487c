"""The start-up check that every host sees the same checkpoint root, with two real processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from trainer_harness import SOURCE_PATHS, free_port

# One rank: initialize the gang on loopback, run the check, report what happened.
RANK = """
import json, sys
import jax
from tardigrade_checkpoint import CheckpointIOError
from tardigrade_checkpoint.sharedprobe import (
    CheckpointPathNotSharedError, check_shared)

port, pid, root = sys.argv[1], int(sys.argv[2]), sys.argv[3]
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                           process_id=pid, initialization_timeout=120)
try:
    check_shared(root, process_id=pid, process_count=2, barrier_timeout_seconds=600,
                 visibility_seconds=1.0)
    print(json.dumps({"shared": True}))
except CheckpointPathNotSharedError as err:
    print(json.dumps({"shared": False, "error": str(err)}))
except CheckpointIOError as err:
    print(json.dumps({"io_error": str(err)}))
jax.distributed.shutdown()
"""


def run_gang(roots: list[Path]) -> list[dict]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TARDIGRADE_")}
    env.pop("XLA_FLAGS", None)
    env["PYTHONPATH"] = os.pathsep.join([*SOURCE_PATHS, env.get("PYTHONPATH", "")])
    env["JAX_PLATFORMS"] = "cpu"
    procs = [subprocess.Popen([sys.executable, "-c", RANK, str(port), str(pid), str(root)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for pid, root in enumerate(roots)]
    results = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=180)
            assert proc.returncode == 0, err.decode()[-3000:]
            results.append(json.loads(out.decode().strip().splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return results


@pytest.mark.slow
def test_one_root_for_both_hosts_passes_and_leaves_no_probe(tmp_path):
    root = tmp_path / "shared"
    root.mkdir()
    (root / ".tardigrade-shared-probe-0123abcd-1").write_text("from a start killed midway")
    assert run_gang([root, root]) == [{"shared": True}] * 2
    assert list(root.iterdir()) == []


@pytest.mark.slow
def test_a_root_private_to_each_host_is_a_config_error_that_says_the_fix(tmp_path):
    roots = [tmp_path / "node-a" / "ckpt", tmp_path / "node-b" / "ckpt"]
    results = run_gang(roots)
    assert [r["shared"] for r in results] == [False, False]
    for rank, result in enumerate(results):
        error = result["error"]
        assert error.startswith(f"spec.checkpoint.path {roots[rank]} is not shared between "
                                "hosts"), error
        assert "host 0 (" in error and "does not see host 1" in error
        assert "host 1 (" in error and "does not see host 0" in error
        for fix in ("ReadWriteMany PersistentVolumeClaim", "gs://", "gcsfuse"):
            assert fix in error
    # Each host removed its own probe.
    assert [list(r.iterdir()) for r in roots] == [[], []]


@pytest.mark.slow
def test_a_host_that_cannot_write_fails_every_host_at_once(tmp_path):
    (tmp_path / "a-file").write_text("x")
    roots = [tmp_path / "ckpt", tmp_path / "a-file" / "ckpt"]
    # Within run_gang's 180 s, far short of the 600 s barrier timeout: the healthy host
    # learns of the failure at the exchange.
    results = run_gang(roots)
    for result in results:
        assert result["io_error"].startswith("host 1 ("), result
        assert f"cannot write a probe under checkpoint path {roots[1]}" in result["io_error"]
    assert list(roots[0].iterdir()) == []
