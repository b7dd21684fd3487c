"""The save on notice against the shutdown window, for the reference model.

    python bench/preemption_save.py [--window 15] [--workdir DIR] [--arms disk,gcs,stalled]

Runs the reference trainer (`examples/trainingjob.yaml`'s `spec.trainer`, 2 ranks) until it
has trained a few steps past its first commit, sends SIGTERM to one rank, and reads what each
rank logged: the seconds from the notice to the commit of the save on notice (or to giving
up), against the save's deadline (the window less its margin) and the window itself.

Arms:
  disk     checkpoints on a local path;
  gcs      checkpoints on the GCS emulator (gs://);
  stalled  the same bucket behind a proxy that stops answering writes right before the notice:
           the save must give up inside its deadline and leave the last commit intact.

Target: every arm ends inside the window: each rank commits or gives up (and every rank has
exited) before the window's SIGKILL would come. The notice is timed, as the trainer times it,
from JAX's agreed preemption step (a lower bound on the SIGTERM); "all exited" is timed from
the SIGTERM by this script (an upper bound: it polls). An arm whose ranks logged no save on
notice did not exercise it: it says so and judges nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
for sub in ("", "trainer_image", "local_cluster"):
    sys.path.insert(0, str(REPO / sub))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from tardigrade_contract import contract  # noqa: E402
from tardigrade_local.gcs import GcsEmulator, client_env  # noqa: E402
from tardigrade_local.gcs_faults import FaultProxy, FaultRule  # noqa: E402
from tardigrade_sdk.preemption import save_deadline  # noqa: E402
from tardigrade_trainer.config import TrainerConfig  # noqa: E402

from tests.trainer.trainer_harness import launch, wait_for  # noqa: E402

BUCKET = "tardigrade-bench"


def reference_config() -> dict[str, Any]:
    job = yaml.safe_load((REPO / "examples" / "trainingjob.yaml").read_text())
    trainer = {**job["spec"]["trainer"], "steps": 100000}
    # Every field, so that the harness's tiny test model fills none of them in.
    return dataclasses.asdict(TrainerConfig.from_mapping(trainer))


@dataclasses.dataclass
class Row:
    arm: str
    outcome: str
    seconds: list[float]  # per rank: notice -> commit (or -> giving up)
    exited: float  # SIGTERM -> every rank exited (an upper bound: polled)
    window: float
    deadline: float
    note: str = ""

    def ok(self) -> bool:
        return bool(self.seconds) and max(self.seconds) <= self.window and (
            self.exited <= self.window)

    def cells(self) -> list[str]:
        if not self.seconds:
            return [self.arm, self.outcome, "-", f"{self.exited:.1f}", f"{self.deadline:.1f}",
                    f"{self.window:g}", "-", "not judged: no save on notice was logged"]
        worst = max(self.seconds)
        verdict = "ok" if self.ok() else "MISSED the window"
        return [self.arm, self.outcome, " / ".join(f"{s:.2f}" for s in self.seconds),
                f"{self.exited:.1f}", f"{self.deadline:.1f}", f"{self.window:g}",
                f"{worst / self.window:.2f}", f"{verdict} {self.note}".strip()]


def run_arm(arm: str, workdir: Path, window: float, env: dict[str, str], url: str,
            proxy: FaultProxy | None) -> Row:
    config = reference_config()
    extra_env = {**env, contract.ENV_SHUTDOWN_WINDOW_SECONDS: f"{window:g}"}
    gang = launch(workdir / arm, processes=2, checkpoint_path=url, config=config,
                  interval_steps=10, extra_env=extra_env, init_timeout=300)
    try:
        first = wait_for(lambda: gang.events("checkpoint_committed")
                         or any(p.poll() is not None for p in gang.procs), 600,
                         "a first commit")
        if first is True:
            raise SystemExit(f"{arm}: the trainer exited early:\n{gang.describe()}")
        committed = first[0]["step"]
        wait_for(lambda: any(e["step"] >= committed + 3 for e in gang.events("step")), 300,
                 "a few steps past the first commit")
        if proxy is not None:
            proxy.set_rules([FaultRule("write", action="stall")])
        signalled = time.monotonic()
        gang.signal(signal.SIGTERM, ranks=[1])
        codes = gang.wait(window + 120)
        exited = time.monotonic() - signalled
    finally:
        gang.kill()
        if proxy is not None:
            proxy.clear()
    seconds, outcome = [], f"exit {codes}"
    for rank in (0, 1):
        done = gang.events("preempted", rank) or gang.events("preempted_unsaved", rank)
        if done:
            seconds.append(done[0]["seconds_since_notice"])
    budget = save_deadline(0.0, window).at
    term = gang.termination(0)
    note = "committed" if term is not None and term.reason == "PreemptedSaved" else ""
    if term is not None and term.reason != "PreemptedSaved":
        note = f"gave up at the deadline; resumes from step {term.checkpoint_step}"
    return Row(arm, outcome, seconds, exited, window, budget, note)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--window", type=float, default=contract.DEFAULT_SHUTDOWN_WINDOW_SECONDS)
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--arms", default="disk,gcs,stalled")
    args = parser.parse_args()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="preemption-save-"))
    workdir.mkdir(parents=True, exist_ok=True)
    arms = args.arms.split(",")
    rows = []
    started = time.monotonic()
    with GcsEmulator() as gcs, FaultProxy(gcs.url) as proxy:
        gcs.create_bucket(BUCKET)
        for arm in arms:
            if arm == "disk":
                rows.append(run_arm(arm, workdir, args.window, {}, str(workdir / "ckpt"), None))
            elif arm in ("gcs", "stalled"):
                rows.append(run_arm(arm, workdir, args.window, client_env(proxy.url),
                                    f"gs://{BUCKET}/{arm}", proxy if arm == "stalled" else None))
            else:
                raise SystemExit(f"unknown arm {arm!r}")
            print(" | ".join(rows[-1].cells()), flush=True)
    header = ["arm", "exit codes", "notice -> committed or gave up, s (rank 0 / 1)",
              "SIGTERM -> all exited, s", "deadline, s", "window, s", "worst / window",
              "verdict"]
    print()
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(row.cells()) + " |")
    print(f"\n{time.monotonic() - started:.0f}s in all; workdir {workdir}")
    return 0 if all(r.ok() for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
