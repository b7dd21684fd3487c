"""A launching job waits for the watch to show the pods it just created instead of listing
them from the API server on every pass (indexlag.py)."""

from __future__ import annotations

from tardigrade_operator import naming
from tardigrade_operator.observation import indexlag


def manifests(job: str, attempt: int, ranks: range) -> list[dict]:
    return [{"metadata": {"name": naming.pod_name(job, attempt, r),
                          "labels": naming.pod_labels(job, attempt, r)}} for r in ranks]


def test_pods_we_just_created_are_awaited_not_listed():
    made = indexlag.created(manifests("j", 2, range(4)), at=100.0)
    assert made is not None
    names = [naming.pod_name("j", 2, r) for r in range(4)]
    assert indexlag.awaiting_own_creates(made, 2, [], 4, now=101.0)
    assert indexlag.awaiting_own_creates(made, 2, names[:3], 4, now=101.0)


def test_the_api_server_is_asked_once_the_index_lags_past_the_grace():
    made = indexlag.created(manifests("j", 2, range(4)), at=100.0)
    assert not indexlag.awaiting_own_creates(made, 2, [], 4,
                                             now=100.0 + indexlag.INDEX_GRACE_SECONDS + 0.1)


def test_ranks_we_did_not_create_are_asked_about_at_once():
    # Only rank 3 was recreated: ranks 0-2 missing from the index are not ours to expect.
    made = indexlag.created(manifests("j", 2, range(3, 4)), at=100.0)
    assert not indexlag.awaiting_own_creates(made, 2, [], 4, now=101.0)
    # Pods of another attempt say nothing about this one; nor does a pass that created none.
    made = indexlag.created(manifests("j", 1, range(4)), at=100.0)
    assert not indexlag.awaiting_own_creates(made, 2, [], 4, now=101.0)
    assert indexlag.created([], at=100.0) is None
    assert not indexlag.awaiting_own_creates(None, 2, [], 4, now=101.0)


def test_a_created_pod_the_index_showed_and_lost_is_gone_not_awaited():
    made = indexlag.created(manifests("j", 2, range(2)), at=100.0)
    names = [naming.pod_name("j", 2, r) for r in range(2)]
    assert made is not None
    made = made.saw(names)
    # Rank 1 deleted (its DELETED event came): the API server is asked at once.
    assert not indexlag.awaiting_own_creates(made, 2, names[:1], 2, now=101.0)
    assert made.saw(names[:1]) is made  # nothing new seen: the same object
