"""Simulated trainer ranks: what a gang of real trainers tells the operator, without JAX.

A container of a simulated node (`simulated.py`) whose environment carries the operator
contract (`tardigrade_contract.contract`) runs as one `TrainerRank` of a `Gang`, keyed by job,
attempt and world size. The gang keeps the promises the real trainer makes (`train.py`,
`__main__.py`) and that the operator's decisions read:
- start-up: ranks wait for each other (`jax.distributed.initialize`); a peer that does not join
  within `TARDIGRADE_INIT_TIMEOUT_SECONDS` makes the ranks exit 76 (`PeerTimeout`);
- restore: process 0 picks the step and every rank starts from it (`choose_restore_step`), from
  the marker checkpoints of `markers.MarkerCheckpoints` under an absolute checkpoint path; a
  numbered step that was never committed exits 3 (`CheckpointCorrupt`);
- training: one step every `trainer.step_seconds` (default 0.05) up to `trainer.steps`, a
  commit every `checkpoint.interval.steps`; rank 0 serves `/progress` on the progress port;
- preemption: SIGTERM to any rank makes every rank agree on the next step
  (`multihost_utils.reached_preemption_sync_point` signals all processes), save it, write
  `PreemptedSaved` and exit 75; without saveOnPreemption the signal kills the rank (143);
- restart in place (`inplace.py`): with TARDIGRADE_RESTART_IN_PLACE_DIR set the save ends in
  `RestartInPlace` and exit 77, each rank once the operator's keyed POST /restart-in-place
  released it (or at `inplace.release_deadline`); the first POST is a SIGTERM; the
  world in the POST's body is kept in the pod's directory and a restarted container takes the
  newer of it and its env's (`inplace.newest_world`); one started on a world it already ran
  exits 77 at once (`StaleWorld`); with TARDIGRADE_RESTART_IN_PROCESS a rank released with a
  newer world starts its next attempt in process instead (`attempts.py`): it leaves its gang
  and joins the new attempt's in the same container, which never exits;
- a rank that dies or freezes stalls its peers' collectives: the gang stops stepping, and its
  ranks no longer manage a save (they go when the kubelet's grace runs out);
- the end: every rank writes `Succeeded` and exits 0.

Time is the event loop's clock; nothing runs between events (steps are computed from it).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import os
import signal
from collections.abc import Callable, Mapping

from tardigrade_contract import contract
from tardigrade_sdk import inplace

from tardigrade_local.markers import MarkerCheckpoints, choose_restore

DEFAULT_STEP_SECONDS = 0.05
DEFAULT_STEPS = 100
GangKey = tuple[str, str, int, int]  # namespace, job, attempt, world size


@dataclasses.dataclass(frozen=True)
class Exit:
    """How a rank ends: its exit status as asyncio reports it (-N: killed by signal N) and the
    termination message it wrote (None: it wrote none)."""

    returncode: int
    message: contract.TerminationMessage | None = None


class TrainerRank:
    """One rank: the gang calls `finish`; the container delivers signals."""

    def __init__(self, gang: Gang, env: contract.TrainerEnvironment,
                 on_exit: Callable[[Exit], None],
                 on_replace: Callable[[], None] | None = None) -> None:
        """`on_replace`: the rank restarts in process (exec) instead of exiting."""
        self.gang = gang
        self.env = env
        self.process_id = env.process_id
        self.frozen = False
        self.exit: Exit | None = None
        self._on_exit = on_exit
        self._on_replace = on_replace
        self.restarts = inplace.RestartRequests(env.restart_key, env.attempt,
                                                env.restart_in_place_dir)
        self._pending: Exit | None = None
        # Loop time of the first SIGTERM sent to this rank itself (its pod is being stopped).
        self.sigterm_at: float | None = None
        self._saved_at = 0.0

    def finish_when_released(self, result: Exit) -> None:
        """The trainer's wait after a save for restart in place (inplace.release_deadline):
        longer while the rank's notice is only a peer's."""
        if self.restarts.released.is_set():
            self.finish(result)
            return
        self._pending = result
        self._saved_at = self.gang.loop.time()
        self.gang.loop.call_at(self._release_deadline(), self._wait_over)

    def _release_deadline(self) -> float:
        # The simulated save takes no time: it ends at the notice.
        return inplace.release_deadline(self._saved_at, self._saved_at, self.sigterm_at,
                                        self.env.num_processes,
                                        self.env.shutdown_window_seconds)

    def _wait_over(self) -> None:
        if self._pending is not None and self.gang.loop.time() >= self._release_deadline():
            self.finish(self._pending)

    def released(self) -> None:
        if self._pending is not None:
            self.finish(self._pending)

    def finish(self, result: Exit) -> None:
        if self.exit is not None:
            return
        self.exit = result
        if result.message is not None:
            write_termination(self.env.termination_log, result.message)
        if result.returncode == contract.EXIT_RESTART_IN_PLACE and self._on_replace is not None \
                and self.restarts.restarts_in_process(self.env):
            self._on_replace()
        else:
            self._on_exit(result)
        self.gang.left(self)

    def deliver(self, sig: int) -> None:
        """A signal, with a process's default dispositions except for SIGTERM."""
        if self.exit is not None:
            return
        if sig == signal.SIGKILL:
            self.finish(Exit(-signal.SIGKILL))
        elif sig == signal.SIGSTOP:
            self.frozen = True
            self.gang.stall()
        elif sig == signal.SIGCONT:
            self.frozen = False
        elif self.frozen:
            return  # pending until SIGCONT, or lost with a SIGKILL
        elif sig == signal.SIGTERM:
            if self.sigterm_at is None:
                self.sigterm_at = self.gang.loop.time()
                if self._pending is not None:  # its own notice shortens the wait
                    self.gang.loop.call_at(self._release_deadline(), self._wait_over)
            self.gang.sigterm(self)
        else:
            self.finish(Exit(-sig))


class Gang:
    def __init__(self, key: GangKey, env: contract.TrainerEnvironment,
                 loop: asyncio.AbstractEventLoop,
                 on_started: Callable[[Gang], None] | None = None,
                 on_ended: Callable[[Gang], None] | None = None) -> None:
        self.key = key
        self.size = key[3]
        self.loop = loop
        self.config = env.trainer_config
        self.steps = int(self.config.get("steps", DEFAULT_STEPS))
        self.step_seconds = float(self.config.get("step_seconds", DEFAULT_STEP_SECONDS))
        self.save_on_preemption = env.save_on_preemption
        self.interval = env.checkpoint_interval_steps
        self.ckpt = MarkerCheckpoints(env.checkpoint_path)
        self.env0 = env
        self.ranks: dict[int, TrainerRank] = {}
        self.started_at: float | None = None
        self.restored: int | None = None
        self.stalled_at: float | None = None  # when a peer died or froze
        self.stop_step: int | None = None  # the step the gang agreed to save and stop at
        self.written: int | None = None  # the newest commit marker written
        self._timers: list[asyncio.TimerHandle] = []
        self._on_started = on_started
        self._on_ended = on_ended
        self._timers.append(loop.call_later(env.init_timeout_seconds, self._peer_timeout))

    # --- membership --------------------------------------------------------------------------
    def join(self, rank: TrainerRank) -> None:
        if rank.process_id in self.ranks or self.started_at is not None:
            # A second process with the same rank (or one that comes late) cannot join: the
            # coordinator has moved on without it.
            self.loop.call_soon(rank.finish, self._peer_failure("the gang has started"))
            return
        self.ranks[rank.process_id] = rank
        if len(self.ranks) == self.size:
            self._start()

    def left(self, rank: TrainerRank) -> None:
        """A rank exited: peers of a gang in training stall; the last one ends the gang."""
        if self.ranks.get(rank.process_id) is rank and self.started_at is not None:
            self.stall()
        if all(r.exit is not None for r in self.ranks.values()):
            self._end()

    def stall(self) -> None:
        if self.started_at is not None and self.stalled_at is None:
            self.stalled_at = self.loop.time()
            self._cancel_timers()

    # --- training ----------------------------------------------------------------------------
    def _start(self) -> None:
        self._cancel_timers()
        try:
            self.restored = choose_restore(self.env0, self.ckpt)
        except LookupError as err:
            message = contract.TerminationMessage(reason="CheckpointCorrupt", message=str(err))
            self._finish_all(Exit(contract.EXIT_CHECKPOINT_CORRUPT, message))
            return
        self.started_at = self.loop.time()
        self.written = self.restored
        remaining = max(0, self.steps - (self.restored or 0))
        self._timers.append(self.loop.call_later(remaining * self.step_seconds, self._complete))
        if self._on_started is not None:
            self._on_started(self)

    def step(self, now: float | None = None) -> int:
        base = self.restored or 0
        if self.started_at is None:
            return base
        now = self.loop.time() if now is None else now
        until = min(now, self.stalled_at) if self.stalled_at is not None else now
        done = base + math.floor(max(0.0, until - self.started_at) / self.step_seconds + 1e-9)
        return min(done, self.steps, self.stop_step or self.steps)

    def committed(self, now: float | None = None) -> int | None:
        step = self.step(now)
        last = self.restored
        if self.interval and step > (last or 0):
            periodic = step - step % self.interval
            if periodic > (last or 0):
                last = periodic
        if step == self.steps and step > 0:
            last = step
        return last

    def progress(self) -> contract.ProgressReport:
        self._write_commits()
        now = self.loop.time()
        step, saved = self.step(now), self.committed(now)
        return contract.ProgressReport(
            step=step, loss=1.0 / step if step else None, checkpoint_step=saved,
            checkpoint_path=self.ckpt.path(saved) if saved is not None else None,
            total_steps=self.steps, attempt=self.env0.attempt, restore_step=self.restored,
        )

    def sigterm(self, rank: TrainerRank) -> None:
        healthy = self.started_at is not None and self.stalled_at is None
        if not self.save_on_preemption or self.started_at is None:
            rank.finish(Exit(-signal.SIGTERM))  # no handler installed (yet): the signal kills
            return
        if not healthy or self.stop_step is not None:
            return  # a save of a stalled gang never completes; the grace runs out
        # The sync point is the next step every process reaches.
        now = self.loop.time()
        self.stop_step = min(self.step(now) + 1, self.steps)
        assert self.started_at is not None
        at = self.started_at + (self.stop_step - (self.restored or 0)) * self.step_seconds
        self._cancel_timers()
        self._timers.append(self.loop.call_at(max(at, now), self._saved))

    def _saved(self) -> None:
        assert self.stop_step is not None
        step = self.stop_step
        self.ckpt.commit(step)
        self.written = step
        code, reason = inplace.stop_code(self.env0)
        message = contract.TerminationMessage(
            reason=reason, step=step, checkpoint_step=step,
            checkpoint_path=self.ckpt.path(step), message=f"saved step {step} on SIGTERM",
            attempt=self.env0.attempt)
        if code == contract.EXIT_RESTART_IN_PLACE:
            for rank in list(self.ranks.values()):
                inplace.remember_exit(rank.env, message)
                if not rank.frozen:
                    rank.finish_when_released(Exit(code, message))
            return
        self._finish_all(Exit(code, message))

    def _complete(self) -> None:
        self._write_commits()
        step = self.step()
        message = contract.TerminationMessage(
            reason="Succeeded", step=step, checkpoint_step=self.written,
            checkpoint_path=self.ckpt.path(self.written) if self.written is not None else None)
        self._finish_all(Exit(contract.EXIT_SUCCEEDED, message))

    def _peer_timeout(self) -> None:
        if self.started_at is None:
            self._finish_all(self._peer_failure(
                f"{self.size - len(self.ranks)} of {self.size} processes never joined"))

    @staticmethod
    def _peer_failure(why: str) -> Exit:
        return Exit(contract.EXIT_PEER_TIMEOUT,
                    contract.TerminationMessage(reason="PeerTimeout", message=why))

    def _finish_all(self, result: Exit) -> None:
        for rank in list(self.ranks.values()):
            if not rank.frozen:
                # Every rank reports the same step and commit, as the real ones do.
                rank.finish(result)

    def _write_commits(self) -> None:
        """Interval commits become marker files once someone can observe them."""
        saved = self.committed()
        if saved is not None and saved != self.written:
            self.ckpt.commit(saved)
            self.written = saved

    def _end(self) -> None:
        self._write_commits()
        self._cancel_timers()
        if self._on_ended is not None:
            self._on_ended(self)

    def _cancel_timers(self) -> None:
        for timer in self._timers:
            timer.cancel()
        self._timers = []


def write_termination(path: str, message: contract.TerminationMessage) -> None:
    with open(path, "w") as f:
        f.write(message.to_json())


def trainer_environment(env: Mapping[str, str]) -> contract.TrainerEnvironment | None:
    """The rank's contract if the container is a Tardigrade rank; None for other containers.
    Raises ContractError for a rank whose environment is malformed."""
    if contract.ENV_NUM_PROCESSES not in env or contract.ENV_PROCESS_ID not in env:
        return None
    return contract.TrainerEnvironment.from_env(env)


def gang_key(env: contract.TrainerEnvironment) -> GangKey:
    return (env.namespace, env.job_name, env.attempt, env.num_processes)


def checkpoint_problem(env: contract.TrainerEnvironment) -> str | None:
    if not os.path.isabs(env.checkpoint_path):
        return (f"checkpoint path {env.checkpoint_path!r}: simulated ranks keep commit markers "
                "on the local disk and need an absolute path")
    return None
