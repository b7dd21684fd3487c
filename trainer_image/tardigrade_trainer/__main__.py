"""Image entry point: `python -m tardigrade_trainer`, configured by the operator contract."""

from __future__ import annotations

import logging
import os
import sys
import traceback
from typing import Any

from tardigrade_trainer import contract
from tardigrade_trainer.config import ConfigError, TrainerConfig


def write_termination(path: str, message: contract.TerminationMessage) -> None:
    try:
        with open(path, "w") as f:
            f.write(message.to_json())
    except OSError as err:
        print(f"cannot write termination log {path}: {err}", file=sys.stderr)


def _fail(path: str, code: int, reason: str, err: BaseException, trainer: Any = None) -> int:
    """Report and return `code`; with the trainer, the message names the last step and the
    last committed checkpoint too (what a relaunch resumes from)."""
    print(f"tardigrade-trainer: {reason}: {err}", file=sys.stderr, flush=True)
    message = (contract.TerminationMessage(reason=reason, message=str(err)) if trainer is None
               else trainer.termination(reason, str(err)))
    write_termination(path, message)
    return code


USAGE = f"""usage: python -m tardigrade_trainer

The reference trainer of a Tardigrade TrainingJob. The operator configures it through the
environment (the contract in tardigrade_trainer.contract), not through arguments:
  {contract.ENV_JOB_NAME}, {contract.ENV_NUM_PROCESSES}, {contract.ENV_PROCESS_ID},
  {contract.ENV_COORDINATOR_ADDRESS}, {contract.ENV_CHECKPOINT_PATH},
  {contract.ENV_TRAINER_CONFIG}, ...
Exit codes: {contract.EXIT_SUCCEEDED} done, {contract.EXIT_PREEMPTED_SAVED} saved and \
preempted, {contract.EXIT_CONFIG_ERROR} config error, {contract.EXIT_FAILED} failed; the \
termination message goes to ${contract.ENV_TERMINATION_LOG}."""


def main(argv: list[str] | None = None) -> int:
    if {"-h", "--help"} & set(sys.argv[1:] if argv is None else argv):
        print(USAGE)
        return 0
    logging.basicConfig(level=os.environ.get("TARDIGRADE_LOG_LEVEL", "WARNING"))
    try:
        env = contract.TrainerEnvironment.from_env()
    except contract.ContractError as err:
        term = os.environ.get(contract.ENV_TERMINATION_LOG) or contract.DEFAULT_TERMINATION_LOG
        return _fail(term, contract.EXIT_CONFIG_ERROR, "ConfigError", err)
    try:
        config = TrainerConfig.from_mapping(env.trainer_config)
    except ConfigError as err:
        return _fail(env.termination_log, contract.EXIT_CONFIG_ERROR, "ConfigError", err)

    from tardigrade_trainer import distributed

    distributed.configure_host_devices(config.devices_per_process)
    distributed.configure_compilation_cache(config.compilation_cache_dir)
    try:
        distributed.initialize(env)
    except distributed.PeerTimeoutError as err:
        return _fail(env.termination_log, contract.EXIT_PEER_TIMEOUT, "PeerTimeout", err)
    except distributed.peerauth.PeerAuthError as err:
        return _fail(env.termination_log, contract.EXIT_CONFIG_ERROR, "ConfigError", err)

    import jax

    from tardigrade_trainer.checkpoint import (
        CheckpointCorruptError,
        CheckpointIOError,
        CheckpointMissingError,
        CheckpointUsageError,
        FencedError,
        ForeignRootError,
    )
    from tardigrade_trainer.train import Trainer

    trainer = None
    try:
        trainer = Trainer(env, config)
        code, message = trainer.run()
    except (ConfigError, CheckpointUsageError) as err:
        code = _fail(env.termination_log, contract.EXIT_CONFIG_ERROR, "ConfigError", err, trainer)
    except ForeignRootError as err:
        code = _fail(env.termination_log, contract.EXIT_CONFIG_ERROR, "CheckpointRootOwned", err,
                     trainer)
    except FencedError as err:
        # A stale gang: the operator already moved on to a newer attempt or job.
        code = _fail(env.termination_log, contract.EXIT_FAILED, "Fenced", err, trainer)
    except CheckpointMissingError as err:
        code = _fail(env.termination_log, contract.EXIT_CHECKPOINT_CORRUPT, "CheckpointMissing",
                     err, trainer)
    except CheckpointCorruptError as err:
        code = _fail(env.termination_log, contract.EXIT_CHECKPOINT_CORRUPT, "CheckpointCorrupt",
                     err, trainer)
    except CheckpointIOError as err:
        code = _fail(env.termination_log, contract.EXIT_CHECKPOINT_IO_ERROR, "CheckpointIOError",
                     err, trainer)
    except Exception as err:
        traceback.print_exc()
        code = _fail(env.termination_log, contract.EXIT_FAILED, "Failed", err, trainer)
    else:
        write_termination(env.termination_log, message)
        # Every host reached this point at the same step, so the shutdown barrier is met.
        jax.distributed.shutdown()
        if code != contract.EXIT_SUCCEEDED:
            # Stopped on notice, SIGKILL on its way: the interpreter's teardown (seconds on a
            # busy host) has nothing left to do that matters, and the exit code must arrive.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        return code
    _exit_gang(code)
    return code


def _exit_gang(code: int) -> None:
    """Leave after a failure without taking healthy-but-failing peers down with us.

    When rank 0 exits, its coordination service goes with it and JAX aborts every peer still
    connected, before they could write their own termination message. If all ranks fail
    together (e.g. a config error every rank sees) they meet at a short barrier and shut down
    cleanly; if the peers are gone or stuck, the barrier times out and we leave at once.
    """
    import jax

    from tardigrade_trainer import distributed

    sys.stdout.flush()
    sys.stderr.flush()
    try:
        distributed.barrier("tardigrade-exit-on-failure", 15)
        jax.distributed.shutdown()
    except Exception as err:
        print(f"tardigrade-trainer: leaving without a clean shutdown: {err}", file=sys.stderr,
              flush=True)
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
