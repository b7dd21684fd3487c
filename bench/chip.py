"""Everything one accelerator chip shows: checkpoints, and the reference trainer's throughput,
MFU, save stall and start-up times.

    python bench/chip.py --dir DIR [--model 184m|tiny] [--batch N] [--steps 30]
        [--interval 10] [--checkpoint-gib 2] [--skip-checkpoint-bench]
        [--relaunches cold,cache-first,warm] [--staging-mib N]

First `bench/checkpoint_bandwidth.py` on the chip (one device, `--checkpoint-gib` GiB of state,
Tardigrade and Orbax in the same run, the staging trade-off), in a process of its own (one
program at a time can hold a chip). Then it runs the reference trainer (`python -m
tardigrade_trainer`, one process: a single-host gang starts no coordination service, so it
runs where no socket can be opened) as the operator would, and reads its JSON log:

  1. seed run: a fresh start (no checkpoint, no compilation cache), `--steps` steps with a
     save every `--interval` steps; SIGTERM once it passed the last interval, so it saves on
     notice and exits 75, as a preempted gang does. Reports tokens/s (median of the logged
     windows after the first steps), the model FLOPs utilisation against the chip's peak
     (`--peak-tflops`, v5e bf16 197), and for every interval save the loop time lost over the
     steps the save overlapped, as the trainer logs it (`checkpoint_loop_time_lost`), against
     the save's own duration, with what the save staged in device memory, its budget and
     where the budget came from (the trainer's automatic budget unless `--staging-mib` sets
     one; `--staging-mib 0` is the unstaged arm); and the step's working memory. With
     `--compare-recompute N`, a run of N steps that keeps attention's probabilities for the
     backward pass instead of recomputing them (the trainer's default): the throughput and
     memory it is judged against;
  2. relaunches: the same job started again (it restores the save on notice), killed once
     its first step is logged: without JAX's persistent compilation cache (`cold`), with an
     empty cache (`cache-first`: it fills it, and is killed only once it has copied the
     cache into the checkpoint root) and with the cache that run filled (`warm`: a
     relaunched gang on GKE). Both cached runs keep the cache where the trainer does by
     default, beside the checkpoints (compile_cache.py). For each, the time from
     the process's start to its phases and to its first step (from the trainer's `startup`,
     `restore_done`, `compiled` and `step` events; time 0 is the process's start as the
     kernel records it). Without a `cache-first` relaunch, the seed run fills the cache that
     `warm` reads (`--relaunches warm`: the relaunch alone, in about two minutes);
  3. after a warm relaunch, the machine's floor (bench/chip_floor.py): when a program that
     does nothing but open the chip and load the step the relaunch loaded has both.

Target (issue 30): a warm relaunch reaches its first step in under 10 s on the chip; the loop
time lost per save is under 10% of the save's duration. A run whose trainer logged no save or
no step says so and judges nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
# One job's cache key for all of this bench's runs, as the operator's Secret holds one per job.
BENCH_CACHE_KEY = secrets.token_hex(32)

MODELS: dict[str, dict[str, Any]] = {
    # The reference model of the TPU measurements: 184M parameters, 2.2 GB of state with
    # AdamW's two moments (float32).
    "184m": {"vocab_size": 32000, "embed_dim": 1024, "num_layers": 12, "num_heads": 16,
             "mlp_dim": 4096, "global_batch_size": 32, "seq_len": 512,
             "learning_rate": 3e-4, "warmup_steps": 10},
    # For trying the script out on a CPU.
    "tiny": {"vocab_size": 256, "embed_dim": 64, "num_layers": 2, "num_heads": 4,
             "mlp_dim": 128, "global_batch_size": 8, "seq_len": 32, "warmup_steps": 5},
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", required=True, help="scratch directory (checkpoints, caches)")
    parser.add_argument("--model", choices=sorted(MODELS), default="184m")
    parser.add_argument("--steps", type=int, default=30, help="steps of the seed run")
    parser.add_argument("--batch", type=int, default=0,
                        help="global batch size (default: the model's; 1 to try 184m on a CPU)")
    parser.add_argument("--interval", type=int, default=10, help="save every N steps")
    parser.add_argument("--peak-tflops", type=float, default=197.0,
                        help="the chip's peak (v5e: 197 bf16 TFLOP/s)")
    parser.add_argument("--relaunches", default="cold,cache-first,warm",
                        help="which relaunches to run, in order")
    parser.add_argument("--log-compiles", action="store_true",
                        help="JAX_LOG_COMPILES=1 in the trainer (its stderr is kept in DIR)")
    parser.add_argument("--checkpoint-gib", type=float, default=2.0,
                        help="state size of the checkpoint bench")
    parser.add_argument("--checkpoint-repeats", type=int, default=2)
    parser.add_argument("--skip-checkpoint-bench", action="store_true")
    parser.add_argument("--headroom-batch", type=int, default=0,
                        help="also a seed run with this global batch (less activation memory: "
                             "device memory to stage saves in)")
    parser.add_argument("--headroom-interval", type=int, default=0,
                        help="the headroom run saves every N steps (default: --interval)")
    parser.add_argument("--staging-mib", type=int, default=None,
                        help="the trainer's checkpoint_snapshot_device_mib in every run: at "
                             "most this much device memory a save may stage its snapshot in, "
                             "within what the training leaves free; 0: never (the unstaged "
                             "arm). Default: unset, the trainer's automatic budget")
    parser.add_argument("--staging", default="0.25,0.5,1",
                        help="the checkpoint bench's --staging fractions")
    parser.add_argument("--memory-tier", default="", metavar="INTERVALS",
                        help="also runs of --memory-tier-steps steps with the memory tier on at "
                             "each of these intervals (comma-separated; N:wait for a run whose "
                             "memory steps wait for the previous commit instead of skipping), "
                             "and one without it: the tier's cost to the loop's throughput")
    parser.add_argument("--memory-tier-steps", type=int, default=60)
    parser.add_argument("--compare-recompute", type=int, default=0, metavar="STEPS",
                        help="also a run of STEPS steps that keeps attention's probabilities "
                             "for the backward pass (recompute_attention: false), the "
                             "baseline of the recomputation's throughput and step memory")
    return parser.parse_args()


def checkpoint_bench(args: argparse.Namespace, workdir: Path) -> None:
    command = [sys.executable, str(REPO / "bench" / "checkpoint_bandwidth.py"),
               "--gib", str(args.checkpoint_gib), "--devices", "1",
               "--repeats", str(args.checkpoint_repeats), "--skip-crc",
               "--skip-tensorstore-only", "--staging", args.staging,
               "--dir", str(workdir / "checkpoint-bench")]
    print("$ " + " ".join(["python", *command[1:]]), flush=True)
    # The chip: whatever JAX finds (the checkpoint bench defaults to the CPU otherwise).
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "")}
    subprocess.run(command, env=env, check=False)


def model_flops_per_token(config: dict[str, Any]) -> float:
    """Training FLOPs per token: 6 per parameter of every matmul (forward and backward; the
    tied embedding counts once, as the output projection) plus causal-free attention scores
    and values, 12 * layers * seq_len * embed (Chinchilla's accounting, appendix F)."""
    d, layers, mlp = config["embed_dim"], config["num_layers"], config["mlp_dim"]
    matmul_params = layers * (4 * d * d + 2 * d * mlp) + d * config["vocab_size"]
    return 6.0 * matmul_params + 12.0 * layers * config["seq_len"] * d


class Run:
    """One trainer process, its JSON log read as it comes."""

    def __init__(self, workdir: Path, name: str, checkpoint: Path, config: dict[str, Any],
                 interval: int, log_compiles: bool, extra_env: dict[str, str] | None = None
                 ) -> None:
        self.name = name
        env = {k: v for k, v in os.environ.items() if not k.startswith("TARDIGRADE_")}
        env.update({
            "TARDIGRADE_JOB_NAME": "chip-bench", "TARDIGRADE_NUM_PROCESSES": "1",
            "TARDIGRADE_PROCESS_ID": "0", "TARDIGRADE_CHECKPOINT_PATH": str(checkpoint),
            "TARDIGRADE_CHECKPOINT_INTERVAL_STEPS": str(interval),
            "TARDIGRADE_TRAINER_CONFIG": json.dumps(config),
            "TARDIGRADE_TERMINATION_LOG": str(workdir / f"{name}.term"),
            # The job's key, as the operator's Secret gives it: without one the trainer
            # neither reads nor writes the cache in the checkpoint root.
            "TARDIGRADE_CACHE_KEY": BENCH_CACHE_KEY,
            "PYTHONUNBUFFERED": "1",
        })
        env["PYTHONPATH"] = os.pathsep.join(
            [p for p in (env.get("PYTHONPATH"), str(REPO / "trainer_image")) if p])
        if log_compiles:
            env["JAX_LOG_COMPILES"] = "1"
        env.update(extra_env or {})
        self.stderr_path = workdir / f"{name}.err"
        self.log = open(workdir / f"{name}.jsonl", "w")  # noqa: SIM115
        self.events: list[dict[str, Any]] = []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tardigrade_trainer"], env=env, cwd=workdir,
            stdout=subprocess.PIPE, stderr=open(self.stderr_path, "wb"),  # noqa: SIM115
            text=True)

    def read_until(self, stop: Any) -> None:
        """Read events until `stop(event)` is true or the process ends."""
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if not line.startswith("{"):
                continue
            event = json.loads(line)
            self.log.write(line)
            self.log.flush()
            self.events.append(event)
            if stop(event):
                return

    def finish(self, sig: int | None = None, timeout: float = 300) -> int:
        if sig is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
        self.read_until(lambda event: False)
        return self.proc.wait(timeout=timeout)

    def of(self, name: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("event") == name]

    def tail(self) -> str:
        return self.stderr_path.read_text()[-3000:]


def seed_run(args: argparse.Namespace, workdir: Path, checkpoint: Path,
             config: dict[str, Any], name: str = "seed",
             interval: int = 0, until: int = 0) -> dict[str, Any]:
    """`until`: stop after that step (default: the step after the last save of `--steps`).
    A seed with the compilation cache on is stopped only once it has copied the cache into
    the checkpoint root."""
    interval = interval or args.interval
    run = Run(workdir, name, checkpoint, config, interval, args.log_compiles)
    last = until or (args.steps - 1) // interval * interval + 1
    run.read_until(lambda e: e.get("event") == "step" and e["step"] >= last)
    if config.get("compilation_cache_in_root", True) and not run.of("compilation_cache_pushed"):
        run.read_until(lambda e: e.get("event") == "compilation_cache_pushed")
    code = run.finish(signal.SIGTERM)
    steps = run.of("step")
    if not steps:
        print(f"{name} run: no step logged (exit {code}): nothing judged\n{run.tail()}")
        raise SystemExit(1)
    rates = [e["tokens_per_second"] for e in steps[3:] if e.get("tokens_per_second")]
    tokens = statistics.median(rates) if rates else float("nan")
    flops = model_flops_per_token(config) * tokens
    mfu = flops / (args.peak_tflops * 1e12)
    start = run.of("start")[0] if run.of("start") else {}
    cached = ("filling the compilation cache" if config.get("compilation_cache_in_root", True)
              else "no cache")
    print(f"{name} run (fresh start, {cached}, batch {config['global_batch_size']}) on "
          f"{start.get('platform', '?')} "
          f"({start.get('devices', '?')} devices): exit {code}; {len(steps)} steps; "
          f"{tokens:,.0f} tokens/s (median of {len(rates)} steps after the first 3); "
          f"{flops / 1e12:.1f} TFLOP/s model FLOPs = {mfu * 100:.1f}% MFU of "
          f"{args.peak_tflops:g} TFLOP/s")
    started = run.of("startup")[0].get("process_started")
    first = steps[0]
    if started is not None:
        print(f"    fresh start to first step: {first['time'] - started:.1f} s")
    compiled = run.of("compiled")[0] if run.of("compiled") else {}
    working = compiled.get("step_working_bytes")
    recompute = config.get("recompute_attention", True)
    print(f"    attention {'recomputed' if recompute else 'kept'} for the backward pass; the "
          f"step's working memory: {gib(working)}")
    lost = run.of("checkpoint_loop_time_lost")
    committed = {e["step"]: e for e in run.of("checkpoint_committed")}
    if not lost:
        print("    save stall: the trainer logged no checkpoint_loop_time_lost: not judged")
    for event in lost:
        save = committed.get(event["step"], {})
        seconds = save.get("seconds")
        share = f"{event['lost_s'] / seconds * 100:.1f}% of" if seconds else "(no commit for)"
        verdict = ("met" if seconds and event["lost_s"] < 0.1 * seconds else "MISSED")
        print(f"    save at step {event['step']} ({event.get('reason', '')}): loop time lost "
              f"{event['lost_s'] * 1e3:.0f} ms over {event['steps']} steps, {share} the "
              f"save's {seconds or 0:.2f} s; save call blocked {event['blocked_s'] * 1e3:.0f} "
              f"ms; staged in HBM {mib(event.get('staged_bytes', 0))} of a budget of "
              f"{mib(event.get('staging_budget_bytes'))} ({event.get('staging_budget', '?')}): "
              f"< 10%: {verdict}")
    for event in run.of("checkpoint_staging_failed"):
        print(f"    save at step {event['step']}: staging {mib(event['failed_bytes'])} in HBM "
              f"failed, copied to the host instead: {event.get('error', '')}")
    notice = run.of("preempted")
    print(f"    save on notice: {'step ' + str(notice[0]['step']) if notice else 'none'}")
    return {"tokens_per_second": tokens, "mfu": mfu, "working_bytes": working}


def mib(nbytes: int | None) -> str:
    return "? MiB" if nbytes is None else f"{nbytes / 2**20:.0f} MiB"


def gib(nbytes: int | None) -> str:
    return "not reported" if nbytes is None else f"{nbytes / 2**30:.2f} GiB"


def relaunch(args: argparse.Namespace, workdir: Path, checkpoint: Path,
             config: dict[str, Any], name: str) -> dict[str, float] | None:
    run = Run(workdir, name, checkpoint, config, args.interval, args.log_compiles)
    run.read_until(lambda e: e.get("event") == "step")
    if name == "cache-first" and not run.of("compilation_cache_pushed"):
        # The run that fills the cache copies it into the checkpoint root once the step is
        # compiled, beside the training (a gang on GKE trains on for minutes): killed at its
        # first step, it would leave the warm relaunch a cache without the step.
        run.read_until(lambda e: e.get("event") == "compilation_cache_pushed")
    code = run.finish(signal.SIGKILL)
    steps, startup = run.of("step"), run.of("startup")
    if not steps or not startup or startup[0].get("process_started") is None:
        print(f"relaunch {name}: no step or no process start logged (exit {code}): "
              f"not judged\n{run.tail()}")
        return None
    zero = startup[0]["process_started"]
    marks = {k: v - zero for k, v in startup[0].items()
             if isinstance(v, float) and k not in ("time", "process_started")}
    found = {"startup logged": startup[0]["time"] - zero, **marks}
    for event in ("restore_done", "compiled"):
        if run.of(event):
            found[event] = run.of(event)[0]["time"] - zero
    found["first step"] = steps[0]["time"] - zero
    compiled = run.of("compiled")[0] if run.of("compiled") else {}
    restored = run.of("restore_done")[0]["step"] if run.of("restore_done") else None
    shown = ", ".join(f"{k} {v:.1f}" for k, v in sorted(found.items(), key=lambda kv: kv[1]))
    cache = {k: compiled[k] for k in ("cache_hits", "cache_requests", "backend_compile_seconds",
                                       "step_cache", "step_untraced") if k in compiled}
    read = run.of("checkpoint_restored")[0] if run.of("checkpoint_restored") else {}
    spent = {k: read[k] for k in ("seconds", "marker_s", "read_wait_s", "device_put_s")
             if k in read}
    print(f"relaunch {name} (restored step {restored}): first step at "
          f"{found['first step']:.1f} s after the process started; {shown}; compile: {cache}; "
          f"restore: {spent}")
    return found


def main() -> int:
    args = parse_args()
    workdir = Path(args.dir).resolve()
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    checkpoint = workdir / "checkpoints"
    cache = checkpoint / "compilation-cache"  # the trainer's default place
    model = {**MODELS[args.model], **({"global_batch_size": args.batch} if args.batch else {})}
    base = {**model, "steps": 100000, "log_every": 1,
            **({} if args.staging_mib is None
               else {"checkpoint_snapshot_device_mib": args.staging_mib})}
    if not args.skip_checkpoint_bench:
        checkpoint_bench(args, workdir)
    print(f"model {args.model}: {json.dumps(model)}; "
          f"{model_flops_per_token(base) / 1e9:.2f} GFLOP per token")
    relaunches = [n for n in args.relaunches.split(",") if n]
    # Without a `cache-first` relaunch, the seed fills the cache a `warm` one reads.
    seed_fills = "warm" in relaunches and "cache-first" not in relaunches
    seed = seed_run(args, workdir, checkpoint,
                    {**base, "compilation_cache_in_root": seed_fills})
    if args.compare_recompute:
        kept = seed_run(args, workdir, workdir / "checkpoints-kept-attention",
                        {**base, "compilation_cache_in_root": False,
                         "recompute_attention": False},
                        name="kept-attention", interval=10**6, until=args.compare_recompute)
        ratio = seed["tokens_per_second"] / kept["tokens_per_second"]
        print(f"recomputed attention against kept: throughput {ratio:.3f}x; step working "
              f"memory {gib(seed['working_bytes'])} against {gib(kept['working_bytes'])}")
    results = {}
    sys.path.insert(0, str(REPO / "trainer_image"))
    from tardigrade_trainer import compile_cache

    where = compile_cache.location(None, str(checkpoint))
    assert where is not None
    for name in relaunches:
        # The trainer's default: the cache beside the checkpoints, as on GKE; every relaunch
        # is a new pod whose disk has no copy of it.
        config = dict(base)
        shutil.rmtree(where.local, ignore_errors=True)
        if name == "cold":
            config["compilation_cache_in_root"] = False
        if name == "cache-first":
            shutil.rmtree(cache, ignore_errors=True)
        results[name] = relaunch(args, workdir, checkpoint, config, name)
    if args.memory_tier:
        memory_tier_arms(args, workdir, base)
    if args.headroom_batch:
        seed_run(args, workdir, workdir / "checkpoints-headroom",
                 {**base, "global_batch_size": args.headroom_batch,
                  "compilation_cache_in_root": False}, name="headroom",
                 interval=args.headroom_interval)
    warm = results.get("warm")
    if warm is not None:
        verdict = "met" if warm["first step"] < 10 else "MISSED"
        print(f"target: warm relaunch to first step {warm['first step']:.1f} s < 10 s: "
              f"{verdict}")
        # The warm relaunch's local copy: the root's entries are sealed (compile_cache.py),
        # the copy holds them as the trainer loads them.
        floor(workdir, Path(where.local), warm["first step"])
    return 0


def memory_tier_arms(args: argparse.Namespace, workdir: Path, base: dict[str, Any]) -> None:
    """The memory tier's cost (issue 42: < 2% of throughput): the same steps without the tier
    and with it at each interval, each arm a fresh job with no bucket save in its window. One
    process holds the chip, so no peer takes a copy (replicas 0): what the chip adds, the
    copy off the device and the write to host memory, is all there. The arms share a local
    compilation cache: only the first compiles."""
    # A pod's memory volume is a tmpfs; where this host's is too small for two snapshots of
    # each arm, the local disk stands in (and says so).
    shm = Path("/dev/shm")
    if not shm.is_dir() or shutil.disk_usage(shm).free < 8 << 30:
        shm = workdir
    print(f"memory tier arms: snapshots in {shm} ({shutil.disk_usage(shm).free / 2**30:.1f} GiB "
          "free)")
    steps = args.memory_tier_steps
    config = {**base, "compilation_cache_dir": str(workdir / "memory-tier-cache"),
              "compilation_cache_in_root": False}
    rates: dict[str, float] = {}
    step_times: dict[str, dict[int, float]] = {}
    first_snapshot: dict[str, int] = {}
    started_at: dict[str, list[int]] = {}
    for interval in ["none", *args.memory_tier.split(",")]:
        name = f"memory-{interval.replace(':', '-')}"
        every, _, when_busy = interval.partition(":")
        env = {} if interval == "none" else {
            "TARDIGRADE_MEMORY_TIER_DIR": str(shm / f"tardigrade-bench-{name}"),
            "TARDIGRADE_MEMORY_TIER_INTERVAL": every,
            "TARDIGRADE_MEMORY_TIER_REPLICAS": "0",
            **({"TARDIGRADE_MEMORY_TIER_WHEN_BUSY": when_busy} if when_busy else {})}
        run = Run(workdir, name, workdir / f"checkpoints-{name}", config, 10**6,
                  args.log_compiles, env)
        run.read_until(lambda e: e.get("event") == "step" and e["step"] >= steps)
        code = run.finish(signal.SIGKILL)
        shutil.rmtree(shm / f"tardigrade-bench-{name}", ignore_errors=True)
        times = [e["time"] for e in run.of("step")]
        step_times[interval] = {e["step"]: e["time"] for e in run.of("step")}
        if len(times) < 10:
            print(f"{name}: {len(times)} steps (exit {code}): not judged\n{run.tail()}")
            return
        # Whole steps over the window after the first 5, snapshots included: a median
        # of per-step rates would leave out the steps a snapshot blocked.
        window = times[5:]
        rates[interval] = (len(window) - 1) / (window[-1] - window[0])
        snaps = run.of("memory_snapshot_started")
        skipped = run.of("memory_snapshot_skipped")
        blocked = [e["blocked_s"] for e in snaps]
        started_at[interval] = [e["step"] for e in snaps]
        if snaps:
            first_snapshot[interval] = snaps[0]["step"]
        committed = run.of("memory_snapshot_committed")
        seconds = [e["seconds"] for e in committed]
        phases = {k: statistics.median(e["phases"][k] for e in committed)
                  for k in ("read_s", "digest_s", "write_s", "seal_s", "workers")
                  if committed and all(k in e.get("phases", {}) for e in committed)}
        print(f"{name}: {rates[interval]:.3f} steps/s over steps {len(times) - len(window) + 1}"
              f"-{len(times)}; {len(snaps)} snapshots started "
              f"(steps {[e['step'] for e in snaps]}), {len(skipped)} skipped "
              f"(steps {[e['step'] for e in skipped]}), {len(committed)} committed; "
              f"loop blocked per snapshot {statistics.median(blocked) * 1e3 if blocked else 0:.0f}"
              f" ms (median; {min(blocked, default=0) * 1e3:.0f}-"
              f"{max(blocked, default=0) * 1e3:.0f}); commit "
              f"{statistics.median(seconds) if seconds else 0:.2f} s (median; "
              f"{min(seconds, default=0):.2f}-{max(seconds, default=0):.2f}); phases summed "
              f"over the commit's threads (median): {phases}")
    for interval, rate in rates.items():
        if interval == "none":
            continue
        cost = 1 - rate / rates["none"]
        verdict = "met" if cost < 0.02 else "MISSED"
        print(f"memory tier every {interval} steps: throughput {rate / rates['none']:.3f}x of "
              f"none, cost {cost * 100:.1f}%: < 2%: {verdict}")
        steady_cost(interval, step_times, first_snapshot, started_at)


def steady_cost(interval: str, step_times: dict[str, dict[int, float]],
                first_snapshot: dict[str, int], started_at: dict[str, list[int]]) -> None:
    """The tier's cost in steady training: the same steps of both arms from one interval after
    the first snapshot, whose one-time costs (the staging copy's program, the commit's threads,
    the memory volume's first files) a run of hours spreads over thousands of snapshots; and
    the loop's time lost per snapshot taken in that window."""
    every = int(interval.partition(":")[0])
    first = first_snapshot.get(interval)
    tier, none = step_times[interval], step_times["none"]
    end = min(max(tier), max(none))
    if first is None or first + every >= end:
        print("    steady: no whole interval after the first snapshot: not judged")
        return
    begin = first + every
    tier_s, none_s = tier[end] - tier[begin], none[end] - none[begin]
    taken = [s for s in started_at[interval] if begin <= s < end]
    cost = 1 - none_s / tier_s
    per = (tier_s - none_s) / len(taken) if taken else float("nan")
    verdict = "met" if cost < 0.02 else "MISSED"
    print(f"    steady (steps {begin}-{end}, {len(taken)} snapshots taken): cost "
          f"{cost * 100:.1f}%, {per * 1e3:.0f} ms of the loop per snapshot: < 2%: {verdict}")


def floor(workdir: Path, cache: Path, first_step: float) -> None:
    """What this machine takes before any relaunch can step: a program that only opens the
    chip and loads the step the warm relaunch loaded (bench/chip_floor.py), in a process of
    its own once the trainer has let go of the chip."""
    done = subprocess.run([sys.executable, str(REPO / "bench" / "chip_floor.py"),
                           "--step-cache", str(cache)], cwd=workdir, capture_output=True,
                          text=True, timeout=300)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        print(f"floor: not measured (exit {done.returncode}): {done.stderr[-2000:]}")
        return
    found = json.loads(lines[-1])
    print(f"floor: {json.dumps(found)}")
    if "step_loaded_s" in found:
        print(f"    the warm relaunch's first step came {first_step - found['step_loaded_s']:.1f}"
              f" s after a program that only opened the chip ({found['devices_open_s']:.1f} s)"
              f" and loaded the step ({found['step_load_s']:.1f} s) had both, at "
              f"{found['step_loaded_s']:.1f} s")


if __name__ == "__main__":
    sys.exit(main())
