"""How far the profiled clock is from the wall clock, on this machine's real engine.

For each model one JaxEngine (wall clock) is built and warmed up once, and one
`ProfiledClock` is fitted over it (the grid of step compositions timed at
warm-up). `static` and `orca` then serve the identical saturating workload
`--repeats` times each, in alternating order, under both clocks:

* wall: each step advances the clock by its measured time; every such step is
  also priced by the profiled clock's fit, which gives the per-step error
  (fit / measured - 1) and the error of the fit's sum over the whole run;
* profiled: each step advances the clock by the fit's price of what it holds.

Printed: output tokens/s (median over repeats) under each clock, the orca/static
throughput ratio under each and their difference, and the per-step errors.

    python benchmarks/profiled_clock.py [--models tiny small] [--repeats 3]

`--across_commands` measures instead what a user sees across commands: the README's
main job (`python -m experiments.compare`, its defaults), each run its own process
with a temporary table store (`--profile_store`), run `--repeats` times with a fresh
table (`--profile_table=fresh`) on the machine as it is, then `--repeats` times with
a fresh table under two busy-loop processes (started and killed here, each bounded by
`--busy_bound_s`), then `--repeats` times under the same load reading the table the
last idle run stored. Printed: every run's output tok/s per policy, wall seconds, load
average and table, and per policy the spread of the fresh tables (idle and loaded)
and whether every reused run matches the idle run that stored its table.

    python benchmarks/profiled_clock.py --across_commands [--repeats 3]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

import jax
import numpy as np

from orca_jax.core.loop.scheduler import SchedulerConfig
from orca_jax.core.step.engine_api import Bucket
from orca_jax.core.step.packing import bucket_config_for, pages_per_seq_for
from orca_jax.runner.build import build_engine, build_workload, scheduler_config
from orca_jax.runner.experiment import run_policy
from orca_jax.runner.spec import JaxEngineSpec, LimitsSpec, RunSpec, WorkloadSpec
from orca_jax.sim.calibration import RecordingEngine
from orca_jax.sim.profiled_clock import ProfiledClock

POLICIES = ("static", "orca")


def _spec(args: argparse.Namespace, model: str, clock: str) -> RunSpec:
    return RunSpec(
        workload=WorkloadSpec(arrival="poisson", num_requests=args.num_requests, rate=args.rate,
                              prompt_len=args.prompt_len, output_len=args.output_len),
        engine=JaxEngineSpec(model=model, clock=clock),
        limits=LimitsSpec(max_num_seqs=args.max_num_seqs, max_num_tokens=args.max_num_tokens),
        seed=args.seed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--across_commands", action="store_true",
                        help="the main job's tok/s across processes, idle and under load")
    parser.add_argument("--busy_bound_s", type=float, default=900.0,
                        help="--across_commands: a busy loop ends itself after this long")
    parser.add_argument("--models", nargs="+", default=["tiny", "small"])
    parser.add_argument("--num_requests", type=int, default=128)
    parser.add_argument("--rate", type=float, default=100.0)
    parser.add_argument("--prompt_len", default="uniform:16:128")
    parser.add_argument("--output_len", default="uniform:1:256")
    parser.add_argument("--max_num_seqs", type=int, default=16)
    parser.add_argument("--max_num_tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.across_commands:
        across_commands(args.repeats, args.busy_bound_s)
        return
    print(f"profiled vs wall clock on {jax.devices()[0].device_kind} ({jax.default_backend()}), "
          f"jax {jax.__version__}, python {platform.python_version()}")
    print(f"workload: {args.num_requests} requests, poisson {args.rate}/s, prompt "
          f"{args.prompt_len}, output {args.output_len}; batch cap {args.max_num_seqs}, "
          f"token budget {args.max_num_tokens}, fp32, greedy; {args.repeats} repeats per "
          "policy and clock, alternating order")
    for model in args.models:
        spec = _spec(args, model, "wall")
        config = scheduler_config(spec)
        start = time.perf_counter()
        wall = build_engine(spec, config)  # a JaxEngine on the wall clock
        # The profiled clock over the very same compiled engine, as `build_engine` makes it.
        limits, kv = config.limits, config.kv
        profiled = ProfiledClock(wall, max_model_len=limits.max_model_len,
                                 page_size=kv.page_size,
                                 pages_per_seq=pages_per_seq_for(limits.max_model_len,
                                                                 kv.page_size),
                                 num_pages=kv.num_kv_pages + 1)
        profiled.warmup(_buckets(config))
        warm_s = time.perf_counter() - start
        requests = build_workload(spec)
        tok_s: dict[tuple[str, str], list[float]] = {}
        errors: list[float] = []
        sum_ratios: list[float] = []
        for repeat in range(args.repeats):
            order = POLICIES if repeat % 2 == 0 else POLICIES[::-1]
            for policy in order:
                recorder = RecordingEngine(wall)
                summary, _ = run_policy(spec, policy, requests=requests, engine=recorder,
                                        progress=False)
                tok_s.setdefault((policy, "wall"), []).append(summary["throughput_tok_s"])
                price = np.array([profiled.fit[t].seconds(q, k) for t, q, k, _ in recorder.steps])
                measured = np.array([s for *_, s in recorder.steps])
                errors += (price / measured - 1).tolist()
                sum_ratios.append(float(price.sum() / measured.sum()))
                summary, _ = run_policy(_spec(args, model, "profiled"), policy,
                                        requests=requests, engine=profiled, progress=False)
                tok_s.setdefault((policy, "profiled"), []).append(summary["throughput_tok_s"])
        print(f"\nmodel={model} (warm-up and profiling {warm_s:.1f} s)")
        print(f"{'policy':>8} {'wall tok/s':>11} {'profiled tok/s':>15}")
        median = {key: statistics.median(values) for key, values in tok_s.items()}
        for policy in POLICIES:
            print(f"{policy:>8} {median[policy, 'wall']:>11.1f} "
                  f"{median[policy, 'profiled']:>15.1f}")
        ratio = {clock: median["orca", clock] / median["static", clock]
                 for clock in ("wall", "profiled")}
        print(f"orca/static throughput: wall {ratio['wall']:.3f}x, profiled "
              f"{ratio['profiled']:.3f}x ({100 * (ratio['profiled'] / ratio['wall'] - 1):+.1f}%)")
        abs_errors = np.abs(errors)
        print(f"per-step error of the fit on the wall runs' {len(errors)} steps: median "
              f"|error| {100 * np.median(abs_errors):.1f}%, p90 "
              f"{100 * np.percentile(abs_errors, 90):.1f}%; fit sum / measured sum per run: "
              f"{', '.join(f'{r:.3f}' for r in sum_ratios)}")


def _buckets(config: SchedulerConfig) -> list[Bucket]:
    limits = config.limits
    return bucket_config_for(max_num_tokens=limits.max_num_tokens,
                             max_num_seqs=limits.max_num_seqs,
                             max_model_len=limits.max_model_len, page_size=config.kv.page_size,
                             token_sizes=limits.token_buckets).buckets()


REPO = Path(__file__).resolve().parents[1]
MAIN_JOB = ("-m", "experiments.compare")  # the README's main job, with its defaults
NUM_BUSY = 2
# A busy loop that ends itself: bounded even if this script is killed before it can.
BUSY_LOOP = "import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end:\n pass"


@contextlib.contextmanager
def busy_loops(count: int, bound_s: float) -> Iterator[None]:
    """`count` processes spinning on a core each while the block runs (killed after it)."""
    loops = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP.format(seconds=bound_s)])
             for _ in range(count)]
    try:
        if loops:
            time.sleep(2.0)  # the load is on before the command starts timing its grid
        yield
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()


def main_job(out_dir: Path, store: Path, *flags: str, busy: int, bound_s: float
             ) -> dict[str, object]:
    """Runs the main job once in its own process: its wall seconds, the load average
    before it, output tok/s per policy and the table it priced by (orca's config.json)."""
    with busy_loops(busy, bound_s):
        load = " ".join(f"{x:.2f}" for x in os.getloadavg())
        start = time.perf_counter()
        result = subprocess.run([sys.executable, *MAIN_JOB, f"--out_dir={out_dir}",
                                 f"--profile_store={store}", *flags], cwd=REPO,
                                capture_output=True, text=True,
                                env={**os.environ, "JAX_PLATFORMS": "cpu"})
        wall_s = time.perf_counter() - start
    if result.returncode != 0:
        sys.exit(f"the main job failed (exit {result.returncode}):\n{result.stderr[-2000:]}")
    rows = json.loads((out_dir / "comparison.json").read_text())
    table = json.loads((out_dir / rows[0]["policy"] / "config.json").read_text())["profile_table"]
    [stored] = table["stored"]
    return {"wall_s": wall_s, "load": load, "busy": busy,
            "tok_s": {row["policy"]: row["output_tok_s"] for row in rows},
            "key": stored["key"], "measured_at": stored["measured_at"], "reused": stored["reused"]}


def across_commands(repeats: int, bound_s: float) -> None:
    """Prints the main job's output tok/s per policy across processes: fresh tables idle
    and under `NUM_BUSY` busy loops, and the reused table under the same load."""
    import jax  # only for the header

    print(f"# the README main job across commands: {platform.machine()}, {os.cpu_count()} "
          f"cores, jax {jax.__version__} on {jax.default_backend()}")
    print(f"# each run: python {' '.join(MAIN_JOB)} --out_dir=TMP/RUN --profile_store=TMP/STORE"
          " [--profile_table=fresh]; busy = python busy loops running beside it")
    print(f"{'run':>16} {'busy':>4} {'wall_s':>7}  {'load_before':<15} {'table':<17} "
          f"{'reused':<6}  tok/s per policy")
    runs: dict[str, list[dict[str, object]]] = {"idle fresh": [], "loaded fresh": [],
                                                 "loaded reused": []}
    with tempfile.TemporaryDirectory(prefix="profiled_clock_across_") as tmp:
        plan = ([("idle fresh", "idle", ("--profile_table=fresh",), 0)] * repeats
                # Their own store: the idle table stays stored for the reused runs.
                + [("loaded fresh", "loaded", ("--profile_table=fresh",), NUM_BUSY)] * repeats
                + [("loaded reused", "idle", (), NUM_BUSY)] * repeats)
        for index, (kind, store, flags, busy) in enumerate(plan):
            run = main_job(Path(tmp) / f"run{index}", Path(tmp) / store, *flags, busy=busy,
                           bound_s=bound_s)
            runs[kind].append(run)
            tok_s = "  ".join(f"{policy} {value:.1f}" for policy, value in run["tok_s"].items())
            print(f"{kind:>16} {busy:>4} {run['wall_s']:>7.1f}  {run['load']:<15} "
                  f"{run['key']:<17} {str(run['reused']):<6}  {tok_s}", flush=True)
    idle = runs["idle fresh"]
    for policy in idle[0]["tok_s"]:
        values = {kind: [run["tok_s"][policy] for run in group] for kind, group in runs.items()}
        idle_median = statistics.median(values["idle fresh"])
        loaded_median = statistics.median(values["loaded fresh"])
        spread = {kind: (max(v) - min(v)) / statistics.median(v) for kind, v in values.items()}
        print(f"{policy}: fresh tables idle {min(values['idle fresh']):.1f}-"
              f"{max(values['idle fresh']):.1f} tok/s (spread {100 * spread['idle fresh']:.1f}%)"
              f", under {NUM_BUSY} busy loops {min(values['loaded fresh']):.1f}-"
              f"{max(values['loaded fresh']):.1f} (spread {100 * spread['loaded fresh']:.1f}%)"
              f"; loaded/idle medians {100 * (loaded_median / idle_median - 1):+.1f}%; reused "
              f"table under load: {', '.join(f'{v:.1f}' for v in values['loaded reused'])}, "
              f"equal to the idle run that stored it: "
              f"{all(v == idle[-1]['tok_s'][policy] for v in values['loaded reused'])}")


if __name__ == "__main__":
    main()
