"""The oldest Kueue Tardigrade supports (v0.17.0, `queueing.MINIMUM_KUEUE`), run by the suite:
the gang's core contract under a queue, taken from test_kueue.py and run here against that
version's own build (local_cluster/builds/kueue-v0.17): a preempted gang saves at one step, is
requeued and resumes with nothing lost, and a gang training past the PodsReady timeout is
never evicted for it (v0.17 has waitForPodsReady off by default; the cluster turns it on, as
a platform team running v0.17 with it would)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from tardigrade_local import gobuild
from tardigrade_operator.decision import queueing

from tests.e2e import test_kueue as current
from tests.e2e.harness import Cluster
from tests.e2e.test_kueue import (  # noqa: F401  (collected and run here, on this cluster)
    cleared,
    test_a_gang_training_past_the_pods_ready_timeout_is_never_evicted_for_it,
    test_a_preempted_gang_saves_at_one_step_is_requeued_and_resumes_with_nothing_lost,
)

pytestmark = pytest.mark.slow
OLDEST = "kueue-v0.17"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(gobuild.KUEUE_MODULE_ENV, OLDEST)
        assert gobuild.kueue_version().startswith(queueing.MINIMUM_KUEUE), (
            f"{OLDEST} pins {gobuild.kueue_version()}, not the minimum the operator names "
            f"({queueing.MINIMUM_KUEUE})")
        yield from current.started_cluster(tmp_path_factory)
