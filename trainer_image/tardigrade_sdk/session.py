"""One entry point for a training loop under the operator: `TrainingSession`.

    with TrainingSession() as session:
        state = session.restore_or(init)
        for step in session.steps(total):
            state, loss = train_step(state, batch(step))
            session.end_step(step, state, loss=loss)

The session owns everything a loop must do for the operator and nothing else: it reads the
operator's environment (contract.py), meets the gang and starts `jax.distributed`
(distributed.py), checks the checkpoint root is writable and shared by every host, restores
the one checkpoint process 0 chose for every rank (restore_choice.py: the root's ownership
and fencing by attempt, the operator's pin as a floor, a rollback, initFrom), applies the
retention a save on notice skipped, decides when to save (every N steps, every S seconds by
process 0's clock, continuously within a budget of the loop's time, at the last step, and at
the step the gang agrees on after SIGTERM, that save bounded by the shutdown window; a notice
before the first step ends the rank at once, notice.py), serves progress on rank 0
(metrics.py; with where the rank's time went, phase_clock.py), and on leaving writes the
termination message and exits with the contract's code (75 after a save on notice).
The checkpoint format is a backend: ours (checkpoint_backend.py) or Orbax's (orbax_backend.py).
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any

from tardigrade_checkpoint.faults import RESTORE, START_UP
from tardigrade_contract import contract
from tardigrade_contract.contract import ConfigError

from tardigrade_sdk import accelerator, attempts, distributed, inplace, phase_clock, phases
from tardigrade_sdk.logs import JsonLog
from tardigrade_sdk.notice import NoticeGuard
from tardigrade_sdk.savestall import SaveStall

if TYPE_CHECKING:  # the backends import jax and tensorstore: only once a session starts
    from tardigrade_checkpoint.faults import SaveFaults

    from tardigrade_sdk.checkpoint_backend import Checkpoints

# -1: start from scratch.
_NO_RESTORE = -1
BACKENDS = ("tardigrade", "orbax")


class StopTraining(BaseException):
    """Raised out of the loop after the save on notice; the session turns it into the exit.

    A BaseException, so that a loop's own `except Exception` does not swallow it."""

    def __init__(self, code: int, message: contract.TerminationMessage,
                 next_attempt_in_process: bool = False) -> None:
        super().__init__(message.message)
        self.code = code
        self.message = message
        # Restart in process: the container's main process starts this rank's new world in a
        # new child (attempts.py) instead of the container exiting.
        self.next_attempt_in_process = next_attempt_in_process


def write_termination(path: str, message: contract.TerminationMessage) -> None:
    try:
        with open(path, "w") as f:
            f.write(message.to_json())
    except OSError as err:
        print(f"cannot write termination log {path}: {err}", file=sys.stderr)


def exit_code_for(err: BaseException) -> tuple[int, str]:
    """The contract's exit code and termination reason for an exception out of a loop."""
    from tardigrade_checkpoint import (
        CheckpointCorruptError,
        CheckpointIOError,
        CheckpointMissingError,
        CheckpointUsageError,
        FencedError,
        ForeignRootError,
    )

    if isinstance(err, accelerator.AcceleratorUnavailable):
        return contract.EXIT_CONFIG_ERROR, "AcceleratorUnavailable"
    if isinstance(err, ConfigError | contract.ContractError | CheckpointUsageError):
        return contract.EXIT_CONFIG_ERROR, "ConfigError"
    if isinstance(err, ForeignRootError):
        return contract.EXIT_CONFIG_ERROR, "CheckpointRootOwned"
    if isinstance(err, FencedError):
        # A stale gang: the operator already moved on to a newer attempt or job.
        return contract.EXIT_FAILED, "Fenced"
    if isinstance(err, CheckpointMissingError):
        return contract.EXIT_CHECKPOINT_CORRUPT, "CheckpointMissing"
    if isinstance(err, distributed.peerauth.PeerAuthError):
        return contract.EXIT_CONFIG_ERROR, "ConfigError"
    if isinstance(err, distributed.PeerTimeoutError):
        return contract.EXIT_PEER_TIMEOUT, "PeerTimeout"
    if isinstance(err, CheckpointCorruptError):
        return contract.EXIT_CHECKPOINT_CORRUPT, "CheckpointCorrupt"
    if isinstance(err, CheckpointIOError):
        return contract.EXIT_CHECKPOINT_IO_ERROR, "CheckpointIOError"
    return contract.EXIT_FAILED, "Failed"


def exit_gang(code: int) -> None:
    """Leave after a failure without taking healthy-but-failing peers down with us.

    When rank 0 exits, its coordination service goes with it and JAX aborts every peer still
    connected, before they could write their own termination message. If all ranks fail
    together (e.g. a config error every rank sees) they meet at a short barrier and shut down
    cleanly; if the peers are gone or stuck, the barrier times out and we leave at once.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        import jax

        distributed.barrier("tardigrade-exit-on-failure", 15)
        jax.distributed.shutdown()
    except Exception as err:
        print(f"tardigrade-trainer: leaving without a clean shutdown: {err}", file=sys.stderr,
              flush=True)
    os._exit(code)


def _fail(path: str, code: int, reason: str, err: BaseException,
          message: contract.TerminationMessage | None = None) -> None:
    print(f"tardigrade-trainer: {reason}: {err}", file=sys.stderr, flush=True)
    write_termination(path, message or contract.TerminationMessage(reason=reason,
                                                                   message=str(err)))


class TrainingSession:
    """One rank's part in one attempt of a TrainingJob; use it as a context manager.

    `checkpoints`: "tardigrade" (our format, the default), "orbax" (an Orbax
    `CheckpointManager` at the operator's path; needs `tardigrade[orbax]`), or a callable
    that builds a backend from the environment (to pass your own manager options).
    `env`: the operator's environment, read from os.environ when not given.
    `checkpoint_options`: settings for the named backend's manager (our `CheckpointManager`,
    or Orbax's `CheckpointManagerOptions`).
    `faults`: for tests only, faults injected at the named points of checkpoint/faults.py
    (our backend's save stages and the end of each step); None injects nothing.
    """

    def __init__(self,
                 checkpoints: str | Callable[[contract.TrainerEnvironment], Checkpoints]
                 = "tardigrade", *,
                 env: contract.TrainerEnvironment | None = None,
                 checkpoint_options: Mapping[str, Any] | None = None,
                 faults: SaveFaults | None = None) -> None:
        if isinstance(checkpoints, str) and checkpoints not in BACKENDS:
            raise ValueError(f"checkpoints={checkpoints!r}: use one of {', '.join(BACKENDS)} "
                             "or a callable that builds a backend from the environment")
        self._choice = checkpoints
        self._given_env = env
        self._options = dict(checkpoint_options or {})
        self._faults = faults
        self.env: contract.TrainerEnvironment
        self._checkpoints: Checkpoints | None = None
        self.restore_step = _NO_RESTORE
        self.restore_choice: Any = None
        self._started = False
        self.start_step = 1
        self.last_step = 0
        self.total_steps: int | None = None
        self._server: Any = None
        # preemption.PreemptionWatcher once the checkpoints are open (None before, or when the
        # job does not save on notice).
        self.watcher: Any = None
        # The operator's restart requests (none taken until `_serve_early` has the env's key).
        self._restarts = inplace.RestartRequests(None)
        self._reported: Any = None
        self.continuous: Any = None  # ContinuousSaving, once the checkpoints are open
        self._stall = SaveStall()
        self._save_prepared = False
        # Where this rank's time goes (phase_clock.py), served in rank 0's progress report.
        self.phase_clock = phase_clock.PhaseClock(phase_clock.since_process_start())
        self._memory: Any = None  # memory_session.MemoryTier, when the memory tier is on
        self.restore_source = "none"
        # SIGTERM from the start (notice.py); None when the job does not save on notice.
        self._guard: NoticeGuard | None = None
        self._stopping = threading.Lock()
        # At the agreed step after a notice, process 0's word for every rank: False when a
        # save is in flight or the step is committed (that save is waited for first).
        self._notice_save_needed: bool | None = None
        # What the last committed save took, snapshot and writes (a second save's estimate).
        self._save_seconds: dict[str, float] = {}

    # --- start-up -----------------------------------------------------------------------------
    def __enter__(self) -> TrainingSession:
        if self._given_env is None and attempts.wanted(os.environ):
            attempts.run_attempts()  # from here on, a child of the container's main process
            self.phase_clock = phase_clock.PhaseClock(phase_clock.since_process_start())
        try:
            self.env = self._given_env or contract.TrainerEnvironment.from_env(
                inplace.newest_world(os.environ))
        except contract.ContractError as err:
            term = os.environ.get(contract.ENV_TERMINATION_LOG) or contract.DEFAULT_TERMINATION_LOG
            _fail(term, contract.EXIT_CONFIG_ERROR, "ConfigError", err)
            raise SystemExit(contract.EXIT_CONFIG_ERROR) from None
        try:
            inplace.enter_world(self.env)
        except inplace.StaleWorld as err:
            _fail(self.env.termination_log, contract.EXIT_RESTART_IN_PLACE, "StaleWorld", err,
                  err.termination(self.env.attempt))
            raise SystemExit(contract.EXIT_RESTART_IN_PLACE) from None
        if self.env.save_on_preemption:
            # Before jax.distributed: a notice during start-up ends the rank cleanly, not by
            # SIGTERM's default action (exit 143, no termination message).
            self._guard = NoticeGuard(self.env.attempt, self._stop_before_training)
        try:
            self._serve_early()
            self._start()
        except BaseException as err:
            self._leave_on_error(err)
            raise
        return self

    def _serve_early(self) -> None:
        """Before the gang meets: the progress port, for the operator's restart requests only
        (rank 0 serves progress once every rank met, `_start`). A kept rank still waiting for
        its peers (a rank lost, a shrink while a new pod cannot be placed) then takes its next
        world and restarts in its pod, its memory tier kept, instead of being recreated."""
        from tardigrade_sdk.metrics import Metrics, ProgressServer

        env = self.env
        self.metrics = Metrics()
        self._restarts = inplace.RestartRequests(env.restart_key, env.attempt,
                                                 env.restart_in_place_dir)
        self._restarts.on_lost_ranks = self._restart_for_lost_ranks
        # Rank 0 serves progress; with restart in place every rank takes the operator's word.
        if env.progress_port is not None and (env.process_id == 0 or env.restart_key):
            self._server = ProgressServer(self.metrics, env.progress_port,
                                          on_restart=self._restarts.answer,
                                          progress_token=env.progress_token,
                                          after_restart=self._restarts.after_answer,
                                          ready=False).start()

    def _start(self) -> None:
        from jax._src import distributed as jax_distributed

        self.fault_point(START_UP, 0, self.env.process_id)
        if jax_distributed.global_state.client is None:
            try:
                distributed.initialize(self.env)
            except (distributed.PeerTimeoutError, distributed.peerauth.PeerAuthError,
                    distributed.CoordinatorBindError) as err:
                code, reason = exit_code_for(err)
                _fail(self.env.termination_log, code, reason, err)
                raise SystemExit(code) from None
        try:
            # The first backend call: after jax.distributed, before anything runs on a device.
            accelerator.verify(self.env.accelerator)
        except accelerator.AcceleratorUnavailable as err:
            code, reason = exit_code_for(err)
            _fail(self.env.termination_log, code, reason, err)
            raise SystemExit(code) from None
        import jax
        from tardigrade_checkpoint import coordination


        env = self.env
        self.log = JsonLog(jax.process_index(), attempt=env.attempt)
        # Where this process's start-up went so far (phases.py); later phases log their own.
        keeper = {"pid": os.getpid(), "keeper_pid": os.getppid()} if attempts.in_child() else {}
        self.log({"event": "startup", **phases.marks(), **keeper,
                  "coordination_service": jax_distributed.global_state.client is not None})
        self.phase_clock.switch(None)  # devices up, jax.distributed initialised
        self.metrics.live = self.phase_clock.seconds
        if self._server is not None:
            # Every rank met: rank 0's report may be read from now on.
            self._server.serve_progress()
        if self._guard is not None:
            # From here on the notice reaches the gang, and a peer's reaches this rank.
            self._guard.connect(jax_distributed.global_state.client, coordination.current())

    @property
    def checkpoints(self) -> Checkpoints:
        """The checkpoint backend (ours or Orbax's)."""
        return self._open_checkpoints()

    def _open_checkpoints(self) -> Checkpoints:
        """Open the backend and agree on the restore step when the loop first needs them: a
        loop that cannot run as configured fails before anything touches storage."""
        if self._checkpoints is None:
            from tardigrade_checkpoint import ContinuousSaving, SaveInterval

            from tardigrade_sdk.preemption import PreemptionWatcher

            env = self.env
            self._checkpoints = self._backend()
            self._checkpoints.prepare()
            # Process 0 decides (ownership, fencing, rollback, the pin as a floor, initFrom)
            # and every rank follows, or stops with the error class process 0 stopped with.
            self.restore_choice = self._checkpoints.choose_restore(env)
            self.restore_step = self.restore_choice.step
            self._open_memory_tier()
            # Rank 0's report names its attempt from now on: the operator's sign that every
            # rank restarted into it (restart_in_place.note_gang_formed).
            self.metrics.report(attempt=env.attempt, restore_step=(
                self.restore_step if self.restore_step >= 0 else None))
            self.interval = SaveInterval(env.checkpoint_interval_steps,
                                         env.checkpoint_interval_seconds)
            fraction = env.checkpoint_continuous_max_loop_fraction
            self.continuous = ContinuousSaving(fraction) if fraction is not None else None
            self.watcher = PreemptionWatcher(self._guard) if env.save_on_preemption else None
        return self._checkpoints

    def _open_memory_tier(self) -> None:
        """With spec.checkpoint.memoryTier: start this rank's memory tier and let the gang
        choose a memory snapshot newer than (or as new as) the bucket's choice."""
        env = self.env
        if env.memory_tier_interval is None:
            return
        manager = getattr(self._checkpoints, "manager", None)
        if manager is None:
            raise ConfigError("spec.checkpoint.memoryTier needs the tardigrade checkpoint "
                              "backend (its lines decide which memory snapshots count)")
        from tardigrade_sdk.memory_session import MemoryTier
        from tardigrade_sdk.restore_choice import OWN_ROOT

        # The bucket save's staging budget: the two never stage more than it together.
        self._memory = MemoryTier(env, self.log, budget=manager.staging_budget)
        record = manager.root_record()
        bucket = self.restore_step if self.restore_choice.source == OWN_ROOT else -1
        step = self._memory.choose(bucket, record.lineage if record is not None else None)
        if step >= 0:
            self.restore_step = step

    def _restore_from_memory(self, target: Any) -> Any:
        """The `Restored` of the gang's memory snapshot, or None (none chosen, or some rank
        could not read its pieces: then every rank goes to the bucket)."""
        from tardigrade_sdk.checkpoint_backend import Restored

        if self._memory is None or self._memory.selection is None:
            return None
        got = self._memory.restore(target)
        if got is None:
            return None
        state, start_step = got
        self.restore_source = self._memory.restored_from
        return Restored(state, start_step)

    def _backend(self) -> Checkpoints:
        if callable(self._choice):
            return self._choice(self.env)
        if self._choice == "orbax":
            from tardigrade_sdk.orbax_backend import OrbaxCheckpoints

            return OrbaxCheckpoints.from_env(self.env, on_event=self._on_checkpoint_event,
                                             **self._options)
        from tardigrade_sdk.checkpoint_backend import TardigradeCheckpoints

        options = self._options if self._faults is None else {**self._options,
                                                               "faults": self._faults}
        return TardigradeCheckpoints.from_env(self.env, on_event=self._on_checkpoint_event,
                                              **options)

    def _on_checkpoint_event(self, event: dict[str, Any]) -> None:
        self.log(event)
        if event["event"] == "checkpoint_started":
            self._save_seconds["blocked"] = float(event.get("blocked_s") or 0.0)
        if event["event"] == "checkpoint_committed":
            self._save_seconds["last"] = (self._save_seconds.get("blocked", 0.0)
                                          + float(event.get("seconds") or 0.0))
            self.metrics.checkpoint_seconds.observe(event.get("seconds", 0.0))
        elif event["event"] == "checkpoint_failed":
            self.metrics.checkpoint_failures.inc()

    # --- the loop -----------------------------------------------------------------------------
    @property
    def config(self) -> dict[str, Any]:
        """The TrainingJob's `spec.trainer`: free-form, for the loop to read."""
        return self.env.trainer_config

    def restore_or(self, init: Callable[[], Any], target: Any = None) -> Any:
        """The state at the operator's restore step, or `init()` when there is none.

        The restore reads into the shapes, dtypes and shardings of `target`, by default those
        of `jax.eval_shape(init)` (jit `init` with `out_shardings` to choose them; leaves
        without one are read replicated on every device). `init` is not run on a restore.
        """
        checkpoints = self._open_checkpoints()  # resolves the restore step
        # An error stops the rank, so only the way out of a restore ends its phase.
        was = self.phase_clock.switch(phase_clock.RESTORE)
        if self.restore_step < 0:
            self.start_step = 1
            self.last_step = 0
            state = init()
        else:
            if target is None:
                target = _abstract_state(init)
            self._set_phase("restore")
            self.fault_point(RESTORE, self.restore_step, self.env.process_id)
            restored = self._restore_from_memory(target)
            if restored is None and self.restore_choice.restores:
                restored = checkpoints.restore(self.restore_choice, target)
                self.restore_source = "bucket"
            if restored is None:  # a memory snapshot that failed, and no bucket step
                self.restore_source = "none"
                self.start_step, self.last_step, state = 1, 0, init()
            else:
                state = restored.state
                self.start_step = restored.start_step
                self.last_step = restored.start_step - 1
            self.restore_step = self.start_step - 1 if restored is not None else _NO_RESTORE
            self._report_checkpoint()
        self.phase_clock.switch(was)
        self._after_restore()
        self._set_phase("the first step's preparation")
        self.log({"event": "restore_done", "step": self.start_step - 1,
                  "source": self.restore_source})
        return state

    def _after_restore(self) -> None:
        """Once, after the restore decision was carried out: the deletes the keep policy
        owes from a save on notice (which skips them)."""
        if not self._started:
            self._started = True
            self._open_checkpoints().started()

    def steps(self, total: int) -> range:
        """The steps this attempt trains: from the one after the restored step to `total`."""
        if total < 1:
            raise ConfigError(f"the number of steps must be >= 1, got {total}")
        self._open_checkpoints()
        self._after_restore()  # a loop that never called restore_or
        self.total_steps = total
        self._begin_training()
        self.phase_clock.switch(phase_clock.TRAIN)
        return range(self.start_step, total + 1)

    def end_step(self, step: int, state: Any, loss: Any = None) -> None:
        """Call once per step on every rank: reports progress, and saves when a save is due.

        After the save on notice it raises `StopTraining` out of the loop; the session turns
        it into the exit code the operator expects. `loss` (optional) is logged and reported;
        reading it waits for the step to finish.
        """
        self.report(step, loss=loss)
        self.prepare_save(state)
        reason = self.save_reason(step)
        if reason is not None:
            self.save(step, state, reason)

    def check_notice(self, state: Any) -> None:
        """Between steps, in work that may outlast the shutdown window (an evaluation, a
        long data-loader refill): call it on every rank at the same points (each evaluation
        batch) with the state of the last step `end_step` was given. At the gang's agreed stop
        point it saves that step as `end_step` would (a save in flight commits first) and
        stops the loop as `end_step` does after a notice."""
        if self.watcher is None:
            self._open_checkpoints()
        if self.watcher is None or not self.watcher.should_stop(self.last_step):
            return
        self._notice_save_needed = self._save_needed_on_notice(self.last_step)
        self.save(self.last_step, state, "preemption")

    def prepare_save(self, state: Any, step_program: Any = None) -> None:
        """Once a step has run (later calls do nothing): get the checkpoints ready to save
        states like `state`, so that the first save stalls the loop no longer than the next
        ones (the staged snapshot's copy program compiles in the background).

        `step_program` (optional): the compiled training step (`jax.jit(step).lower(...)
        .compile()`) or its `memory_analysis()`. On an accelerator a save stages its snapshot
        in the device memory the training leaves free; with the step's own figures that is
        known before the step's peak has been seen, without them the device's peaks decide
        (checkpoint/stagingbudget.py)."""
        if self._save_prepared:
            return
        self._save_prepared = True
        was = self.phase_clock.switch(phase_clock.CHECKPOINT_STALL)
        if step_program is None:
            self.checkpoints.prepare_save(state)
        else:  # a backend of the loop's own may predate the argument
            self.checkpoints.prepare_save(state, step_program=step_program)
        if self._memory is not None:
            self._memory.prepare(state)
        self.phase_clock.switch(was)

    def report(self, step: int, loss: Any = None, **fields: Any) -> None:
        """Record that `step` is done: rank 0's /progress and metrics, a `step` log line."""
        self.last_step = step
        self._time_save_stall()
        changes: dict[str, Any] = {"step": step, "total_steps": self.total_steps, **fields}
        self.metrics.step.set(step)
        if loss is not None:
            value = float(loss)
            changes["loss"] = value
            self.metrics.loss.set(value)
            self.log({"event": "step", "step": step, "loss": value,
                      **{k: v for k, v in fields.items() if v is not None}})
        self.metrics.report(**changes)
        self._report_checkpoint()
        if self._faults is not None:
            import jax
            from tardigrade_checkpoint.faults import STEP_END

            self._faults.at(STEP_END, step, jax.process_index())

    def _time_save_stall(self) -> None:
        """One step ended: close the record of a save that has ended since (savestall.py)."""
        saving = getattr(self._checkpoints, "saving", None)
        record = self._stall.step_ended(time.monotonic(), bool(saving and saving()))
        if record is not None:
            self.log({"event": "checkpoint_loop_time_lost", **record})

    def _saved(self, step: int, reason: str, blocked: float | None) -> None:
        if blocked is not None:
            self.metrics.checkpoint_blocked.observe(blocked)
        # What the save staged (our backend; others stage nothing, or do not say).
        staging = getattr(self._checkpoints, "staging", None)
        if not isinstance(staging, dict):
            staging = {"staged_bytes": int(getattr(self._checkpoints, "staged_bytes", 0) or 0)}
        previous = self._stall.save_started(step, reason, blocked or 0.0, staging)
        if previous is not None:
            self.log({"event": "checkpoint_loop_time_lost", **previous})

    def save_reason(self, step: int) -> str | None:
        """Why `step` must be saved ("preemption", "interval", "continuous", "final"), or
        None.

        Every rank must call it at every step: it is where the gang agrees on the step to
        save at after SIGTERM, and where process 0 decides a time-based or continuous save
        (by its clock and its view of the save in flight)."""
        import jax
        import numpy as np
        from jax.experimental import multihost_utils
        from tardigrade_checkpoint import SaveContext

        self._open_checkpoints()  # the interval and the watcher come with it
        self._begin_training()
        preempted = self.watcher is not None and self.watcher.should_stop(step)
        reason = "interval" if self.interval.due_by_step(step) else None
        if self.interval.seconds is not None or self.continuous is not None:
            # Clocks (and what each host knows of the save in flight) differ between hosts:
            # process 0 decides, everyone follows. 1: interval, 2: continuous.
            decided = 1 if self.interval.due_by_time() else 0
            if not decided and self.continuous is not None and self.continuous.should_save(
                    SaveContext(step=step, saving=bool(self.checkpoints.saving()))):
                decided = 2
            word = np.int32(decided)
            if jax.process_count() > 1:
                word = multihost_utils.broadcast_one_to_all(word)
            reason = reason or {1: "interval", 2: "continuous"}.get(int(word))
        if preempted:
            self._notice_save_needed = self._save_needed_on_notice(step)
            return "preemption"
        if step == self.total_steps:
            return "final"
        if reason is None and self._memory is not None and self._memory.due(step):
            return "memory"
        return reason

    def save(self, step: int, state: Any, reason: str = "interval",
             extra: Mapping[str, Any] | None = None,
             mesh: Mapping[str, int] | None = None) -> None:
        """Save `state` as `step` on every rank; after a save on notice, stop the loop.

        A save on notice must commit by the shutdown window's deadline
        (`preemption.save_deadline`): one that cannot fails cleanly, naming the deadline."""
        # The loop waits here: the save's stall in the goodput account (phase_clock.py).
        with self.phase_clock.during(phase_clock.CHECKPOINT_STALL):
            self._save(step, state, reason, extra, mesh)

    def _save(self, step: int, state: Any, reason: str, extra: Mapping[str, Any] | None,
              mesh: Mapping[str, int] | None) -> None:
        from tardigrade_checkpoint import CheckpointIOError

        from tardigrade_sdk.preemption import save_deadline

        self._begin_training()  # a loop that never called steps() or save_reason()
        if reason == "memory":  # the memory tier alone (memory_session.py)
            self._memory.snapshot(step, state, {"data_position": step + 1, "reason": reason,
                                                **(extra or {})}, mesh)
            return
        if reason != "preemption":
            started = time.monotonic()
            blocked = self.checkpoints.save(
                step, state,
                extra={"data_position": step + 1, "reason": reason, **(extra or {})},
                mesh=mesh)
            self._saved(step, reason, blocked)
            self.interval.saved()
            if self.continuous is not None:
                self.continuous.saved(started, self._gang_held(time.monotonic() - started))
            if self._memory is not None and reason in ("interval", "continuous") \
                    and self._memory.due(step):
                self._save(step, state, "memory", extra, mesh)
            return
        noticed_at = self.watcher.noticed_at if self.watcher is not None else None
        until = (save_deadline(noticed_at, self.env.shutdown_window_seconds)
                 if noticed_at is not None else None)
        try:
            if self._notice_save_needed is False:
                # A save was in flight: it commits first. The agreed step is saved too only
                # where the window holds a second save (notice.another_save_fits).
                self.log({"event": "preemption_waits_for_save", "step": step,
                          "seconds_since_notice": round(self._since_notice(), 3)})
                self.checkpoints.wait(until)
                if self._second_save_fits(step, until):
                    blocked = self.checkpoints.save(
                        step, state,
                        extra={"data_position": step + 1, "reason": reason, **(extra or {})},
                        mesh=mesh, deadline=until)
                    self._saved(step, reason, blocked)
                    self.checkpoints.wait(until)
            else:
                blocked = self.checkpoints.save(
                    step, state,
                    extra={"data_position": step + 1, "reason": reason, **(extra or {})},
                    mesh=mesh, deadline=until)
                self._saved(step, reason, blocked)
                self.checkpoints.wait(until)
        except CheckpointIOError as err:
            # Not "PreemptedSaved": the operator must resume from the older commit.
            self.log({"event": "preempted_unsaved", "step": step, "error": str(err),
                      "seconds_since_notice": round(self._since_notice(), 3)})
            raise StopTraining(contract.EXIT_CHECKPOINT_IO_ERROR, self.termination(
                "CheckpointIOError", f"preempted at step {step}; saving it failed: {err}")
            ) from None
        self.interval.saved()
        self._stop_after_notice(step)

    def _second_save_fits(self, step: int, until: Any) -> bool:
        """Once the save in flight at a notice committed: whether to save the agreed `step`
        too, by process 0's clock and estimate for every rank."""
        import jax
        import numpy as np
        from jax.experimental import multihost_utils

        from tardigrade_sdk.notice import another_save_fits

        committed = self.checkpoints.committed()
        if committed is not None and committed.step >= step:
            return False  # every rank has seen the same commit: nothing newer to save
        left = None if until is None else until.remaining()
        fits = np.int32(another_save_fits(left, self._save_seconds.get("last")))
        if jax.process_count() > 1:
            fits = multihost_utils.broadcast_one_to_all(fits)
        self.log({"event": "preemption_second_save", "step": step, "saved": bool(fits),
                  "seconds_left": None if left is None else round(left, 3),
                  "estimate_s": self._save_seconds.get("last")})
        return bool(fits)

    def _gang_held(self, seconds: float) -> float:
        """The longest any rank's save call held its loop (all it waited for, the previous
        save's end included): a gang's steps go at its slowest rank's pace."""
        import jax
        import numpy as np
        from jax.experimental import multihost_utils

        if jax.process_count() == 1:
            return seconds
        return float(np.max(multihost_utils.process_allgather(np.float32(seconds))))

    def _save_needed_on_notice(self, step: int) -> bool:
        """At the gang's agreed stop point: whether `step` must be saved, by process 0's view
        for every rank (a rank may learn of a commit later than process 0): not when a save
        is in flight or `step` is committed already."""
        import jax
        import numpy as np
        from jax.experimental import multihost_utils

        checkpoints = self.checkpoints
        committed = checkpoints.committed()
        needed = np.int32(not checkpoints.saving()
                          and (committed is None or committed.step < step))
        if jax.process_count() > 1:
            needed = multihost_utils.broadcast_one_to_all(needed)
        return bool(needed)

    def _since_notice(self) -> float:
        return self.watcher.seconds_since_notice() if self.watcher is not None else 0.0

    def _stop_after_notice(self, step: int) -> None:
        from tardigrade_sdk.preemption import window_overrun

        self._report_checkpoint()
        used = self._since_notice()
        committed = self._checkpoints.committed() if self._checkpoints is not None else None
        saved = committed.step if committed is not None else step
        self.log({"event": "preempted", "step": step, "checkpoint_step": saved,
                  "seconds_since_notice": round(used, 3),
                  "shutdown_window_seconds": self.env.shutdown_window_seconds})
        overrun = window_overrun(used, self.env.shutdown_window_seconds)
        if overrun is not None:
            self.log({"event": "shutdown_window_exceeded", "level": "warning", "step": step,
                      "message": overrun})
        code, reason = inplace.stop_code(self.env)
        message = self.termination(reason, f"saved step {saved} on SIGTERM")
        if code == contract.EXIT_RESTART_IN_PLACE:
            inplace.remember_exit(self.env, message)
            released = self._wait_for_word()
            in_process = self._restarts.restarts_in_process(self.env) and attempts.in_child()
            self.log({"event": "restart_in_place", "step": step, "released": released,
                      "in_process": in_process})
            raise StopTraining(code, message, next_attempt_in_process=in_process)
        raise StopTraining(code, message)

    def _wait_for_word(self, since_notice: float | None = None) -> bool:
        """After the save on notice, the operator's request (inplace.release_deadline)."""
        saved_at = time.monotonic()
        watcher = self.watcher
        notice_at = saved_at - (self._since_notice() if since_notice is None else since_notice)
        guard = self._guard

        def own_notice_at() -> float | None:
            # Without a watcher's word the notice counts as the rank's own: the shorter wait.
            if watcher is not None:
                return watcher.own_notice_at
            return guard.received_at if guard is not None and guard.installed else notice_at

        return self._restarts.wait_released_until(lambda: inplace.release_deadline(
            saved_at, notice_at, own_notice_at(), self.env.num_processes,
            self.env.shutdown_window_seconds))

    # --- ranks lost without notice (inplace.RestartRequests.lost_ranks) ----------------------
    def _restart_for_lost_ranks(self, lost: tuple[int, ...]) -> None:
        """The operator's word that `lost` ranks are gone without a notice, with this rank's
        new world: no save can commit without them, and the loop waits in a collective that
        never completes. So the rank leaves at once from the server's thread, with the code
        that restarts it in its pod (its memory tier's volume kept); the new attempt restores
        the newest step complete across the memory tier and the bucket. Ends the process."""
        if not self._stopping.acquire(blocking=False):
            return  # already on its way out (a save on notice, a failure): that exit stands
        env = self.env
        committed = self._checkpoints.committed() if self._checkpoints is not None else None
        memory = self._memory.newest_step() if self._memory is not None else None
        text = (f"ranks {', '.join(map(str, lost))} lost without notice at step "
                f"{self.last_step}: restarting in place without a save (memory tier's newest "
                f"step here: {memory}, bucket's: "
                f"{committed.step if committed is not None else None})")
        # No checkpoint step: the step restored is decided by the new gang, and the operator
        # reads it from rank 0's first report (recovery.strategy.note_gang_formed).
        message = contract.TerminationMessage(
            reason="RestartInPlace", step=self.last_step, checkpoint_step=None,
            checkpoint_path=None, message=text, attempt=env.attempt)
        log = getattr(self, "log", None) or JsonLog(env.process_id, attempt=env.attempt)
        log({"event": "restart_for_lost_ranks", "lost": list(lost), "step": self.last_step,
                  "memory_step": memory,
                  "bucket_step": committed.step if committed is not None else None})
        code, _ = inplace.stop_code(env)
        if code == contract.EXIT_RESTART_IN_PLACE:
            inplace.remember_exit(env, message)
        write_termination(env.termination_log, message)
        in_process = self._restarts.restarts_in_process(env) and attempts.in_child()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(attempts.EXIT_NEXT_ATTEMPT if in_process else code)

    # --- a notice before the first step (notice.py) ------------------------------------------
    def _set_phase(self, phase: str) -> None:
        if self._guard is not None:
            self._guard.phase = phase

    def fault_point(self, point: str, step: int, process_id: int) -> None:
        """For tests only: the faults given to the session, at `point` (checkpoint/faults.py)."""
        if self._faults is not None:
            self._faults.at(point, step, process_id)

    def _begin_training(self) -> None:
        """Every rank, once, before its first step: the gang trains, or a notice came first
        and the rank stops here with nothing to save."""
        guard = self._guard
        if guard is None or guard.training:
            return
        if not guard.begin_training(self.env.init_timeout_seconds):
            self._stop_before_training(guard.phase)
        guard.phase = "training"

    def _stop_before_training(self, phase: str) -> None:
        """A notice before the gang's first step: nothing is newer than the committed
        checkpoint, so leave at once with the contract's code for a stop on notice. Called
        from whichever thread learnt it; ends the process (a second caller waits for that)."""
        self._stopping.acquire()
        env = self.env
        guard = self._guard
        since = guard.seconds_since_notice() if guard is not None else 0.0
        # jax.distributed is up (and the notice was written to it): leave with the gang.
        connected = guard is not None and guard.connected
        code, reason = inplace.stop_code(env)
        if code == contract.EXIT_RESTART_IN_PLACE and not connected \
                and not self._restarts.restarts_into_newer(env):
            code, reason = contract.EXIT_PREEMPTED_SAVED, "PreemptedSaved"
        from tardigrade_sdk.restore_choice import OWN_ROOT

        committed = self._checkpoints.committed() if self._checkpoints is not None else None
        # Mid-restore nothing is reported committed yet; the step being restored from this
        # job's root is (another job's, initFrom, is not this job's checkpoint).
        step = committed.step if committed is not None else (
            self.restore_step if self.restore_step >= 0
            and getattr(self.restore_choice, "source", OWN_ROOT) == OWN_ROOT else None)
        newest = (f"nothing newer than the committed step {step} to save"
                  if step is not None else "nothing trained to save")
        text = f"notice during {phase}: {newest}"
        message = contract.TerminationMessage(
            reason=reason, step=self.last_step or step, checkpoint_step=step,
            checkpoint_path=committed.path if committed is not None else None, message=text,
            attempt=env.attempt)
        record = {"event": "preempted_before_training", "phase": phase,
                  "checkpoint_step": step, "seconds_since_notice": round(since, 3)}
        (self.log if connected else JsonLog(env.process_id, attempt=env.attempt))(record)
        exit_code = code
        if code == contract.EXIT_RESTART_IN_PLACE:
            inplace.remember_exit(env, message)
            self._wait_for_word(since)
            if self._restarts.restarts_in_process(env) and attempts.in_child():
                exit_code = attempts.EXIT_NEXT_ATTEMPT
        write_termination(env.termination_log, message)
        self._stop_server()
        if connected:
            exit_gang(exit_code)  # every rank stops too: they meet, then leave together
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(exit_code)

    def _report_checkpoint(self) -> None:
        committed = self._checkpoints.committed() if self._checkpoints is not None else None
        if committed is not None and committed != self._reported:
            self._reported = committed
            self.metrics.checkpoint_step.set(committed.step)
            self.metrics.report(checkpoint_step=committed.step, checkpoint_path=committed.path,
                                checkpoint_time=committed.time)

    def termination(self, reason: str, message: str = "") -> contract.TerminationMessage:
        committed = self._checkpoints.committed() if self._checkpoints is not None else None
        return contract.TerminationMessage(
            reason=reason, step=self.last_step,
            checkpoint_step=committed.step if committed else None,
            checkpoint_path=committed.path if committed else None, message=message,
            attempt=self.env.attempt)

    # --- leaving ------------------------------------------------------------------------------
    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> bool:
        if exc is None:
            try:
                if self._memory is not None:
                    self._memory.close()
                if self._checkpoints is not None:
                    self._checkpoints.close()  # the last save commits before we say Succeeded
            except BaseException as err:
                self._leave_on_error(err)
                raise
            self.log({"event": "done", "step": self.last_step})
            self._leave(contract.EXIT_SUCCEEDED, self.termination("Succeeded"))
            return False
        if isinstance(exc, StopTraining):
            self._leave(exc.code, exc.message)
            # Stopped on notice, SIGKILL on its way: the interpreter's teardown (seconds on a
            # busy host) has nothing left to do that matters, and the exit code must arrive.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(attempts.EXIT_NEXT_ATTEMPT if exc.next_attempt_in_process else exc.code)
        if isinstance(exc, SystemExit | KeyboardInterrupt | GeneratorExit):
            return False
        self._leave_on_error(exc)
        return False

    def _leave(self, code: int, message: contract.TerminationMessage) -> None:
        import jax

        write_termination(self.env.termination_log, message)
        self._stop_server()
        # Every host reached this point at the same step, so the shutdown barrier is met.
        jax.distributed.shutdown()

    def _leave_on_error(self, err: BaseException) -> None:
        if self._stopping.locked():
            # A stop on notice is ending the process from another thread (and may have taken
            # the coordination service down under this one): its message stands.
            self._stopping.acquire()
        if isinstance(err, SystemExit | KeyboardInterrupt | GeneratorExit):
            return
        code, reason = exit_code_for(err)
        if code == contract.EXIT_FAILED:
            traceback.print_exception(err)
        # With the session started, the message names the last step and the last committed
        # checkpoint too (what a relaunch resumes from).
        _fail(self.env.termination_log, code, reason, err, self.termination(reason, str(err)))
        self._stop_server()
        exit_gang(code)

    def _stop_server(self) -> None:
        if self._memory is not None:
            self._memory.stop_serving()
        if self._server is not None:
            self._server.stop()
            self._server = None


def _abstract_state(init: Callable[[], Any]) -> Any:
    """`jax.eval_shape(init)`, with a replicated sharding over all devices where it has none."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    abstract = jax.eval_shape(init)
    replicated = NamedSharding(Mesh(jax.devices(), ("devices",)), PartitionSpec())

    def with_sharding(leaf: Any) -> Any:
        sharding = getattr(leaf, "sharding", None)
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding or replicated)

    return jax.tree_util.tree_map(with_sharding, abstract)
