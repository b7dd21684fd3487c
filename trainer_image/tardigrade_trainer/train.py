"""The reference training loop: tiny GPT, AdamW, deterministic data, async checkpoints."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec
from tardigrade_checkpoint.faults import COMPILE
from tardigrade_checkpoint.manager import gathered_state_hash
from tardigrade_checkpoint.storage import StorageRetries
from tardigrade_sdk import distributed, phase_clock
from tardigrade_sdk.session import TrainingSession

from tardigrade_trainer import (
    compile_cache,
    compile_stats,
    compiled_step,
    data,
    mesh,
    model,
    step_cache,
    step_check,
    step_identity,
)
from tardigrade_trainer.config import TrainerConfig


def make_optimizer(config: TrainerConfig) -> optax.GradientTransformation:
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=config.learning_rate,
        warmup_steps=min(config.warmup_steps, config.steps),
        decay_steps=max(config.steps, config.warmup_steps + 1),
        end_value=config.learning_rate * 0.1,
    )
    return optax.adamw(schedule, weight_decay=config.weight_decay)


def abstract_target(abstract: Any, plan: mesh.MeshPlan) -> Any:
    """ShapeDtypeStructs carrying the current mesh's shardings: what restore reads into."""
    shardings = hax.partitioning.infer_resource_partitions(abstract, plan.axis_mapping, plan.mesh)
    leaves, treedef = jax.tree_util.tree_flatten(abstract)
    sharding_leaves = jax.tree_util.tree_leaves(
        shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding)
    )
    return jax.tree_util.tree_unflatten(
        treedef,
        [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
         for a, s in zip(leaves, sharding_leaves, strict=True)],
    )


def checkpoint_options(config: TrainerConfig) -> dict[str, Any]:
    """The `CheckpointManager` settings `spec.trainer` holds."""
    return {
        "barrier_timeout_seconds": config.checkpoint_barrier_timeout_seconds,
        "checksum": config.checkpoint_checksum,
        "storage": StorageRetries(max_retries=config.checkpoint_storage_retries,
                                  stall_seconds=config.checkpoint_storage_stall_seconds),
        "verify_restore": config.checkpoint_verify_restore,
        "restore_inflight_bytes": config.checkpoint_restore_inflight_mib << 20,
        # None: the automatic budget (stagingbudget.py); 0: never stage.
        "snapshot_device_bytes": (None if config.checkpoint_snapshot_device_mib is None
                                  else config.checkpoint_snapshot_device_mib << 20),
    }


class StepCompile:
    """The step being compiled (or loaded) in a daemon thread: a process that has nothing to
    train leaves without waiting for it."""

    def __init__(self, compile_step: Callable[[threading.Event], tuple[Any, step_cache.Outcome]],
                 example_args: tuple[Any, ...], lower: Callable[[], Any],
                 predicted: tuple[Any, Any]) -> None:
        """`compile_step(traced)` sets `traced` once its Python work (tracing, lowering) is
        done and the backend's (loading or compiling the program) begins. `lower()`: the step
        traced and lowered (for a step used untraced, its later check); `predicted`: its
        argument and output trees, worked out without tracing."""
        self.example_args = example_args
        self.lower = lower
        self.predicted = predicted
        self._done = threading.Event()
        self._traced = threading.Event()
        self._result: tuple[Any, step_cache.Outcome] | None = None
        self._error: BaseException | None = None
        # The program's memory analysis (its working memory is logged; the save's staging
        # budget leaves its needs to it): asked here, since it took 0.4 s of the loop's start
        # on a CPU.
        self.memory: Any = None
        self.working_bytes: int | None = None

        def run() -> None:
            try:
                self._result = compile_step(self._traced)
                self.memory = compiled_step.memory_analysis(self._result[0])
                self.working_bytes = compiled_step.working_memory_bytes(self.memory)
            except BaseException as err:  # handed to the caller of result()
                self._error = err
            finally:
                self._traced.set()
                self._done.set()

        threading.Thread(target=run, name="compile-step", daemon=True).start()

    def wait(self) -> None:
        self._done.wait()

    def wait_traced(self) -> None:
        """Until the step is traced and lowered (or failed): what follows (loading or
        compiling it) leaves the interpreter to other threads."""
        self._traced.wait()

    def result(self) -> tuple[Any, step_cache.Outcome]:
        self._done.wait()
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result


class Trainer:
    """The reference loop: one user of `TrainingSession`, which owns the operator's side."""

    DONATE = step_identity.DONATE  # the step's state, not its batch

    def __init__(self, session: TrainingSession, config: TrainerConfig, *,
                 compilation_cache: compile_cache.Location | None = None,
                 mirror: compile_cache.RootMirror | None = None,
                 cache_pulled: dict[str, Any] | None = None,
                 early_preload: step_identity.EarlyPreload | None = None) -> None:
        """`compilation_cache`: where JAX's cache is (configured before JAX compiled
        anything); `mirror`: the bucket it mirrors, pushed to once the step is compiled;
        `early_preload`: the cached step's load, started as the devices opened."""
        self.cache = compilation_cache
        self.mirror = mirror
        self._compiling: StepCompile | None = None
        self._check: step_check.ProgramCheck | None = None
        self._step_cache: step_cache.StepCache | None = None
        self._preload: step_cache.Preload | None = None
        self._early = early_preload
        self.preloaded_early = False
        self.cache_pulled = cache_pulled or {}
        self.session = session
        self.env = session.env
        self.config = config
        self.log = session.log
        self.metrics = session.metrics
        self.plan = mesh.build_mesh(config)
        self.optimizer = make_optimizer(config)

    def _init_state(self, key: jax.Array) -> dict[str, Any]:
        gpt = model.Gpt.init(self.config, key=key)
        return {"model": gpt, "opt": self.optimizer.init(eqx.filter(gpt, eqx.is_array))}

    def _train_step(
        self, state: dict[str, Any], x: hax.NamedArray, y: hax.NamedArray
    ) -> tuple[dict[str, Any], jax.Array]:
        loss, grads = eqx.filter_value_and_grad(lambda m: m.loss(x, y))(state["model"])
        updates, opt = self.optimizer.update(grads, state["opt"], eqx.filter(state["model"],
                                                                             eqx.is_array))
        return {"model": eqx.apply_updates(state["model"], updates), "opt": opt}, loss

    def _start_compiling(self, target: Any, batch_sharding: NamedSharding) -> StepCompile:
        """Lower the step for the state's shapes and shardings (`target`) and compile it, or
        load it from a cache, in a thread of its own: while the state is restored (or
        initialised), not after. A relaunch's restore and its step's compile or load are the
        two long phases of its start (seconds each on an accelerator)."""
        x, y = data.sharded_batch(self.config, 1, batch_sharding)
        cache, preload = self._step_cache, self._preload
        devices = list(self.plan.mesh.devices.flat)
        # The step returns the state's structure and its loss.
        predicted = compiled_step.predicted_trees(
            self._train_step, self.DONATE, (target, x, y),
            (target, jax.ShapeDtypeStruct((), jnp.float32)))

        def lower() -> Any:
            # The mesh and the axis mapping are the thread's own: enter the loop's.
            with jax.set_mesh(self.plan.mesh), hax.axis_mapping(self.plan.axis_mapping):
                return compiled_step.lower_abstract(
                    self._train_step, self.DONATE, self.plan.axis_mapping, target, x, y)

        def compile_step(traced: threading.Event) -> tuple[Any, step_cache.Outcome]:
            self.session.fault_point(COMPILE, 0, jax.process_index())
            if preload is not None and preload.expected and jax.process_count() == 1:
                # An entry named by what determines the program is there: the restore need
                # not wait for a trace. Used untraced where it was stored with trees the
                # lowering agreed with; its program is checked once the loop runs
                # (step_check.py). A gang traces first: ranks swapping programs at
                # different steps could disagree on their collectives.
                traced.set()
                got = preload.result()
                if got.loaded is not None and got.loaded.trees_predicted:
                    return (got.loaded.compiled_with(*predicted),
                            step_cache.Outcome("hit", got.seconds, untraced=True))
            return step_cache.compile_or_load(
                lower(), cache, devices, on_backend=traced.set,
                key=preload.key if preload is not None else None, preload=preload,
                predicted=predicted)

        return StepCompile(compile_step, (target, x, y), lower, predicted)

    def _start_checking(self, compiling: StepCompile) -> step_check.ProgramCheck | None:
        """For a step used untraced (`step_untraced`), its program checked beside the loop."""
        outcome = compiling.result()[1]
        preload = self._preload
        if not outcome.untraced or preload is None:
            return None
        loaded = preload.result().loaded
        assert loaded is not None
        cache, devices, key = self._step_cache, list(self.plan.mesh.devices.flat), preload.key
        predicted = compiling.predicted

        def compile_again(lowered: Any) -> Any:
            return step_cache.compile_or_load(lowered, cache, devices, key=key,
                                              predicted=predicted)[0]

        return step_check.ProgramCheck(compiling.lower, loaded.program, compile_again)

    def _start_preloading(self) -> None:
        """Read and load this rank's cached step onto the devices from now on, before the step
        is traced (step_cache.Preload), unless `__main__` started that load already, when the
        devices opened (step_identity.EarlyPreload): a relaunch's first step waits for that
        load, the longest part of its start once its compiles are cached. The entry is named
        by what determines the program (step_identity.preload_key) and used only if it holds
        the program lowered later."""
        if self.cache is None:
            return
        devices = list(self.plan.mesh.devices.flat)
        key = step_identity.preload_key(self.config, devices)
        if self._early is not None:
            self._preload = self._early.preload(key, devices)
            self.preloaded_early = self._preload is not None
        if self._preload is None:
            self._step_cache = step_cache.StepCache(self.cache.local, jax.process_index())
            self._preload = step_cache.Preload(self._step_cache, key, devices)
        self._step_cache = self._preload.cache

    def _meet_compiled(self, compiling: StepCompile) -> tuple[Any, dict[str, Any]]:
        """The step the loop is to call (the executable compiled or loaded, never jit's own:
        jit would compile it again wherever JAX's cache misses), and what the `compiled` log
        line says about getting it; in a gang, once every rank has it.

        XLA's CPU collectives give a peer a fixed 30 s to reach the first collective
        (GlooKeyValueStore::get, xla/backends/cpu/collectives/gloo_kv_store.cc); on a loaded
        host compiling the step can take longer than that, and the whole gang then fails. The
        meeting, in the coordination service's key-value store, waits as long as start-up may
        (`init_timeout_seconds`). Each rank loads the step from its own cache (step_cache.py)
        where it can."""
        compiled, outcome = compiling.result()
        step = compiled_step.CompiledStep(self._train_step, compiled, self.DONATE,
                                          compiling.example_args)
        working = compiling.working_bytes
        memory = {} if working is None else {"step_working_bytes": working}
        if jax.process_count() == 1:
            return step, {**outcome.fields(), **memory}
        timeout = self.env.init_timeout_seconds
        try:
            # Every rank waits for every rank's word: the meeting, and rank 0 learns how each
            # got its step (a relaunch whose compiled phase is long shows who compiled).
            ranks = distributed.gather_to_root(
                f"tardigrade-compiled-{self.env.attempt}",
                f"{outcome.result} {outcome.seconds:.3f}", timeout)
        except Exception as err:  # the coordination service's error for a missing peer
            raise distributed.PeerTimeoutError(
                f"not every rank had compiled the training step within {timeout:g} s: {err}"
            ) from err
        by_rank = {} if ranks is None else {"step_cache_ranks": ranks}  # rank 0's alone
        return step, {**outcome.fields(), **memory, **by_rank}

    def run(self) -> None:
        compile_stats.watch()
        try:
            with jax.set_mesh(self.plan.mesh), hax.axis_mapping(self.plan.axis_mapping):
                self._run()
        finally:
            # An interpreter that exits while XLA compiles in another thread aborts (SIGABRT,
            # "exception not rethrown"): a loop that returns early waits for its compile.
            if self._compiling is not None:
                self._compiling.wait()
            if self._check is not None:
                # A run shorter than the check (a relaunch preempted at once) still says
                # what it found.
                self._check.wait()
                self.log({"event": "step_checked", "step": None, **self._check.fields()})
            if self._preload is not None:
                self._preload.wait()
            if self._early is not None:
                self._early.wait()  # a load started early and not adopted

    def _run(self) -> None:
        env, config, plan, session = self.env, self.config, self.plan, self.session
        self._start_preloading()
        self.log({"event": "start", "job": env.job_name, "attempt": env.attempt,
                  "process_count": jax.process_count(), "devices": jax.device_count(),
                  "platform": jax.devices()[0].platform,
                  "mesh": plan.describe(), "per_device_batch":
                  config.global_batch_size // plan.data_size})
        key = jax.random.PRNGKey(config.seed)
        target = abstract_target(eqx.filter_eval_shape(self._init_state, key), plan)
        batch_sharding = NamedSharding(plan.mesh, PartitionSpec(plan.batch_axes, None))
        session.checkpoints  # noqa: B018  (the gang's restore decision, before the restore)
        if session.restore_step < config.steps:
            self._compiling = self._start_compiling(target, batch_sharding)
            # The restore (or the initialisation) waits until the step is traced: the step's
            # tracing and the restore are both mostly Python, and sharing the interpreter
            # slowed both (a TPU relaunch: 5.4 s restoring, the step's load 3 s late). Loading
            # or compiling the step, the longer part, then runs beside the restore.
            with session.phase_clock.during(phase_clock.COMPILE):
                self._compiling.wait_traced()
        state = session.restore_or(
            lambda: hax.named_jit(self._init_state, axis_resources=plan.axis_mapping)(key),
            target=target)
        start = session.start_step
        if config.debug_state_hash:
            self.log({"event": "state_hash", "step": start - 1, "hash": gathered_state_hash(state)})

        tokens_per_step = config.global_batch_size * config.seq_len
        step_fn: Any = None
        if start <= config.steps:
            if self._compiling is None:  # restored further back than the decision said
                self._compiling = self._start_compiling(target, batch_sharding)
            with session.phase_clock.during(phase_clock.COMPILE):
                step_fn, got = self._meet_compiled(self._compiling)
            early = {"step_preloaded_early": True} if self.preloaded_early else {}
            self.log({"event": "compiled", "step": start, **compile_stats.totals(), **got,
                      **early, **self.cache_pulled})
            if self.mirror is not None:
                compile_cache.push_in_background(self.mirror, lambda fields: self.log(
                    {"event": "compilation_cache_pushed", **fields}))
        window_start, window_steps = time.perf_counter(), 0

        def report(step: int, loss: jax.Array) -> None:
            nonlocal window_start, window_steps
            window_steps += 1
            if step % config.log_every == 0 or step == config.steps:
                loss_value = float(loss)  # waits for the step: only when we log
                elapsed = time.perf_counter() - window_start
                tps = tokens_per_step * window_steps / elapsed if elapsed > 0 else None
                self.metrics.tokens.inc(tokens_per_step * window_steps)
                window_start, window_steps = time.perf_counter(), 0
                session.report(step, loss=loss_value, tokens_per_second=tps)
            else:
                session.report(step)

        # A step is reported (its loss read) once the next one is dispatched: the device runs
        # the next step while the host waits for the loss and does its bookkeeping, so a host
        # hiccup shorter than a step (a save's threads holding the GIL) costs the device
        # nothing. A step to be saved is reported before its save, as progress must be.
        unreported: tuple[int, jax.Array] | None = None
        # The step's needs, which the save's staging budget leaves to it.
        step_memory = self._compiling.memory if self._compiling is not None else None
        checking = False
        for step in session.steps(config.steps):
            x, y = data.sharded_batch(config, step, batch_sharding)
            state, loss = step_fn(state, x, y)
            if self._check is not None and self._check.done():
                self.log({"event": "step_checked", "step": step, **self._check.fields()})
                if self._check.replacement is not None:
                    step_fn = compiled_step.CompiledStep(
                        self._train_step, self._check.replacement, self.DONATE,
                        self._compiling.example_args)
                self._check = None
            session.prepare_save(state, step_program=step_memory)
            if unreported is not None:
                report(*unreported)
                if not checking and self._compiling is not None:
                    # Once the first step is reported: the check's tracing then shares the
                    # interpreter with the loop, not with the start (on a TPU, started with
                    # the first step, it delayed that step's end by 0.6 s).
                    checking, self._check = True, self._start_checking(self._compiling)
            unreported = (step, loss)
            reason = session.save_reason(step)
            if reason is not None:
                report(*unreported)
                unreported = None
                if config.debug_state_hash:
                    self.log({"event": "state_hash", "step": step,
                              "hash": gathered_state_hash(state)})
                session.save(step, state, reason, mesh=plan.describe(),
                             extra={"config": dataclasses.asdict(config)})
        if unreported is not None:
            report(*unreported)
