"""The contract between the operator and the trainer pods: one place, no third-party imports.

The operator renders these environment variables into every trainer pod; the trainer reads
them back with `TrainerEnvironment.from_env()`. Exit codes and the termination message tell
the operator why a rank stopped. Both sides import this module, so a change here is a change
of the wire format and must stay backward compatible.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from tardigrade_contract import boundedjson

# --- environment variables set by the operator on every rank ---------------------------------
# Records of one level (worlds, termination messages): anything nested below is cut out
# while decoding (boundedjson), and is then a wrong type for its key.
FLAT_RECORD_LIMIT = 2
ENV_JOB_NAME = "TARDIGRADE_JOB_NAME"
ENV_NAMESPACE = "TARDIGRADE_NAMESPACE"
ENV_ATTEMPT = "TARDIGRADE_ATTEMPT"
ENV_COORDINATOR_ADDRESS = "TARDIGRADE_COORDINATOR_ADDRESS"  # host:port of rank 0
ENV_NUM_PROCESSES = "TARDIGRADE_NUM_PROCESSES"
ENV_PROCESS_ID = "TARDIGRADE_PROCESS_ID"
ENV_CHECKPOINT_PATH = "TARDIGRADE_CHECKPOINT_PATH"  # gs://bucket/prefix or an absolute path
# "latest", "none" or the operator's pin: a step number N means "the newest committed step of
# the current line, which must be N or newer" (keep policies delete older steps, so N itself
# may be gone; if nothing at N or newer is committed, the trainer says so and stops).
ENV_RESTORE_STEP = "TARDIGRADE_RESTORE_STEP"
ENV_JOB_UID = "TARDIGRADE_JOB_UID"  # the root record's owner (with namespace and name)
# spec.checkpoint.restoreStep: restore exactly this step and continue from it as a new line;
# the request id makes it happen once, however often the gang is relaunched.
ENV_ROLLBACK_STEP = "TARDIGRADE_ROLLBACK_STEP"
ENV_ROLLBACK_REQUEST = "TARDIGRADE_ROLLBACK_REQUEST"
# spec.checkpoint.initFrom: another root to start from (read only) while this one has no line.
ENV_INIT_FROM_PATH = "TARDIGRADE_INIT_FROM_PATH"
ENV_INIT_FROM_STEP = "TARDIGRADE_INIT_FROM_STEP"
ENV_CHECKPOINT_INTERVAL_STEPS = "TARDIGRADE_CHECKPOINT_INTERVAL_STEPS"
ENV_CHECKPOINT_INTERVAL_SECONDS = "TARDIGRADE_CHECKPOINT_INTERVAL_SECONDS"
# spec.checkpoint.interval.continuous.maxLoopFraction: continuous saving (the next save starts
# once the last one is done) within that fraction of the loop's time; unset: off.
ENV_CHECKPOINT_CONTINUOUS_MAX_LOOP_FRACTION = "TARDIGRADE_CHECKPOINT_CONTINUOUS_MAX_LOOP_FRACTION"
ENV_CHECKPOINT_KEEP_LAST = "TARDIGRADE_CHECKPOINT_KEEP_LAST"
ENV_CHECKPOINT_KEEP_EVERY = "TARDIGRADE_CHECKPOINT_KEEP_EVERY"
ENV_SAVE_ON_PREEMPTION = "TARDIGRADE_SAVE_ON_PREEMPTION"
ENV_PROGRESS_PORT = "TARDIGRADE_PROGRESS_PORT"
ENV_TRAINER_CONFIG = "TARDIGRADE_TRAINER_CONFIG"  # JSON object: spec.trainer
ENV_TERMINATION_LOG = "TARDIGRADE_TERMINATION_LOG"
ENV_INIT_TIMEOUT_SECONDS = "TARDIGRADE_INIT_TIMEOUT_SECONDS"
# How long JAX's coordination service waits for a silent rank before it aborts every rank
# (`jax.distributed.initialize(heartbeat_timeout_seconds=...)`; JAX's default 100 s when
# unset). The operator sets it past its own detection of a lost node for gangs whose
# survivors it keeps (memory tier): an aborted survivor would take its memory along.
ENV_HEARTBEAT_TIMEOUT_SECONDS = "TARDIGRADE_HEARTBEAT_TIMEOUT_SECONDS"
# Seconds between SIGTERM and SIGKILL on a node shutdown: the save-on-notice deadline.
ENV_SHUTDOWN_WINDOW_SECONDS = "TARDIGRADE_SHUTDOWN_WINDOW_SECONDS"
# spec.accelerator.kind: what the job asked to train on. A rank whose JAX backend is not that
# accelerator stops at start-up (exit 2, reason AcceleratorUnavailable) instead of training on
# the CPU. Unset: no check (a trainer run outside the operator).
ENV_ACCELERATOR = "TARDIGRADE_ACCELERATOR"
ACCELERATOR_KINDS = ("cpu", "nvidia-gpu", "tpu")
# The pod's own IP (downward API). Servers bind to it rather than 0.0.0.0, so that pods that
# share one network namespace (the local cluster) do not collide on the same ports.
ENV_POD_IP = "TARDIGRADE_POD_IP"
# The pod's projected service-account token for the rendezvous (audience RENDEZVOUS_AUDIENCE),
# a file the kubelet refreshes: ranks prove who they are with it, rank 0 checks it with a
# TokenReview. Read at each hello, so pods kept across attempts present a fresh token.
ENV_RENDEZVOUS_TOKEN_FILE = "TARDIGRADE_RENDEZVOUS_TOKEN_FILE"
# "true" turns rendezvous authentication off: only for trainers run outside a cluster (tests,
# a laptop), where no API server can review tokens. The operator never sets it.
ENV_RENDEZVOUS_INSECURE = "TARDIGRADE_RENDEZVOUS_INSECURE"
# Restart in place: the gang's new world as JSON, from the pod annotation ANNOTATION_WORLD
# through `fieldRef: metadata.annotations[...]`. The kubelet resolves such env vars again at
# every container start (pkg/kubelet/kubelet_pods.go makeEnvironmentVariables), so a container
# restarted in its kept pod sees the world the operator wrote after the pod was created; when
# set, it overrides the static variables named in WORLD_KEYS.
ENV_WORLD = "TARDIGRADE_WORLD"
ANNOTATION_WORLD = "tardigrade.dev/world"
WORLD_KEYS = {
    "attempt": ENV_ATTEMPT,
    "numProcesses": ENV_NUM_PROCESSES,
    "processId": ENV_PROCESS_ID,
    "coordinatorAddress": ENV_COORDINATOR_ADDRESS,
    "restoreStep": ENV_RESTORE_STEP,
}
# Restart in place is on for this pod: a directory that outlives the container (an emptyDir),
# where the trainer keeps the attempt it last ran so that a restart on a stale world is
# refused. With it set, a rank stops after a save on notice with EXIT_RESTART_IN_PLACE.
ENV_RESTART_IN_PLACE_DIR = "TARDIGRADE_RESTART_IN_PLACE_DIR"
# The key the operator presents (Authorization: Bearer) when it asks rank 0 to save and
# restart the gang in place (POST RESTART_IN_PLACE_PATH on the progress port).
ENV_RESTART_KEY = "TARDIGRADE_RESTART_KEY"
# Restart in process ("true", with ENV_RESTART_IN_PLACE_DIR): a kept rank that saved and got its
# new world replaces its own process image (exec) instead of exiting 77 for its kubelet to
# restart the container. No container restart: no kubelet status write, no crash-loop back-off;
# the container's restart rule stays for a rank that exits 77 anyway.
ENV_RESTART_IN_PROCESS = "TARDIGRADE_RESTART_IN_PROCESS"
RESTART_IN_PLACE_PATH = "/restart-in-place"
# The restart request's query parameter naming the ranks lost without notice (comma-separated):
# the gang cannot save without them, so a kept rank restarts at once, without a save on
# notice, and restores the newest step its memory tier and the bucket hold.
RESTART_LOST_RANKS_PARAM = "lost"
# How long a rank that got no SIGTERM of its own (its notice came from a peer: its pod is not
# being stopped) waits for the operator's word. Nothing kills it meanwhile, and without the
# word it can only restart on the world it ran: on a busy control plane the word came more
# than 5 s after the save, the kept ranks had left, and the recovery was done a second time,
# recreating every rank. Its own SIGTERM during the wait brings the wait down to a going pod's.
# The operator asks such a rank again after as long (operator restart_in_place.py).
PEER_NOTICE_RELEASE_WAIT_SECONDS = 30.0
# The job's keys live in a Secret the operator creates for each job (owned by the job, so gone
# with it) and reach only the job's pods, through `secretKeyRef`: never as literal env values,
# which anyone who may read pods could read. The restart key above is SECRET_RESTART_KEY in it.
SECRET_RESTART_KEY = "restart-key"
# The bearer token the operator presents on GET /progress (rank 0 answers no one else).
ENV_PROGRESS_TOKEN = "TARDIGRADE_PROGRESS_TOKEN"
SECRET_PROGRESS_TOKEN = "progress-token"
# The key that authenticates compilation-cache entries (HMAC-SHA256) kept where others may
# write (the checkpoint root, a gs:// cache): an entry without a valid tag is never loaded.
ENV_CACHE_KEY = "TARDIGRADE_CACHE_KEY"
SECRET_CACHE_KEY = "cache-key"
# The request's body is the rank's new world (the annotation's JSON): a kept rank need not wait
# for the kubelet to see the operator's pod patch. Worlds are ~200 bytes; more is refused.
MAX_WORLD_BYTES = 4096
RENDEZVOUS_AUDIENCE = "tardigrade.dev/rendezvous"
RENDEZVOUS_TOKEN_DIR = "/var/run/secrets/tardigrade.dev/rendezvous"
RENDEZVOUS_TOKEN_FILE = f"{RENDEZVOUS_TOKEN_DIR}/token"

# The memory tier (spec.checkpoint.memoryTier, docs/memory-tier.md): every rank snapshots its
# own shards every INTERVAL steps into DIR (the pod's memory volume) and sends a copy to
# REPLICAS peers over HTTP on REPLICA_PORT, authenticated with the job's replica key (Secret).
ENV_MEMORY_TIER_DIR = "TARDIGRADE_MEMORY_TIER_DIR"
ENV_MEMORY_TIER_INTERVAL = "TARDIGRADE_MEMORY_TIER_INTERVAL"
ENV_MEMORY_TIER_REPLICAS = "TARDIGRADE_MEMORY_TIER_REPLICAS"
# What a memory step does while the previous snapshot's commit still runs on some rank: skip
# (the default: the loop never waits) or wait (the loop waits for it). Rendered from
# spec.checkpoint.memoryTier.whenBusy.
ENV_MEMORY_TIER_WHEN_BUSY = "TARDIGRADE_MEMORY_TIER_WHEN_BUSY"
MEMORY_TIER_SKIP = "skip"
MEMORY_TIER_WAIT = "wait"
ENV_REPLICA_KEY = "TARDIGRADE_REPLICA_KEY"
SECRET_REPLICA_KEY = "replica-key"
ENV_REPLICA_PORT = "TARDIGRADE_REPLICA_PORT"
DEFAULT_REPLICA_PORT = 8478
MEMORY_TIER_VOLUME_PATH = "/var/run/tardigrade/memory-tier"

RESTORE_LATEST = "latest"
RESTORE_NONE = "none"
DEFAULT_COORDINATOR_PORT = 8476
DEFAULT_PROGRESS_PORT = 8477
DEFAULT_TERMINATION_LOG = "/dev/termination-log"
# What the kubelet gives regular pods on a GKE spot reclaim: min(pod grace, shutdownGracePeriod
# - shutdownGracePeriodCriticalPods) = the first 15 s of the 30 s notice
# (pkg/kubelet/nodeshutdown/nodeshutdown_manager.go: migrateConfig, podManager.killPods).
DEFAULT_SHUTDOWN_WINDOW_SECONDS = 15
# spec.checkpoint.keep.last when the job does not say, and the trainer's keep policy when
# TARDIGRADE_CHECKPOINT_KEEP_LAST is unset: one value for both sides.
DEFAULT_CHECKPOINT_KEEP_LAST = 3
# Continuous saving: the budget of the loop's time when the job does not say, and the most a
# job may give (beyond half, saving would be the loop's main work). One value for both sides.
DEFAULT_CONTINUOUS_MAX_LOOP_FRACTION = 0.05
MAX_CONTINUOUS_MAX_LOOP_FRACTION = 0.5
DEFAULT_INIT_TIMEOUT_SECONDS = 300.0
# Defaults of the checkpoint library that the reference trainer's spec.trainer settings
# (config.py) expose: stated once, here, because both sides must stay importable without jax.
# How long a host waits for its peers at a step of a save before the save fails.
DEFAULT_CHECKPOINT_BARRIER_TIMEOUT_SECONDS = 600.0
# Object storage: retries of a failed or stalled request, and the stall that cuts one.
DEFAULT_STORAGE_RETRIES = 8
DEFAULT_STORAGE_STALL_SECONDS = 60
# Host memory a restore may fill with reads not yet checked and put on their devices.
DEFAULT_RESTORE_INFLIGHT_MIB = 4096
# Kubernetes truncates termination messages beyond this many bytes.
TERMINATION_MESSAGE_LIMIT = 4096
# Longest string field of a report (a checkpoint path, a message) the operator takes in.
MAX_REPORT_TEXT = 4096

# --- exit codes -------------------------------------------------------------------------------
EXIT_SUCCEEDED = 0
EXIT_FAILED = 1
EXIT_CONFIG_ERROR = 2  # the spec cannot run as written; retrying will not help
# A committed checkpoint cannot be read or does not fit the model; retrying the same restore
# will not help (restore an older step with spec.checkpoint.restoreStep instead).
EXIT_CHECKPOINT_CORRUPT = 3
EXIT_CHECKPOINT_IO_ERROR = 74  # storage unavailable; retryable
EXIT_PREEMPTED_SAVED = 75  # stopped on SIGTERM after committing a checkpoint
EXIT_PEER_TIMEOUT = 76  # a peer never joined the gang; retryable
# Saved at the gang's step and asks to be started again in the same pod with the new world
# (restart in place): the pod's container restart rule matches this code (operator inplace.py).
EXIT_RESTART_IN_PLACE = 77

RETRYABLE_EXIT_CODES = frozenset(
    {EXIT_CHECKPOINT_IO_ERROR, EXIT_PREEMPTED_SAVED, EXIT_PEER_TIMEOUT}
)
# The job cannot run as written: restarting it the same way fails the same way.
FATAL_EXIT_CODES = frozenset({EXIT_CONFIG_ERROR, EXIT_CHECKPOINT_CORRUPT})


class ConfigError(ValueError):
    """The trainer config cannot run as written (exit code EXIT_CONFIG_ERROR, termination
    reason "ConfigError"): raised by the reference trainer, the SDK and the checkpoint library."""



@dataclasses.dataclass(frozen=True)
class TrainerEnvironment:
    """Everything a trainer rank learns from the operator."""

    job_name: str
    namespace: str
    attempt: int
    coordinator_address: str
    num_processes: int
    process_id: int
    checkpoint_path: str
    restore_step: str = RESTORE_LATEST
    checkpoint_interval_steps: int | None = None
    checkpoint_interval_seconds: float | None = None
    checkpoint_continuous_max_loop_fraction: float | None = None
    checkpoint_keep_last: int | None = DEFAULT_CHECKPOINT_KEEP_LAST
    checkpoint_keep_every: int | None = None
    save_on_preemption: bool = True
    progress_port: int | None = None
    trainer_config: dict[str, Any] = dataclasses.field(default_factory=dict)
    termination_log: str = DEFAULT_TERMINATION_LOG
    init_timeout_seconds: float = DEFAULT_INIT_TIMEOUT_SECONDS
    heartbeat_timeout_seconds: int | None = None  # None: JAX's default
    shutdown_window_seconds: float = DEFAULT_SHUTDOWN_WINDOW_SECONDS
    rendezvous_token_file: str | None = None
    rendezvous_insecure: bool = False
    job_uid: str = ""
    rollback_step: int | None = None
    rollback_request: str | None = None
    init_from_path: str | None = None
    init_from_step: int | None = None
    restart_in_place_dir: str | None = None
    restart_key: str | None = None
    restart_in_process: bool = False
    progress_token: str | None = None
    cache_key: str | None = None
    accelerator: str | None = None  # one of ACCELERATOR_KINDS
    memory_tier_dir: str | None = None
    memory_tier_interval: int | None = None  # None: the memory tier is off
    memory_tier_replicas: int = 1
    memory_tier_when_busy: str = MEMORY_TIER_SKIP
    replica_key: str | None = None
    replica_port: int = DEFAULT_REPLICA_PORT

    @property
    def keep_last(self) -> int:
        """How many committed checkpoints to keep: the API's default when unset."""
        last = self.checkpoint_keep_last
        return DEFAULT_CHECKPOINT_KEEP_LAST if last is None else last

    def to_env(self) -> dict[str, str]:
        """Render as environment variables (unset optional values are left out)."""
        env = {
            ENV_JOB_NAME: self.job_name,
            ENV_NAMESPACE: self.namespace,
            ENV_ATTEMPT: str(self.attempt),
            ENV_COORDINATOR_ADDRESS: self.coordinator_address,
            ENV_NUM_PROCESSES: str(self.num_processes),
            ENV_PROCESS_ID: str(self.process_id),
            ENV_CHECKPOINT_PATH: self.checkpoint_path,
            ENV_RESTORE_STEP: self.restore_step,
            ENV_SAVE_ON_PREEMPTION: "true" if self.save_on_preemption else "false",
            ENV_TRAINER_CONFIG: json.dumps(self.trainer_config, sort_keys=True),
            ENV_TERMINATION_LOG: self.termination_log,
            ENV_INIT_TIMEOUT_SECONDS: _format_number(self.init_timeout_seconds),
            ENV_SHUTDOWN_WINDOW_SECONDS: _format_number(self.shutdown_window_seconds),
        }
        optional = {
            ENV_CHECKPOINT_INTERVAL_STEPS: self.checkpoint_interval_steps,
            ENV_CHECKPOINT_INTERVAL_SECONDS: self.checkpoint_interval_seconds,
            ENV_CHECKPOINT_CONTINUOUS_MAX_LOOP_FRACTION:
                self.checkpoint_continuous_max_loop_fraction,
            ENV_CHECKPOINT_KEEP_LAST: self.checkpoint_keep_last,
            ENV_CHECKPOINT_KEEP_EVERY: self.checkpoint_keep_every,
            ENV_PROGRESS_PORT: self.progress_port,
            ENV_HEARTBEAT_TIMEOUT_SECONDS: self.heartbeat_timeout_seconds,
            ENV_JOB_UID: self.job_uid or None,
            ENV_ROLLBACK_STEP: self.rollback_step,
            ENV_ROLLBACK_REQUEST: self.rollback_request,
            ENV_INIT_FROM_PATH: self.init_from_path,
            ENV_INIT_FROM_STEP: self.init_from_step,
            ENV_RESTART_IN_PLACE_DIR: self.restart_in_place_dir,
            ENV_RESTART_KEY: self.restart_key,
            ENV_PROGRESS_TOKEN: self.progress_token,
            ENV_CACHE_KEY: self.cache_key,
            ENV_ACCELERATOR: self.accelerator,
            ENV_MEMORY_TIER_DIR: self.memory_tier_dir,
            ENV_MEMORY_TIER_INTERVAL: self.memory_tier_interval,
            ENV_REPLICA_KEY: self.replica_key,
        }
        env.update({k: v if isinstance(v, str) else _format_number(v)
                    for k, v in optional.items() if v is not None})
        if self.rendezvous_token_file:
            env[ENV_RENDEZVOUS_TOKEN_FILE] = self.rendezvous_token_file
        if self.rendezvous_insecure:
            env[ENV_RENDEZVOUS_INSECURE] = "true"
        if self.restart_in_process:
            env[ENV_RESTART_IN_PROCESS] = "true"
        if self.memory_tier_interval is not None:
            env[ENV_MEMORY_TIER_REPLICAS] = str(self.memory_tier_replicas)
            env[ENV_REPLICA_PORT] = str(self.replica_port)
            # Always, the default too: the pod spec says what its trainer does.
            env[ENV_MEMORY_TIER_WHEN_BUSY] = self.memory_tier_when_busy
        return env

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> TrainerEnvironment:
        """Read the contract back; a missing or malformed variable raises `ContractError`."""
        env = _with_world(os.environ if environ is None else environ)

        def required(name: str) -> str:
            value = env.get(name)
            if value is None or value == "":
                raise ContractError(f"environment variable {name} is not set")
            return value

        def integer(name: str, value: str) -> int:
            try:
                return int(value)
            except ValueError:
                raise ContractError(f"{name}={value!r} is not an integer") from None

        def optional_int(name: str) -> int | None:
            value = env.get(name)
            return None if value in (None, "") else integer(name, value)

        def optional_float(name: str) -> float | None:
            value = env.get(name)
            if value in (None, ""):
                return None
            try:
                return float(value)
            except ValueError:
                raise ContractError(f"{name}={value!r} is not a number") from None

        num_processes = integer(ENV_NUM_PROCESSES, required(ENV_NUM_PROCESSES))
        process_id = integer(ENV_PROCESS_ID, required(ENV_PROCESS_ID))
        if num_processes < 1:
            raise ContractError(f"{ENV_NUM_PROCESSES} must be >= 1, got {num_processes}")
        if not 0 <= process_id < num_processes:
            raise ContractError(
                f"{ENV_PROCESS_ID}={process_id} is outside 0..{num_processes - 1}"
            )
        restore_step = env.get(ENV_RESTORE_STEP) or RESTORE_LATEST
        if restore_step not in (RESTORE_LATEST, RESTORE_NONE):
            integer(ENV_RESTORE_STEP, restore_step)
        try:
            trainer_config = json.loads(env.get(ENV_TRAINER_CONFIG) or "{}")
        except json.JSONDecodeError as err:
            raise ContractError(f"{ENV_TRAINER_CONFIG} is not valid JSON: {err}") from None
        if not isinstance(trainer_config, dict):
            raise ContractError(f"{ENV_TRAINER_CONFIG} must be a JSON object")
        save_flag = (env.get(ENV_SAVE_ON_PREEMPTION) or "true").lower()
        rollback_step = optional_int(ENV_ROLLBACK_STEP)
        if rollback_step is not None and not env.get(ENV_ROLLBACK_REQUEST):
            raise ContractError(f"{ENV_ROLLBACK_STEP} needs {ENV_ROLLBACK_REQUEST} (any id that "
                                "changes with each new rollback request)")
        accelerator = env.get(ENV_ACCELERATOR) or None
        if accelerator is not None and accelerator not in ACCELERATOR_KINDS:
            raise ContractError(f"{ENV_ACCELERATOR}={accelerator!r}: expected one of "
                                f"{', '.join(ACCELERATOR_KINDS)} (spec.accelerator.kind)")
        memory_interval = optional_int(ENV_MEMORY_TIER_INTERVAL)
        memory_replicas = optional_int(ENV_MEMORY_TIER_REPLICAS)
        memory_replicas = 1 if memory_replicas is None else memory_replicas
        replica_port = optional_int(ENV_REPLICA_PORT)
        heartbeat = optional_int(ENV_HEARTBEAT_TIMEOUT_SECONDS)
        if heartbeat is not None and heartbeat < 1:
            raise ContractError(f"{ENV_HEARTBEAT_TIMEOUT_SECONDS}={heartbeat} must be >= 1 "
                                "second")
        if memory_interval is not None:
            if memory_interval < 1:
                raise ContractError(f"{ENV_MEMORY_TIER_INTERVAL}={memory_interval} must be >= 1 "
                                    "step (spec.checkpoint.memoryTier.interval)")
            if not env.get(ENV_MEMORY_TIER_DIR):
                raise ContractError(f"{ENV_MEMORY_TIER_INTERVAL} is set but "
                                    f"{ENV_MEMORY_TIER_DIR} is not: the memory tier needs the "
                                    "pod's memory volume")
            if memory_replicas < 0:
                raise ContractError(f"{ENV_MEMORY_TIER_REPLICAS}={memory_replicas} must be "
                                    ">= 0 (spec.checkpoint.memoryTier.replicas)")
            if memory_replicas > 0 and not env.get(ENV_REPLICA_KEY):
                raise ContractError(f"{ENV_MEMORY_TIER_REPLICAS}={memory_replicas} needs "
                                    f"{ENV_REPLICA_KEY} (the job's Secret key "
                                    f"{SECRET_REPLICA_KEY}): peers accept no unauthenticated "
                                    "replica")
        when_busy = env.get(ENV_MEMORY_TIER_WHEN_BUSY) or MEMORY_TIER_SKIP
        if when_busy not in (MEMORY_TIER_SKIP, MEMORY_TIER_WAIT):
            raise ContractError(f"{ENV_MEMORY_TIER_WHEN_BUSY}={when_busy!r}: expected "
                                f"{MEMORY_TIER_SKIP} (a memory step skips its snapshot while "
                                f"the previous one's commit runs) or {MEMORY_TIER_WAIT} (the "
                                "loop waits for it)")
        continuous = optional_float(ENV_CHECKPOINT_CONTINUOUS_MAX_LOOP_FRACTION)
        if continuous is not None and not 0 < continuous <= MAX_CONTINUOUS_MAX_LOOP_FRACTION:
            raise ContractError(
                f"{ENV_CHECKPOINT_CONTINUOUS_MAX_LOOP_FRACTION}={continuous:g} "
                "(spec.checkpoint.interval.continuous.maxLoopFraction) must be above 0 and at "
                f"most {MAX_CONTINUOUS_MAX_LOOP_FRACTION:g}: the share of the training loop's "
                "time that saves may take")
        window = optional_float(ENV_SHUTDOWN_WINDOW_SECONDS)
        if window is not None and window <= 0:
            raise ContractError(f"{ENV_SHUTDOWN_WINDOW_SECONDS}={window:g} must be > 0 seconds")
        return cls(
            job_name=env.get(ENV_JOB_NAME) or "local",
            namespace=env.get(ENV_NAMESPACE) or "default",
            attempt=optional_int(ENV_ATTEMPT) or 0,
            coordinator_address=env.get(ENV_COORDINATOR_ADDRESS)
            or f"127.0.0.1:{DEFAULT_COORDINATOR_PORT}",
            num_processes=num_processes,
            process_id=process_id,
            checkpoint_path=required(ENV_CHECKPOINT_PATH),
            restore_step=restore_step,
            checkpoint_interval_steps=optional_int(ENV_CHECKPOINT_INTERVAL_STEPS),
            checkpoint_interval_seconds=optional_float(ENV_CHECKPOINT_INTERVAL_SECONDS),
            checkpoint_continuous_max_loop_fraction=continuous,
            checkpoint_keep_last=optional_int(ENV_CHECKPOINT_KEEP_LAST),
            checkpoint_keep_every=optional_int(ENV_CHECKPOINT_KEEP_EVERY),
            save_on_preemption=save_flag not in ("false", "0", "no"),
            progress_port=optional_int(ENV_PROGRESS_PORT),
            trainer_config=trainer_config,
            termination_log=env.get(ENV_TERMINATION_LOG) or DEFAULT_TERMINATION_LOG,
            init_timeout_seconds=(optional_float(ENV_INIT_TIMEOUT_SECONDS)
                                  or DEFAULT_INIT_TIMEOUT_SECONDS),
            heartbeat_timeout_seconds=heartbeat,
            shutdown_window_seconds=DEFAULT_SHUTDOWN_WINDOW_SECONDS if window is None else window,
            rendezvous_token_file=env.get(ENV_RENDEZVOUS_TOKEN_FILE) or None,
            rendezvous_insecure=switched_on(env, ENV_RENDEZVOUS_INSECURE),
            job_uid=env.get(ENV_JOB_UID) or "",
            rollback_step=rollback_step,
            rollback_request=env.get(ENV_ROLLBACK_REQUEST) or None,
            init_from_path=env.get(ENV_INIT_FROM_PATH) or None,
            init_from_step=optional_int(ENV_INIT_FROM_STEP),
            restart_in_place_dir=env.get(ENV_RESTART_IN_PLACE_DIR) or None,
            restart_key=env.get(ENV_RESTART_KEY) or None,
            restart_in_process=switched_on(env, ENV_RESTART_IN_PROCESS),
            progress_token=env.get(ENV_PROGRESS_TOKEN) or None,
            cache_key=env.get(ENV_CACHE_KEY) or None,
            accelerator=accelerator,
            memory_tier_dir=env.get(ENV_MEMORY_TIER_DIR) or None,
            memory_tier_interval=memory_interval,
            memory_tier_replicas=memory_replicas,
            memory_tier_when_busy=when_busy,
            replica_key=env.get(ENV_REPLICA_KEY) or None,
            replica_port=DEFAULT_REPLICA_PORT if replica_port is None else replica_port,
        )


def switched_on(env: Mapping[str, str], name: str) -> bool:
    """An opt-in switch of the contract: on only when set to "true"."""
    return (env.get(name) or "").lower() == "true"


def _with_world(env: Mapping[str, str]) -> Mapping[str, str]:
    """The environment with the new world's values in place of the launch-time ones."""
    text = env.get(ENV_WORLD)
    if not text:
        return env
    return {**env, **parse_world(text)}


def parse_world(text: str, source: str = ENV_WORLD) -> dict[str, str]:
    """A world (WORLD_KEYS) as the environment variables it sets; `source` names where it came
    from (the env var, or the operator's restart request) in the ContractError."""
    try:
        world = boundedjson.loads(text, FLAT_RECORD_LIMIT)
    except json.JSONDecodeError as err:
        raise ContractError(f"{source} is not valid JSON: {err}") from None
    if not isinstance(world, dict):
        raise ContractError(f"{source} must be a JSON object with keys "
                            f"{', '.join(WORLD_KEYS)}")
    unknown = sorted(set(world) - set(WORLD_KEYS))
    if unknown:
        raise ContractError(f"{source}: unknown keys {unknown}; expected "
                            f"{', '.join(WORLD_KEYS)}")
    merged: dict[str, str] = {}
    for key, value in world.items():
        if not isinstance(value, (str, int)) or isinstance(value, bool):
            raise ContractError(f"{source}.{key} must be a string or an integer")
        merged[WORLD_KEYS[key]] = str(value)
    return merged


class ContractError(ValueError):
    """The operator-provided environment is missing or malformed."""


@dataclasses.dataclass(frozen=True)
class TerminationMessage:
    """What a rank writes to its termination log just before it exits (JSON)."""

    reason: str  # "Succeeded", "PreemptedSaved", "Failed", "ConfigError", ...
    step: int | None = None  # last step completed
    checkpoint_step: int | None = None  # newest committed checkpoint
    checkpoint_path: str | None = None
    message: str = ""
    attempt: int | None = None  # the attempt the rank ran as (its world's, when restarted)

    def to_json(self) -> str:
        payload = {k: v for k, v in dataclasses.asdict(self).items() if v not in (None, "")}
        text = json.dumps(payload, sort_keys=True)
        if len(text.encode()) <= TERMINATION_MESSAGE_LIMIT:
            return text
        # Keep the structured fields; trim the free text so the whole stays parseable.
        overflow = len(text.encode()) - TERMINATION_MESSAGE_LIMIT + 16
        keep = max(0, len(self.message) - overflow)
        trimmed = dataclasses.replace(self, message=self.message[:keep])
        return trimmed.to_json()

    @classmethod
    def from_json(cls, text: str) -> TerminationMessage | None:
        """Parse a termination message; anything that is not ours, or breaks the contract
        (a step as a string, a negative step), gives None: the exit code alone then counts."""
        try:
            data = boundedjson.loads(text, FLAT_RECORD_LIMIT)
        except (TypeError, ValueError):
            return None
        if not isinstance(data, dict) or "reason" not in data:
            return None
        try:
            return cls(reason=_text(data, "reason", required=True) or "",
                       step=_count(data, "step"),
                       checkpoint_step=_count(data, "checkpoint_step"),
                       checkpoint_path=_text(data, "checkpoint_path"),
                       message=_text(data, "message") or "",
                       attempt=_count(data, "attempt"))
        except MalformedReport:
            return None


@dataclasses.dataclass(frozen=True)
class ProgressReport:
    """What rank 0 serves as JSON on the progress port at `/progress`."""

    step: int
    loss: float | None = None
    tokens_per_second: float | None = None
    checkpoint_step: int | None = None
    checkpoint_path: str | None = None
    checkpoint_time: str | None = None  # RFC 3339
    total_steps: int | None = None
    # The attempt the reporting trainer runs and the step it restored (None: none): rank 0
    # serves progress only once the gang has met, so a report of a new attempt tells the
    # operator that every rank restarted into it, also when none restarted its container.
    attempt: int | None = None
    restore_step: int | None = None
    # Where this trainer's time went since its process started, in seconds, each phase
    # counted while it runs (PHASE_SECONDS_FIELDS): the operator's goodput account. Trainers
    # that predate them send none, and are read as before.
    accelerator_start_seconds: float | None = None
    restore_seconds: float | None = None
    compile_seconds: float | None = None
    checkpoint_stall_seconds: float | None = None
    train_seconds: float | None = None

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ProgressReport:
        """Parse rank 0's report; MalformedReport (naming the field) if it breaks the contract.

        The operator folds a report into the job's status and decisions, so every field is
        checked here, once: a step sent as "7" or a naive timestamp would otherwise fail each
        reconcile pass later, far from its cause."""
        bare = _JSON_STRING.sub("", text) if isinstance(text, str) else ""
        if bare.count("{") + bare.count("[") > 1:
            # Checked before parsing: nesting is how JSON makes a parser recurse.
            raise MalformedReport("progress report must be one flat JSON object")
        try:
            data = json.loads(text)
        except (TypeError, ValueError) as err:
            raise MalformedReport(f"progress report is not JSON: {err}") from None
        if not isinstance(data, dict):
            raise MalformedReport("progress report must be a JSON object")
        step = _count(data, "step", required=True)
        assert step is not None
        total = _count(data, "total_steps")
        return cls(step=step, loss=_finite(data, "loss"),
                   tokens_per_second=_finite(data, "tokens_per_second"),
                   checkpoint_step=_count(data, "checkpoint_step"),
                   checkpoint_path=_text(data, "checkpoint_path"),
                   checkpoint_time=_timestamp(data, "checkpoint_time"),
                   total_steps=total or None, attempt=_count(data, "attempt"),
                   restore_step=_count(data, "restore_step"),
                   **{name: _seconds(data, name) for name in PHASE_SECONDS_FIELDS})


# The trainer's phases in its progress report (ProgressReport), cumulative seconds since its
# process started: from the start to its devices up and jax.distributed initialised, the
# restore (or the initialisation), the wait for the compiled step, the loop blocked by saves,
# and the step loop's own time (its saves' stalls left out).
PHASE_SECONDS_FIELDS = ("accelerator_start_seconds", "restore_seconds", "compile_seconds",
                        "checkpoint_stall_seconds", "train_seconds")


_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')


class MalformedReport(ValueError):
    """A report from a rank that breaks the contract; the message names the field."""


def _present(data: Mapping[str, Any], name: str, required: bool) -> bool:
    if data.get(name) is None:
        if required:
            raise MalformedReport(f"{name} is required")
        return False
    return True


def _count(data: Mapping[str, Any], name: str, required: bool = False) -> int | None:
    if not _present(data, name, required):
        return None
    value = data[name]
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise MalformedReport(f"{name} must be a non-negative integer (got {value!r:.40})")
    return value


def _finite(data: Mapping[str, Any], name: str) -> float | None:
    """A number; NaN and infinities (a diverging loss) are dropped, not an error."""
    if not _present(data, name, False):
        return None
    value = data[name]
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise MalformedReport(f"{name} must be a number (got {value!r:.40})")
    return float(value) if math.isfinite(value) else None


def _seconds(data: Mapping[str, Any], name: str) -> float | None:
    """A duration: a finite number >= 0 (a phase's seconds; anything else breaks the contract)."""
    if not _present(data, name, False):
        return None
    value = data[name]
    if (isinstance(value, bool) or not isinstance(value, int | float)
            or not math.isfinite(value) or value < 0):
        raise MalformedReport(f"{name} must be a number of seconds >= 0 (got {value!r:.40})")
    return float(value)


def _text(data: Mapping[str, Any], name: str, required: bool = False) -> str | None:
    if not _present(data, name, required):
        return None
    value = data[name]
    if not isinstance(value, str) or len(value) > MAX_REPORT_TEXT:
        raise MalformedReport(f"{name} must be a string of at most {MAX_REPORT_TEXT} "
                              f"characters (got {value!r:.40})")
    return value


def parse_time(text: str | None) -> datetime | None:
    """An RFC 3339 time as Kubernetes and the trainer write it ("...Z" or an offset); None
    for an empty one. The one parser both sides use; ValueError for anything else."""
    if not text:
        return None
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def _timestamp(data: Mapping[str, Any], name: str) -> str | None:
    text = _text(data, name)
    if text is None:
        return None
    try:
        when = parse_time(text)
    except ValueError:
        when = None
    if when is None or when.tzinfo is None:
        raise MalformedReport(f"{name} must be an RFC 3339 time with a zone, e.g. "
                              f"2026-01-02T03:04:05Z (got {text!r:.40})")
    return text


def _format_number(value: float) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)
