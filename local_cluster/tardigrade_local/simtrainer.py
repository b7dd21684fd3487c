"""A stand-in for the trainer image that obeys the operator contract without JAX.

    python -m tardigrade_local.simtrainer      (the pod's command; the operator sets the env)

It reads `TrainerEnvironment` from the environment like the real trainer and keeps every
promise the operator relies on, cheaply enough to run dozens of gangs on two cores:
- steps at `trainer.step_seconds` (default 0.05) up to `trainer.steps`; rank 0 serves
  `/progress` on the progress port;
- "checkpoints" are marker files `step_<N>` under an absolute checkpoint path, written
  atomically every `checkpoint.interval.steps`; a numbered restore step (the operator's pin)
  resumes from the newest committed step, and exits 3 when none is at least that new, as the
  real trainer does (no lineage, ownership or rollback here);
- SIGTERM with saveOnPreemption: commit the current step, write the termination message
  (`PreemptedSaved`) and exit 75; without it the signal kills the process (143);
- done: termination message `Succeeded`, exit 0; a bad environment: exit 2.

Unlike the real trainer, ranks do not wait for each other: gang semantics are the
operator's, and this process only has to answer it the way a trainer does.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from types import FrameType

from tardigrade_contract import contract
from tardigrade_sdk.metrics import Metrics, ProgressServer

from tardigrade_local.markers import MarkerCheckpoints, choose_restore


def _terminate(env: contract.TrainerEnvironment, code: int, reason: str, step: int | None,
               saved: int | None, ckpt: MarkerCheckpoints, message: str = "") -> int:
    text = contract.TerminationMessage(
        reason=reason, step=step, checkpoint_step=saved,
        checkpoint_path=ckpt.path(saved) if saved is not None else None, message=message,
    ).to_json()
    with open(env.termination_log, "w") as f:
        f.write(text)
    return code


def run(env: contract.TrainerEnvironment) -> int:
    ckpt = MarkerCheckpoints(env.checkpoint_path)
    config = env.trainer_config
    steps = int(config.get("steps", 100))
    step_seconds = float(config.get("step_seconds", 0.05))
    if not os.path.isabs(env.checkpoint_path):
        return _terminate(env, contract.EXIT_CONFIG_ERROR, "ConfigError", None, None, ckpt,
                          "the simulated trainer needs an absolute checkpoint path")
    try:
        saved = choose_restore(env, ckpt)
    except LookupError as err:
        return _terminate(env, contract.EXIT_CHECKPOINT_CORRUPT, "CheckpointCorrupt", None,
                          None, ckpt, str(err))
    stop = threading.Event()
    if env.save_on_preemption:
        def on_sigterm(signum: int, frame: FrameType | None) -> None:
            stop.set()
        signal.signal(signal.SIGTERM, on_sigterm)
    metrics = Metrics()
    server = None
    if env.process_id == 0 and env.progress_port is not None:
        host = os.environ.get(contract.ENV_POD_IP, "")
        server = ProgressServer(metrics, env.progress_port, host,
                                progress_token=env.progress_token).start()
    step = saved or 0
    metrics.report(step=step, total_steps=steps, checkpoint_step=saved,
                   checkpoint_path=ckpt.path(saved) if saved is not None else None)
    interval = env.checkpoint_interval_steps
    try:
        while step < steps:
            if stop.wait(step_seconds):
                ckpt.commit(step)
                saved = step
                return _terminate(env, contract.EXIT_PREEMPTED_SAVED, "PreemptedSaved", step,
                                  saved, ckpt, f"saved step {step} on SIGTERM")
            step += 1
            if (interval and step % interval == 0) or step == steps:
                ckpt.commit(step)
                saved = step
            metrics.report(step=step, loss=1.0 / step, checkpoint_step=saved,
                           checkpoint_path=ckpt.path(saved) if saved is not None else None,
                           checkpoint_time=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        return _terminate(env, contract.EXIT_SUCCEEDED, "Succeeded", step, saved, ckpt)
    finally:
        if server is not None:
            server.stop()


def main() -> int:
    try:
        env = contract.TrainerEnvironment.from_env()
    except contract.ContractError as err:
        path = os.environ.get(contract.ENV_TERMINATION_LOG) or contract.DEFAULT_TERMINATION_LOG
        with open(path, "w") as f:
            f.write(contract.TerminationMessage(reason="ConfigError", message=str(err)).to_json())
        return contract.EXIT_CONFIG_ERROR
    return run(env)


if __name__ == "__main__":
    sys.exit(main())
