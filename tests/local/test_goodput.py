"""The goodput bench's arithmetic: kept steps, goodput and recovery from a step log."""

from __future__ import annotations

import dataclasses
import json

import pytest
from tardigrade_local.goodput import (
    Disruption,
    DisruptionCost,
    RunReport,
    kept,
    percentile,
    run_report,
    step_runs,
)
from tardigrade_local.steplog import StepLog

T0 = 1_000_000.0


def steps(attempt: int, first: int, last: int, start: float, every: float = 1.0,
          first_takes: float | None = None) -> list[dict]:
    """Step records of one attempt: `first` ends at `start`, then one every `every` s."""
    records = [{"event": "start", "attempt": attempt, "time": start - (first_takes or every)}]
    for i, step in enumerate(range(first, last + 1)):
        records.append({"event": "step", "attempt": attempt, "step": step, "loss": 1.0,
                        "time": start + i * every})
    return records


def test_undisturbed_run_keeps_every_step_and_ignores_compilation():
    # The first step took 10 s (compilation); the others 0.5 s. Submitted 20 s before it.
    records = steps(1, 1, 5, T0 + 20, every=0.5, first_takes=10)
    report = run_report(records, [], started=T0)
    assert report.steps_computed == report.steps_kept == 5
    assert report.kept_seconds == pytest.approx(5 * 0.5)
    assert report.wall_seconds == pytest.approx(22.0)
    assert report.goodput == pytest.approx(2.5 / 22.0)


def test_preemption_with_notice_loses_nothing_and_times_the_recovery():
    # Notice at step 8's time; the gang agrees on step 10, saves, and the next attempt resumes
    # at step 11, 12 s after the notice.
    records = steps(1, 1, 10, T0 + 1) + steps(2, 11, 20, T0 + 20, first_takes=4)
    notice = Disruption("preemption", T0 + 8, attempt=1)
    report = run_report(records, [notice], started=T0)
    assert report.steps_kept == 20
    (cost,) = report.costs
    assert cost.steps_lost == 0
    assert cost.recovery_seconds == pytest.approx(12.0)
    assert cost.stopped_seconds == pytest.approx(2.0)  # attempt 1's last step, at T0 + 10
    assert cost.relaunch_seconds == pytest.approx(8.0)  # attempt 2 started at T0 + 16


def test_steps_past_the_restored_checkpoint_are_lost():
    # No save on notice: attempt 2 restores step 5, so attempt 1's steps 6..10 were wasted.
    records = steps(1, 1, 10, T0 + 1) + steps(2, 6, 20, T0 + 20)
    report = run_report(records, [Disruption("preemption", T0 + 10.5, attempt=1)], started=T0)
    assert report.steps_computed == 25
    assert report.steps_kept == 20
    assert report.kept_seconds == pytest.approx(20.0)
    assert report.costs[0].steps_lost == 5
    assert report.costs[0].stopped_seconds == 0.0  # its last step came before the notice
    assert report.wall_seconds == pytest.approx(34.0)


def test_a_later_attempt_that_goes_further_back_discards_more():
    runs = step_runs(steps(1, 1, 10, T0) + steps(2, 9, 12, T0 + 20) + steps(3, 7, 15, T0 + 40))
    kept_steps = [(r.attempt, r.step) for r, k in zip(runs, kept(runs), strict=True) if k]
    assert kept_steps == [(1, s) for s in range(1, 7)] + [(3, s) for s in range(7, 16)]


def test_a_disruption_with_no_recovery_has_no_recovery_time():
    records = steps(1, 1, 10, T0 + 1)
    report = run_report(records, [Disruption("resize", T0 + 5, attempt=1)], started=T0)
    assert report.costs[0].recovery_seconds is None
    assert report.costs[0].steps_lost == 0


def test_percentile_is_nearest_rank():
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert percentile([3.0, 1.0, 2.0], 0.99) == 3.0
    assert percentile(list(map(float, range(1, 101))), 0.99) == 99.0
    assert percentile([], 0.5) != percentile([], 0.5)  # NaN: nothing measured


def _cri(lines: list[dict | str]) -> bytes:
    out = []
    for line in lines:
        text = line if isinstance(line, str) else json.dumps(line)
        out.append(f"2026-01-01T00:00:00.000000Z stdout F {text}\n")
    return "".join(out).encode()


def _pod_logs(root, pod: str, runs: list[list]) -> None:
    """A real kubelet's files of one pod: `<ns>_<pod>_<uid>/trainer/<restart count>.log`."""
    for restart, lines in enumerate(runs):
        path = root / f"{pod}_0f3c" / "trainer" / f"{restart}.log"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(_cri(lines))


def test_step_log_reads_rank_zero_of_every_attempt_from_the_kubelet_files(tmp_path):
    logs = {
        "default_job-a1-0": [{"event": "start", "time": 1.0}, "jax: a warning",
                             {"event": "step", "step": 1, "loss": 2.0, "time": 2.0}],
        "default_job-a2-0": [{"event": "checkpoint_restored", "step": 1, "time": 5.0},
                             {"event": "step", "step": 2, "loss": 1.5, "time": 6.0}],
        "default_job-a2-1": [{"event": "step", "step": 2, "loss": 9.0, "time": 6.0}],
        "default_job-b-a1-0": [{"event": "step", "step": 7, "loss": 9.0, "time": 6.0}],
    }
    # Two nodes' directories: attempt 2 ran on another node.
    for pod, lines in logs.items():
        _pod_logs(tmp_path / ("node-2" if "-a2-" in pod else "node-1"), pod, [lines])
    log = StepLog.from_pod_log_dirs([tmp_path / "node-1", tmp_path / "node-2"], "default", "job")
    assert [(r["event"], r["attempt"]) for r in log.records] == [
        ("start", 1), ("step", 1), ("checkpoint_restored", 2), ("step", 2)]
    assert log.curve() == {1: 2.0, 2: 1.5}
    assert log.restored == [1]


def test_step_log_reads_the_run_before_a_restart_in_place_first(tmp_path):
    """Rank 0 kept across attempts (restarted by its kubelet): one pod, two runs."""
    _pod_logs(tmp_path, "default_job-a1-0", [
        [{"event": "step", "step": 1, "loss": 2.0, "attempt": 1},
         {"event": "checkpoint_committed", "step": 1, "attempt": 1}],
        [{"event": "checkpoint_restored", "step": 1, "attempt": 2},
         {"event": "step", "step": 2, "loss": 1.5, "attempt": 2}]])
    log = StepLog.from_pod_log_dirs([tmp_path], "default", "job")
    assert [(r["event"], r["attempt"]) for r in log.records] == [
        ("step", 1), ("checkpoint_committed", 1), ("checkpoint_restored", 2), ("step", 2)]
    assert log.curve() == {1: 2.0, 2: 1.5}


def _bench_goodput():
    """bench/goodput.py, loaded from its file (bench/ is scripts, not a package)."""
    import importlib.util
    import sys

    from tests.conftest import REPO_ROOT

    spec = importlib.util.spec_from_file_location("bench_goodput", REPO_ROOT / "bench" /
                                                  "goodput.py")
    module = importlib.util.module_from_spec(spec)
    # dataclasses resolve the module of the classes they decorate through sys.modules.
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _arm_result(bench, key: str, goodput: float, lost: list[int]):
    costs = tuple(DisruptionCost(Disruption("preemption", T0, 1), 5.0, 1.0, 3.0, n)
                  for n in lost)
    report = RunReport(wall_seconds=100.0, kept_seconds=100.0 * goodput, steps_kept=10,
                             steps_computed=10, costs=costs)
    return bench.ArmResult(bench.ARMS[key], report, T0, [], [], [])


def test_goodput_bench_judges_no_target_on_an_arm_that_saw_no_disruption():
    bench = _bench_goodput()
    quiet = bench.verdicts([_arm_result(bench, "a", 0.9, []), _arm_result(bench, "b", 0.9, []),
                            _arm_result(bench, "d", 0.8, [])])
    assert quiet == [
        "target (b) goodput >= 0.9 x (a): not judged, arm (b) saw no preemption (run too short)",
        "target zero steps lost with notice (b): not judged, arm (b) saw no disruption",
        "target zero steps lost with notice (d): not judged, arm (d) saw no disruption",
    ]
    disrupted = bench.verdicts([_arm_result(bench, "a", 0.9, []),
                                _arm_result(bench, "b", 0.72, [0, 2])])
    assert disrupted == ["target (b) goodput >= 0.9 x (a): 0.80 x -> MISSED",
                         "target zero steps lost with notice (b): 2 lost -> MISSED"]


def test_goodput_bench_judges_the_window_and_ungraceful_arms_only_when_they_were_hit():
    bench = _bench_goodput()
    quiet = bench.verdicts([_arm_result(bench, "e", 0.9, []), _arm_result(bench, "f", 0.9, [])])
    assert quiet == [
        "target zero steps lost with notice (f): not judged, arm (f) saw no disruption",
        "target (f) save on notice inside the shutdown window: not judged, arm (f) saw no "
        "save on notice",
        "target (e) training again within 170 s of an ungraceful loss (node monitor grace + "
        "node-lost-after + survivors' grace + slack): not judged, arm (e) saw no halt",
    ]
    window = dataclasses.replace(_arm_result(bench, "f", 0.8, [0]),
                                 notice_saves=[(4.5, 15.0), (16.5, 15.0)])
    halted = _arm_result(bench, "e", 0.5, [12])
    hit = bench.verdicts([halted, window])
    assert hit[1] == ("target (f) save on notice inside the shutdown window: 1.10 of it at "
                      "most -> MISSED")
    assert hit[2].endswith(": 5.0 s at most -> met")
    # (f) trains another model than (a): no ratio to it.
    row = bench.summary_rows([_arm_result(bench, "a", 0.9, []), window])[1]
    assert row["goodput vs (a)"] == "-"
    assert row["save on notice / window (max)"] == "16.50 s / 15 s (1.10)"


def test_goodput_bench_gives_each_rank_a_spot_node_of_its_own():
    """A reclaim of one rank's node must take that rank only: two ranks fit on no node."""
    from types import SimpleNamespace

    from kubernetes.utils import parse_quantity

    module = _bench_goodput()
    bench = object.__new__(module.Bench)  # no cluster: the job is built from settings alone
    bench.settings, bench.seed = module.Settings.quick(), 0
    bench.real = SimpleNamespace(images={"trainer-cpu": "registry.local/trainer:1"},
                                 gcs_pod_env=lambda: {"STORAGE_EMULATOR_HOST": "http://gcs"})
    allocatable = ["1900m", "2"]
    bench.rank_cpu = module.rank_cpu(allocatable)
    job = bench.job(module.ARMS["i"])
    asked = parse_quantity(job["spec"]["resources"]["requests"]["cpu"])
    assert asked * 2 > parse_quantity("1900m") and asked <= parse_quantity("1900m")
    assert job["spec"]["podTemplate"]["nodeSelector"] == {"cloud.google.com/gke-spot": "true"}
    assert job["spec"]["image"] == "registry.local/trainer:1"
    assert {"name": "STORAGE_EMULATOR_HOST", "value": "http://gcs"} in job["spec"]["env"]


def test_goodput_bench_judges_restart_in_process_against_recreation():
    bench = _bench_goodput()

    def recovering(key: str, seconds: float):
        arm = _arm_result(bench, key, 0.9, [0])
        costs = tuple(dataclasses.replace(c, recovery_seconds=seconds) for c in arm.report.costs)
        return dataclasses.replace(arm, report=dataclasses.replace(arm.report, costs=costs))

    lines = bench.verdicts([recovering("b", 4.0), recovering("i", 1.8)])
    (ratio,) = [line for line in lines if line.startswith("target (i) time to recover")]
    assert ratio == "target (i) time to recover p50 <= 0.5 x (b): 0.45 x -> met"
    (missed,) = [line for line in bench.verdicts([recovering("b", 3.2), recovering("i", 3.6)])
                 if line.startswith("target (i)")]
    assert ": 1.12 x -> MISSED" in missed
