"""The memory tier's rules: which snapshot a gang restores, what a host keeps, what a peer may
send (tardigrade_checkpoint/memory_tier.py, tardigrade_sdk/replica_server.py)."""

from __future__ import annotations

import dataclasses
import http.client
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from tardigrade_checkpoint import memory_tier
from tardigrade_checkpoint.memory_tier import Held, MemoryStore, MemoryTierError, select
from tardigrade_sdk import replica_server

KEY = b"memory-tier-test-key-0123456789ab"
LINE = ""


def held(owner: int, step: int, attempt: int = 0, count: int = 3, line: str = LINE) -> Held:
    return Held(owner, step, attempt, count, line)


# --- the selection rules --------------------------------------------------------------------
def test_newest_step_whose_every_owner_is_held_somewhere_wins():
    inventories = {
        0: [held(0, 10), held(2, 10), held(0, 15)],
        1: [held(1, 10), held(0, 10), held(1, 15), held(0, 15)],
        2: [],  # a new pod: its memory is empty; rank 1 holds nothing of owner 2 at 15
    }
    chosen = select(inventories, LINE, floor=5)
    assert chosen is not None and chosen.step == 10
    # Each owner reads its own memory where it can; owner 2 from rank 0, its replica holder.
    assert chosen.sources == (0, 1, 0)


def test_a_torn_step_is_never_chosen_and_older_complete_one_is():
    # Owner 2 died while writing step 15: no copy of it anywhere.
    inventories = {0: [held(0, 15), held(2, 10), held(0, 10)],
                   1: [held(1, 15), held(0, 15), held(1, 10)],
                   2: [held(2, 10), held(1, 10)]}
    chosen = select(inventories, LINE, floor=-1)
    assert chosen is not None and (chosen.step, chosen.sources) == (10, (0, 1, 2))


def test_the_bucket_wins_when_it_is_newer_and_memory_wins_ties():
    inventories = {r: [held(r, 10)] for r in range(3)}
    assert select(inventories, LINE, floor=11) is None
    tie = select(inventories, LINE, floor=10)
    assert tie is not None and tie.step == 10


def test_snapshots_of_one_step_by_two_attempts_or_launches_are_never_mixed():
    # Attempt 1 re-trained step 15 after restoring from the bucket: its state may differ.
    inventories = {0: [held(0, 15, attempt=0)], 1: [held(1, 15, attempt=1)],
                   2: [held(2, 15, attempt=0), held(2, 15, attempt=1)]}
    assert select(inventories, LINE, floor=-1) is None
    inventories[0].append(held(0, 15, attempt=1))
    chosen = select(inventories, LINE, floor=-1)
    assert chosen is not None and chosen.attempt == 1
    # Two launches of one attempt (a trainer run outside the operator keeps attempt 0).
    relaunched = {0: [Held(0, 20, 0, 2, LINE, "first")], 1: [Held(1, 20, 0, 2, LINE, "second")]}
    assert select(relaunched, LINE, -1) is None
    relaunched[1].append(Held(1, 20, 0, 2, LINE, "first"))
    chosen = select(relaunched, LINE, -1)
    assert chosen is not None and chosen.launch == "first" and chosen.sources == (0, 1)


def test_snapshots_of_another_line_do_not_count_and_another_gang_size_must_be_whole():
    assert select({r: [held(r, 20, line="old")] for r in range(3)}, "new", -1) is None
    # Three ranks left of a gang of four, rank 3's pieces nowhere: torn.
    assert select({r: [held(r, 20, count=4)] for r in range(3)}, LINE, -1) is None
    # A gang of two grown to three: both owners held, by ranks 0 and 1 (rank 2 is new).
    grown = select({0: [held(0, 20, count=2), held(1, 20, count=2)], 1: [held(1, 20, count=2)],
                    2: []}, LINE, -1)
    assert grown is not None and grown.process_count == 2 and grown.sources == (0, 1)


def test_holders_are_the_next_ranks_on_the_ring():
    assert memory_tier.holders(2, 3, 1) == [0]
    assert memory_tier.holders(0, 4, 2) == [1, 2]
    assert memory_tier.holders(0, 2, 5) == [1]  # never the owner itself
    assert memory_tier.holders(0, 1, 1) == []


@st.composite
def histories(draw):
    """A gang of P ranks taking snapshots every 5 steps with a ring replica, where any rank
    may die partway through a snapshot (its own copy written, its replica not, or neither),
    after which some pods' memories are lost."""
    count = draw(st.integers(1, 5))
    keep = draw(st.integers(1, 3))
    snapshots = draw(st.integers(0, 5))
    # holder -> owner -> steps
    memories: dict[int, dict[int, list[int]]] = {r: {} for r in range(count)}
    complete = []
    for index in range(1, snapshots + 1):
        step = 5 * index
        last = index == snapshots
        done = True
        for owner in range(count):
            # Only the last snapshot can be cut short: the gang stops there.
            stage = draw(st.sampled_from(["none", "own", "all"])) if last else "all"
            targets = {"none": [], "own": [owner],
                       "all": [owner, *memory_tier.holders(owner, count, 1)]}[stage]
            done = done and stage != "none"
            for holder in targets:
                steps = memories[holder].setdefault(owner, [])
                steps.append(step)
                del steps[:-keep]
        if done:
            complete.append(step)
    lost = draw(st.sets(st.integers(0, count - 1), max_size=count))
    return count, keep, memories, complete, lost


@settings(max_examples=300, deadline=None)
@given(histories(), st.integers(-1, 30))
def test_generated_histories_choose_the_newest_step_still_whole(history, floor):
    count, _, memories, _, lost = history
    inventories = {holder: [] if holder in lost else
                   [held(owner, step, count=count) for owner, steps in by_owner.items()
                    for step in steps]
                   for holder, by_owner in memories.items()}
    chosen = select(inventories, LINE, floor)
    whole = [step for step in {h.step for items in inventories.values() for h in items}
             if all(any(held(o, step, count=count) in inventories[h] for h in range(count))
                    for o in range(count))]
    expected = max((s for s in whole if s >= floor), default=None)
    assert (chosen.step if chosen else None) == expected
    if chosen is not None:
        for owner, source in enumerate(chosen.sources):
            # Every owner's pieces come from a rank that holds exactly that snapshot...
            assert held(owner, chosen.step, count=count) in inventories[source]
            # ...its own memory whenever it still has it.
            if held(owner, chosen.step, count=count) in inventories[owner]:
                assert source == owner


@settings(max_examples=200, deadline=None)
@given(histories())
def test_with_no_pod_lost_the_newest_completed_snapshot_is_chosen(history):
    count, keep, memories, complete, _ = history
    # Keeping one snapshot, a snapshot cut short has already replaced the last whole one on
    # the ranks that finished it: why the store keeps two (DEFAULT_KEEP).
    assume(keep >= memory_tier.DEFAULT_KEEP)
    inventories = {holder: [held(owner, step, count=count) for owner, steps in by_owner.items()
                            for step in steps] for holder, by_owner in memories.items()}
    chosen = select(inventories, LINE, -1)
    assert (chosen.step if chosen else None) == (complete[-1] if complete else None)


# --- one host's memory directory ------------------------------------------------------------
def _snapshot(step: int, owner: int = 0, count: int = 2, attempt: int = 0
              ) -> tuple[bytes, list[np.ndarray]]:
    snapshot = memory_tier.Snapshot(
        {"w": {"shape": [4], "dtype": "float32"}, "n": {"shape": [], "dtype": "int32"}},
        [memory_tier.Piece("w", "0:4", "float32", (4,), np.arange(4, dtype=np.float32) + step),
         memory_tier.Piece("n", "", "int32", (), np.array(step, np.int32))])
    manifest, buffers = memory_tier.encode(snapshot, step=step, attempt=attempt, owner=owner,
                                           process_count=count, lineage=LINE, job_uid="u")
    return memory_tier.seal(KEY, manifest), buffers


def test_a_snapshot_counts_once_its_manifest_is_written_and_only_if_sealed(tmp_path):
    store = MemoryStore(tmp_path, KEY)
    sealed, buffers = _snapshot(5)
    store.write(sealed, buffers)
    assert store.inventory() == [held(0, 5, count=2)]
    # A partial snapshot (data, no manifest) is not listed.
    (store.root / "owner_00000" / "step_00000010").mkdir()
    (store.root / "owner_00000" / "step_00000010" / memory_tier.DATA).write_bytes(b"x")
    assert store.inventory() == [held(0, 5, count=2)]
    # A manifest sealed with another key (another job) is not listed.
    other, _ = _snapshot(15)
    forged = MemoryStore(tmp_path, b"another-jobs-key-0123456789abcdef")
    forged.write(memory_tier.seal(forged.key, memory_tier.unseal(KEY, other)), buffers)
    assert store.inventory() == [held(0, 5, count=2)]


def test_a_damaged_piece_is_refused_on_load(tmp_path):
    store = MemoryStore(tmp_path, KEY)
    sealed, buffers = _snapshot(5)
    store.write(sealed, buffers)
    manifest, data = store.load(0, 5)
    assert manifest.extra == {} and len(data) == manifest.data_bytes
    path = store.root / "owner_00000" / "step_00000005" / memory_tier.DATA
    raw = bytearray(path.read_bytes())
    raw[3] ^= 1
    path.write_bytes(bytes(raw))
    with pytest.raises(MemoryTierError, match="does not match its digest"):
        store.load(0, 5)
    with pytest.raises(MemoryTierError, match="seal"):
        memory_tier.unseal(KEY, sealed.replace(b'"step": 5', b'"step": 6'))


def test_each_owner_keeps_its_newest_snapshots(tmp_path):
    store = MemoryStore(tmp_path, KEY, keep=2)
    for step, owner in itertools.product((5, 10, 15), (0, 1)):
        sealed, buffers = _snapshot(step, owner)
        store.write(sealed, buffers)
    assert sorted((h.owner, h.step) for h in store.inventory()) == [
        (0, 10), (0, 15), (1, 10), (1, 15)]


def test_own_shards_round_trip_onto_the_same_mesh_and_not_another():
    devices = np.array(jax.devices()[:4])
    mesh = Mesh(devices.reshape(2, 2), ("data", "model"))
    split = NamedSharding(mesh, PartitionSpec("data", "model"))
    state = {"w": jax.device_put(jnp.arange(32, dtype=jnp.bfloat16).reshape(4, 8), split),
             "b": jax.device_put(jnp.ones(8), NamedSharding(mesh, PartitionSpec())),
             "count": np.int32(7), "key": jax.random.key(3)}
    snapshot = memory_tier.take_snapshot(state)
    # Four quarters of w, one copy of the replicated b.
    assert sorted((p.leaf, p.region) for p in snapshot.pieces if p.leaf in ("w", "b")) == [
        ("b", "0:8"), ("w", "0:2,0:4"), ("w", "0:2,4:8"), ("w", "2:4,0:4"), ("w", "2:4,4:8")]
    manifest, buffers = memory_tier.encode(snapshot, step=5, attempt=0, owner=0,
                                           process_count=1, lineage=LINE, job_uid="u")
    data = b"".join(bytes(b) for b in buffers)
    memory_tier.check_data(manifest, data)
    target = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        if isinstance(x, jax.Array) else x, state)
    back = memory_tier.assemble([(manifest, data)], target)
    assert np.array_equal(np.asarray(back["w"]), np.asarray(state["w"]))
    assert back["w"].sharding == split and back["count"] == 7
    assert np.array_equal(jax.random.key_data(back["key"]), jax.random.key_data(state["key"]))
    # Onto another mesh: rows of w cut from the quarters that tile them.
    rows = NamedSharding(Mesh(devices, ("data",)), PartitionSpec("data"))
    resharded = memory_tier.assemble([(manifest, data)], {**target, "w": jax.ShapeDtypeStruct(
        (4, 8), jnp.bfloat16, sharding=rows)})
    assert resharded["w"].sharding == rows
    assert np.array_equal(np.asarray(resharded["w"]), np.asarray(state["w"]))
    # A region no piece covers is refused, not filled.
    halves = memory_tier.Manifest(**{**dataclasses.asdict(manifest), "pieces": [
        e for e in manifest.pieces if e["leaf"] != "w" or e["region"].startswith("0:2")]})
    with pytest.raises(MemoryTierError, match=r"not covered"):
        memory_tier.assemble([(halves, data)], target)


def test_a_gang_of_another_size_takes_each_region_from_the_owners_that_hold_it():
    devices = np.array(jax.devices()[:4])
    rows = NamedSharding(Mesh(devices, ("data",)), PartitionSpec("data"))
    state = {"w": jax.device_put(jnp.arange(64, dtype=jnp.float32).reshape(8, 8), rows),
             "b": jax.device_put(jnp.ones(8), NamedSharding(Mesh(devices, ("data",)),
                                                            PartitionSpec()))}
    whole = memory_tier.take_snapshot(state)
    # Two owners, as a gang of two processes of two devices each wrote them: rows 0:4 and
    # 4:8 of w, and each a whole copy of the replicated b.
    parts = {}
    for owner, prefix in ((0, ("0:2", "2:4")), (1, ("4:6", "6:8"))):
        mine = memory_tier.Snapshot(whole.arrays, [
            p for p in whole.pieces if p.leaf == "b" or p.region.split(",")[0] in prefix])
        manifest, buffers = memory_tier.encode(mine, step=5, attempt=0, owner=owner,
                                               process_count=2, lineage=LINE, job_uid="u")
        parts[owner] = (manifest, b"".join(bytes(b) for b in buffers))
    columns = NamedSharding(Mesh(devices[:2], ("model",)), PartitionSpec(None, "model"))
    target = {"w": jax.ShapeDtypeStruct((8, 8), jnp.float32, sharding=columns),
              "b": jax.ShapeDtypeStruct((8,), jnp.float32, sharding=NamedSharding(
                  columns.mesh, PartitionSpec("model")))}
    wanted = memory_tier.wanted_regions(target)
    manifests = {o: m for o, (m, _) in parts.items()}
    # Columns of w need both owners; b alone would need one: the one held here.
    assert memory_tier.owners_needed(manifests, wanted, prefer=[1]) == [0, 1]
    assert memory_tier.owners_needed(manifests, {"b": wanted["b"]}, prefer=[1]) == [1]
    back = memory_tier.assemble(list(parts.values()), target)
    assert np.array_equal(np.asarray(back["w"]), np.asarray(state["w"]))
    assert np.array_equal(np.asarray(back["b"]), np.ones(8))


# --- the peer transport ---------------------------------------------------------------------
@pytest.fixture
def server(tmp_path):
    store = MemoryStore(tmp_path / "holder", KEY)
    running = replica_server.ReplicaServer(store, KEY.decode(), "127.0.0.1", 0, 1 << 20).start()
    yield running
    running.stop()


def test_a_replica_goes_to_a_peer_and_comes_back_checked(server):
    address = f"127.0.0.1:{server.port}"
    sealed, buffers = _snapshot(5, owner=1)
    replica_server.send(address, KEY.decode(), sealed, list(buffers), 1, 5)
    assert server.store.inventory() == [held(1, 5, count=2)]
    got_sealed, data = replica_server.fetch(address, KEY.decode(), 1, 5, 1 << 20)
    manifest = memory_tier.unseal(KEY, got_sealed)
    memory_tier.check_data(manifest, data)
    assert manifest.owner == 1 and manifest.step == 5


def test_a_peer_without_the_token_or_a_sealed_manifest_is_refused(server):
    address = f"127.0.0.1:{server.port}"
    sealed, buffers = _snapshot(5, owner=1)
    with pytest.raises(MemoryTierError, match=r"HTTP 401"):
        replica_server.send(address, "not-the-key-0123456789", sealed, list(buffers), 1, 5)
    with pytest.raises(MemoryTierError, match=r"HTTP 401"):
        replica_server.fetch(address, "not-the-key-0123456789", 1, 5, 1 << 20)
    with pytest.raises(MemoryTierError, match=r"HTTP 400.*manifest is owner 1 step 5"):
        replica_server.send(address, KEY.decode(), sealed, list(buffers), 0, 5)
    with pytest.raises(MemoryTierError, match=r"HTTP 400.*the manifest says"):
        replica_server.send(address, KEY.decode(), sealed, [buffers[0]], 1, 5)
    forged = memory_tier.seal(b"another-jobs-key-0123456789abcdef", memory_tier.unseal(
        KEY, sealed))
    with pytest.raises(MemoryTierError, match=r"HTTP 400.*seal"):
        replica_server.send(address, KEY.decode(), forged, list(buffers), 1, 5)
    assert server.store.inventory() == []
    # A damaged piece is kept (the holder checks seal and length only) and refused where it
    # is used: the restoring rank checks every piece.
    damaged = [buffers[0].copy(), buffers[1]]
    damaged[0][0] ^= 1
    replica_server.send(address, KEY.decode(), sealed, damaged, 1, 5)
    got_sealed, data = replica_server.fetch(address, KEY.decode(), 1, 5, 1 << 20)
    with pytest.raises(MemoryTierError, match="does not match its digest"):
        memory_tier.check_data(memory_tier.unseal(KEY, got_sealed), data)
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    connection.request("PUT", "/memory/1/5", body=b"x" * 64,
                       headers={"Authorization": f"Bearer {KEY.decode()}",
                                "Content-Length": str(2 << 20)})
    assert connection.getresponse().status == 413
