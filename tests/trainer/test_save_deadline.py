"""A save on notice has a deadline; retention deletes stay out of it (issue 14, point 6).

Storage is the GCS emulator behind the fault proxy, which stalls chosen requests the way an
unhealthy bucket does (held, never answered).
"""

from __future__ import annotations

import signal
import time

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from tardigrade_checkpoint import CheckpointManager, KeepLast
from tardigrade_checkpoint import deadline as deadlines
from tardigrade_checkpoint.deadline import Deadline, DeadlineExceeded
from tardigrade_checkpoint.manager import CheckpointDeadlineError
from tardigrade_checkpoint.storage import ENV_LOW_SPEED_TIME, StorageRetries
from tardigrade_contract import contract
from tardigrade_local.gcs import client_env
from tardigrade_local.gcs_faults import FaultRule
from trainer_harness import launch, wait_for

from tests.faults.gcs_scenarios import BUCKET, faulty_gcs

# The trainer's defaults: 8 retries with backoff up to 16 s, a request cut after 60 s stalled.
# Unbounded, one stalled request keeps a save busy for minutes.
DEFAULT_RETRIES = StorageRetries()
# A loaded 2-core machine (other test suites beside this one) delays every thread; unbounded,
# the same stalled save takes minutes (90 s and more with the retries below).
SLACK = 10.0


@pytest.fixture(scope="module")
def proxy():
    with faulty_gcs() as proxy:
        yield proxy


def _state(seed: int) -> dict[str, jax.Array]:
    sharding = NamedSharding(Mesh(np.array(jax.devices()[:2]), ("data",)), PartitionSpec("data"))
    rng = np.random.default_rng(seed)
    return {"w": jax.device_put(rng.standard_normal((64, 32)).astype(np.float32), sharding)}


def _target(state: dict[str, jax.Array]) -> dict[str, jax.ShapeDtypeStruct]:
    return {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding)
            for k, v in state.items()}


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _EarlyWaker:
    """A future that never finishes, whose timed waits wake up to 10 ms early on the clock."""

    def __init__(self, clock: _Clock, error: BaseException | None = None) -> None:
        self.clock, self.error = clock, error
        self.waits: list[float] = []
        self.cancelled = False

    def result(self, timeout: float | None = None) -> None:
        if self.error is not None:
            raise self.error
        assert timeout is not None
        self.waits.append(timeout)
        self.clock.now += max(timeout - 0.01, min(timeout, 0.001))
        raise TimeoutError

    def done(self) -> bool:
        return self.error is not None

    def cancel(self) -> bool:
        self.cancelled = True
        return True


def test_a_wait_that_wakes_early_does_not_give_up_before_the_deadline():
    clock = _Clock()
    until = Deadline(4.0, "the test's deadline", clock=clock)
    future = _EarlyWaker(clock)
    with pytest.raises(DeadlineExceeded, match="writing had not finished at the test's deadline"):
        deadlines.result(future, until, "writing")
    assert clock.now >= 4.0 and future.cancelled
    assert len(future.waits) > 1


def test_a_future_that_failed_with_a_timeout_of_its_own_fails_with_it_at_once():
    clock = _Clock()
    own = TimeoutError("the peer's own timeout")
    future = _EarlyWaker(clock, error=own)
    with pytest.raises(TimeoutError) as raised:
        deadlines.result(future, Deadline(4.0, clock=clock), "writing")
    assert raised.value is own and clock.now == 0.0 and not future.cancelled


class _FinishesAsTheWaitEnds:
    """A future whose timed wait times out in the instant before it finishes."""

    def __init__(self) -> None:
        self.finished = False

    def result(self, timeout: float | None = None) -> str:
        if timeout is not None and not self.finished:
            self.finished = True
            raise TimeoutError
        return "written"

    def done(self) -> bool:
        return self.finished

    def cancel(self) -> bool:
        raise AssertionError("a finished future is not cancelled")


def test_a_future_that_finishes_as_its_wait_times_out_gives_its_result():
    clock = _Clock()
    assert deadlines.result(_FinishesAsTheWaitEnds(), Deadline(4.0, clock=clock),
                            "writing") == "written"


def test_a_save_on_notice_against_stalled_storage_fails_inside_its_deadline(proxy):
    events: list[dict] = []
    manager = CheckpointManager(f"gs://{BUCKET}/deadline", storage=DEFAULT_RETRIES,
                                on_event=events.append)
    before = _state(10)
    manager.save(10, before)
    manager.wait()
    proxy.set_rules([FaultRule("write", action="stall")])
    until = Deadline.after(3.0, "the test's deadline")
    started = time.monotonic()
    manager.save(20, _state(20), deadline=until)
    with pytest.raises(CheckpointDeadlineError, match=r"step_00000020 failed: .* had not "
                                                      r"finished at the test's deadline"):
        manager.wait(until)
    assert time.monotonic() - started < 3.0 + SLACK
    assert events[-1]["event"] == "checkpoint_failed" and events[-1]["step"] == 20
    proxy.clear()
    assert manager.list_steps()[0] == [10]
    restored, _ = manager.restore(10, _target(before))
    assert np.array_equal(np.asarray(restored["w"]), np.asarray(before["w"]))
    manager.close()


def test_retention_deletes_stay_out_of_a_save_on_notice(proxy):
    events: list[dict] = []
    manager = CheckpointManager(f"gs://{BUCKET}/retention", keep=KeepLast(1),
                                storage=DEFAULT_RETRIES, on_event=events.append)
    manager.save(10, _state(10))
    manager.wait()
    # Deleting step 10 (due once 20 commits) hangs, as on a bucket that stopped answering.
    proxy.set_rules([FaultRule("write", action="stall", path_contains="step_00000010")])
    manager.save(20, _state(20))
    wait_for(lambda: manager.list_steps()[0] == [10, 20], 30, "step 20 to commit")
    until = Deadline.after(8.0, "the test's deadline")
    manager.save(30, _state(30), deadline=until)  # the notice comes while 10 is being deleted
    info = manager.wait(until)  # raises CheckpointDeadlineError if it waited behind the delete
    assert info is not None and info.step == 30
    assert events[-1] == {"event": "checkpoint_retention_deferred", "step": 30}
    proxy.clear()
    # The next start applies the keep policy that the save on notice left undone. Step 10 may
    # be gone already: the storage layer retries its stalled delete, and once the bucket
    # answers again that retry can land first (seen once under load).
    deleted = manager.apply_retention()
    assert 20 in deleted and set(deleted) <= {10, 20}, deleted
    assert manager.list_steps() == ([30], [])
    manager.close()


def test_a_relaunch_owed_deletes_does_not_wait_for_them(proxy):
    """The deletes a save on notice left undone run beside the next attempt's training
    (`start_retention`, the trainer's start-up); the next save waits for them."""
    url = f"gs://{BUCKET}/startup-retention"
    first = CheckpointManager(url, keep=KeepLast(1), storage=DEFAULT_RETRIES)
    for step in (10, 20):  # each a save on notice: its deletes are left for the next start
        first.save(step, _state(step), deadline=Deadline.after(60.0, "the notice"))
        first.wait(Deadline.after(60.0, "the notice"))
    first.close()
    events: list[dict] = []
    relaunched = CheckpointManager(url, keep=KeepLast(1), storage=DEFAULT_RETRIES,
                                   on_event=events.append)
    assert relaunched.list_steps()[0] == [10, 20]
    # Deleting step 10 hangs, as on a bucket that stopped answering.
    proxy.set_rules([FaultRule("write", action="stall", path_contains="step_00000010")])
    relaunched.start_retention()  # returns while the delete hangs
    wait_for(lambda: proxy.injected["stall"] >= 1, 30, "the delete of step 10 to reach the bucket")
    assert relaunched.list_steps()[0] == [10, 20]
    proxy.clear()
    relaunched.save(30, _state(30))  # waits for the deletes first
    relaunched.wait()
    assert {"event": "checkpoint_deleted", "step": 10} in events
    assert relaunched.list_steps() == ([30], [])
    relaunched.close()


@pytest.mark.slow
def test_the_trainer_fails_a_stalled_save_on_notice_inside_the_window(proxy, tmp_path):
    url = f"gs://{BUCKET}/trainer-deadline"
    env = {**client_env(proxy.url), ENV_LOW_SPEED_TIME: "60",
           contract.ENV_SHUTDOWN_WINDOW_SECONDS: "5"}
    config = {"steps": 4, "devices_per_process": 1}
    first = launch(tmp_path / "first", processes=1, checkpoint_path=url, config=config,
                   extra_env=env)
    assert first.wait() == [0], first.describe()  # commits step 4, the last
    config = {**config, "steps": 100000}
    gang = launch(tmp_path / "second", processes=1, checkpoint_path=url, config=config,
                  interval_seconds=3600, extra_env=env)
    try:
        wait_for(lambda: any(e["step"] >= 8 for e in gang.events("step"))
                 or gang.procs[0].poll() is not None, 180, "training past the restored step")
        proxy.set_rules([FaultRule("write", action="stall")])
        signalled = time.time()
        gang.signal(signal.SIGTERM)
        assert gang.wait(60) == [contract.EXIT_CHECKPOINT_IO_ERROR], gang.describe()
    finally:
        gang.kill()
        proxy.clear()
    (unsaved,) = gang.events("preempted_unsaved")
    # 5 s window, 1 s margin: given up 4 s after the notice (the trainer's clock), reported
    # inside the window (wall clock from the signal; a loaded machine may add scheduling).
    assert 4.0 <= unsaved["seconds_since_notice"] < 5.0
    assert unsaved["time"] - signalled < 5.0 + SLACK / 5
    message = gang.termination(0)
    assert message is not None and message.reason == "CheckpointIOError"
    assert "the save-on-notice deadline (4.0s after the notice, of the 5s shutdown window)" in (
        message.message)
    assert message.checkpoint_step == 4
    manager = CheckpointManager(url)
    assert manager.list_steps()[0] == [4]
    assert manager.verify(4)[1] == []
    manager.close()


class _SilentPeers:
    """The coordination service's key-value store where no peer ever writes: a get waits
    its whole timeout (in whole milliseconds, as the service takes it) on the clock."""

    def __init__(self, clock: _Clock) -> None:
        self.clock = clock

    def blocking_key_value_get(self, key: str, timeout_ms: int) -> str:
        self.clock.now += timeout_ms / 1000
        raise RuntimeError(f"DEADLINE_EXCEEDED: {key}")


def test_a_silent_peer_at_the_deadline_is_the_deadline_not_a_peer_timeout():
    from tardigrade_checkpoint.agreement import Channel

    clock = _Clock()
    # What is left of the deadline is not a whole number of milliseconds.
    until = Deadline(3.9996, "the test's deadline", clock=clock)
    channel = Channel("save-7", process_id=1, process_count=2, timeout_seconds=60.0,
                      deadline=until)
    channel._client = _SilentPeers(clock)
    with pytest.raises(DeadlineExceeded, match=r"process 0 .* had not reported at the test's"):
        channel.wait_prepared()
    assert clock.now >= until.at
