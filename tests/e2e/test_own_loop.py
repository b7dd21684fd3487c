"""End to end on real nodes: a user's own loop (the examples of docs/trainer.md, verbatim)
under the operator installed by helm, through a spot reclaim and a resize, with our checkpoint
format and with Orbax's.

The shipped trainer image runs the loop (`spec.command: [python3, /loop/loop.py]`), the file
from a ConfigMap mounted in the pods, as a user without an image of their own would ship it.
The image does not declare Orbax (the `[orbax]` extra); it has it transitively (marin-haliax
-> aqtp -> flax -> orbax-checkpoint), which is what the Orbax loop uses here, checkpointing to
the cluster's ReadWriteMany claim (Orbax reaches gs:// through gcsfs, which the loop's image
would configure for its bucket)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.harness import (
    NAMESPACE,
    NEEDS_REAL_NODES,
    InstalledOperator,
    RealCluster,
    real_cluster,
    wait_for,
)
from tests.trainer.test_session import LOOPS, doc_example

pytestmark = [
    pytest.mark.slow,
    NEEDS_REAL_NODES,
]
# Enough steps that the job is still training after a relaunch, at a few hundred steps a
# second for this loop on a loaded two-core machine.
STEPS = 15_000


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealCluster]:
    # The gang's two spot nodes, and one for the relaunch after each reclaim (the reclaimed
    # node is not recreated): one test per backend.
    with real_cluster(tmp_path_factory.mktemp("loop"), 4) as running:
        yield running


@pytest.fixture(autouse=True)
def _one_job_at_a_time(cluster: RealCluster) -> Iterator[None]:
    yield
    cluster.clear_jobs()


def _loop_job(cluster: RealCluster, name: str, backend: str) -> tuple[dict, Path]:
    """The job, its loop from the ConfigMap `name`; and where its checkpoints show here."""
    job = cluster.trainingjob(name, steps=STEPS)
    job["spec"]["trainer"] = {"steps": STEPS}
    job["spec"]["command"] = ["python3", "/loop/loop.py"]
    job["spec"]["checkpoint"]["interval"] = {"steps": 5000}
    template = job["spec"]["podTemplate"]
    template.setdefault("volumes", []).append({"name": "loop", "configMap": {"name": name}})
    template.setdefault("volumeMounts", []).append({"name": "loop", "mountPath": "/loop"})
    here = Path()
    if backend == "orbax":
        in_pods, shared = cluster.mount_shared_checkpoints(job)
        job["spec"]["checkpoint"]["path"] = f"{in_pods}/{name}"
        here = shared / name
    return job, here


@pytest.mark.parametrize("backend", sorted(LOOPS))
def test_own_loop_survives_a_preemption_and_a_resize_with_no_step_lost(
        cluster: RealCluster, operator: InstalledOperator, backend: str):
    name = f"e2e-loop-{backend}"
    cluster.core.create_namespaced_config_map(NAMESPACE, {
        "metadata": {"name": name}, "data": {"loop.py": doc_example(LOOPS[backend])}})
    job, checkpoints = _loop_job(cluster, name, backend)
    cluster.apply(job)
    log = cluster.step_log(name)

    wait_for(lambda: (log.collect(), log.last_step >= 200)[1], 300, "training to pass step 200")
    victim = next(p for p in cluster.pods(name) if p.metadata.labels["tardigrade.dev/rank"] == "1")
    cluster.real.reclaim(cluster.spot_node_of(victim))
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
        assert (checkpoints / str(STEPS)).is_dir()
    # As shipped off the nodes: the old gangs' last lines, gone with their pods, are there too.
    complete = cluster.complete_log(name)
    missing = [s for s in range(1, STEPS + 1) if s not in complete.losses]
    assert not missing, f"no loss logged for steps {missing[:10]}"
    for step, losses in complete.losses.items():
        # A step trained again after a restore gives the same loss: same data, same state.
        assert max(losses) - min(losses) <= 1e-5 * max(1.0, abs(losses[0])), (step, losses)
