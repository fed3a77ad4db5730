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
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

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


if __name__ == "__main__":
    main()
