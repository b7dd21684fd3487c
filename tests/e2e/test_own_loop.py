"""End to end: a user's own loop (the examples of docs/trainer.md, verbatim) under the real
operator on the local cluster, through a node preemption and a resize, with our checkpoint
format and with Orbax's.

The shipped trainer image runs the plain loop (`spec.command: [python, loop.py]`; pods on the
local cluster share this machine's disk, where a real cluster would have the file in the
image). The shipped image does not declare Orbax (it is the `[orbax]` extra; today it arrives
there only transitively, marin-haliax -> aqtp -> flax -> orbax-checkpoint), so the Orbax loop
runs in `local/python`, the local cluster's stand-in for a user's own image with the extra."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from tardigrade_local.cluster import LocalCluster

from tests.e2e.harness import Cluster, OperatorProcess, trainingjob, wait_for
from tests.trainer.test_session import LOOPS, doc_example

pytestmark = pytest.mark.slow

GRACE_SECONDS = 20
# Enough steps that the job is still training after a relaunch, at a few hundred steps a
# second for this loop on a loaded two-core machine.
STEPS = 15_000


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("e2e-own-loop")
    with LocalCluster(root / "cluster", nodes=3, shutdown_grace_seconds=GRACE_SECONDS) as local:
        yield Cluster(local)


@pytest.fixture(autouse=True)
def _one_job_at_a_time(cluster: Cluster) -> Iterator[None]:
    yield
    cluster.clear_jobs()


def _loop_job(name: str, backend: str, loop: Path, checkpoints: Path) -> dict:
    job = trainingjob(name, steps=STEPS)
    job["spec"]["trainer"] = {"steps": STEPS}
    job["spec"]["command"] = ["python", str(loop)]
    job["spec"]["checkpoint"]["interval"] = {"steps": 5000}
    if backend == "orbax":
        job["spec"]["image"] = "local/python"
        # A shared filesystem (a mounted volume on a real cluster): Orbax reaches gs:// through
        # gcsfs, which the loop's image would configure for its bucket.
        job["spec"]["checkpoint"]["path"] = str(checkpoints)
    return job


@pytest.mark.parametrize("backend", sorted(LOOPS))
def test_own_loop_survives_a_preemption_and_a_resize_with_no_step_lost(
        cluster: Cluster, operator: OperatorProcess, tmp_path: Path, backend: str):
    name = f"e2e-loop-{backend}"
    loop = tmp_path / "loop.py"
    loop.write_text(doc_example(LOOPS[backend]))
    cluster.apply(_loop_job(name, backend, loop, tmp_path / "checkpoints"))
    log = cluster.step_log(name)

    wait_for(lambda: (log.collect(), log.last_step >= 200)[1], 300, "training to pass step 200")
    victim = next(p for p in cluster.pods(name) if p.metadata.labels["tardigrade.dev/rank"] == "1")
    cluster.local.preempt_node(victim.spec.node_name, grace_seconds=GRACE_SECONDS,
                               replace_after_seconds=1)
    wait_for(lambda: (log.collect(), len(log.restored) == 1
                      and log.last_step >= log.restored[0] + 200)[1],
             300, "the relaunched gang to train 200 steps")
    cluster.kubectl("scale", f"tj/{name}", "--replicas=1")
    status = cluster.wait_phase(name, {"Succeeded"}, timeout=600, collector=log)
    operator.assert_alive()

    causes = [r["cause"] for r in status["recoveries"]]
    assert causes == ["Preemption", "Resize"], status["recoveries"]
    for recovery in status["recoveries"]:
        assert recovery["stepsLost"] == 0, recovery
    assert log.restored == [r["restoreStep"] for r in status["recoveries"]]
    assert status["restarts"]["failures"] == 0
    assert status["step"] == STEPS
    assert status["lastCheckpoint"]["step"] == STEPS
    if backend == "orbax":  # Orbax's own layout: one directory per step, named by the step
        assert (tmp_path / "checkpoints" / str(STEPS)).is_dir()
    # From the kubelets' files: the old gangs' last lines, gone with their pods, are there too.
    complete = cluster.complete_log(name)
    missing = [s for s in range(1, STEPS + 1) if s not in complete.losses]
    assert not missing, f"no loss logged for steps {missing[:10]}"
    for step, losses in complete.losses.items():
        # A step trained again after a restore gives the same loss: same data, same state.
        assert max(losses) - min(losses) <= 1e-5 * max(1.0, abs(losses[0])), (step, losses)
