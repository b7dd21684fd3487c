"""Trainer fault injection: SIGKILL at random moments and a failing GCS, with zero tolerance.

    python bench/faults_trainer.py --trials 50 [--seed N] [--workdir DIR] [--skip-gcs]

A. Kill trials (tests/faults/kill_trials.py): gangs of 1 and 2 trainer processes are
   SIGKILLed at seeded random moments: at named points inside a save, a random few ms into a
   save, or anywhere (start-up, restore, training, saves, garbage collection). After every
   kill the checkpoint root is audited and the next gang's restore is checked; each campaign
   ends with a SIGTERM stop that must save and leave no partial checkpoint.
B. GCS scenarios (tests/faults/gcs_scenarios.py): a fault proxy in front of the emulator
   returns 5xx/429 or stalls reads or writes during saves and restores, then a real trainer
   rides out an outage and a failed preemption save, a gang of 2 hears within seconds
   that storage refused process 0's commit, and root record writes that land but lose their
   answers (retries refused 412, as by GCS) still make one claim and one branch.
C. Checkpoint root trials (tests/faults/root_trials.py): seeded ordinary-use stories for the
   operator's pin, rollback, re-created and foreign jobs, initFrom and stale attempts, run on
   the real checkpoint manager and restore decision: 0 stranded jobs, 0 wrong-weights restores.
D. Unshared roots (tests/faults/sharedroot_trial.py): a gang whose hosts each see their own
   root (an emptyDir or hostPath per node) must refuse to start, not strand its checkpoints.

Prints one line per trial, then the tables. Exit status 1 if anything was lost, corrupt or
otherwise wrong. The seed is printed first: `--seed` reruns the same kill plan.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for sub in ("", "trainer_image", "local_cluster"):
    sys.path.insert(0, str(REPO / sub))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from tests.faults.gcs_scenarios import (  # noqa: E402
    Outcome,
    Scenarios,
    faulty_gcs,
    gang_hears_of_a_refused_commit,
    gang_rolls_back_through_lost_answers,
    trainer_rides_out_an_outage,
)
from tests.faults.kill_trials import Campaign, TrialResult  # noqa: E402
from tests.faults.root_trials import RootTrialResult  # noqa: E402
from tests.faults.root_trials import run as run_root_trials  # noqa: E402
from tests.faults.sharedroot_trial import unshared_root_is_refused  # noqa: E402
from tests.trainer.trainer_harness import TINY  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=50, help="kill trials in all")
    parser.add_argument("--seed", type=int, default=None, help="default: from the clock")
    parser.add_argument("--per-campaign", type=int, default=13,
                        help="kill trials per gang lifetime (then a clean stop)")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--skip-gcs", action="store_true")
    parser.add_argument("--root-trials", type=int, default=25,
                        help="checkpoint root trials (C); 0 skips them")
    return parser.parse_args()


def run_kills(args: argparse.Namespace, workdir: Path) -> tuple[list[TrialResult],
                                                                   list[TrialResult]]:
    trials: list[TrialResult] = []
    stops: list[TrialResult] = []
    remaining, campaign_no = args.trials, 0
    while remaining > 0:
        count = min(args.per_campaign, remaining)
        processes = 2 if campaign_no % 2 == 0 else 1
        seed = args.seed * 1000 + campaign_no
        campaign = Campaign(workdir / f"campaign{campaign_no}", processes=processes, seed=seed)
        print(f"campaign {campaign_no}: {processes} process(es), {count} kills, seed {seed}",
              flush=True)
        try:
            for _ in range(count):
                result = campaign.trial()
                trials.append(result)
                print(f"  {len(trials):3d} {'ok  ' if result.ok else 'FAIL'} "
                      f"{result.kill.describe():38s} restored {result.restored!s:>4} "
                      f"(newest {result.expected_restore!s:>4}) in-save {result.landed_in_save!s:5}"
                      f" committed {result.committed} partial {result.partial} "
                      f"{result.seconds:5.1f}s", flush=True)
                for line in result.lost + result.corrupt + result.problems:
                    print(f"       {line[:400]}", flush=True)
            stop = campaign.finish()
            stops.append(stop)
            print(f"  stop {'ok  ' if stop.ok else 'FAIL'} SIGTERM: restored {stop.restored}, "
                  f"committed {stop.committed}, partial {stop.partial} {stop.seconds:5.1f}s",
                  flush=True)
            for line in stop.lost + stop.corrupt + stop.problems:
                print(f"       {line[:400]}", flush=True)
        finally:
            campaign.close()
        remaining -= count
        campaign_no += 1
    return trials, stops


def run_gcs(workdir: Path, seed: int) -> list[Outcome | str]:
    outcomes: list[Outcome | str] = []
    with faulty_gcs(seed=seed) as proxy:
        scenarios = Scenarios(proxy)
        for scenario in scenarios.all():
            try:
                outcomes.append(scenario())
            except AssertionError as err:
                outcomes.append(f"FAIL {scenario.__name__}: {err}")
            print(f"  {outcomes[-1]}", flush=True)
        try:
            outcomes.append(trainer_rides_out_an_outage(proxy, workdir / "gcs", resume=True))
        except AssertionError as err:
            outcomes.append(f"FAIL trainer outage: {str(err)[:2000]}")
        print(f"  {outcomes[-1]}", flush=True)
        try:
            outcomes.append(gang_hears_of_a_refused_commit(proxy, workdir / "gcs"))
        except AssertionError as err:
            outcomes.append(f"FAIL refused commit: {str(err)[:2000]}")
        print(f"  {outcomes[-1]}", flush=True)
        try:
            outcomes.append(gang_rolls_back_through_lost_answers(proxy, workdir / "gcs"))
        except AssertionError as err:
            outcomes.append(f"FAIL lost root record answers: {str(err)[:2000]}")
        print(f"  {outcomes[-1]}", flush=True)
    return outcomes


def main() -> int:
    args = parse_args()
    args.seed = args.seed if args.seed is not None else int(time.time()) % 100000
    print(f"seed {args.seed} (rerun: python bench/faults_trainer.py --trials {args.trials} "
          f"--seed {args.seed})", flush=True)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="tardigrade-faults-"))
    started = time.monotonic()
    trials, stops = run_kills(args, workdir)
    kill_seconds = time.monotonic() - started
    outcomes = [] if args.skip_gcs else run_gcs(workdir, args.seed)
    roots = run_root_trials(workdir / "roots", args.seed, args.root_trials)

    def count(predicate: object) -> int:
        return sum(1 for t in trials if predicate(t))  # type: ignore[operator]

    everything = trials + stops
    lost = sum(len(t.lost) for t in everything)
    corrupt = sum(len(t.corrupt) for t in everything)
    problems = sum(len(t.problems) for t in everything)
    restores = [t for t in everything if t.restored is not None]
    stop_seconds = sum(t.seconds for t in stops) / max(1, len(stops))
    trial_seconds = sum(t.seconds for t in trials) / max(1, len(trials))
    rows = [
        ("seed", args.seed),
        ("kill trials (1 process / 2 processes)",
         f"{len(trials)} ({count(lambda t: t.processes == 1)} / "
         f"{count(lambda t: t.processes == 2)})"),
        ("  at a named point inside a save (hook)", count(lambda t: t.kill.kind == "hook")),
        ("  a random 0-150 ms into a save (timer)", count(lambda t: t.kill.kind == "timer")),
        ("  at a random moment (anywhere)", count(lambda t: t.kill.kind == "anywhere")),
        ("  whole gang killed at once", count(lambda t: len(t.kill.victims) > 1)),
        ("kills that landed inside a save (started, never finished)",
         count(lambda t: t.landed_in_save)),
        ("restores checked: newest commit taken, digests verified by the trainer",
         f"{sum(1 for t in restores if not t.problems)} of {len(restores)}"),
        ("committed checkpoints audited: read back, equal to saved digests",
         f"{sum(t.checkpoints_verified for t in everything)} "
         f"({sum(t.regions_verified for t in everything)} shard regions)"),
        ("partial checkpoints removed at the next start",
         sum(t.partials_removed for t in everything)),
        ("clean SIGTERM stops: saved, exit 75, no partial left",
         f"{sum(1 for s in stops if s.ok)} of {len(stops)}"),
        ("mean seconds per kill trial (x a clean stop run)",
         f"{trial_seconds:.1f} ({trial_seconds / max(stop_seconds, 1e-9):.2f}x)"),
        ("LOST committed work (must be 0)", lost),
        ("CORRUPT checkpoints (must be 0)", corrupt),
        ("other problems (must be 0)", problems),
    ]
    print(f"\nA. SIGKILL trials ({kill_seconds / 60:.1f} min)\n")
    print("| figure | value |\n| --- | --- |")
    for name, value in rows:
        print(f"| {name} | {value} |")
    failed_gcs = 0
    if outcomes:
        print("\nB. GCS emulator faults (fault proxy in front of fake-gcs-server)\n")
        print("| scenario | faults injected | outcome | seconds |\n| --- | --- | --- | --- |")
        for outcome in outcomes:
            if isinstance(outcome, str):
                failed_gcs += 1
                print(f"| {outcome[:300]} | | | |")
            else:
                print(f"| {outcome.scenario} | {outcome.faults} | {outcome.result} | "
                      f"{outcome.seconds} |")
    failed_roots = print_root_trials(roots)
    shared_ok, shared_what, shared_seconds = unshared_root_is_refused(
        workdir / "unshared-root", {**TINY, "steps": 8, "devices_per_process": 2})
    print("\nD. Unshared roots\n")
    print("| trial | outcome | seconds |\n| --- | --- | --- |")
    print(f"| one root per host (stranded checkpoints if it ran) | "
          f"{'ok' if shared_ok else 'FAIL'}: {shared_what[:300]} | {shared_seconds:.1f} |")
    return 1 if lost or corrupt or problems or failed_gcs or failed_roots or not shared_ok else 0


def print_root_trials(results: list[RootTrialResult]) -> int:
    """Section C; returns the number of failed trials."""
    if not results:
        return 0
    print("\nC. Checkpoint root trials (pin, lineage, ownership, fencing)\n")
    print("| story | trials | launches | refusals checked | stranded (must be 0) | "
          "wrong weights (must be 0) | failed |\n| --- | --- | --- | --- | --- | --- | --- |")
    for kind in dict.fromkeys(r.kind for r in results):
        mine = [r for r in results if r.kind == kind]
        print(f"| {kind} | {len(mine)} | {sum(r.launches for r in mine)} | "
              f"{sum(r.refusals_checked for r in mine)} | {sum(r.stranded for r in mine)} | "
              f"{sum(r.wrong_weights for r in mine)} | {sum(not r.ok for r in mine)} |")
    failed = [r for r in results if not r.ok]
    for result in failed:
        for line in result.problems:
            print(f"  FAIL {result.kind}: {line[:400]}")
    return len(failed)


if __name__ == "__main__":
    sys.exit(main())
