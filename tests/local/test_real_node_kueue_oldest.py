"""The oldest Kueue Tardigrade supports (v0.17.0, `queueing.MINIMUM_KUEUE`), run by the suite:
the gang's core contract under a queue on real nodes with real trainers, taken from
test_real_node_kueue.py and run here against that version's own build
(local_cluster/builds/kueue-v0.17): the quota admits whole gangs and a job that does not fit
waits Queued, a gang training past the PodsReady timeout is never evicted for it (v0.17 has
waitForPodsReady off by default; the cluster turns it on, as a platform team running v0.17
with it would), and a preempted gang saves at one step, is requeued and resumes with nothing
lost."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import test_real_node_kueue as current
from tardigrade_local import gobuild
from tardigrade_local.realcluster import RealNodeCluster
from tardigrade_operator.decision import queueing
from test_real_node_kueue import (  # noqa: F401  (the module's fixtures, for this cluster)
    custom,
    installed,
    kube,
    pytestmark,
    recorder,
)

# Collected and run here, in this order: they build on each other.
test_the_quota_admits_whole_gangs_and_a_job_that_does_not_fit_waits_queued_then_runs = (
    current.test_the_quota_admits_whole_gangs_and_a_job_that_does_not_fit_waits_queued_then_runs)
test_a_gang_training_past_the_pods_ready_timeout_is_never_evicted_for_it = (
    current.test_a_gang_training_past_the_pods_ready_timeout_is_never_evicted_for_it)
test_a_preempted_gang_saves_at_one_step_is_requeued_and_resumes_with_nothing_lost = (
    current.test_a_preempted_gang_saves_at_one_step_is_requeued_and_resumes_with_nothing_lost)

OLDEST = "kueue-v0.17"


@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealNodeCluster]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(gobuild.KUEUE_MODULE_ENV, OLDEST)
        assert gobuild.kueue_version().startswith(queueing.MINIMUM_KUEUE), (
            f"{OLDEST} pins {gobuild.kueue_version()}, not the minimum the operator names "
            f"({queueing.MINIMUM_KUEUE})")
        yield from current.started_real(tmp_path_factory)
