"""Which attempt a pod counts in: a pod kept by a restart in place (in_place.py) runs in the
job's new attempt before its label says so. Pure; the observation sorts the gang with it
(observation/gang.py), and the recovery records which ranks it recreated as rank ranges."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

from tardigrade_operator.api.types import TrainingJobStatus
from tardigrade_operator.observation.pods import PodView

# Pod name -> (its view, the attempt it was carried to, the carried view).
CarryMemo = dict[str, tuple[PodView, int, PodView]]


def carried(pods: Sequence[PodView], status: TrainingJobStatus,
            memo: CarryMemo | None = None) -> list[PodView]:
    """The pods with the attempt they run in: a pod kept by the restarts in place since its
    label's attempt counts in the job's attempt before its label is patched (`late_labels`).

    A pod is carried from its label's attempt L to the job's attempt A when every recovery
    into L+1..A kept pods (`kept_pods`, written with the recovery before any of its pods was
    touched), none of them recreated its rank (`recreated_ranks`, written with it: the pod
    that set a recovery off is never kept, and the operator may see it before it sees the
    deletion that follows), it is not being deleted (a recovery deletes every pod it does not
    keep), its rank is in the new world, and no pod labelled with a newer attempt holds its
    rank. `memo` keeps the carried views between passes (a pass reads the whole gang)."""
    kept_into = {r.attempt: r for r in status.recoveries if r.kept_pods}
    oldest = status.attempt
    while oldest in kept_into:
        oldest -= 1
    if oldest == status.attempt:
        return list(pods)
    # Rank -> the newest attempt into which a recovery recreated it.
    recreated: dict[int, int] = {}
    for attempt, recovery in kept_into.items():
        for rank in parse_rank_ranges(recovery.recreated_ranks or ""):
            recreated[rank] = max(recreated.get(rank, -1), attempt)
    newest_label = {}
    for pod in pods:
        if not pod.deleting and pod.attempt > newest_label.get(pod.rank, -1):
            newest_label[pod.rank] = pod.attempt
    memo = {} if memo is None else memo

    def carry(pod: PodView) -> PodView:
        known = memo.get(pod.name)
        if known is not None and known[0] is pod and known[1] == status.attempt:
            return known[2]
        view = dataclasses.replace(pod, attempt=status.attempt, label_attempt=pod.attempt)
        memo[pod.name] = (pod, status.attempt, view)
        return view

    views = [carry(pod) if oldest <= pod.attempt < status.attempt and not pod.deleting
             and pod.rank < status.replicas and newest_label.get(pod.rank) == pod.attempt
             and recreated.get(pod.rank, -1) <= pod.attempt
             else pod for pod in pods]
    for name in memo.keys() - {pod.name for pod in pods}:
        del memo[name]
    return views


def rank_ranges(ranks: Iterable[int]) -> str:
    """Ranks as ranges: [3, 5, 6, 7] -> "3,5-7"."""
    out: list[str] = []
    for rank in sorted(set(ranks)):
        if out and "-" not in out[-1] and int(out[-1]) == rank - 1:
            out[-1] = f"{out[-1]}-{rank}"
        elif out and "-" in out[-1] and int(out[-1].split("-")[1]) == rank - 1:
            out[-1] = f"{out[-1].split('-')[0]}-{rank}"
        else:
            out.append(str(rank))
    return ",".join(out)


def parse_rank_ranges(text: str) -> set[int]:
    ranks: set[int] = set()
    for part in filter(None, text.split(",")):
        first, _, last = part.partition("-")
        ranks.update(range(int(first), int(last or first) + 1))
    return ranks
