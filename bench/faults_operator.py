"""Operator and control-plane faults: every trial must converge with exact bookkeeping.

    python bench/faults_operator.py [--trials 20] [--seed N] [--only SUBSTRING,...]

On one real-node cluster (real kubelets and containerd; the chart's operator on an
on-demand node, simulated trainers in a test image on 3 spot nodes; run as root) each
scenario of `tests/faults/operator_scenarios.py` runs `--trials` times: the operator
SIGKILLed at random moments of a launch, a recovery and a resize; the API server restarted
and all watch connections cut in the middle of a recovery; a storm of 10 spot reclaims; a
node lost for good. Duplicate pods, orphans and counter mismatches must all be 0, and the
storm's 10 reclaims must come within 60 s (a pace the tests do not judge: it is the
cluster's and the operator's speed). Times to converge are also given as a ratio to an
undisturbed launch measured in the same run (the baseline). Exit status 1 when any trial
broke an invariant or missed its pace.
"""

from __future__ import annotations

import argparse
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), *(str(REPO / d) for d in ("operator", "trainer_image", "local_cluster"))]

from tests.faults.operator_scenarios import (  # noqa: E402
    SCENARIOS,
    Expected,
    FaultBed,
    TrialFailed,
    TrialResult,
)
from tests.polling import wait_for  # noqa: E402


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def clean_launch(bed: FaultBed, index: int) -> TrialResult:
    name = f"baseline-{index}"
    started = time.monotonic()
    bed.apply(bed.sim_job(name, 2))
    wait_for(lambda: bed.converged(name), 120, f"{name} to start")
    seconds = time.monotonic() - started
    result = bed.judge("undisturbed launch (baseline)", name, Expected(1, 2), started)
    result.seconds = seconds
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", default="",
                        help="comma-separated: run the scenarios whose name has one of these")
    args = parser.parse_args()
    # SIGTERM (e.g. from `timeout`) must still stop the cluster, its pods and the operator.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    wanted = [w.strip().lower() for w in args.only.split(",")]
    chosen = {k: v for k, v in SCENARIOS.items() if any(w in k.lower() for w in wanted)}
    root = Path(tempfile.mkdtemp(prefix="tardigrade-faults-"))
    failures: list[TrialResult] = []
    rows = []
    with FaultBed(root, seed=args.seed) as bed:
        baseline = [clean_launch(bed, i) for i in range(5)]
        base = statistics.median(r.seconds for r in baseline)
        print(f"seed {args.seed}; baseline: undisturbed 2-rank launch, apply -> Running, "
              f"p50 {base:.2f}s over {len(baseline)} launches", flush=True)
        failures += [r for r in baseline if not r.ok]
        for scenario, trial in chosen.items():
            results = []
            for index in range(args.trials):
                try:
                    result = trial(bed, index)
                except (AssertionError, TrialFailed) as err:  # a wait timed out, a reclaim failed
                    result = TrialResult(scenario, False, 0, 0, [], float("nan"), str(err))
                    bed.forget_jobs()
                results.append(result)
                if not result.ok or result.pace_missed:
                    failures.append(result)
                    print(f"  FAILED {result.describe()}", flush=True)
            times = [r.seconds for r in results if r.converged]
            p50 = percentile(times, 0.5) if times else float("nan")
            p99 = percentile(times, 0.99) if times else float("nan")
            rows.append(f"| {scenario} | {len(results)} | {sum(r.converged for r in results)} "
                        f"| {sum(r.duplicates for r in results)} "
                        f"| {sum(r.orphans for r in results)} "
                        f"| {sum(len(r.mismatches) for r in results)} "
                        f"| {p50:.1f} | {p99:.1f} | {p50 / base:.1f}x |")
            print(f"  {scenario}: done ({len(results)} trials)\n  {rows[-1]}", flush=True)
    print("\n| scenario | trials | converged | duplicate pods | orphans | counter mismatches "
          "| converge p50 s | p99 s | p50 / undisturbed launch |")
    print("|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    for result in failures:
        print(f"FAILED {result.describe()}")
    print(f"operator log and cluster state: {root}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
