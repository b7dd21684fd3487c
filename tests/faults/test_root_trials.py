"""The checkpoint root trials of bench/faults_trainer.py (section C), a few of each story."""

from __future__ import annotations

from tests.faults.root_trials import KINDS, run


def test_root_trials_strand_no_job_and_restore_no_wrong_weights(tmp_path):
    results = run(tmp_path, seed=14, trials=2 * len(KINDS))
    assert {r.kind for r in results} == set(KINDS)
    assert [p for r in results for p in r.problems] == []
    assert sum(r.stranded for r in results) == sum(r.wrong_weights for r in results) == 0
    # The refusals the rules require were exercised, not skipped.
    assert sum(r.refusals_checked for r in results) >= 2 * 3
