"""Kill trials: SIGKILL real trainer gangs at random moments, then audit every checkpoint.

A campaign is one training run on one checkpoint root, restarted after every kill as the
operator would (restore "latest"). Each trial draws a kill from a seeded generator:

* hook:     SIGKILL at a named point of a save (checkpoint/faults.py: save_start ...
            after_gc, injected by tests/trainer/faulty_trainer.py);
* timer:    SIGKILL a random few milliseconds after a save started (inside its writes);
* anywhere: SIGKILL at a random moment: a random delay after launch (start-up, restore) or
            a random jitter after a random training step (training, saves, GC).

The victim is one rank or the whole gang; the rest of a broken gang is killed too. After
each trial the storage is audited offline and the next gang's restore is checked:
committed work is never lost (the newest commit never goes back), every committed
checkpoint reads back equal to the digests its saver recorded, a restore takes the newest
committed step and verifies it, and partial checkpoints are never restored and get removed.
"""

from __future__ import annotations

import dataclasses
import math
import random
import signal
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tardigrade_checkpoint import CheckpointManager
from tardigrade_checkpoint.digest import parse_region
from tardigrade_contract import contract

from tests.polling import wait_for
from tests.trainer.trainer_harness import Gang, launch

SAVE_POINTS = ("save_start", "after_prepare", "after_write", "before_commit", "after_commit",
               "after_gc")
ROOT_ONLY_POINTS = ("before_commit", "after_commit")  # only process 0 commits
GANG_TIMEOUT = 300.0


@dataclasses.dataclass(frozen=True)
class Kill:
    kind: str  # "hook", "timer" or "anywhere"
    victims: tuple[int, ...]
    step: int | None = None  # hook/timer: the save step; anywhere: kill after this step
    point: str | None = None  # hook: where in the save
    delay: float = 0.0  # timer: after save_start; anywhere: after launch or after `step`

    def describe(self) -> str:
        who = "all" if len(self.victims) > 1 else f"rank {self.victims[0]}"
        if self.kind == "hook":
            return f"{who} at {self.point} of save {self.step}"
        if self.kind == "timer":
            return f"{who} {self.delay * 1000:.0f} ms into save {self.step}"
        if self.step is None:
            return f"{who} {self.delay:.2f} s after launch"
        return f"{who} {self.delay:.2f} s after step {self.step}"

    def hooks(self) -> list[dict[str, Any]]:
        if self.kind == "hook":
            return [{"point": self.point, "step": self.step, "process": v, "action": "kill"}
                    for v in self.victims]
        if self.kind == "timer":
            return [{"point": "save_start", "step": self.step, "process": v,
                     "action": "kill_later", "delay": self.delay} for v in self.victims]
        return []


@dataclasses.dataclass
class TrialResult:
    kill: Kill
    expected_restore: int | None
    processes: int = 1
    expected_regions: int = 0  # digests recorded for the step that should be restored
    restored: int | None = None
    restore_regions: int = 0  # verified by the restoring trainer (rank 0)
    landed_in_save: bool = False
    committed: list[int] = dataclasses.field(default_factory=list)
    partial: list[int] = dataclasses.field(default_factory=list)
    partials_removed: int = 0
    checkpoints_verified: int = 0  # committed checkpoints read back and matched offline
    regions_verified: int = 0
    lost: list[str] = dataclasses.field(default_factory=list)
    corrupt: list[str] = dataclasses.field(default_factory=list)
    problems: list[str] = dataclasses.field(default_factory=list)  # anything else unexpected
    seconds: float = 0.0
    # The notice came before the gang's first step (the trainer logged
    # `preempted_before_training`): nothing newer than the restored step to save.
    stopped_before_training: bool = False

    @property
    def ok(self) -> bool:
        return not (self.lost or self.corrupt or self.problems)


def plan_kill(rng: random.Random, processes: int, restored: int, interval: int,
              startup_seconds: float) -> Kill:
    victims = tuple(range(processes)) if processes > 1 and rng.random() < 0.3 else (
        rng.randrange(processes),)
    first_save = (restored // interval + 1) * interval
    save_step = first_save + interval * rng.randrange(3)
    kind = rng.choice(["hook", "timer", "anywhere"])
    if kind == "hook":
        point = rng.choice(SAVE_POINTS)
        if point in ROOT_ONLY_POINTS and 0 not in victims:
            victims = (0,)
        return Kill("hook", victims, save_step, point=point)
    if kind == "timer":
        return Kill("timer", victims, save_step, delay=round(rng.uniform(0.0, 0.15), 4))
    if rng.random() < 0.25:  # start-up, rendezvous, restore, partial collection
        return Kill("anywhere", victims, None, delay=round(rng.uniform(0, startup_seconds), 3))
    return Kill("anywhere", victims, restored + rng.randint(1, 3 * interval),
                delay=round(rng.uniform(0.0, 0.3), 4))


def _region_volume(key: str) -> int:
    return math.prod(s.stop - s.start for s in parse_region(key))


class Campaign:
    """One checkpoint root, one gang size, many kill trials; then a clean preemption stop."""

    def __init__(self, workdir: Path, *, processes: int, seed: int, steps: int = 100000,
                 interval: int = 2, keep_last: int = 2, extra_env: dict[str, str] | None = None,
                 say: Callable[[str], None] = lambda line: None) -> None:
        self.workdir = workdir
        self.root = workdir / "ckpt"
        self.processes = processes
        self.rng = random.Random(seed)
        self.config = {"steps": steps, "devices_per_process": 2 // processes or 1}
        self.interval = interval
        self.keep_last = keep_last
        self.say = say
        cache = workdir / "jax-cache"
        # Every gang compiles the same programs: a persistent cache keeps trials cheap.
        self.env = {"JAX_COMPILATION_CACHE_DIR": str(cache),
                    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
                    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0", **(extra_env or {})}
        self.manager = CheckpointManager(str(self.root))
        self.newest_logged_commit = -1
        self.startup_samples: list[float] = []
        self.trials = 0

    def close(self) -> None:
        self.manager.close()

    # --- one trial ----------------------------------------------------------------------------
    def _launch(self, name: str, hooks: list[dict[str, Any]]) -> Gang:
        return launch(self.workdir / name, processes=self.processes,
                      checkpoint_path=str(self.root), config=self.config,
                      interval_steps=self.interval, keep_last=self.keep_last, hooks=hooks,
                      extra_env=self.env)

    def next_kill(self) -> Kill:
        committed, _ = self.manager.list_steps()
        restored = committed[-1] if committed else 0
        startup = statistics.median(self.startup_samples) if self.startup_samples else 20.0
        return plan_kill(self.rng, self.processes, restored, self.interval, startup)

    def trial(self, kill: Kill | None = None) -> TrialResult:
        kill = kill or self.next_kill()
        self.trials += 1
        started = time.monotonic()
        committed_before, partial_before = self.manager.list_steps()
        result = self._expect(kill, committed_before)
        launched = time.time()
        gang = self._launch(f"trial{self.trials:03d}", kill.hooks())
        try:
            self._strike(gang, kill, result, launched)
        finally:
            gang.kill()
        self._check_restore(gang, result, partial_before)
        self._audit(gang, result, committed_before)
        result.seconds = round(time.monotonic() - started, 1)
        return result

    def _expect(self, kill: Kill, committed_before: list[int]) -> TrialResult:
        if not committed_before:
            return TrialResult(kill, None, self.processes)
        info = self.manager.read_info(committed_before[-1])
        return TrialResult(kill, info.step, self.processes,
                           sum(len(r) for r in info.digests.values()))

    def _strike(self, gang: Gang, kill: Kill, result: TrialResult, launched: float) -> None:
        def exited() -> bool:
            return any(p.poll() is not None for p in gang.procs)

        if kill.kind == "anywhere":
            if kill.step is not None:
                target = kill.step
                wait_for(lambda: exited() or any(
                    e["step"] >= target for e in gang.events("step")),
                    GANG_TIMEOUT, f"step {target} or an exit")
            time.sleep(kill.delay)  # the random moment itself, not a wait for a condition
            for rank in kill.victims:
                if gang.procs[rank].poll() is None:
                    gang.procs[rank].send_signal(signal.SIGKILL)
        others = [p for r, p in enumerate(gang.procs) if r not in kill.victims]
        overdue = (kill.step or 0) + 10

        # Also stop waiting if a rank that is no victim exits, or training runs far past the
        # save that should have been hit: the kill will not come then.
        def settled() -> bool:
            return (all(gang.procs[v].poll() is not None for v in kill.victims)
                    or any(p.poll() is not None for p in others)
                    or (kill.kind != "anywhere" and any(
                        e["step"] >= overdue for e in gang.events("step"))))

        wait_for(settled, GANG_TIMEOUT, f"victims {kill.victims} to die")
        first_step = next(iter(gang.events("step")), None)
        if first_step is not None:
            self.startup_samples.append(max(1.0, first_step["time"] - launched))
        for rank in kill.victims:
            code = gang.procs[rank].poll()
            # JAX aborts a rank whose coordinator (rank 0) died first: the gang is down.
            aborted = code == -signal.SIGABRT and "another task died" in (
                gang.stderr(rank).read_text(errors="replace"))
            if code != -signal.SIGKILL and not aborted:
                result.problems.append(f"rank {rank} exited with {code}, not killed:\n"
                                       + gang.describe()[-2000:])
        for rank in kill.victims:
            started_steps = [e["step"] for e in gang.events("checkpoint_started", rank)]
            done = {e["step"] for name in ("checkpoint_committed", "checkpoint_failed",
                                           "checkpoint_skipped")
                    for e in gang.events(name, rank)}
            if started_steps and started_steps[-1] not in done:
                result.landed_in_save = True

    def _check_restore(self, gang: Gang, result: TrialResult, partial_before: list[int]) -> None:
        restored = gang.events("checkpoint_restored")
        if restored:
            result.restored = restored[0]["step"]
            result.restore_regions = restored[0].get("regions_verified", 0)
            if result.restored != result.expected_restore:
                result.problems.append(f"restored step {result.restored}, newest committed "
                                       f"was {result.expected_restore}")
            if result.restore_regions < max(1, result.expected_regions):
                result.problems.append(f"restore verified {result.restore_regions} of "
                                       f"{result.expected_regions} saved regions")
        elif gang.events("step") and result.expected_restore is not None:
            result.problems.append("trained without restoring the committed "
                                   f"step {result.expected_restore}")
        removed = {e["step"] for e in gang.events("checkpoint_partial_removed")}
        result.partials_removed = len(removed & set(partial_before))
        if gang.events("step") and not set(partial_before) <= removed:
            result.problems.append(f"partial steps {sorted(set(partial_before) - removed)} "
                                   "were not removed at start-up")

    def _audit(self, gang: Gang, result: TrialResult, committed_before: list[int]) -> None:
        logged = [e["step"] for r in range(self.processes)
                  for e in gang.events("checkpoint_committed", r)]
        self.newest_logged_commit = max([self.newest_logged_commit, *logged])
        result.committed, result.partial = self.manager.list_steps()
        newest = result.committed[-1] if result.committed else -1
        if newest < self.newest_logged_commit:
            result.lost.append(f"newest committed step on storage is {newest}, but step "
                               f"{self.newest_logged_commit} was committed")
        if committed_before and newest < committed_before[-1]:
            result.lost.append(f"newest commit went back from {committed_before[-1]} to {newest}")
        for step in result.committed:
            info = self.manager.read_info(step)
            checked, mismatches = self.manager.verify(step)
            result.corrupt += [f"step {step}: {m}" for m in mismatches]
            for name, meta in info.arrays.items():
                covered = sum(_region_volume(k) for k in info.digests.get(name, {}))
                if covered != math.prod(meta["shape"]):
                    result.corrupt.append(f"step {step}: {name} digests cover {covered} of "
                                          f"{math.prod(meta['shape'])} elements")
            result.checkpoints_verified += not mismatches
            result.regions_verified += checked

    # --- the end: a clean preemption stop -----------------------------------------------------
    def finish(self, at_restore: bool = False) -> TrialResult:
        """SIGTERM a healthy gang: it must save, exit 75, and leave no partial checkpoint.

        `at_restore`: the notice comes as soon as the restore is done, before the first step.
        """
        started = time.monotonic()
        committed_before, partial_before = self.manager.list_steps()
        result = self._expect(Kill("sigterm", tuple(range(self.processes))), committed_before)
        gang = self._launch("finish", [])
        try:
            start = result.expected_restore or 0
            wait_for(lambda: (gang.events("checkpoint_restored") if at_restore else any(
                e["step"] >= start + 3 for e in gang.events("step")))
                or any(p.poll() is not None for p in gang.procs),
                GANG_TIMEOUT, "the restore" if at_restore else "three steps after the restore")
            gang.signal(signal.SIGTERM)
            codes = gang.wait(GANG_TIMEOUT)
        finally:
            gang.kill()
        if codes != [contract.EXIT_PREEMPTED_SAVED] * self.processes:
            result.problems.append(f"exit codes {codes} on SIGTERM:\n{gang.describe()[-2000:]}")
        self._check_restore(gang, result, partial_before)
        self._audit(gang, result, committed_before)
        result.stopped_before_training = bool(gang.events("preempted_before_training"))
        saved = gang.termination(0)
        if saved is None or not result.committed or saved.checkpoint_step != result.committed[-1]:
            result.problems.append(f"termination message {saved} does not name the newest "
                                   f"commit {result.committed[-1:]}")
        if result.partial:
            result.problems.append(f"partial checkpoints left after a clean stop: {result.partial}")
        result.seconds = round(time.monotonic() - started, 1)
        return result
