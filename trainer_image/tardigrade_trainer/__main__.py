"""Image entry point: `python -m tardigrade_trainer`, configured by the operator contract."""

from __future__ import annotations

import logging
import os
import sys
from typing import TYPE_CHECKING, Any

from tardigrade_contract import contract
from tardigrade_sdk import attempts, inplace, phases

from tardigrade_trainer import cache_seal, compile_cache, step_identity
from tardigrade_trainer.config import ConfigError, TrainerConfig

if TYPE_CHECKING:
    from tardigrade_checkpoint.faults import SaveFaults


def _fail(path: str, code: int, reason: str, err: BaseException) -> int:
    from tardigrade_sdk.session import write_termination

    print(f"tardigrade-trainer: {reason}: {err}", file=sys.stderr, flush=True)
    write_termination(path, contract.TerminationMessage(reason=reason, message=str(err)))
    return code


def _environment() -> contract.TrainerEnvironment | int:
    """The operator's contract, or the exit code of a config error."""
    try:
        # A container restarted in place takes the newer of its env's world and the one its
        # operator's request left in the pod (inplace.newest_world): the pod's annotation,
        # which the env reads, is patched only once the whole gang runs again.
        return contract.TrainerEnvironment.from_env(inplace.newest_world(os.environ))
    except contract.ContractError as err:
        term = os.environ.get(contract.ENV_TERMINATION_LOG) or contract.DEFAULT_TERMINATION_LOG
        return _fail(term, contract.EXIT_CONFIG_ERROR, "ConfigError", err)


USAGE = f"""usage: python -m tardigrade_trainer

The reference trainer of a Tardigrade TrainingJob. The operator configures it through the
environment (the contract in tardigrade_contract.contract), not through arguments:
  {contract.ENV_JOB_NAME}, {contract.ENV_NUM_PROCESSES}, {contract.ENV_PROCESS_ID},
  {contract.ENV_COORDINATOR_ADDRESS}, {contract.ENV_CHECKPOINT_PATH},
  {contract.ENV_TRAINER_CONFIG}, ...
Exit codes: {contract.EXIT_SUCCEEDED} done, {contract.EXIT_PREEMPTED_SAVED} saved and \
preempted, {contract.EXIT_CONFIG_ERROR} config error, {contract.EXIT_FAILED} failed; the \
termination message goes to ${contract.ENV_TERMINATION_LOG}."""


def _pull_compilation_cache(cache: compile_cache.Location | None, key: bytes | None,
                            env: contract.TrainerEnvironment, config: TrainerConfig
                            ) -> tuple[compile_cache.RootMirror | None, dict[str, Any]]:
    """A cache in the checkpoint root (or another shared folder): this pod's local copy,
    filled before anything compiles with the entries sealed with the job's `key`. Storage that
    does not answer costs this start its cache, never the start itself."""
    if cache is None or cache.remote is None or key is None:
        return None, {}
    from tardigrade_checkpoint.storage import StorageRetries

    retries = StorageRetries(max_retries=config.checkpoint_storage_retries,
                             stall_seconds=config.checkpoint_storage_stall_seconds)
    mirror = compile_cache.RootMirror(cache, env.process_id, key, retries.context_spec())
    try:
        pulled = mirror.pull().fields("cache_pulled")
    except Exception as err:
        logging.getLogger(__name__).warning("compilation cache: %s not read: %s",
                                            cache.remote, err)
        pulled = {"cache_pull_error": str(err)}
    phases.mark("compilation_cache_pulled")
    return mirror, pulled


def main(argv: list[str] | None = None, faults: SaveFaults | None = None) -> int:
    """`faults`: for tests only (checkpoint/faults.py), passed to the session."""
    if {"-h", "--help"} & set(sys.argv[1:] if argv is None else argv):
        print(USAGE)
        return 0
    logging.basicConfig(level=os.environ.get("TARDIGRADE_LOG_LEVEL", "WARNING"))
    env = _environment()
    if isinstance(env, int):
        return env
    try:
        config = TrainerConfig.from_mapping(env.trainer_config)
        # The key that seals the entries of a shared compilation cache (compile_cache.py).
        cache_key = cache_seal.job_key(env.cache_key) if env.cache_key else None
    except (ConfigError, cache_seal.CacheKeyError) as err:
        return _fail(env.termination_log, contract.EXIT_CONFIG_ERROR, "ConfigError", err)

    from tardigrade_sdk import distributed

    distributed.configure_host_devices(config.devices_per_process)
    if env.num_processes == 1 and not attempts.wanted(os.environ):
        # A restart in process forks before any device is open: not there. Before the cache's
        # pull, which opening the devices does not need (nothing compiles before the cache is
        # configured below): the chip opens while the cache is copied.
        distributed.open_devices_early()
    cache = compile_cache.for_key(
        compile_cache.location(config.compilation_cache_dir, env.checkpoint_path,
                               config.compilation_cache_in_root), cache_key)
    in_children = attempts.wanted(os.environ)
    # A keeper that forks its attempts must not start TensorStore's threads first (TensorStore
    # aborts a process that forks after them): each attempt pulls in its own child.
    mirror, pulled = ((None, {}) if in_children
                      else _pull_compilation_cache(cache, cache_key, env, config))
    distributed.configure_compilation_cache(cache.local if cache else None)
    # The cached step's load starts as soon as the devices are open, not once the trainer's
    # modules are imported (on a TPU host that could be a second later): where the devices
    # open early, and the cache pulled above holds the entry (step_identity.py).
    early = (step_identity.EarlyPreload(cache.local, config)
             if cache is not None and env.num_processes == 1 and not in_children else None)

    from tardigrade_sdk.session import TrainingSession

    from tardigrade_trainer.train import Trainer, checkpoint_options

    phases.mark("imports_done")
    if in_children:
        # Every attempt runs in a child of this process, with its own world (attempts.py).
        attempts.run_attempts()
        env = _environment()
        if isinstance(env, int):
            return env
        mirror, pulled = _pull_compilation_cache(cache, cache_key, env, config)

    # The session turns every outcome into the contract's exit code and termination message.
    with TrainingSession(env=env, checkpoint_options=checkpoint_options(config),
                         faults=faults) as session:
        Trainer(session, config, compilation_cache=cache, mirror=mirror,
                cache_pulled=pulled, early_preload=early).run()
    return contract.EXIT_SUCCEEDED


if __name__ == "__main__":
    code = main()
    # Every outcome is decided and written by now (the termination message, the checkpoints
    # closed). The interpreter's teardown runs static destructors while JAX's and
    # TensorStore's C++ threads may still run, and once aborted a trainer that had finished
    # ("terminate called ... exception not rethrown", SIGABRT after its "done"): a success
    # must not end with a failure's exit code.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
