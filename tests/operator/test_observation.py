"""The observation step (observation/observe.py) without a server: kopf's indexes as plain
dicts, the reads it makes beyond them answered by a fake reader."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tardigrade_contract import contract
from tardigrade_operator import naming
from tardigrade_operator.config import OperatorConfig
from tardigrade_operator.decision.decide import decide
from tardigrade_operator.observation import indexlag
from tardigrade_operator.observation.job_memory import JobState
from tardigrade_operator.observation.observe import Indexes, observe
from tardigrade_operator.observation.pods import PodView, parse_pod, parse_service
from tardigrade_operator.observation.progress import Progress

from tests.operator.fake_cluster import JOB, KEYS, FakeCluster, spec

KEY = (JOB.namespace, JOB.name)


class FakeReader:
    """The cluster and rank 0 as the observation reads them; every read is recorded."""

    def __init__(self, cluster: FakeCluster, report: contract.ProgressReport | None) -> None:
        self.cluster, self.report = cluster, report
        self.calls: list[tuple[str, Any]] = []

    async def list_job_pods(self, namespace: str, job: str) -> list[dict[str, Any]]:
        self.calls.append(("list_job_pods", job))
        return list(self.cluster.pods.values())

    async def read_service(self, namespace: str, name: str) -> dict[str, Any] | None:
        self.calls.append(("read_service", name))
        return self.cluster.service

    async def read_secret(self, namespace: str, name: str) -> dict[str, Any] | None:
        self.calls.append(("read_secret", name))
        return self.cluster.keys_secret

    async def list_scale_up_events(self, namespace: str) -> list[dict[str, Any]]:
        self.calls.append(("list_scale_up_events", namespace))
        return []

    async def kueue_api(self) -> Any:
        raise AssertionError("a job without the queue label never asks for Kueue")

    async def fetch_progress(self, gang: Sequence[PodView], token: str | None) -> Progress:
        self.calls.append(("fetch_progress", ([p.name for p in gang], token)))
        return Progress(report=self.report)


def running_cluster() -> FakeCluster:
    cluster = FakeCluster(spec())
    cluster.reconcile()
    cluster.run_all()
    cluster.reconcile()
    return cluster


def body(cluster: FakeCluster) -> dict[str, Any]:
    return {"metadata": {"name": JOB.name, "namespace": JOB.namespace, "uid": JOB.uid,
                         "generation": 1, "resourceVersion": "7"},
            "spec": cluster.spec,
            "status": cluster.status.model_dump(mode="json", by_alias=True, exclude_none=True)}


def indexes(cluster: FakeCluster, pods: list[dict[str, Any]]) -> Indexes:
    views = [v for v in (parse_pod(p) for p in pods) if v is not None]
    assert cluster.service is not None
    return Indexes(pods={KEY: views}, services={KEY: [parse_service(cluster.service)]})


async def test_a_running_gang_is_observed_from_the_indexes_and_one_progress_read():
    cluster = running_cluster()
    reader = FakeReader(cluster, contract.ProgressReport(step=12, checkpoint_step=10))
    seen = await observe(KEY, JOB.uid, body(cluster),
                         indexes(cluster, [*cluster.pods.values()]), JobState(),
                         OperatorConfig(), reader, clock=0.0)
    assert seen is not None
    observed = seen.observed
    assert [p.name for p in observed.gang.current] == ["tiny-a1-0", "tiny-a1-1"]
    assert observed.gang.attempt == 1 and observed.gang.previous == []
    assert observed.status.phase == "Running" and seen.version == "7"
    assert observed.progress is not None and observed.progress.step == 12
    assert observed.keys_secret is not None and observed.new_keys is None
    # The index held the whole gang: no list; the Secret once; rank 0 polled with the token.
    assert reader.calls == [("read_secret", naming.keys_secret_name(JOB.name)),
                            ("fetch_progress", (["tiny-a1-0", "tiny-a1-1"], KEYS.progress_token))]
    # The decision reads the observation as it is.
    assert decide(observed).status.step == 12


async def test_a_rank_missing_from_the_index_is_asked_of_the_api_server():
    cluster = running_cluster()
    reader = FakeReader(cluster, None)
    lagging = [p for name, p in cluster.pods.items() if name != "tiny-a1-1"]
    seen = await observe(KEY, JOB.uid, body(cluster), indexes(cluster, lagging), JobState(),
                         OperatorConfig(), reader, clock=0.0)
    assert seen is not None
    assert ("list_job_pods", JOB.name) in reader.calls
    assert [p.rank for p in seen.observed.gang.current] == [0, 1]


async def test_the_pods_just_created_are_awaited_not_listed():
    cluster = FakeCluster(spec())
    plan = cluster.reconcile()
    state = JobState()
    state.created = indexlag.created(plan.create_pods, 0.0)
    reader = FakeReader(cluster, None)
    assert await observe(KEY, JOB.uid, body(cluster), indexes(cluster, []), state,
                         OperatorConfig(), reader, clock=0.1) is None
    assert reader.calls == []


async def test_a_previous_job_s_pods_are_set_aside_once():
    cluster = running_cluster()
    other = {**cluster.pods["tiny-a1-0"]}
    other["metadata"] = {**other["metadata"], "name": "tiny-a7-0", "ownerReferences": [
        {**JOB.owner_reference(), "uid": "uid-old"}],
        "labels": {**other["metadata"]["labels"], "tardigrade.dev/attempt": "7"}}
    reader = FakeReader(cluster, None)
    seen = await observe(KEY, JOB.uid, body(cluster),
                         indexes(cluster, [*cluster.pods.values(), other]), JobState(),
                         OperatorConfig(), reader, clock=0.0)
    assert seen is not None
    assert [p.name for p in seen.observed.gang.previous] == ["tiny-a7-0"]
    assert seen.observed.gang.attempt == 1
