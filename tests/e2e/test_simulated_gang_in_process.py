"""End to end on simulated nodes with restart in process: the real operator (its image's
virtualenv) keeps 15 of 16 simulated ranks through a spot reclaim of one host, and the kept
trainers start their new world by replacing their process, not through their kubelet: no kept
container restarts, and the operator learns that the gang met again from rank 0's report of
the new attempt (recovery/strategy.note_gang_formed)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.harness import Cluster, OperatorProcess, running_operator, wait_for
from tests.e2e.test_simulated_gang_in_place import NAME, RANKS, _labelled, reclaim_last_rank
from tests.e2e.test_simulated_gang_in_place import cluster as cluster  # the fixture

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def operator(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[OperatorProcess]:
    with running_operator(cluster, tmp_path_factory.mktemp("operator"),
                          env={"TARDIGRADE_RESTART_IN_PLACE": "true",
                               "TARDIGRADE_RESTART_IN_PROCESS": "true"}) as process:
        yield process


def _container(pod: Any) -> Any:
    return pod.status.container_statuses[0]


def test_kept_ranks_restart_in_process_without_a_container_restart(
        cluster: Cluster, operator: OperatorProcess, tmp_path: Path):
    attempt, kept_pods, events = reclaim_last_rank(cluster, tmp_path / "checkpoints")
    kept = {p.metadata.name: p for p in kept_pods}

    status = wait_for(lambda: (s := cluster.status(NAME)).get("phase") == "Running"
                      and s.get("attempt") == attempt + 1 and s, 120, "the job Running again")
    operator.assert_alive()
    recovery = status["recoveries"][-1]
    assert recovery["cause"] == "Preemption" and recovery["keptPods"] == RANKS - 1, recovery
    # Rank 0 reported the new attempt: that, not a container restart, let the gang count as
    # running, and its report named the step restored.
    assert recovery.get("gangFormedTime"), recovery
    assert recovery["stepsLost"] == 0 and recovery["restoreStep"] > 0, recovery
    wait_for(lambda: (cluster.status(NAME).get("step") or 0) > recovery["restoreStep"], 60,
             "training past the restored step")
    labelled = wait_for(lambda: (pods := _labelled(cluster.pods(NAME), attempt + 1))
                        and len(pods) == RANKS and pods, 60, "every pod labelled anew")
    now = {p.metadata.name: p for p in labelled}
    for name, before in kept.items():
        # The same pod and the same container, started once: the trainer replaced itself.
        assert now[name].metadata.uid == before.metadata.uid
        container = _container(now[name])
        assert container.restart_count == 0 and container.last_state.terminated is None, name
        assert container.state.running.started_at == _container(before).state.running.started_at
    seen = events.stop()
    # No kept pod's status changed while the gang restarted (no kubelet status write): its
    # only event is the operator's label once the gang ran again.
    kept_events = [(name, label) for name, label, _ in seen if name in kept]
    assert all(label == str(attempt + 1) for _, label in kept_events), kept_events[:5]
    assert (cluster.status(NAME).get("restarts") or {}).get("preemptions") == 1
