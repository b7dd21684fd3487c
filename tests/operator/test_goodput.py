"""The goodput account (decision/goodput.py): a job's wall time split into buckets that always
add up to it, through a whole job's life in `decide` and for arbitrary histories."""

from __future__ import annotations

from datetime import timedelta

from hypothesis import given
from hypothesis import strategies as st
from tardigrade_contract import contract
from tardigrade_operator.api.types import Goodput, Recovery, TrainingJobStatus
from tardigrade_operator.decision import goodput
from tardigrade_operator.decision.goodput import Sighting, account, buckets
from tardigrade_operator.observation.pods import PodView

from tests.fuzz import CHEAP
from tests.operator.fake_cluster import T0, FakeCluster, spec


def _report(step: int, attempt: int = 1, **phases: float) -> contract.ProgressReport:
    return contract.ProgressReport(step=step, attempt=attempt,
                                   **{f"{name}_seconds": value for name, value in phases.items()})


def _balanced(account_: Goodput, created=T0) -> dict[str, float]:
    """The account's buckets, checked: none negative, their sum the wall time, which is the
    time from creation to the account's end."""
    seconds = buckets(account_)
    assert all(value >= 0 for value in seconds.values()), seconds
    assert abs(sum(seconds.values()) - account_.wall_seconds) < 1e-6, seconds
    assert abs(account_.wall_seconds
               - (account_.accounted_until - created).total_seconds()) < 1e-6
    assert 0 <= account_.fraction <= 1
    return seconds


def test_a_jobs_life_is_split_into_its_buckets_and_a_lost_steps_price_leaves_productive():
    cluster = FakeCluster(spec(), now=T0 + timedelta(seconds=3))
    cluster.reconcile()  # the operator saw the job 3 s after its creation; it launches
    cluster.advance(10)
    cluster.reconcile()  # the pods wait for capacity
    for index, pod in enumerate(cluster.attempt_pods()):
        pod["spec"]["nodeName"] = f"node-{index}"  # scheduled: the kubelet starts them
    cluster.advance(4)
    cluster.reconcile()
    cluster.run_all()
    cluster.advance(6)
    cluster.reconcile()  # containers run; the trainer has not reported yet
    assert cluster.status.goodput.current == "acceleratorStart"
    cluster.advance(15)
    cluster.progress = _report(5, accelerator_start=7, restore=2, compile=1, train=3)
    cluster.reconcile()
    seconds = _balanced(cluster.status.goodput)
    # The 15 s of the running trainer: its phases, and 2 s it spent in none (other).
    assert seconds == {"queued": 17.0, "podStart": 6.0, "acceleratorStart": 7.0,
                       "restore": 2.0, "compile": 1.0, "checkpointStall": 0.0,
                       "lostSteps": 0.0, "productive": 3.0, "other": 2.0}

    cluster.advance(20)
    cluster.progress = _report(42, accelerator_start=7, restore=2, compile=1,
                               checkpoint_stall=1.5, train=21)
    cluster.reconcile()
    seconds = _balanced(cluster.status.goodput)
    assert (seconds["productive"], seconds["checkpointStall"], seconds["other"]) == (
        21.0, 1.5, 2.5)
    assert cluster.status.goodput.seconds_per_step == 0.5  # 21 s over 42 steps

    # Rank 1 crashes; the gang restarts from step 30: 12 steps (6 s of training) are lost.
    cluster.advance(2)
    cluster.progress = None
    cluster.terminate(cluster.attempt_pods()[1], 1)
    cluster.reconcile()
    cluster.advance(1)
    cluster.terminate_all(1, step=42, checkpoint=30)
    for _ in range(3):
        cluster.advance(5)
        cluster.reconcile()
    assert cluster.status.attempt == 2 and cluster.status.recoveries[-1].steps_lost == 12
    seconds = _balanced(cluster.status.goodput)
    assert (seconds["lostSteps"], seconds["productive"]) == (6.0, 15.0)

    # The new attempt trains to the end; the account stops at the job's completion.
    cluster.run_all()
    cluster.advance(3)
    cluster.reconcile()
    cluster.advance(10)
    cluster.progress = _report(50, attempt=2, accelerator_start=4, restore=1, train=4)
    cluster.reconcile()
    cluster.advance(5)
    cluster.terminate_all(0, step=100, checkpoint=100)
    cluster.reconcile()
    assert cluster.status.phase == "Succeeded"
    ended = cluster.status.goodput
    cluster.advance(600)
    cluster.reconcile()
    assert cluster.status.goodput == ended  # nothing is booked after the end
    assert ended.accounted_until == cluster.status.completion_time
    seconds = _balanced(ended)
    # The last 5 s came after the trainer's last report: nothing says where they went.
    assert seconds["productive"] == 15.0 + 4.0
    assert ended.unexplained_seconds == 5.0 + 10.0 - 4.0 - 1.0 - 4.0
    assert ended.fraction == round(seconds["productive"] / ended.wall_seconds, 6)


def test_a_trainer_that_reports_in_the_pass_its_pods_are_first_seen_takes_its_time_from_queued():
    cluster = FakeCluster(spec())
    cluster.reconcile()
    cluster.advance(20)
    cluster.run_all()  # scheduled, started, reported: all between two passes
    cluster.progress = _report(3, accelerator_start=6, restore=2, compile=3, train=1)
    cluster.reconcile()
    seconds = _balanced(cluster.status.goodput)
    assert (seconds["queued"], seconds["acceleratorStart"], seconds["restore"]) == (
        8.0, 6.0, 2.0)


def test_a_trainer_that_reports_in_the_pass_its_pods_start_in_takes_its_time_from_pod_start():
    cluster = FakeCluster(spec())
    cluster.reconcile()
    for index, pod in enumerate(cluster.attempt_pods()):
        pod["spec"]["nodeName"] = f"node-{index}"
    cluster.reconcile()
    assert cluster.status.goodput.current == "podStart"
    cluster.advance(30)
    cluster.run_all()
    cluster.progress = _report(3, accelerator_start=6, restore=2, compile=3, train=1)
    cluster.reconcile()
    seconds = _balanced(cluster.status.goodput)
    # 30 s since the pods were seen scheduled, of which the trainer's process lived 12.
    assert (seconds["podStart"], seconds["acceleratorStart"], seconds["productive"]) == (
        18.0, 6.0, 1.0)


def test_a_job_first_accounted_after_its_launch_books_its_unknown_past_as_other():
    cluster = FakeCluster(spec())
    cluster.reconcile()
    cluster.run_all()
    cluster.reconcile()
    cluster.status.goodput = None  # as an operator older than the account left it
    cluster.advance(100)
    cluster.progress = _report(40, restore=1, train=20)
    cluster.reconcile()
    seconds = _balanced(cluster.status.goodput)
    # Nothing says where the 100 s went, but what the trainer's phases account for.
    assert (seconds["other"], seconds["restore"], seconds["productive"]) == (79.0, 1.0, 20.0)
    assert seconds["queued"] == 0.0
    cluster.advance(30)
    cluster.progress = _report(80, restore=1, train=45)
    cluster.reconcile()
    assert _balanced(cluster.status.goodput)["productive"] == 45.0


def test_a_trainer_without_phase_fields_counts_its_running_time_as_training():
    cluster = FakeCluster(spec())
    cluster.reconcile()
    cluster.run_all()
    cluster.reconcile()
    cluster.advance(30)
    cluster.progress = contract.ProgressReport(step=40)  # an older trainer's report
    cluster.reconcile()
    cluster.advance(30)
    cluster.progress = contract.ProgressReport(step=80)
    cluster.reconcile()
    seconds = _balanced(cluster.status.goodput)
    assert seconds["productive"] == 60.0 and seconds["acceleratorStart"] == 0.0


def test_a_queued_job_is_not_rewritten_every_pass_but_its_account_catches_up():
    cluster = FakeCluster(spec())
    cluster.reconcile()
    cluster.advance(1)
    cluster.reconcile()  # the pods wait for capacity
    first = cluster.status.model_copy(deep=True)
    cluster.advance(20)
    cluster.reconcile()  # they still wait, nothing else changed: no write
    assert cluster.status == first
    cluster.advance(goodput.REFRESH.total_seconds())
    cluster.reconcile()
    seconds = _balanced(cluster.status.goodput)
    assert seconds["queued"] == 21 + goodput.REFRESH.total_seconds()


# --- any history ------------------------------------------------------------------------------

PHASES = ("Pending", "Queued", "Running", "Restarting", "Resizing", "Suspended", "Succeeded",
          "Failed")
_seconds = st.one_of(st.none(), st.floats(0, 5000, allow_nan=False))
_reports = st.one_of(st.none(), st.builds(
    contract.ProgressReport, step=st.integers(0, 10_000),
    attempt=st.one_of(st.none(), st.integers(0, 6)),
    restore_step=st.one_of(st.none(), st.integers(0, 10_000)),
    **{name: _seconds for name in contract.PHASE_SECONDS_FIELDS}))
_pods = st.lists(st.builds(
    PodView, name=st.just("p"), attempt=st.integers(0, 6), rank=st.integers(0, 3),
    phase=st.sampled_from(["Pending", "Running", "Succeeded", "Failed", "Unknown"]),
    node_name=st.one_of(st.none(), st.just("node")), container_started=st.booleans(),
    deletion_timestamp=st.one_of(st.none(), st.just(T0))), max_size=4)
_passes = st.lists(st.tuples(
    st.floats(-60, 4000, allow_nan=False),  # seconds since the last pass (clocks may step back)
    st.sampled_from(PHASES), st.integers(0, 6), _pods, _reports,
    st.one_of(st.none(), st.integers(0, 500)),  # a recovery's steps lost, recorded this pass
    st.booleans(),  # the pass writes the status anyway
    st.one_of(st.none(), st.floats(-100, 100, allow_nan=False)),  # completion, from now
), max_size=25)


@CHEAP
@given(created_offset=st.one_of(st.none(), st.floats(-1000, 1000, allow_nan=False)),
       passes=_passes)
def test_for_any_history_the_buckets_add_up_to_the_wall_time_and_none_is_negative(
        created_offset, passes):
    now = T0
    created = None if created_offset is None else T0 + timedelta(seconds=created_offset)
    start = None
    latest = now
    status = TrainingJobStatus()
    for dt, phase, attempt, pods, report, lost, written, completion in passes:
        now += timedelta(seconds=dt)
        latest = max(latest, now)
        new = status.model_copy(deep=True)
        new.phase, new.attempt = phase, attempt
        new.completion_time = None if completion is None else now + timedelta(
            seconds=completion)
        if lost is not None:
            new.recoveries = [*new.recoveries, Recovery(
                cause="Failure", time=now, attempt=len(new.recoveries) + 1, steps_lost=lost)]
        seen = Sighting(now=now, phase=phase, attempt=attempt,
                        completion_time=new.completion_time, pods=pods, report=report)
        before = status.goodput
        result = account(before, created, seen, status, new, written)
        if start is None:
            start = min(created or now, now)
        _balanced(result, start)
        if before is not None:
            assert result.accounted_until >= before.accounted_until
            assert all(getattr(result.seconds, f) >= getattr(before.seconds, f) - 1e-9
                       for f in ("queued", "pod_start", "lost_steps"))
        assert result.accounted_until <= max(latest, start)
        new.goodput = result
        status = new


def test_the_time_kueue_holds_a_job_is_queued_time():
    from tests.operator.test_queueing import ADMITTED, PENDING, gate

    cluster = FakeCluster(spec(), queue=gate(PENDING))
    cluster.reconcile()
    cluster.advance(40)
    cluster.reconcile()
    assert cluster.status.phase == "Queued"
    cluster.advance(20)
    cluster.queue = gate(ADMITTED, admitted=2)
    cluster.reconcile()  # admitted: the gang is launched
    cluster.run_all()
    cluster.advance(5)
    cluster.reconcile()
    seconds = _balanced(cluster.status.goodput)
    assert (seconds["queued"], seconds["podStart"]) == (65.0, 0.0)
    assert cluster.status.goodput.current == "acceleratorStart"
