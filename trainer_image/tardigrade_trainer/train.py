"""The reference training loop: tiny GPT, AdamW, deterministic data, async checkpoints."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any

import equinox as eqx
import haliax as hax
import jax
import numpy as np
import optax
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

from tardigrade_trainer import contract, data, mesh, model, restore_choice, testhooks
from tardigrade_trainer.checkpoint import (
    CheckpointIOError,
    CheckpointManager,
    KeepEvery,
    KeepLast,
    SaveInterval,
    keep_union,
)
from tardigrade_trainer.checkpoint.deadline import Deadline
from tardigrade_trainer.checkpoint.manager import gathered_state_hash
from tardigrade_trainer.checkpoint.sharedprobe import check_shared
from tardigrade_trainer.checkpoint.storage import StorageRetries
from tardigrade_trainer.config import TrainerConfig
from tardigrade_trainer.logs import JsonLog
from tardigrade_trainer.metrics import Metrics, ProgressServer
from tardigrade_trainer.preemption import PreemptionWatcher, save_deadline, window_overrun


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


def keep_policy(env: contract.TrainerEnvironment) -> Any:
    policies: list[Any] = [KeepLast(env.checkpoint_keep_last or 1)]
    if env.checkpoint_keep_every:
        policies.append(KeepEvery(env.checkpoint_keep_every))
    return keep_union(*policies)


class Trainer:
    def __init__(self, env: contract.TrainerEnvironment, config: TrainerConfig) -> None:
        self.env = env
        self.config = config
        self.log = JsonLog(jax.process_index())
        self.metrics = Metrics()
        self.plan = mesh.build_mesh(config)
        self.optimizer = make_optimizer(config)
        self.last_step = 0
        self.manager = CheckpointManager(
            env.checkpoint_path,
            keep=keep_policy(env),
            barrier_timeout_seconds=config.checkpoint_barrier_timeout_seconds,
            on_event=self._on_checkpoint_event,
            checksum=config.checkpoint_checksum,
            storage=StorageRetries(max_retries=config.checkpoint_storage_retries,
                                   stall_seconds=config.checkpoint_storage_stall_seconds),
            verify_restore=config.checkpoint_verify_restore,
            restore_inflight_bytes=config.checkpoint_restore_inflight_mib << 20,
        )

    def _restore(self, choice: restore_choice.RestoreChoice, target: Any) -> tuple[Any, Any]:
        if choice.source == restore_choice.OWN_ROOT:
            return self.manager.restore(choice.step, target)
        assert self.env.init_from_path is not None
        # Another job's root: read only (no claim, no retention, no partial collection).
        source = CheckpointManager(self.env.init_from_path, storage=self.manager.storage,
                                   verify_restore=self.config.checkpoint_verify_restore,
                                   on_event=self._on_checkpoint_event)
        try:
            return source.restore(choice.step, target)
        finally:
            source.close()

    def _on_checkpoint_event(self, event: dict[str, Any]) -> None:
        self.log(event)
        if event["event"] == "checkpoint_committed":
            self.metrics.checkpoint_step.set(event["step"])
            self.metrics.checkpoint_seconds.observe(event["seconds"])
            info = self.manager.last_committed
            self.metrics.report(checkpoint_step=event["step"], checkpoint_path=event["path"],
                                checkpoint_time=info.time if info else None)
        elif event["event"] == "checkpoint_failed":
            self.metrics.checkpoint_failures.inc()

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

    def termination(self, reason: str, message: str = "") -> contract.TerminationMessage:
        info = self.manager.last_committed
        return contract.TerminationMessage(
            reason=reason, step=self.last_step,
            checkpoint_step=info.step if info else None,
            checkpoint_path=info.path if info else None, message=message,
        )

    def run(self) -> tuple[int, contract.TerminationMessage]:
        env, plan = self.env, self.plan
        server = None
        if env.progress_port is not None and jax.process_index() == 0:
            server = ProgressServer(self.metrics, env.progress_port).start()
        try:
            with jax.set_mesh(plan.mesh), hax.axis_mapping(plan.axis_mapping):
                return self._run()
        finally:
            if server is not None:
                server.stop()

    def _run(self) -> tuple[int, contract.TerminationMessage]:
        env, config, plan = self.env, self.config, self.plan
        self.log({"event": "start", "job": env.job_name, "attempt": env.attempt,
                  "process_count": jax.process_count(), "devices": jax.device_count(),
                  "mesh": plan.describe(), "per_device_batch":
                  config.global_batch_size // plan.data_size})
        self.manager.check_writable()
        # Before anything is saved or restored: a root private to each host would take
        # checkpoints that no gang can restore.
        check_shared(self.manager.root, process_id=jax.process_index(),
                     process_count=jax.process_count(),
                     context_spec=self.manager.storage.context_spec(),
                     barrier_timeout_seconds=config.checkpoint_barrier_timeout_seconds)
        choice = restore_choice.choose(env, self.manager)
        # No save of this gang can be in flight yet, so every partial checkpoint is garbage.
        self.manager.collect_partials()
        key = jax.random.PRNGKey(config.seed)
        if choice.restores:
            target = abstract_target(eqx.filter_eval_shape(self._init_state, key), plan)
            state, info = self._restore(choice, target)
            self.manager.last_committed = info
            start = int(info.extra.get("data_position", choice.step + 1))
            self.metrics.report(checkpoint_step=info.step, checkpoint_path=info.path,
                                checkpoint_time=info.time)
        else:
            state = hax.named_jit(self._init_state, axis_resources=plan.axis_mapping)(key)
            start = 1
        # Deletes the keep policy owes from a save on notice (which skips them).
        self.manager.apply_retention()
        self.last_step = start - 1
        if config.debug_state_hash:
            self.log({"event": "state_hash", "step": start - 1, "hash": gathered_state_hash(state)})

        step_fn = hax.named_jit(self._train_step, axis_resources=plan.axis_mapping,
                                donate_args=(True, False, False))
        batch_sharding = NamedSharding(plan.mesh, PartitionSpec(plan.batch_axes, None))
        interval = SaveInterval(env.checkpoint_interval_steps, env.checkpoint_interval_seconds)
        watcher = PreemptionWatcher() if env.save_on_preemption else None
        tokens_per_step = config.global_batch_size * config.seq_len
        window_start, window_steps = time.perf_counter(), 0

        for step in range(start, config.steps + 1):
            x, y = data.sharded_batch(config, step, batch_sharding)
            state, loss = step_fn(state, x, y)
            self.last_step = step
            window_steps += 1
            if step % config.log_every == 0 or step == config.steps:
                loss_value = float(loss)  # waits for the step: only when we log
                elapsed = time.perf_counter() - window_start
                tps = tokens_per_step * window_steps / elapsed if elapsed > 0 else None
                logged_steps = window_steps
                window_start, window_steps = time.perf_counter(), 0
                self.log({"event": "step", "step": step, "loss": loss_value,
                          "tokens_per_second": tps})
                self.metrics.step.set(step)
                self.metrics.loss.set(loss_value)
                self.metrics.tokens.inc(tokens_per_step * logged_steps)
                self.metrics.report(step=step, loss=loss_value, tokens_per_second=tps,
                                    total_steps=config.steps)
            testhooks.hit("step_end", step, jax.process_index())
            preempted = watcher is not None and watcher.should_stop(step)
            due = interval.due_by_step(step) or step == config.steps
            if interval.seconds is not None:
                # Clocks differ between hosts: process 0 decides, everyone follows.
                by_time = np.int32(interval.due_by_time())
                if jax.process_count() > 1:
                    by_time = multihost_utils.broadcast_one_to_all(by_time)
                due = due or bool(by_time)
            if due and not preempted:
                self._save(step, state, reason="interval")
                interval.saved()
            if preempted:
                assert watcher is not None and watcher.noticed_at is not None
                until = save_deadline(watcher.noticed_at, env.shutdown_window_seconds)
                try:
                    self._save(step, state, reason="preemption", until=until)
                    self.manager.wait(until)
                except CheckpointIOError as err:
                    # Not "PreemptedSaved": the operator must resume from the older commit.
                    self.log({"event": "preempted_unsaved", "step": step, "error": str(err),
                              "seconds_since_notice": round(watcher.seconds_since_notice(), 3)})
                    return contract.EXIT_CHECKPOINT_IO_ERROR, self.termination(
                        "CheckpointIOError", f"preempted at step {step}; saving it failed: {err}")
                used = watcher.seconds_since_notice()
                self.log({"event": "preempted", "step": step,
                          "seconds_since_notice": round(used, 3),
                          "shutdown_window_seconds": env.shutdown_window_seconds})
                overrun = window_overrun(used, env.shutdown_window_seconds)
                if overrun is not None:
                    self.log({"event": "shutdown_window_exceeded", "level": "warning",
                              "step": step, "message": overrun})
                return contract.EXIT_PREEMPTED_SAVED, self.termination(
                    "PreemptedSaved", f"saved step {step} on SIGTERM")
        self.manager.close()
        self.log({"event": "done", "step": self.last_step})
        return contract.EXIT_SUCCEEDED, self.termination("Succeeded")

    def _save(self, step: int, state: dict[str, Any], reason: str,
              until: Deadline | None = None) -> None:
        # Storage failed the previous save (logged and counted by its checkpoint_failed
        # event)? The last commit is intact, so keep training and try again now.
        with contextlib.suppress(CheckpointIOError):
            self.manager.wait(until)
        if self.config.debug_state_hash:
            self.log({"event": "state_hash", "step": step, "hash": gathered_state_hash(state)})
        blocked = self.manager.save(
            step, state, mesh=self.plan.describe(),
            extra={"data_position": step + 1, "reason": reason,
                   "config": dataclasses.asdict(self.config)},
            deadline=until,
        )
        self.metrics.checkpoint_blocked.observe(blocked)
