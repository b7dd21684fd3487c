"""Which events wake a job's loop (handlers.py), without a server: a settled job passes only
when woken, so a missed wake-up is a late decision."""

from __future__ import annotations

from types import SimpleNamespace

from tardigrade_operator import handlers
from tardigrade_operator.api.types import TrainingJobStatus
from tardigrade_operator.config import OperatorConfig
from tardigrade_operator.decision.maintenance import SCHEDULED_MAINTENANCE_LABEL
from tardigrade_operator.observation.job_memory import JobState
from tardigrade_operator.observation.pods import PodView

A, B = ("ml", "a"), ("ml", "b")


def memo(config: OperatorConfig | None = None) -> SimpleNamespace:
    return SimpleNamespace(jobs={A: JobState(), B: JobState()}, nodes_seen={},
                           config=config or OperatorConfig())


def pods_on(node_of: dict[tuple[str, str], str]) -> dict:
    """The gang_pods index: job -> its pods, each on the given node."""
    return {key: [PodView(name=f"{key[1]}-a1-0", attempt=1, rank=0, phase="Running",
                          node_name=node)] for key, node in node_of.items()}


def node_event(state: SimpleNamespace, index: dict, ready: str, labels: dict | None = None,
               kind: str = "MODIFIED", pools: dict | None = None) -> set[tuple[str, str]]:
    for job in state.jobs.values():
        job.wake.clear()
    status = {"conditions": [{"type": "Ready", "status": ready}]}
    handlers.node_changed(type=kind, name="n1", status=status, labels=labels or {},
                          memo=state, gang_pods=index, node_pool=pools)
    return {key for key, job in state.jobs.items() if job.wake.is_set()}


def test_a_node_wakes_the_jobs_on_it_only_when_its_readiness_or_maintenance_changes():
    state, index = memo(), pods_on({A: "n1", B: "n2"})
    assert node_event(state, index, "True") == {A}  # first sight
    assert node_event(state, index, "True") == set()  # a heartbeat: nothing new
    assert node_event(state, index, "Unknown") == {A}
    assert node_event(state, index, "Unknown") == set()
    assert node_event(state, index, "Unknown",
                      {SCHEDULED_MAINTENANCE_LABEL: "1767225600"}) == {A}
    assert node_event(state, index, "Unknown", kind="DELETED") == {A}


def test_maintenance_on_a_node_wakes_the_jobs_in_its_node_pool():
    # Job A's TPU slice runs on n2 and n3 of pool-a; n1 (no rank on it) is in pool-a too.
    state, index = memo(), pods_on({A: "n2", B: "n7"})
    pools = {"n1": ["pool-a"], "n2": ["pool-a"], "n3": ["pool-a"], "n7": ["pool-b"]}
    pool_a = {"cloud.google.com/gke-nodepool": "pool-a"}
    assert node_event(state, index, "True", pool_a, pools=pools) == set()
    assert node_event(state, index, "True", {**pool_a, SCHEDULED_MAINTENANCE_LABEL: "1767225600"},
                      pools=pools) == {A}
    # Readiness of a node is its own business: the pool's other jobs are not woken.
    assert node_event(state, index, "False", {**pool_a, SCHEDULED_MAINTENANCE_LABEL: "1767225600"},
                      pools=pools) == set()


def job_event(state: SimpleNamespace, version: str) -> bool:
    job = state.jobs[A]
    job.wake.clear()
    handlers.job_changed(type="MODIFIED", namespace="ml", name="a", uid="u1",
                         meta={"resourceVersion": version}, memo=state)
    return job.wake.is_set()


def test_the_echo_of_the_operator_s_own_status_write_wakes_nobody():
    state = memo()
    state.jobs[A].written = ("41", TrainingJobStatus())
    assert not job_event(state, "41")
    assert job_event(state, "42")  # someone else changed the job


def test_the_fixed_loop_is_woken_by_its_own_writes_as_before():
    state = memo(OperatorConfig(pacing="fixed"))
    state.jobs[A].written = ("41", TrainingJobStatus())
    assert job_event(state, "41")


def test_only_news_restarts_the_progress_back_off():
    """A job event at the same generation (an echo that came before the write's answer)
    wakes the loop for a cheap pass, but starts no read: no read, no write, no echo loop."""
    state = memo()
    job = state.jobs[A]
    job.spec = (3, None, None)
    job.news = False
    handlers.job_changed(type="MODIFIED", namespace="ml", name="a", uid="u1",
                         meta={"resourceVersion": "50", "generation": 3}, memo=state)
    assert job.wake.is_set() and not job.news
    handlers.job_changed(type="MODIFIED", namespace="ml", name="a", uid="u1",
                         meta={"resourceVersion": "51", "generation": 4}, memo=state)
    assert job.news
    job.news = False
    node_event(state, pods_on({A: "n1"}), "False")
    assert job.news


def test_routine_event_handler_successes_are_not_logged_but_failures_are():
    import logging

    def record(message: str) -> logging.LogRecord:
        return logging.LogRecord("kopf.objects", logging.INFO, __file__, 1, message, None, None)

    assert not handlers._not_routine(record("Handler 'pod_changed' succeeded."))
    assert handlers._not_routine(record("Handler 'pod_changed' failed with an exception and "
                                        "will try again in 60 seconds: boom"))
    assert handlers._not_routine(record("Daemon 'keep_gang' succeeded."))
