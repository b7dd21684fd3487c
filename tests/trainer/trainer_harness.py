"""Launch gangs of real trainer processes on loopback and read their JSON-lines logs."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tardigrade_contract import contract
from tardigrade_local.ports import free_port

from tests.polling import wait_for  # noqa: F401  (re-exported for the test modules)

REPO = Path(__file__).resolve().parents[2]
# The reference trainer with faults injected (`hooks`): a test-only entry point.
# What the operator puts in each job's Secret: the key that seals the job's compilation cache
# in its checkpoint root (compile_cache.py). One for every launch, as a job has one.
CACHE_KEY = "harness-job-cache-key-0123456789abcdef"
FAULTY_TRAINER = Path(__file__).with_name("faulty_trainer.py")
SOURCE_PATHS = [str(REPO / "trainer_image"), str(REPO / "local_cluster")]

# Small enough that a step takes milliseconds and compiling takes seconds on 2 CPU cores.
TINY = {
    "seq_len": 8,
    "vocab_size": 32,
    "embed_dim": 16,
    "num_heads": 2,
    "mlp_dim": 32,
    "num_layers": 1,
    "global_batch_size": 12,
    "warmup_steps": 3,
    "learning_rate": 1e-2,
}


def read_records(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        if line.startswith("{"):
            # The last line may be half written right now.
            with contextlib.suppress(json.JSONDecodeError):
                records.append(json.loads(line))
    return records


@dataclasses.dataclass
class Gang:
    procs: list[subprocess.Popen[bytes]]
    workdir: Path

    def stdout(self, rank: int) -> Path:
        return self.workdir / f"rank{rank}.out"

    def stderr(self, rank: int) -> Path:
        return self.workdir / f"rank{rank}.err"

    def records(self, rank: int = 0) -> list[dict[str, Any]]:
        return read_records(self.stdout(rank))

    def events(self, name: str, rank: int = 0) -> list[dict[str, Any]]:
        return [r for r in self.records(rank) if r.get("event") == name]

    def losses(self, rank: int = 0) -> dict[int, float]:
        return {r["step"]: r["loss"] for r in self.events("step", rank)}

    def termination(self, rank: int) -> contract.TerminationMessage | None:
        path = self.workdir / f"rank{rank}.term"
        return contract.TerminationMessage.from_json(path.read_text()) if path.exists() else None

    def wait(self, timeout: float = 240) -> list[int]:
        deadline = time.monotonic() + timeout
        codes = []
        for proc in self.procs:
            try:
                codes.append(proc.wait(timeout=max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                self.kill()
                raise AssertionError(f"trainer gang did not finish:\n{self.describe()}") from None
        return codes

    def signal(self, sig: int, ranks: list[int] | None = None) -> None:
        for rank, proc in enumerate(self.procs):
            if (ranks is None or rank in ranks) and proc.poll() is None:
                proc.send_signal(sig)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        for proc in self.procs:
            proc.wait()

    def describe(self) -> str:
        parts = []
        for rank, _ in enumerate(self.procs):
            err = self.stderr(rank).read_text()[-3000:] if self.stderr(rank).exists() else ""
            out = self.stdout(rank).read_text()[-1500:] if self.stdout(rank).exists() else ""
            parts.append(f"--- rank {rank} stdout ---\n{out}\n--- rank {rank} stderr ---\n{err}")
        return "\n".join(parts)


def launch(
    workdir: Path,
    *,
    processes: int,
    checkpoint_path: str,
    config: dict[str, Any],
    interval_steps: int | None = None,
    interval_seconds: float | None = None,
    keep_last: int | None = 3,
    hooks: list[dict[str, Any]] | None = None,
    extra_env: dict[str, str] | None = None,
    init_timeout: float = 120,
    restore_step: str = contract.RESTORE_LATEST,
    progress_port: int | None = None,
    ranks: list[int] | None = None,
    rank_env: dict[int, dict[str, str]] | None = None,
    argv: list[str] | None = None,
    cache_key: str | None = CACHE_KEY,
) -> Gang:
    """`argv`: what each rank runs (default: the reference trainer). `hooks`: faults the
    reference trainer injects (injected_faults.py), through the test-only entry point.
    `cache_key`: the job's compilation-cache key (None: a trainer without one)."""
    if hooks and argv is not None:
        raise ValueError("hooks run the reference trainer (faulty_trainer.py): drop argv")
    if hooks:
        argv = [sys.executable, str(FAULTY_TRAINER), json.dumps(hooks), str(workdir)]
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs = []
    for rank in range(processes) if ranks is None else ranks:
        env_contract = contract.TrainerEnvironment(
            job_name="test", namespace="default", attempt=0,
            coordinator_address=f"127.0.0.1:{port}", num_processes=processes, process_id=rank,
            checkpoint_path=checkpoint_path, restore_step=restore_step,
            checkpoint_interval_steps=interval_steps, checkpoint_interval_seconds=interval_seconds,
            checkpoint_keep_last=keep_last,
            trainer_config={**TINY, **config}, termination_log=str(workdir / f"rank{rank}.term"),
            init_timeout_seconds=init_timeout,
            progress_port=progress_port if rank == 0 else None,
            # No API server here to review tokens: the documented opt-out for such runs.
            rendezvous_insecure=True,
            cache_key=cache_key,
        )
        env = {k: v for k, v in os.environ.items() if not k.startswith("TARDIGRADE_")}
        env.pop("XLA_FLAGS", None)
        env.update(env_contract.to_env())
        env["PYTHONPATH"] = os.pathsep.join([*SOURCE_PATHS, env.get("PYTHONPATH", "")])
        env["JAX_PLATFORMS"] = "cpu"
        env.update(extra_env or {})
        env.update((rank_env or {}).get(rank, {}))  # e.g. a host that sees another root
        procs.append(subprocess.Popen(
            argv or [sys.executable, "-m", "tardigrade_trainer"],
            env=env, cwd=workdir,
            stdout=open(workdir / f"rank{rank}.out", "wb"),  # noqa: SIM115
            stderr=open(workdir / f"rank{rank}.err", "wb"),  # noqa: SIM115
        ))
    return Gang(procs, workdir)


def committed_steps(root: Path) -> list[int]:
    return sorted(int(p.parent.name.split("_")[1]) for p in root.glob("step_*/metadata.json"))


def step_dirs(root: Path) -> list[int]:
    return sorted(int(p.name.split("_")[1]) for p in root.glob("step_*"))
