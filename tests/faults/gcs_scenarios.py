"""Checkpoint saves and restores against a GCS emulator that fails or stalls on purpose.

Each scenario drives a `CheckpointManager` on gs:// through a `FaultProxy`, checks what must
hold (raising AssertionError otherwise) and returns one summary row. The pytest module and
`bench/faults_trainer.py` run the same scenarios.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from tardigrade_checkpoint import CheckpointIOError, CheckpointManager, JobIdentity
from tardigrade_checkpoint.rootrecord import ROOT_FILE
from tardigrade_checkpoint.storage import (
    ENV_LOW_SPEED_LIMIT,
    ENV_LOW_SPEED_TIME,
    StorageRetries,
)
from tardigrade_contract import contract
from tardigrade_local.gcs import GcsEmulator, client_env
from tardigrade_local.gcs_faults import FaultProxy, FaultRule

from tests.polling import wait_for

BUCKET = "tardigrade-faults"
# Small bounds so that a persistent fault fails in seconds; a request may fail 4 times.
RETRIES = StorageRetries(max_retries=4, initial_delay_seconds=0.05, max_delay_seconds=0.4,
                         stall_seconds=1)
SLACK_SECONDS = 20.0  # a loaded 2-core machine: process scheduling, emulator latency


@dataclasses.dataclass
class Outcome:
    scenario: str
    faults: str  # what was injected, counted by the proxy
    result: str  # what the manager did
    seconds: float


@contextlib.contextmanager
def faulty_gcs(seed: int = 0) -> Iterator[FaultProxy]:
    """An emulator, a proxy in front of it, and this process's TensorStore pointed at it."""
    keys = [*client_env("http://x"), ENV_LOW_SPEED_TIME, ENV_LOW_SPEED_LIMIT]
    saved = {k: os.environ.get(k) for k in keys}
    with GcsEmulator() as gcs, FaultProxy(gcs.url, seed=seed) as proxy:
        gcs.create_bucket(BUCKET)
        os.environ.update(client_env(proxy.url))
        os.environ[ENV_LOW_SPEED_TIME] = str(RETRIES.stall_seconds)
        os.environ[ENV_LOW_SPEED_LIMIT] = str(RETRIES.stall_bytes_per_second)
        try:
            yield proxy
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


def _state(seed: int) -> dict[str, jax.Array]:
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    rng = np.random.default_rng(seed)
    return {
        "w": jax.device_put(rng.standard_normal((64, 32)).astype(np.float32),
                            NamedSharding(mesh, PartitionSpec("data"))),
        "b": jax.device_put(rng.standard_normal((32,)).astype(np.float32),
                            NamedSharding(mesh, PartitionSpec())),
        "count": jax.device_put(np.int32(seed), NamedSharding(mesh, PartitionSpec())),
    }


def _target(state: dict[str, jax.Array]) -> dict[str, jax.ShapeDtypeStruct]:
    return {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding)
            for k, v in state.items()}


def _same(a: dict[str, jax.Array], b: dict[str, jax.Array]) -> bool:
    return all(np.array_equal(np.asarray(a[k]), np.asarray(b[k])) for k in a)


def _check(condition: object, message: str) -> None:
    if not condition:
        raise AssertionError(message)


class Scenarios:
    """One manager per scenario, each under its own prefix of one bucket."""

    def __init__(self, proxy: FaultProxy) -> None:
        self.proxy = proxy
        self.events: list[dict[str, Any]] = []

    def _manager(self, name: str, retries: StorageRetries = RETRIES) -> CheckpointManager:
        self.events = []
        return CheckpointManager(f"gs://{BUCKET}/{name}", storage=retries,
                                 on_event=self.events.append)

    def _faults(self) -> str:
        return _faults(self.proxy)

    def _run(self, name: str, body: Callable[[], str]) -> Outcome:
        self.proxy.clear()
        self.proxy.injected.clear()
        self.proxy.statuses.clear()
        started = time.monotonic()
        try:
            result = body()
        finally:
            self.proxy.clear()
        return Outcome(name, self._faults(), result, round(time.monotonic() - started, 1))

    def _committed_then(self, manager: CheckpointManager, step: int) -> dict[str, jax.Array]:
        state = _state(step)
        manager.save(step, state)
        manager.wait()
        return state

    def _fails_within_bound(self, manager: CheckpointManager, step: int) -> float:
        started = time.monotonic()
        manager.save(step, _state(step))
        try:
            manager.wait()
        except CheckpointIOError:
            seconds = time.monotonic() - started
            # Opening the arrays, writing and committing are at most a few rounds of requests.
            bound = 4 * RETRIES.request_bound_seconds() + SLACK_SECONDS
            _check(seconds <= bound, f"the failed save took {seconds:.1f}s > {bound:.1f}s")
            _check(any(e["event"] == "checkpoint_failed" and e["step"] == step
                       for e in self.events), "no checkpoint_failed event")
            return seconds
        raise AssertionError(f"save {step} committed through persistent faults")

    def _intact(self, manager: CheckpointManager, committed: int, state: dict[str, jax.Array],
                failed: int) -> None:
        steps, _ = manager.list_steps()
        _check(steps[-1] == committed, f"newest commit is {steps}, want {committed}")
        _check(failed not in steps, f"failed step {failed} is marked committed")
        checked, mismatches = manager.verify(committed)
        _check(checked > 0 and not mismatches, f"step {committed}: {mismatches}")
        restored, _ = manager.restore(committed, _target(state))
        _check(_same(restored, state), f"step {committed} restored different values")

    # --- saves --------------------------------------------------------------------------------
    def transient_write_errors(self) -> Outcome:
        def body() -> str:
            manager = self._manager("transient-writes")
            self.proxy.set_rules([FaultRule("write", status=503, count=2),
                                  FaultRule("write", status=429, count=2)])
            state = self._committed_then(manager, 10)
            _check(sum(self.proxy.injected.values()) == 4, "the faults were not all injected")
            self._intact(manager, 10, state, failed=-1)
            manager.close()
            return "retried; committed and verified"
        return self._run("write 503/429, 4 requests", body)

    def random_write_errors(self) -> Outcome:
        def body() -> str:
            # 8 retries: a request fails for good with probability 0.2^9 = 5e-7.
            manager = self._manager("random-writes", dataclasses.replace(RETRIES,
                                                                         max_retries=8))
            self.proxy.set_rules([FaultRule("any", status=503, fraction=0.2)])
            state = self._committed_then(manager, 10)
            self._intact(manager, 10, state, failed=-1)
            manager.close()
            return "retried; committed, restored and verified"
        return self._run("20% of all requests 503", body)

    def _persistent_save_fault(self, name: str, rule: FaultRule) -> Outcome:
        def body() -> str:
            manager = self._manager(name)
            state = self._committed_then(manager, 10)
            self.proxy.set_rules([rule])
            seconds = self._fails_within_bound(manager, 20)
            self.proxy.clear()
            self._intact(manager, 10, state, failed=20)
            # The next save point commits, and the failed save's leftovers are collected.
            newer = self._committed_then(manager, 30)
            steps, partial = manager.list_steps()
            _check(steps == [10, 30] and partial == [], f"after recovery: {steps}, {partial}")
            self._intact(manager, 30, newer, failed=20)
            manager.close()
            return (f"failed in {seconds:.1f}s (CheckpointIOError), not committed; "
                    "step 10 intact; next save committed, partial removed")
        return self._run(name, body)

    def persistent_write_errors(self) -> Outcome:
        return self._persistent_save_fault("writes 503 until healed",
                                           FaultRule("write", status=503))

    def stalled_writes(self) -> Outcome:
        return self._persistent_save_fault("writes stall until healed",
                                           FaultRule("write", action="stall"))

    def commit_marker_refused(self) -> Outcome:
        return self._persistent_save_fault(
            "commit marker write 500", FaultRule("write", status=500,
                                                 path_contains="metadata.json"))

    # --- restores -----------------------------------------------------------------------------
    def transient_read_errors(self) -> Outcome:
        def body() -> str:
            manager = self._manager("transient-reads")
            state = self._committed_then(manager, 10)
            self.proxy.set_rules([FaultRule("read", status=503, count=4)])
            restored, _ = manager.restore(10, _target(state))
            _check(_same(restored, state), "restored different values")
            _check(sum(self.proxy.injected.values()) == 4, "the faults were not all injected")
            manager.close()
            return "retried; restored and verified"
        return self._run("read 503, 4 requests", body)

    def _persistent_restore_fault(self, name: str, rule: FaultRule) -> Outcome:
        def body() -> str:
            manager = self._manager(name)
            state = self._committed_then(manager, 10)
            self.proxy.set_rules([rule])
            started = time.monotonic()
            try:
                manager.restore(10, _target(state))
            except CheckpointIOError:  # retryable, unlike CheckpointCorruptError
                seconds = time.monotonic() - started
            else:
                raise AssertionError("restore succeeded through persistent faults")
            bound = 4 * RETRIES.request_bound_seconds() + SLACK_SECONDS
            _check(seconds <= bound, f"the failed restore took {seconds:.1f}s > {bound:.1f}s")
            self.proxy.clear()
            self._intact(manager, 10, state, failed=-1)
            manager.close()
            return (f"failed in {seconds:.1f}s as CheckpointIOError (retryable, not corrupt); "
                    "restored after healing")
        return self._run(name, body)

    def persistent_read_errors(self) -> Outcome:
        # Only chunk reads fail: the commit marker reads, so this is the restore itself.
        return self._persistent_restore_fault("chunk reads 503 until healed",
                                              FaultRule("read", status=503, path_contains="/c/"))

    def stalled_reads(self) -> Outcome:
        return self._persistent_restore_fault("chunk reads stall until healed",
                                              FaultRule("read", action="stall",
                                                        path_contains="/c/"))

    # --- the root record ----------------------------------------------------------------------
    def root_record_answers_lost(self) -> Outcome:
        """The root record's writes land but their answers are lost; TensorStore retries and
        the emulator answers 412, as GCS does. Each write must count once: one claim, one new
        branch for one rollback, nothing committed lost."""
        def body() -> str:
            manager = self._manager("lost-answers")
            me = JobIdentity("ml", "faults", "uid-1")
            # Claiming the empty root (create-only): the connection closes once it landed.
            self.proxy.set_rules([FaultRule("write", action="lose", status=0, count=1,
                                            path_contains=ROOT_FILE)])
            claimed = manager.open_root(me, 1)
            ten = self._committed_then(manager, 10)
            self._committed_then(manager, 20)
            # A rollback to 10 (a new line): a 503 comes back after the record was written.
            self.proxy.set_rules([FaultRule("write", action="lose", status=503, count=1,
                                            path_contains=ROOT_FILE)])
            forked = manager.fork_root(10, "uid-1/a1")
            self.proxy.clear()
            _check(sum(self.proxy.injected.values()) == 2, f"injected {self.proxy.injected}")
            _check(self.proxy.statuses[412] == 2,
                   f"the retried writes were not refused: {self.proxy.statuses}")
            _check(set(claimed.branches) == {""}, f"claimed {claimed}")
            _check(set(forked.branches) == {"", forked.lineage},
                   f"the rollback made {len(forked.branches) - 1} branches: {forked.branches}")
            lines = [e["lineage"] for e in self.events if e["event"] == "checkpoint_line_started"]
            _check(lines == [forked.lineage], f"line events {lines} for {forked.lineage}")
            fresh = CheckpointManager(manager.root, storage=RETRIES)
            try:
                _check(fresh.root_record() == forked, f"stored {fresh.root_record()}")
            finally:
                fresh.close()
            _check(manager.latest_committed() == 10, f"latest {manager.latest_committed()}")
            thirty = self._committed_then(manager, 30)
            _check(manager.line_steps() == [10, 30], f"line {manager.line_steps()}")
            self._intact(manager, 30, thirty, failed=-1)
            restored, _ = manager.restore(10, _target(ten))
            _check(_same(restored, ten), "step 10 restored different values")
            manager.close()
            return ("each lost answer's retry refused 412 and recognised as the gang's own "
                    "write: one claim, one branch; line [10, 30] committed and verified")
        return self._run("root record writes land, answers lost", body)

    def all(self) -> list[Callable[[], Outcome]]:
        return [self.transient_write_errors, self.random_write_errors,
                self.persistent_write_errors, self.stalled_writes, self.commit_marker_refused,
                self.transient_read_errors, self.persistent_read_errors, self.stalled_reads,
                self.root_record_answers_lost]


def trainer_rides_out_an_outage(proxy: FaultProxy, workdir: Path, resume: bool) -> Outcome:
    """A real trainer: a failed save is reported and retried; a failed preemption save exits 74.

    With `resume`, a new trainer then restores the newest commit through transient read errors.
    """
    from tests.trainer.trainer_harness import free_port, launch

    started = time.monotonic()
    proxy.clear()
    proxy.injected.clear()
    url = f"gs://{BUCKET}/trainer"
    port = free_port()
    config = {"steps": 100000, "devices_per_process": 1, "checkpoint_storage_retries": 2,
              "checkpoint_storage_stall_seconds": 2}
    env = {**client_env(proxy.url), ENV_LOW_SPEED_TIME: "2"}
    gang = launch(workdir / "outage", processes=1, checkpoint_path=url, config=config,
                  interval_steps=3, keep_last=2, progress_port=port, extra_env=env)
    try:
        def event(name: str, after: int = 0) -> dict[str, Any] | None:
            found = [e for e in gang.events(name) if e["step"] > after]
            _check(gang.procs[0].poll() is None, f"trainer exited early:\n{gang.describe()}")
            return found[0] if found else None

        first = wait_for(lambda: event("checkpoint_committed"), 300, "a first commit")
        proxy.set_rules([FaultRule("write", status=503)])
        failed = wait_for(lambda: event("checkpoint_failed", first["step"]), 120,
                          "a failed save")["step"]
        wait_for(lambda: event("step", failed + 1), 120, "training to go on")
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            metrics = r.read().decode()
        _check("tardigrade_checkpoint_failures_total 1.0" in metrics
               or "tardigrade_checkpoint_failures_total 2.0" in metrics,
               "the failure counter is not exported")
        proxy.clear()
        recovered = wait_for(lambda: event("checkpoint_committed", failed), 120,
                             "the next save point to commit")["step"]
        proxy.set_rules([FaultRule("write", status=503)])
        gang.signal(signal.SIGTERM)
        codes = gang.wait(180)
    finally:
        gang.kill()
        proxy.clear()
    _check(codes == [contract.EXIT_CHECKPOINT_IO_ERROR], f"exit {codes} on SIGTERM:\n"
           + gang.describe())
    message = gang.termination(0)
    _check(message is not None and message.reason == "CheckpointIOError"
           and "preempted" in message.message, f"termination message {message}")
    manager = CheckpointManager(url, storage=RETRIES)
    try:
        steps, _ = manager.list_steps()
        _check(failed not in steps, f"failed step {failed} is committed")
        _check(message is not None and steps[-1] == message.checkpoint_step >= recovered,
               f"newest commit {steps} vs termination message {message}")
        checked, mismatches = manager.verify(steps[-1])
        _check(checked > 0 and not mismatches, f"{mismatches}")
    finally:
        manager.close()
    result = (f"save {failed} failed, logged + counted, training went on; save {recovered} "
              f"committed; failed preemption save exited {codes[0]} naming step {steps[-1]}")
    if resume:
        proxy.set_rules([FaultRule("read", status=503, count=2)])
        again = launch(workdir / "resume", processes=1, checkpoint_path=url, config=config,
                       interval_steps=3, keep_last=2, extra_env=env)
        try:
            restored = wait_for(lambda: again.events("checkpoint_restored") or (
                again.procs[0].poll() is not None), 300, "the restore")
            _check(restored is not True and restored[0]["step"] == steps[-1]
                   and restored[0]["regions_verified"] > 0,
                   f"restore {restored}:\n{again.describe()}")
            wait_for(lambda: any(e["step"] > steps[-1] for e in again.events("step")), 300,
                     "a step after the restore")
            again.signal(signal.SIGTERM)
            codes = again.wait(180)
        finally:
            again.kill()
            proxy.clear()
        _check(codes == [contract.EXIT_PREEMPTED_SAVED], f"exit {codes}:\n{again.describe()}")
        result += f"; resumed from {steps[-1]} through read errors, verified"
    return Outcome("trainer: writes 503, then preempted", _faults(proxy), result,
                   round(time.monotonic() - started, 1))


def gang_hears_of_a_refused_commit(proxy: FaultProxy, workdir: Path) -> Outcome:
    """2 ranks on gs://: storage refuses process 0's commit marker of the last step (500s
    until retries run out). Every rank must report it within seconds, as a storage error
    (exit 74, retryable) naming the last commit, which stays intact (issue 14, point 5)."""
    from tests.trainer.trainer_harness import launch

    started = time.monotonic()
    proxy.clear()
    proxy.injected.clear()
    url = f"gs://{BUCKET}/refused-commit"
    config = {"steps": 12, "devices_per_process": 1, "checkpoint_storage_retries": 2,
              "checkpoint_storage_stall_seconds": 2}
    proxy.set_rules([FaultRule("write", status=500,
                               path_contains="refused-commit/step_00000012/metadata.json")])
    gang = launch(workdir / "refused-commit", processes=2, checkpoint_path=url, config=config,
                  interval_steps=6, extra_env={**client_env(proxy.url), ENV_LOW_SPEED_TIME: "2"})
    try:
        codes = gang.wait(300)
    finally:
        gang.kill()
        proxy.clear()
    want = contract.EXIT_CHECKPOINT_IO_ERROR
    _check(codes == [want, want], f"exit {codes}, want [{want}, {want}]:\n{gang.describe()}")
    failed = [gang.events("checkpoint_failed", rank) for rank in (0, 1)]
    _check(all(f and f[0]["step"] == 12 for f in failed), f"checkpoint_failed events {failed}")
    lag = failed[1][0]["time"] - failed[0][0]["time"]
    _check(lag < 5, f"rank 1 heard of rank 0's failure {lag:.1f}s later")
    _check("process 0" in failed[1][0]["error"], f"rank 1 says {failed[1][0]['error']}")
    for rank in (0, 1):
        message = gang.termination(rank)
        _check(message is not None and message.reason == "CheckpointIOError"
               and message.checkpoint_step == 6, f"rank {rank} termination message {message}")
    manager = CheckpointManager(url, storage=RETRIES)
    try:
        steps, _ = manager.list_steps()
        _check(steps == [6], f"committed {steps}, want [6]")
        checked, mismatches = manager.verify(6)
        _check(checked > 0 and not mismatches, f"{mismatches}")
    finally:
        manager.close()
    return Outcome("2 ranks: commit marker of the last step refused", _faults(proxy),
                   f"both ranks exit {want} (retryable), rank 1 {lag:.1f}s after rank 0, "
                   "naming process 0's error; step 6 intact", round(time.monotonic() - started, 1))


def gang_rolls_back_through_lost_answers(proxy: FaultProxy, workdir: Path) -> Outcome:
    """2 ranks on gs://: a relaunch with a rollback, every root record write of which lands
    but loses its answer (the connection closes). TensorStore retries each, the emulator
    answers 412; the gang must take each for its own write: one new branch, the rollback step
    restored, the new line committed, nothing lost."""
    from tests.trainer.trainer_harness import launch

    started = time.monotonic()
    proxy.clear()
    proxy.injected.clear()
    proxy.statuses.clear()
    url = f"gs://{BUCKET}/rollback-lost"
    config = {"steps": 9, "devices_per_process": 1}
    env = {**client_env(proxy.url), ENV_LOW_SPEED_TIME: "2"}
    first = launch(workdir / "rollback-first", processes=2, checkpoint_path=url, config=config,
                   interval_steps=3, extra_env=env)
    try:
        codes = first.wait(300)
    finally:
        first.kill()
    _check(codes == [0, 0], f"first gang exit {codes}:\n{first.describe()}")
    proxy.set_rules([FaultRule("write", action="lose", status=0, once_per_request=True,
                               path_contains=f"rollback-lost/{ROOT_FILE}")])
    again = launch(workdir / "rollback-again", processes=2, checkpoint_path=url,
                   config={**config, "steps": 12}, interval_steps=3,
                   extra_env={**env, contract.ENV_ATTEMPT: "1", contract.ENV_ROLLBACK_STEP: "3",
                              contract.ENV_ROLLBACK_REQUEST: "rollback-1"})
    try:
        codes = again.wait(300)
    finally:
        again.kill()
        proxy.clear()
    _check(codes == [0, 0], f"rollback gang exit {codes}:\n{again.describe()}")
    lost = sum(proxy.injected.values())
    _check(lost == 2, f"{proxy.injected}: want the claim's and the fork's answers lost")
    _check(proxy.statuses[412] == lost, f"retries not refused: {proxy.statuses}")
    restored = again.events("checkpoint_restored")
    _check([e["step"] for e in restored] == [3], f"restored {restored}")
    started_lines = [e["lineage"] for e in again.events("checkpoint_line_started")]
    manager = CheckpointManager(url, storage=RETRIES)
    try:
        record = manager.root_record()
        _check(record is not None and set(record.branches) == {"", record.lineage}
               and record.branches[record.lineage].request == "rollback-1",
               f"root record after the rollback: {record}")
        assert record is not None
        _check(started_lines == [record.lineage], f"line events {started_lines}")
        line = manager.line_steps()
        _check(line and line[-1] == 12 and all(
            manager.read_info(s).lineage == record.lineage for s in line if s > 3),
            f"current line {line}")
        checked, mismatches = manager.verify(12)
        _check(checked > 0 and not mismatches, f"{mismatches}")
    finally:
        manager.close()
    return Outcome("2 ranks: rollback, root record answers lost", _faults(proxy),
                   f"retries refused 412 ({lost}) and taken as own writes: one new branch, "
                   f"restored 3, line {line} committed and verified",
                   round(time.monotonic() - started, 1))


def _faults(proxy: FaultProxy) -> str:
    return ", ".join(f"{n} x {k}" for k, n in sorted(proxy.injected.items())) or "none"


def main(argv: list[str]) -> int:
    """Run the named scenarios in this process and print one JSON row each.

    TensorStore reads the stall cut from the environment once per process, at its first HTTP
    request: in a test process that already spoke to a bucket with other settings, a stalled
    request would be cut after that process's stall (60 s by default), not this module's 1 s.
    The pytest module runs the scenarios through here, in a process of their own.
    """
    import json
    import sys

    names, seed = argv[:-1], int(argv[-1])
    failed = 0
    with faulty_gcs(seed=seed) as proxy:
        scenarios = Scenarios(proxy)
        for name in names:
            try:
                outcome = getattr(scenarios, name)()
            except AssertionError as err:
                failed += 1
                print(json.dumps({"name": name, "error": str(err)}), flush=True)
            else:
                print(json.dumps({"name": name, **dataclasses.asdict(outcome)}), flush=True)
    sys.stdout.flush()
    return 1 if failed else 0


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
