"""The memory tier in a training session: snapshot, replicate, choose, restore.

Every `interval` steps each rank copies its shards off its devices (the loop waits for that
copy only), then a background thread commits them to its memory directory and sends them to
its ring successors (replica_server.py), which keep them in theirs. At start-up, after the
bucket's restore decision (restore_choice.py), every rank lists what its memory holds;
process 0 picks the newest snapshot complete across the gang and not older than the bucket's
step (tardigrade_checkpoint.memory_tier.select), and every rank reads its own pieces from its
memory or from the peer holding them; in a gang of another size, the pieces of the owners
that cover its new regions. If any rank cannot (a peer gone, a damaged piece), the
whole gang restores the bucket's step instead: every rank must restore the same step.
Design and costs: docs/memory-tier.md.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import secrets
import time
from collections.abc import Callable, Mapping
from typing import Any

from tardigrade_checkpoint import coordination, memory_tier, stagingbudget
from tardigrade_checkpoint.lineage import LEGACY_LINEAGE
from tardigrade_contract import contract

from tardigrade_sdk import replica_server

# What a peer may upload or answer: bounded by the memory volume in practice; this only
# refuses a length no state has.
MAX_SNAPSHOT_BYTES = 1 << 40
# Threads a commit digests and writes its pieces on (memory_tier.commit). SHA-256 runs at
# about 0.5-1 GB/s a core: 8 make a 2 GB snapshot's digests a fraction of a second, and an
# accelerator host's cores are mostly idle while the chips train.
MAX_COMMIT_WORKERS = 8
# Memory steps skipped in a row before one waits for the commit: what bounds the steps lost
# when commits are slow (a host whose cores are busy runs the tier's threads last), at
# interval x (2 + this) steps; a commit up to this many intervals long never holds the loop.
MAX_SKIPS_IN_A_ROW = 2


def commit_workers() -> int:
    """The commit's threads: the cores this process may run on, at most MAX_COMMIT_WORKERS."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(MAX_COMMIT_WORKERS, cores))


class MemoryTier:
    """One rank's memory tier for one attempt."""

    def __init__(self, env: contract.TrainerEnvironment, log: Callable[[dict[str, Any]], None],
                 timeout_seconds: float | None = None,
                 budget: stagingbudget.DeviceBudget | None = None) -> None:
        """`budget`: the bucket save's staging budget, which snapshots share (None: never
        stage; memory_tier.take_snapshot)."""
        import jax

        assert env.memory_tier_dir is not None and env.memory_tier_interval is not None
        self.env = env
        self.log = log
        self.rank = jax.process_index()
        self.count = jax.process_count()
        self.interval = env.memory_tier_interval
        self.replicas = min(env.memory_tier_replicas, self.count - 1)
        self.timeout = timeout_seconds or env.init_timeout_seconds
        self.budget = budget if budget is not None else stagingbudget.DeviceBudget(0)
        if self.replicas > 0:
            secret = memory_tier.check_key((env.replica_key or "").encode(),
                                           contract.ENV_REPLICA_KEY)
        else:  # nothing leaves the pod: the seal only ties a manifest to its job
            secret = (env.replica_key or
                      f"tardigrade-memory-tier/{env.job_uid}/{env.job_name}").encode()
        self.seal_key, self.token = memory_tier.derived_keys(secret)
        self.store = memory_tier.MemoryStore(env.memory_tier_dir, self.seal_key)
        self.lineage = LEGACY_LINEAGE
        self.selection: memory_tier.Selection | None = None
        self.restored_from = ""  # memory (its own), peer, or resharded
        self._executor = concurrent.futures.ThreadPoolExecutor(
            1, "memory-tier", initializer=replica_server.lower_priority)
        self.workers = commit_workers()
        self._pool = concurrent.futures.ThreadPoolExecutor(
            self.workers, "memory-tier-commit", initializer=replica_server.lower_priority)
        self._pending: concurrent.futures.Future[None] | None = None
        self._pending_step = -1
        self._pending_since = 0.0
        self.skipped: list[int] = []  # the memory steps skipped, the previous commit running
        self._skips_in_a_row = 0  # the same on every rank: from the gang's gathered flags
        self._server: replica_server.ReplicaServer | None = None
        self.peers: list[str] = []
        self._newest: int | None = None  # this rank's newest snapshot written and sent
        # One id for this launch of the gang, process 0's, on every rank (memory_tier.Manifest).
        gang = coordination.current()
        own_launch = secrets.token_hex(8)
        self.launch = own_launch if gang is None else gang.from_root(
            f"tardigrade-memory-launch-{env.attempt}", own_launch, self.timeout)
        if self.replicas > 0:
            host = os.environ.get(contract.ENV_POD_IP) or "127.0.0.1"
            self._server = replica_server.ReplicaServer(
                self.store, self.token, host, env.replica_port, MAX_SNAPSHOT_BYTES).start()
            address = f"[{host}]:{self._server.port}" if ":" in host else \
                f"{host}:{self._server.port}"
            self.peers = self._everyones("peers", address)

    def _everyones(self, what: str, value: str) -> list[str]:
        """Every rank's `value`, on every rank (two O(N) calls on the coordination service)."""
        gang = coordination.current()
        if gang is None:
            return [value]
        name = f"tardigrade-memory-{what}-{self.env.attempt}"
        gathered = gang.gather_to_root(name, value, self.timeout)
        text = gang.from_root(f"{name}/all", json.dumps(gathered) if gathered else None,
                              self.timeout)
        return [str(v) for v in json.loads(text)]

    # --- saving -------------------------------------------------------------------------------
    def due(self, step: int) -> bool:
        return step % self.interval == 0

    def prepare(self, state: Any) -> None:
        """Once a step has run: compile the staged copy's program for `state`'s layout in the
        background (staging.prepare), so that the first snapshot need not copy the slower
        way. Nothing to do on the CPU or with staging off."""
        if self.budget.limit_bytes != 0:
            memory_tier.prepare(state, self.budget)

    def snapshot(self, step: int, state: Any, extra: Mapping[str, Any],
                 mesh: Mapping[str, int] | None) -> float:
        """Start this rank's snapshot of `step`; the seconds the loop was blocked (the copy
        off the devices: to spare device memory within the staging budget, to the host for
        the rest).

        One snapshot is in flight at most. When the previous one's commit (read, digest,
        write, send) is still running on some rank, the whole gang skips this step's
        snapshot (`memory_snapshot_skipped`) and the loop does not wait; after
        MAX_SKIPS_IN_A_ROW skips in a row, or when the job asks to wait
        (`TARDIGRADE_MEMORY_TIER_WHEN_BUSY=wait`), the loop waits for the commit instead.
        Every rank skips the same steps (in a gang, the ranks' flags are gathered): a step
        snapshotted on some ranks only would be a torn step, never restored, whose commits
        would push the last whole one out of the peers' memories."""
        from tardigrade_checkpoint import staging

        started = time.perf_counter()
        if (self.env.memory_tier_when_busy == contract.MEMORY_TIER_SKIP
                and self._skips_in_a_row < MAX_SKIPS_IN_A_ROW):
            busy = self._busy_ranks()
            if busy:
                self.skipped.append(step)
                self._skips_in_a_row += 1
                self.log({"event": "memory_snapshot_skipped", "step": step,
                          "reason": "previous snapshot's commit still running",
                          "skips_in_a_row": self._skips_in_a_row,
                          "previous_step": self._pending_step, "busy_ranks": busy,
                          "commit_running_s": round(started - self._pending_since, 6)
                          if self._pending_step >= 0 else None,
                          "blocked_s": round(time.perf_counter() - started, 6)})
                return time.perf_counter() - started
        self._skips_in_a_row = 0
        waited = self._pending is not None and not self._pending.done()
        self.wait()  # the previous commit, which has read (and freed) its staged copies
        report = staging.StagingReport()
        snapshot = memory_tier.take_snapshot(state, self.budget, report)
        blocked = time.perf_counter() - started
        self.log({"event": "memory_snapshot_started", "step": step,
                  "blocked_s": round(blocked, 6), "waited_for_previous": waited,
                  "bytes": snapshot.nbytes,
                  "staged_bytes": report.staged_bytes,
                  "staging_budget_bytes": report.budget_bytes,
                  "staging_budget": self.budget.source})
        if report.failed_bytes:
            self.log({"event": "memory_snapshot_staging_failed", "level": "warning",
                      "step": step, "failed_bytes": report.failed_bytes,
                      "error": "; ".join(report.errors)})
        self._pending_step, self._pending_since = step, time.perf_counter()
        self._pending = self._executor.submit(self._commit, step, snapshot, dict(extra),
                                              dict(mesh or {}))
        return blocked

    def _busy_ranks(self) -> list[int]:
        """The ranks whose previous snapshot is still being committed (on every rank, the
        same list: a gang gathers its ranks' flags, a small collective at memory steps
        only)."""
        mine = self._pending is not None and not self._pending.done()
        if self.count == 1:
            return [self.rank] if mine else []
        import numpy as np
        from jax.experimental import multihost_utils

        flags = np.asarray(multihost_utils.process_allgather(np.int32(mine))).reshape(-1)
        return [rank for rank, flag in enumerate(flags.tolist()) if flag]

    def _commit(self, step: int, snapshot: memory_tier.Snapshot, extra: dict[str, Any],
                mesh: dict[str, int]) -> None:
        started = time.perf_counter()
        try:
            # Each piece is digested and written as soon as the device reader has brought it
            # to the host, on the commit's threads; the manifest last (memory_tier.commit).
            sealed, buffers, times = memory_tier.commit(
                self.store, snapshot, self._pool, self.workers, step=step,
                attempt=self.env.attempt, owner=self.rank, process_count=self.count,
                lineage=self.lineage, job_uid=self.env.job_uid, extra=extra, mesh=mesh,
                launch=self.launch)
            written = time.perf_counter()
            sent = []
            for holder in memory_tier.holders(self.rank, self.count, self.replicas):
                replica_server.send(self.peers[holder], self.token, sealed, list(buffers),
                                    self.rank, step)
                sent.append(holder)
        except (memory_tier.MemoryTierError, OSError) as err:
            # The bucket is untouched and older memory snapshots stay: training goes on.
            self.log({"event": "memory_snapshot_failed", "level": "warning", "step": step,
                      "error": str(err)})
            return
        finally:
            snapshot.release()  # device memory of pieces never read (a failed commit)
        self._newest = step
        self.log({"event": "memory_snapshot_committed", "step": step,
                  "bytes": sum(int(b.nbytes) for b in buffers), "replicas": sent,
                  "write_s": round(written - started, 6),
                  "send_s": round(time.perf_counter() - written, 6),
                  "phases": times.to_json(),
                  "seconds": round(time.perf_counter() - started, 6)})

    def newest_step(self) -> int | None:
        """This rank's newest snapshot of this attempt written and sent to its holders."""
        return self._newest

    def wait(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._executor.shutdown(wait=True)
            self._pool.shutdown(wait=True)
            self.stop_serving()

    def stop_serving(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None

    # --- the restore decision -----------------------------------------------------------------
    def choose(self, bucket_step: int, lineage: str | None) -> int:
        """Every rank: the memory step the gang restores (-1: none newer than the bucket's
        `bucket_step`, which it may equal: memory is read faster). `lineage`: the root's
        current line, which a snapshot must belong to."""
        self.lineage = LEGACY_LINEAGE if lineage is None else lineage
        held = self.store.inventory()
        if self.env.restore_step == contract.RESTORE_NONE:
            held = []
        listed = json.dumps([h.to_json() for h in held])
        gang = coordination.current()
        if gang is None:
            selection = memory_tier.select({0: held}, self.lineage, bucket_step)
        else:
            name = f"tardigrade-memory-held-{self.env.attempt}"
            gathered = gang.gather_to_root(name, listed, self.timeout)
            chosen = None
            if gathered is not None:
                inventories = {rank: [memory_tier.Held.from_json(item)
                                      for item in json.loads(text)]
                               for rank, text in enumerate(gathered)}
                found = memory_tier.select(inventories, self.lineage, bucket_step)
                chosen = found.to_json() if found is not None else ""
            selection = memory_tier.Selection.from_json(
                gang.from_root(f"{name}/chosen", chosen, self.timeout))
        self.selection = selection
        self.log({"event": "memory_tier_decision", "bucket_step": bucket_step,
                  "held": sorted({(h.owner, h.step) for h in held}),
                  "step": selection.step if selection else None,
                  "sources": list(selection.sources) if selection else None,
                  "saved_process_count": selection.process_count if selection else None})
        return selection.step if selection is not None else -1

    def restore(self, target: Any) -> tuple[Any, int] | None:
        """Every rank: (state, first step to train) from the chosen snapshot, or None when
        some rank could not read its pieces (then every rank restores from the bucket)."""
        selection = self.selection
        assert selection is not None
        started = time.perf_counter()
        resharded = selection.process_count != self.count
        holder = -1 if resharded else selection.sources[self.rank]
        state, why, manifest, owners = None, "", None, [self.rank]
        try:
            if resharded:
                parts = self._resharded_parts(selection, target)
                owners = [m.owner for m, _ in parts]
            else:
                parts = [self._pieces(selection, self.rank)]
            manifest = parts[0][0]
            state = memory_tier.assemble(parts, target)
        except memory_tier.MemoryTierError as err:
            why = f"rank {self.rank}: {err}"
        verdict = self._gang_verdict(why)
        if verdict:
            self.log({"event": "memory_tier_fallback", "step": selection.step,
                      "reason": verdict})
            return None
        assert manifest is not None
        self.restored_from = ("memory" if holder == self.rank else
                              "resharded" if resharded else "peer")
        self.log({"event": "memory_tier_restored", "step": selection.step,
                  "source": self.restored_from,
                  "holder": holder, "owners": owners,
                  "saved_process_count": selection.process_count,
                  "seconds": round(time.perf_counter() - started, 3)})
        return state, int(manifest.extra.get("data_position", selection.step + 1))

    def _pieces(self, selection: memory_tier.Selection, owner: int
                ) -> tuple[memory_tier.Manifest, bytes]:
        """`owner`'s snapshot of the chosen step, from this rank's memory or the peer that
        holds it, its seal and every piece checked."""
        holder = selection.sources[owner]
        if holder == self.rank:
            manifest, data = self.store.load(owner, selection.step)
        else:
            sealed, data = replica_server.fetch(self.peers[holder], self.token, owner,
                                                selection.step, MAX_SNAPSHOT_BYTES)
            manifest = self._checked(sealed, selection, owner, holder)
            memory_tier.check_data(manifest, data)
            if owner == self.rank and selection.process_count == self.count:
                # This rank's memory holds its own snapshot again (a new pod's is empty).
                self.store.write(sealed, [data])
        self._check_identity(manifest, selection, holder)
        return manifest, data

    def _checked(self, sealed: bytes, selection: memory_tier.Selection, owner: int,
                 holder: int) -> memory_tier.Manifest:
        manifest = memory_tier.unseal(self.seal_key, sealed)
        if (manifest.owner, manifest.step) != (owner, selection.step):
            raise memory_tier.MemoryTierError(
                f"peer {holder} answered owner {manifest.owner} step {manifest.step}")
        return manifest

    def _check_identity(self, manifest: memory_tier.Manifest,
                        selection: memory_tier.Selection, holder: int) -> None:
        if (manifest.attempt, manifest.launch, manifest.process_count, manifest.lineage) != (
                selection.attempt, selection.launch, selection.process_count, self.lineage):
            raise memory_tier.MemoryTierError(
                f"step {selection.step} from rank {holder} was written by attempt "
                f"{manifest.attempt} (launch {manifest.launch}) of {manifest.process_count} "
                f"processes on line {manifest.lineage!r}, not the one chosen")

    def _resharded_parts(self, selection: memory_tier.Selection, target: Any
                         ) -> list[tuple[memory_tier.Manifest, bytes]]:
        """A snapshot of a gang of another size: every owner's manifest, then the pieces of
        the owners whose regions overlap what this rank restores."""
        manifests = {}
        for owner, holder in enumerate(selection.sources):
            if holder == self.rank:
                sealed = self.store.read_manifest(owner, selection.step)
            else:
                sealed, _ = replica_server.fetch(self.peers[holder], self.token, owner,
                                                 selection.step, MAX_SNAPSHOT_BYTES,
                                                 manifest_only=True)
            manifests[owner] = self._checked(sealed, selection, owner, holder)
            self._check_identity(manifests[owner], selection, holder)
        needed = memory_tier.owners_needed(
            manifests, memory_tier.wanted_regions(target),
            prefer=[o for o, holder in enumerate(selection.sources) if holder == self.rank])
        return [self._pieces(selection, owner) for owner in needed]

    def _gang_verdict(self, why: str) -> str:
        """'' when every rank read its pieces, else the first rank's reason (on every rank)."""
        gang = coordination.current()
        if gang is None:
            return why
        name = f"tardigrade-memory-restored-{self.env.attempt}"
        gathered = gang.gather_to_root(name, why, self.timeout)
        first = next((w for w in gathered or [] if w), "")
        return gang.from_root(f"{name}/verdict", first, self.timeout)
