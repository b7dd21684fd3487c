"""End-to-end: a gang whose rank is lost without notice, with its memory, restores from the
memory tier: the lost rank's shards from its peer's replica, the survivor's from its own."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from tardigrade_contract import contract
from trainer_harness import committed_steps, launch, wait_for

pytestmark = pytest.mark.slow

STEPS = 20
BASE = {"steps": STEPS, "devices_per_process": 2, "debug_state_hash": True}
MEMORY_INTERVAL = 5
REPLICA_KEY = "memory-tier-gang-test-key-0123456789"


def memory_env(work, processes: int = 2, when_busy: str = contract.MEMORY_TIER_WAIT
               ) -> tuple[dict[str, str], dict[int, dict[str, str]]]:
    """`when_busy`: wait by default, so that every interval is snapshotted however loaded the
    machine is (the tests below lose a rank after a given snapshot)."""
    common = {contract.ENV_MEMORY_TIER_INTERVAL: str(MEMORY_INTERVAL),
              contract.ENV_MEMORY_TIER_REPLICAS: "1",
              contract.ENV_MEMORY_TIER_WHEN_BUSY: when_busy,
              contract.ENV_REPLICA_KEY: REPLICA_KEY,
              contract.ENV_REPLICA_PORT: "0"}  # any free port: it is published to the gang
    # Each rank's memory volume: a directory of its own, as each pod has its emptyDir.
    per_rank = {rank: {contract.ENV_MEMORY_TIER_DIR: str(work / f"memory{rank}")}
                for rank in range(processes)}
    return common, per_rank


def _launch(workdir, ckpt, memory_root, hooks=None, processes=2, config=BASE,
            when_busy=contract.MEMORY_TIER_WAIT):
    common, per_rank = memory_env(memory_root, processes, when_busy)
    return launch(workdir, processes=processes, checkpoint_path=str(ckpt), config=config,
                  interval_steps=10, extra_env=common, rank_env=per_rank, hooks=hooks)


def _hash_at(gang, step: int) -> str:
    return next(e["hash"] for e in gang.events("state_hash") if e["step"] == step)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    work = tmp_path_factory.mktemp("memory-straight")
    # The default: a memory step skips its snapshot while a rank's previous commit runs.
    gang = _launch(work / "run", work / "ckpt", work, when_busy=contract.MEMORY_TIER_SKIP)
    assert gang.wait() == [0, 0], gang.describe()
    return gang


def test_every_rank_snapshots_every_interval_and_replicates_to_the_next(straight):
    taken = {}
    for rank in (0, 1):
        committed = straight.events("memory_snapshot_committed", rank)
        skipped = straight.events("memory_snapshot_skipped", rank)
        # Each interval snapshotted or skipped (a commit still running on a loaded machine),
        # never both, and the same steps on both ranks: no torn step.
        taken[rank] = [e["step"] for e in committed]
        assert sorted(taken[rank] + [e["step"] for e in skipped]) == [5, 10, 15]
        assert taken[rank][:1] == [5]
        assert all(e["replicas"] == [1 - rank] for e in committed)
    assert taken[0] == taken[1]
    # The bucket keeps its own interval.
    assert committed_steps(straight.workdir.parent / "ckpt") == [10, 20]


def _lose_rank_after_step_17(tmp_path, lose_memory=True):
    """Train to step 17 (memory snapshot 15 committed, bucket step 10), then lose the whole
    gang without notice and (`lose_memory`) rank 1's memory with it (its pod is gone)."""
    ckpt = tmp_path / "ckpt"
    first = _launch(tmp_path / "first", ckpt, tmp_path,
                    hooks=[{"point": "step_end", "step": 17, "action": "pause"}])
    wait_for(lambda: all((tmp_path / "first" / f"step_end-17-{r}").exists() for r in (0, 1))
             and all(any(e["step"] == 15 for e in first.events("memory_snapshot_committed", r))
                     for r in (0, 1))
             and committed_steps(ckpt) == [10], 240,
             "both ranks at step 17 with memory step 15 and bucket step 10 committed")
    first.kill()  # SIGKILL: no notice, no save
    if lose_memory:
        shutil.rmtree(tmp_path / "memory1")
    return ckpt


def test_a_rank_lost_without_notice_restores_from_its_peers_replica(straight, tmp_path):
    ckpt = _lose_rank_after_step_17(tmp_path)
    second = _launch(tmp_path / "second", ckpt, tmp_path)
    assert second.wait() == [0, 0], second.describe()
    sources = {rank: second.events("restore_done", rank)[0]["source"] for rank in (0, 1)}
    assert sources == {0: "memory", 1: "peer"}
    restored = {rank: second.events("memory_tier_restored", rank)[0] for rank in (0, 1)}
    assert restored[0]["step"] == restored[1]["step"] == 15
    assert restored[1]["holder"] == 0
    assert not second.events("checkpoint_restored")  # nothing read from the bucket
    # Steps lost: 17 trained, 15 restored; the bucket alone would have lost 7.
    assert 17 - restored[0]["step"] <= MEMORY_INTERVAL
    # The state is the one the uninterrupted run had at step 15, and training continues
    # exactly as it did.
    assert _hash_at(second, 15) == _hash_at(straight, 15)
    assert min(second.losses()) == 16
    reference = straight.losses()
    assert second.losses() == {s: reference[s] for s in second.losses()}
    # Rank 1's memory holds its own snapshot again, and the next ones.
    assert (tmp_path / "memory1" / "tardigrade-memory" / "owner_00001").is_dir()


def test_a_damaged_replica_sends_the_whole_gang_to_the_bucket(straight, tmp_path):
    ckpt = _lose_rank_after_step_17(tmp_path)
    data = tmp_path / "memory0" / "tardigrade-memory" / "owner_00001" / "step_00000015" / \
        "data.bin"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    second = _launch(tmp_path / "second", ckpt, tmp_path)
    assert second.wait() == [0, 0], second.describe()
    for rank in (0, 1):
        fallback = second.events("memory_tier_fallback", rank)
        assert fallback and "rank 1" in fallback[0]["reason"] and "digest" in \
            fallback[0]["reason"], second.describe()
        assert second.events("restore_done", rank)[0]["source"] == "bucket"
    assert [e["step"] for e in second.events("checkpoint_restored")] == [10]
    assert _hash_at(second, 10) == _hash_at(straight, 10)


def test_in_a_ring_of_three_the_lost_rank_reads_from_its_successor(tmp_path):
    # Rank 1's replica is on rank 2, the next rank on the ring; rank 0 holds rank 2's.
    config = {**BASE, "devices_per_process": 1, "global_batch_size": 6}
    ckpt = tmp_path / "ckpt"
    first = _launch(tmp_path / "first", ckpt, tmp_path, processes=3, config=config,
                    hooks=[{"point": "step_end", "step": 17, "action": "pause"}])
    wait_for(lambda: all((tmp_path / "first" / f"step_end-17-{r}").exists() for r in range(3))
             and all(any(e["step"] == 15 for e in first.events("memory_snapshot_committed", r))
                     for r in range(3)), 240, "all three ranks at step 17, memory step 15 in")
    assert [e["replicas"] for e in first.events("memory_snapshot_committed", 1)] == [[2]] * 3
    first.kill()
    shutil.rmtree(tmp_path / "memory1")
    second = _launch(tmp_path / "second", ckpt, tmp_path, processes=3, config=config)
    assert second.wait() == [0, 0, 0], second.describe()
    assert [second.events("restore_done", r)[0]["source"] for r in range(3)] == [
        "memory", "peer", "memory"]
    restored = second.events("memory_tier_restored", 1)[0]
    assert (restored["step"], restored["holder"]) == (15, 2)
    assert min(second.losses()) == 16


def test_a_gang_grown_to_three_reshards_the_snapshot_from_its_peers(straight, tmp_path):
    """Point 2's second half: the relaunch has another size (a rank added), so every rank
    reads the regions of its new layout from the snapshot's owners, the new rank entirely
    from its peers' memories."""
    ckpt = _lose_rank_after_step_17(tmp_path, lose_memory=False)
    second = _launch(tmp_path / "second", ckpt, tmp_path, processes=3)
    assert second.wait() == [0, 0, 0], second.describe()
    decision = second.events("memory_tier_decision")[0]
    assert (decision["step"], decision["saved_process_count"]) == (15, 2)
    for rank in range(3):
        assert second.events("restore_done", rank)[0]["source"] == "resharded"
        restored = second.events("memory_tier_restored", rank)[0]
        # The reference model is data parallel: one owner's copy holds every region. Ranks 0
        # and 1 take their own; new rank 2, holding none, takes owner 0's from rank 0.
        assert restored["owners"] == [rank if rank < 2 else 0], restored
    assert not second.events("checkpoint_restored")
    assert second.events("start")[0]["mesh"] == {"data": 6, "model": 1}
    assert _hash_at(second, 15) == _hash_at(straight, 15)
    losses, reference = second.losses(), straight.losses()
    assert sorted(losses) == list(range(16, STEPS + 1))
    np.testing.assert_allclose([losses[s] for s in losses], [reference[s] for s in losses],
                               rtol=1e-5, atol=1e-5)
