"""The root record's compare-and-swap against the GCS emulator (issue 28, point 6).

docs/checkpoint-format.md, "Root record": process 0 writes `tardigrade-root.json` only with
GCS's `ifGenerationMatch` on the generation it read. Here the emulator refuses a stale write
with 412, and a write whose answer was lost on the way back (TensorStore retries it, and the
retry meets the object the first try wrote: 412) counts as the gang's own write, while a
rival's write still sends the change round again.
"""

from __future__ import annotations

import contextlib
import json
import urllib.parse
import urllib.request
from collections.abc import Iterator

import pytest
from tardigrade_checkpoint import CheckpointManager, rootrecord
from tardigrade_checkpoint.rootrecord import ROOT_FILE, JobIdentity
from tardigrade_checkpoint.rootstore import RootStore
from tardigrade_checkpoint.storage import (
    ENV_LOW_SPEED_LIMIT,
    ENV_LOW_SPEED_TIME,
    StorageRetries,
)
from tardigrade_local.gcs import GcsEmulator, client_env
from tardigrade_local.gcs_faults import FaultProxy, FaultRule

BUCKET = "tardigrade-rootrecord"
RETRIES = StorageRetries(max_retries=4, initial_delay_seconds=0.05, max_delay_seconds=0.4,
                         stall_seconds=2)
ME = JobIdentity("ml", "gpt", "uid-1")


@pytest.fixture(scope="module")
def gcs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GcsEmulator]:
    log = tmp_path_factory.mktemp("gcs") / "gcs.log"
    with GcsEmulator(log_path=log, log_requests=True) as emulator:
        emulator.create_bucket(BUCKET)
        yield emulator


@pytest.fixture
def storage_at(monkeypatch: pytest.MonkeyPatch):
    """Point this process's TensorStore at a URL (the emulator, or a proxy in front of it)."""
    monkeypatch.setenv(ENV_LOW_SPEED_TIME, str(RETRIES.stall_seconds))
    monkeypatch.setenv(ENV_LOW_SPEED_LIMIT, str(RETRIES.stall_bytes_per_second))

    def point(url: str) -> None:
        for key, value in client_env(url).items():
            monkeypatch.setenv(key, value)

    return point


@contextlib.contextmanager
def _proxy(gcs: GcsEmulator, storage_at) -> Iterator[FaultProxy]:
    with FaultProxy(gcs.url) as proxy:
        storage_at(proxy.url)
        yield proxy


def _record_writes(gcs: GcsEmulator, prefix: str) -> list[tuple[str | None, int]]:
    """(ifGenerationMatch, status) of each upload of `prefix`'s root record, in order."""
    writes = []
    for method, path, status in gcs.answers():
        query = urllib.parse.parse_qs(urllib.parse.urlsplit(path).query)
        if method == "POST" and query.get("name") == [f"{prefix}/{ROOT_FILE}"]:
            writes.append((query.get("ifGenerationMatch", [None])[0], status))
    return writes


def _generation(gcs: GcsEmulator, name: str) -> int:
    url = f"{gcs.url}/storage/v1/b/{BUCKET}/o/{urllib.parse.quote(name, safe='')}"
    with urllib.request.urlopen(url, timeout=10) as response:
        return int(json.load(response)["generation"])


def test_a_stale_compare_and_swap_of_the_root_record_is_refused_412(gcs, storage_at):
    storage_at(gcs.url)
    root = f"gs://{BUCKET}/stale"
    kv = RootStore(root, RETRIES).kv
    absent, nothing_at = rootrecord.load(kv, root)
    assert absent is None
    claim = rootrecord.take_over(None, ME, 1, -1, root)
    assert rootrecord.store(kv, claim, nothing_at, root)
    # A second claim of a root it saw empty (create-only, ifGenerationMatch=0): refused.
    rival_claim = rootrecord.take_over(None, JobIdentity("ml", "other", "uid-9"), 1, -1, root)
    assert not rootrecord.store(kv, rival_claim, nothing_at, root)

    record, read_at = rootrecord.load(kv, root)
    assert record == claim
    claimed_at = _generation(gcs, f"stale/{ROOT_FILE}")
    newer = rootrecord.take_over(record, ME, 3, -1, root)  # attempt 3 started meanwhile
    assert rootrecord.store(kv, newer, read_at, root)
    stale = rootrecord.take_over(record, ME, 2, -1, root)  # attempt 2 read before it wrote
    assert not rootrecord.store(kv, stale, read_at, root)
    assert rootrecord.load(kv, root)[0] == newer

    # Both claims were create-only; both later writes sent the generation they read, the
    # claim's: whichever came second lost.
    assert _record_writes(gcs, "stale") == [("0", 200), ("0", 412), (str(claimed_at), 200),
                                            (str(claimed_at), 412)]


@pytest.mark.parametrize("answer", [503, 0], ids=["answered-503", "connection-closed"])
def test_a_write_whose_answer_was_lost_is_the_gangs_own(gcs, storage_at, answer):
    root_prefix = f"lost-{answer}"
    root = f"gs://{BUCKET}/{root_prefix}"
    with _proxy(gcs, storage_at) as proxy:
        kv = RootStore(root, RETRIES).kv
        _, nothing_at = rootrecord.load(kv, root)
        claim = rootrecord.take_over(None, ME, 1, -1, root)
        proxy.set_rules([FaultRule("write", action="lose", status=answer, count=1,
                                   path_contains=ROOT_FILE)])
        assert rootrecord.store(kv, claim, nothing_at, root)
        assert sum(proxy.injected.values()) == 1, proxy.injected
    assert rootrecord.load(RootStore(root, RETRIES).kv, root)[0] == claim
    # The first try landed; TensorStore's retry met the object it wrote and was refused.
    assert [status for _, status in _record_writes(gcs, root_prefix)] == [200, 412]


def test_a_fork_whose_answer_was_lost_adds_exactly_one_branch(gcs, storage_at):
    root = f"gs://{BUCKET}/fork-lost"
    events: list[dict] = []
    with _proxy(gcs, storage_at) as proxy:
        manager = CheckpointManager(root, storage=RETRIES, on_event=events.append)
        manager.open_root(ME, 1)
        proxy.set_rules([FaultRule("write", action="lose", status=503, count=1,
                                   path_contains=ROOT_FILE)])
        record = manager.fork_root(None, "uid-1/a1")
        assert proxy.injected == {"lost answer (503)": 1}
        assert proxy.statuses[412] == 1
        manager.close()
    stored = CheckpointManager(root, storage=RETRIES)
    try:
        assert stored.root_record() == record
    finally:
        stored.close()
    assert set(record.branches) == {"", record.lineage}
    assert record.branches[record.lineage].request == "uid-1/a1"
    lines = [e for e in events if e["event"] == "checkpoint_line_started"]
    assert [e["lineage"] for e in lines] == [record.lineage]


def test_a_rivals_write_still_sends_the_change_round_again(gcs, storage_at, monkeypatch):
    storage_at(gcs.url)
    root = f"gs://{BUCKET}/rival"
    manager = CheckpointManager(root, storage=RETRIES)
    rival = CheckpointManager(root, storage=RETRIES)
    manager.open_root(ME, 1)
    rival.open_root(ME, 2)  # the rival gang's attempt
    fork = rootrecord.fork
    rival_lineage: list[str] = []

    def fork_raced(*args, **kwargs):
        new = fork(*args, **kwargs)
        if not rival_lineage:  # between this gang's read and its write, the rival writes
            monkeypatch.setattr(rootrecord, "fork", fork)
            rival_lineage.append(rival.fork_root(None, "rival").lineage)
            monkeypatch.setattr(rootrecord, "fork", fork_raced)
        return new

    monkeypatch.setattr(rootrecord, "fork", fork_raced)
    try:
        record = manager.fork_root(None, "ours")
    finally:
        manager.close()
        rival.close()
    # The rival's branch survives, and ours went on top of it in a second round.
    assert set(record.branches) == {"", rival_lineage[0], record.lineage}
    assert record.branches[record.lineage].request == "ours"
    assert record.attempt == 2
    statuses = [status for _, status in _record_writes(gcs, "rival")]
    assert statuses == [200, 200, 200, 412, 200], statuses
