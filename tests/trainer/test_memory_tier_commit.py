"""The memory tier's commit on a pool of threads (memory_tier.commit) and what a memory step
does while the previous snapshot's commit still runs (memory_session.MemoryTier.snapshot):
skip it, the same on every rank, or wait for it when the job asks to."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tardigrade_checkpoint import memory_tier
from tardigrade_checkpoint.memory_tier import MemoryStore, MemoryTierError
from tardigrade_contract import contract
from tardigrade_sdk import memory_session
from tardigrade_sdk.memory_session import MemoryTier

KEY = b"memory-tier-commit-key-0123456789"
FIELDS = {"attempt": 0, "owner": 0, "process_count": 1, "lineage": "", "job_uid": "u"}


class Gated:
    """A piece's host data that arrives when the test lets it (a staged piece's read), in
    the device reader's order `read_order`; `failing`: its read raises instead."""

    def __init__(self, value: np.ndarray, read_order: int, failing: bool = False) -> None:
        self.value, self.read_order, self.failing = value, read_order, failing
        self.nbytes, self.shape, self.dtype = value.nbytes, value.shape, value.dtype
        self.gate = threading.Event()
        self.released = False

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        self.gate.wait()
        if self.failing:
            raise OSError(5, "the device read failed")
        return self.value

    def release(self) -> None:
        self.released = True


def _snapshot(step: int, values: list[Any]) -> memory_tier.Snapshot:
    pieces, arrays = [], {}
    for i, value in enumerate(values):
        shape = tuple(np.asarray(value.value if isinstance(value, Gated) else value).shape)
        arrays[f"w{i}"] = {"shape": list(shape), "dtype": "float32"}
        region = memory_tier._whole(shape)
        pieces.append(memory_tier.Piece(f"w{i}", region, "float32", shape, value))
    return memory_tier.Snapshot(arrays, pieces)


def _values(step: int, count: int = 6) -> list[np.ndarray]:
    rng = np.random.default_rng(step)
    return [rng.standard_normal((64 * (i + 1), 33)).astype(np.float32) for i in range(count)]


@pytest.fixture
def pool() -> Any:
    with concurrent.futures.ThreadPoolExecutor(4) as workers:
        yield workers


def test_a_commit_on_four_threads_stores_what_one_thread_in_order_stores(tmp_path, pool):
    values = _values(5)
    snapshot = _snapshot(5, values)
    threaded = MemoryStore(tmp_path / "threaded", KEY)
    sealed, buffers, times = memory_tier.commit(threaded, snapshot, pool, 4, step=5, **FIELDS)
    reference = MemoryStore(tmp_path / "in-order", KEY)
    manifest, reference_buffers = memory_tier.encode(snapshot, step=5, **FIELDS)
    reference.write(memory_tier.seal(KEY, manifest), reference_buffers)
    # The same manifest (digests, offsets) and the same bytes: a restore cannot tell them apart.
    assert sealed == memory_tier.seal(KEY, manifest)
    assert threaded.read(0, 5) == reference.read(0, 5)
    loaded, data = threaded.load(0, 5)  # every piece checked against its digest
    for entry, value in zip(loaded.pieces, values, strict=True):
        np.testing.assert_array_equal(memory_tier._piece_value(entry, data), value)
    assert b"".join(bytes(b) for b in buffers) == data
    assert times.workers == 4 and times.seconds > 0 and times.digest_s > 0


def test_pieces_are_written_as_they_arrive_and_the_manifest_only_after_the_last(tmp_path,
                                                                                  pool):
    values = _values(10, count=4)
    # Read in the reverse of their place in the snapshot (the reader takes the largest first).
    gated = [Gated(value, read_order=10 - i) for i, value in enumerate(values)]
    store = MemoryStore(tmp_path, KEY)
    committing = pool.submit(memory_tier.commit, store, _snapshot(10, gated),
                             concurrent.futures.ThreadPoolExecutor(2), 2, step=10, **FIELDS)
    step_dir = store.root / "owner_00000" / "step_00000010"
    offsets = np.cumsum([0] + [v.nbytes for v in values])
    # Every piece but the first in the file, digested and written while the first has not
    # reached the host: no manifest yet, the snapshot not listed.
    for i in (3, 2, 1):
        gated[i].gate.set()

    def written(i: int) -> bool:
        raw = (step_dir / memory_tier.DATA).read_bytes() if (step_dir / memory_tier.DATA
                                                             ).exists() else b""
        return raw[offsets[i]:offsets[i + 1]] == values[i].tobytes()

    give_up = time.monotonic() + 60
    while not all(written(i) for i in (1, 2, 3)):
        assert not committing.done(), committing.exception()
        assert time.monotonic() < give_up, "the pieces on the host were not written"
        threading.Event().wait(0.01)
    assert not (step_dir / memory_tier.MANIFEST).exists()
    assert store.inventory() == []
    gated[0].gate.set()
    committing.result(timeout=60)
    assert [(h.owner, h.step) for h in store.inventory()] == [(0, 10)]
    store.load(0, 10)


def test_a_piece_that_fails_fails_the_commit_and_leaves_the_last_one_whole(tmp_path, pool):
    store = MemoryStore(tmp_path, KEY)
    memory_tier.commit(store, _snapshot(5, _values(5)), pool, 4, step=5, **FIELDS)
    gated = [Gated(value, read_order=i, failing=i == 2) for i, value in
             enumerate(_values(10))]
    for piece in gated:
        piece.gate.set()
    with pytest.raises(OSError, match="device read failed"):
        memory_tier.commit(store, _snapshot(10, gated), pool, 4, step=10, **FIELDS)
    assert [(h.owner, h.step) for h in store.inventory()] == [(0, 5)]
    store.load(0, 5)


def test_a_piece_whose_host_copy_is_not_its_staged_size_is_refused(tmp_path, pool):
    piece = Gated(np.zeros(8, np.float32), read_order=0)
    piece.gate.set()
    piece.nbytes = 16  # what the staged copy said
    with pytest.raises(MemoryTierError, match="16 staged"):
        memory_tier.commit(MemoryStore(tmp_path, KEY), _snapshot(5, [piece]), pool, 1, step=5,
                           **FIELDS)


# --- a memory step while the previous commit runs --------------------------------------------
def _tier(tmp_path: Path, when_busy: str | None = None) -> tuple[MemoryTier, list[dict]]:
    environ = {contract.ENV_NUM_PROCESSES: "1", contract.ENV_PROCESS_ID: "0",
               contract.ENV_CHECKPOINT_PATH: str(tmp_path / "ckpt"),
               contract.ENV_MEMORY_TIER_DIR: str(tmp_path / "memory"),
               contract.ENV_MEMORY_TIER_INTERVAL: "5",
               contract.ENV_MEMORY_TIER_REPLICAS: "0", contract.ENV_JOB_UID: "uid-1"}
    if when_busy is not None:
        environ[contract.ENV_MEMORY_TIER_WHEN_BUSY] = when_busy
    events: list[dict] = []
    return MemoryTier(contract.TrainerEnvironment.from_env(environ), events.append), events


@pytest.fixture
def held_commit(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Commits wait for this event before they start (a commit longer than the interval)."""
    gate = threading.Event()
    commit = memory_tier.commit

    def held(*args: Any, **kwargs: Any) -> Any:
        gate.wait()
        return commit(*args, **kwargs)

    monkeypatch.setattr(memory_tier, "commit", held)
    yield gate
    gate.set()


def _state(step: int) -> dict[str, np.ndarray]:
    return {"w": np.full((16, 8), step, np.float32)}


def _in_thread(call: Any) -> concurrent.futures.Future[Any]:
    future: concurrent.futures.Future[Any] = concurrent.futures.Future()
    threading.Thread(target=lambda: future.set_result(call()), daemon=True).start()
    return future


def test_a_memory_step_skips_its_snapshot_while_the_previous_commit_runs(tmp_path,
                                                                         held_commit):
    tier, events = _tier(tmp_path)
    tier.snapshot(5, _state(5), {}, None)
    # The commit of step 5 cannot end: step 10 is skipped, and the loop does not wait for it
    # (a wait would never end while the commit is held).
    _in_thread(lambda: tier.snapshot(10, _state(10), {}, None)).result(timeout=60)
    skipped = [e for e in events if e["event"] == "memory_snapshot_skipped"]
    assert [(e["step"], e["previous_step"], e["busy_ranks"]) for e in skipped] == [(10, 5, [0])]
    assert "still running" in skipped[0]["reason"]
    assert tier.skipped == [10]
    held_commit.set()
    tier.wait()
    tier.snapshot(15, _state(15), {}, None)  # the previous commit done: taken
    tier.close()
    committed = [e["step"] for e in events if e["event"] == "memory_snapshot_committed"]
    assert committed == [5, 15]
    assert [h.step for h in tier.store.inventory()] == [5, 15]
    phases = next(e for e in events if e["event"] == "memory_snapshot_committed")["phases"]
    assert phases["workers"] == tier.workers >= 1


def test_after_two_skips_in_a_row_the_loop_waits_for_the_commit(tmp_path, held_commit):
    tier, events = _tier(tmp_path)
    tier.snapshot(5, _state(5), {}, None)
    for step in (10, 15):
        _in_thread(lambda step=step: tier.snapshot(step, _state(step), {}, None)
                   ).result(timeout=60)
    # The commit of step 5 still held: step 20 waits for it (the bound on the steps lost).
    third = _in_thread(lambda: tier.snapshot(20, _state(20), {}, None))
    held_commit.set()
    third.result(timeout=60)
    tier.close()
    assert memory_session.MAX_SKIPS_IN_A_ROW == 2 and tier.skipped == [10, 15]
    skipped = [e["skips_in_a_row"] for e in events if e["event"] == "memory_snapshot_skipped"]
    assert skipped == [1, 2]
    started = [(e["step"], e["waited_for_previous"]) for e in events
               if e["event"] == "memory_snapshot_started"]
    assert started == [(5, False), (20, True)]
    assert [e["step"] for e in events if e["event"] == "memory_snapshot_committed"] == [5, 20]


def test_a_gang_skips_when_any_rank_is_still_committing(tmp_path, monkeypatch):
    from jax.experimental import multihost_utils

    tier, events = _tier(tmp_path)
    tier.count = 2  # rank 0 of two; rank 1's commit is still running
    gathered = []

    def allgather(value: Any) -> np.ndarray:
        gathered.append(int(value))
        return np.array([int(value), 1], np.int32)

    monkeypatch.setattr(multihost_utils, "process_allgather", allgather)
    tier.snapshot(5, _state(5), {}, None)
    tier.close()
    assert gathered == [0]  # this rank had nothing in flight...
    assert [(e["event"], e.get("busy_ranks")) for e in events] == [
        ("memory_snapshot_skipped", [1])]  # ...and skips with the gang


def test_a_job_that_asks_to_wait_waits_for_the_previous_commit(tmp_path, held_commit):
    tier, events = _tier(tmp_path, contract.MEMORY_TIER_WAIT)
    tier.snapshot(5, _state(5), {}, None)
    second = _in_thread(lambda: tier.snapshot(10, _state(10), {}, None))
    held_commit.set()
    second.result(timeout=60)
    tier.close()
    started = [e for e in events if e["event"] == "memory_snapshot_started"]
    assert [(e["step"], e["waited_for_previous"]) for e in started] == [(5, False), (10, True)]
    assert not [e for e in events if e["event"] == "memory_snapshot_skipped"]
    assert [h.step for h in tier.store.inventory()] == [5, 10]


def test_the_policy_must_be_skip_or_wait():
    with pytest.raises(contract.ContractError, match=contract.ENV_MEMORY_TIER_WHEN_BUSY):
        contract.TrainerEnvironment.from_env({
            contract.ENV_NUM_PROCESSES: "1", contract.ENV_PROCESS_ID: "0",
            contract.ENV_CHECKPOINT_PATH: "/c", contract.ENV_MEMORY_TIER_DIR: "/m",
            contract.ENV_MEMORY_TIER_INTERVAL: "5", contract.ENV_MEMORY_TIER_REPLICAS: "0",
            contract.ENV_MEMORY_TIER_WHEN_BUSY: "sometimes"})
    env = contract.TrainerEnvironment(
        job_name="j", namespace="n", attempt=0, coordinator_address="h:1", num_processes=1,
        process_id=0, checkpoint_path="/c", memory_tier_dir="/m", memory_tier_interval=5,
        memory_tier_replicas=0, memory_tier_when_busy=contract.MEMORY_TIER_WAIT)
    assert contract.TrainerEnvironment.from_env(env.to_env()).memory_tier_when_busy == "wait"


def test_the_commit_uses_the_cores_it_may_run_on_up_to_a_limit(monkeypatch):
    monkeypatch.setattr(memory_session.os, "sched_getaffinity", lambda pid: set(range(64)),
                        raising=False)
    assert memory_session.commit_workers() == memory_session.MAX_COMMIT_WORKERS
    monkeypatch.setattr(memory_session.os, "sched_getaffinity", lambda pid: {0, 1},
                        raising=False)
    assert memory_session.commit_workers() == 2
