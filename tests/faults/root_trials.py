"""Seeded trials of the checkpoint root rules (issue 14, points 1-3, fencing by attempt).

Each trial drives the real checkpoint manager and the real restore decision in process (one
CPU device, tiny arrays) through one ordinary-use story with random sizes and timings, keeps a
reference model of which weights each committed step of the current line must hold, and
counts two failures:
- stranded: a launch that should have resumed (a committed step at or after the operator's
  pin exists on the current line) but refused to start;
- wrong weights: a launch that restored weights other than the newest of the current line
  (or of the initFrom source), or a stale gang whose commit became visible.
A refusal the rules require (another job's root, a fenced-off gang) is checked too: if it
does not happen, that is a problem, not a pass.
"""

from __future__ import annotations

import dataclasses
import random
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec
from tardigrade_checkpoint import (
    CheckpointError,
    CheckpointManager,
    FencedError,
    ForeignRootError,
    JobIdentity,
    KeepLast,
)
from tardigrade_contract import contract
from tardigrade_sdk import restore_choice


@dataclasses.dataclass
class RootTrialResult:
    kind: str
    launches: int = 0
    stranded: int = 0
    wrong_weights: int = 0
    refusals_checked: int = 0
    problems: list[str] = dataclasses.field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not (self.stranded or self.wrong_weights or self.problems)


def _sharding() -> NamedSharding:
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    return NamedSharding(mesh, PartitionSpec())


def _state(value: float) -> dict[str, jax.Array]:
    return {"w": jax.device_put(np.full((4,), value, np.float32), _sharding())}


TARGET = {"w": jax.ShapeDtypeStruct((4,), np.float32, sharding=_sharding())}


class Job:
    """One TrainingJob's gangs on one root, as the operator would launch them."""

    def __init__(self, root: Path, result: RootTrialResult, *, name: str = "job",
                 uid: str = "uid-1", keep: int = 3, init_from: Path | None = None) -> None:
        self.root, self.result, self.name, self.uid, self.keep = root, result, name, uid, keep
        self.init_from = init_from
        self.attempt = 0
        self.pin: int | None = None  # what the operator saw committed last
        self.rollback: tuple[int, str] | None = None
        self.manager: CheckpointManager | None = None

    def launch(self, expect: float | None) -> CheckpointManager | None:
        """Start the next attempt; check it restores weights `expect` (None: from scratch)."""
        if self.manager is not None:
            self.manager.close()
        self.attempt += 1
        self.result.launches += 1
        env = contract.TrainerEnvironment(
            job_name=self.name, namespace="ns", attempt=self.attempt,
            coordinator_address="127.0.0.1:1", num_processes=1, process_id=0,
            checkpoint_path=str(self.root),
            restore_step=contract.RESTORE_LATEST if self.pin is None else str(self.pin),
            job_uid=self.uid,
            rollback_step=self.rollback[0] if self.rollback else None,
            rollback_request=self.rollback[1] if self.rollback else None,
            init_from_path=str(self.init_from) if self.init_from else None)
        manager = CheckpointManager(str(self.root), keep=KeepLast(self.keep))
        try:
            choice = restore_choice.choose(env, manager)
        except CheckpointError as err:
            manager.close()
            if expect is not None:
                self.result.stranded += 1
                self.result.problems.append(f"attempt {self.attempt} stranded: {err}")
            else:
                self.result.problems.append(f"attempt {self.attempt} refused: {err}")
            return None
        got = None
        if choice.restores:
            source = (manager if choice.source == restore_choice.OWN_ROOT
                      else CheckpointManager(str(self.init_from)))
            restored, _ = source.restore(choice.step, TARGET)
            if source is not manager:
                source.close()
            got = float(np.asarray(restored["w"])[0])
            self.pin = choice.step  # the trainer reports what it restored
        if got != (None if expect is None else float(np.float32(expect))):
            self.result.wrong_weights += 1
            self.result.problems.append(
                f"attempt {self.attempt} restored {got} (step {choice.step}), expected {expect}")
        self.manager = manager
        return manager

    def commit(self, step: int, value: float, seen: bool = True) -> None:
        assert self.manager is not None
        self.manager.save(step, _state(value))
        self.manager.wait()
        if seen:  # the operator's progress poll caught it
            self.pin = step

    def close(self) -> None:
        if self.manager is not None:
            self.manager.close()
            self.manager = None


def _expect_refusal(result: RootTrialResult, what: str, error: type[Exception],
                    action: Callable[[], object]) -> None:
    try:
        action()
    except error:
        result.refusals_checked += 1
        return
    result.problems.append(f"{what} was not refused")


def pin_deleted(root: Path, rng: random.Random, result: RootTrialResult) -> None:
    """keep.last 1-2 and several commits between two progress polls: the pin is deleted."""
    job = Job(root, result, keep=rng.randint(1, 2))
    job.launch(None)
    step, values = 0, {}
    for _ in range(rng.randint(2, 4)):
        for poll in range(rng.randint(1, 4)):  # commits between polls: the last one is seen
            step += rng.randint(1, 20)
            values[step] = rng.random()
            job.commit(step, values[step], seen=poll == 0)
        job.launch(values[step])  # a plain preemption
    job.close()


def rollback(root: Path, rng: random.Random, result: RootTrialResult) -> None:
    """Restore an older step on purpose, then train a new line over the old step numbers."""
    job = Job(root, result, keep=10)
    job.launch(None)
    steps = sorted(rng.sample(range(1, 60), rng.randint(3, 6)))
    line = {s: rng.random() for s in steps}
    for s in steps:
        job.commit(s, line[s])
    back = rng.choice(steps[:-1])
    job.rollback = (back, f"attempt-{job.attempt + 1}")
    job.pin = back  # the operator resets its pin to the requested step
    job.launch(line[back])
    line = {s: v for s, v in line.items() if s <= back}
    for s in sorted(rng.sample(range(back + 1, back + 60), rng.randint(1, 4))):
        line[s] = -rng.random()
        job.commit(s, line[s])
        if rng.random() < 0.5:
            job.launch(line[max(line)])  # preempted on the new line; the request is not re-run
    job.launch(line[max(line)])
    job.close()


def recreate(root: Path, rng: random.Random, result: RootTrialResult) -> None:
    """Delete and re-apply the job (new uid, attempts from 1) while an old gang still runs."""
    old = Job(root, result, uid="uid-old")
    old.attempt = rng.randint(1, 9)
    old.launch(None)
    value = rng.random()
    old.commit(10, value)
    new = Job(root, result, uid="uid-new")
    new.launch(value)
    _expect_refusal(result, "a commit of the deleted job's gang", FencedError,
                    lambda: old.commit(20, rng.random()))
    new.commit(20, -value)
    new.launch(-value)
    new.close()
    old.close()


def foreign(root: Path, rng: random.Random, result: RootTrialResult) -> None:
    """Another job on the same root is refused; with initFrom it starts from it, read only."""
    owner = Job(root, result)
    owner.launch(None)
    value = rng.random()
    owner.commit(rng.randint(1, 50), value)
    owner.close()
    before = {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}
    intruder = CheckpointManager(str(root))
    _expect_refusal(result, "another job on the root", ForeignRootError,
                    lambda: intruder.open_root(JobIdentity("ns", "other", "uid-9"), 1))
    intruder.close()
    other = Job(root.parent / f"{root.name}-other", result, name="other", uid="uid-9",
                init_from=root)
    other.launch(value)
    other.commit(100, -value)
    other.launch(-value)  # its own line now, not the source
    other.close()
    after = {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}
    if after != before:
        result.problems.append("initFrom changed the source root")
    shutil.rmtree(other.root, ignore_errors=True)


def stale_attempt(root: Path, rng: random.Random, result: RootTrialResult) -> None:
    """A gang cut off by a partition keeps training after the operator relaunched."""
    job = Job(root, result)
    stale = job.launch(None)
    value = rng.random()
    job.commit(10, value)
    job.manager = None  # the operator lost sight of it; it keeps running
    job.launch(value)
    assert stale is not None
    stale.save(20, _state(-1.0))
    _expect_refusal(result, "a commit of the stale attempt", FencedError, stale.wait)
    stale.close()
    job.commit(20, -value)
    job.launch(-value)
    job.close()


KINDS = {"pin deleted by keep policy": pin_deleted, "rollback": rollback,
         "re-created job": recreate, "foreign root / initFrom": foreign,
         "stale attempt": stale_attempt}


def run(workdir: Path, seed: int, trials: int) -> list[RootTrialResult]:
    rng = random.Random(seed)
    results = []
    for number in range(trials):
        kind = list(KINDS)[number % len(KINDS)]
        result = RootTrialResult(kind)
        root = workdir / f"root{number}"
        started = time.perf_counter()
        try:
            KINDS[kind](root, rng, result)
        except Exception as err:  # a crash of the trial is a finding, not a bench error
            result.problems.append(f"{type(err).__name__}: {err}")
        result.seconds = time.perf_counter() - started
        shutil.rmtree(root, ignore_errors=True)
        results.append(result)
    return results
