"""Continuous (orca) vs static batching on the real engine, on this machine's CPU.

For each model (`tiny`, `small`) one JaxEngine is built and warmed up once;
`static` and `orca` then serve the identical Poisson workload with uniform
lengths through the very same compiled steps. Printed per policy: output
tokens/s, p50 and p99 latency, under the profiled clock (each step advances
the virtual clock by a warm-up fit's price of what it holds: repeatable) and the wall
clock (the measured time of each step); then orca's throughput ratio over
static's. Then a rate sweep under the profiled clock, over several workload seeds,
compares the two at equal or lower p50 latency, as Orca's paper does.

Each table also prints the workload's decode-step ceiling
(`metrics.static_batching_ceiling`): with every slot busy, continuous batching
needs sum(output) / B decode steps where static batching needs the sum over its
batches of the longest member's output, so no scheduler beats static's saturated
throughput by more than that ratio (about 2B / (B + 1) for outputs uniform from 1).

    python benchmarks/engine_throughput.py [--models tiny small] [--num_requests 128]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import jax

from orca_jax.core.step.engine_api import Bucket
from orca_jax.core.step.packing import bucket_config_for
from orca_jax.results.metrics import static_batching_ceiling
from orca_jax.runner.build import build_engine, build_workload, scheduler_config
from orca_jax.runner.experiment import run_policy
from orca_jax.runner.spec import JaxEngineSpec, LimitsSpec, RunSpec, WorkloadSpec
from orca_jax.runner.sweep import point_spec


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["tiny", "small"])
    parser.add_argument("--num_requests", type=int, default=128)
    parser.add_argument("--rate", type=float, default=100.0)
    parser.add_argument("--prompt_len", default="uniform:16:128")
    parser.add_argument("--output_len", default="uniform:1:256")
    parser.add_argument("--max_num_seqs", type=int, default=16)
    parser.add_argument("--max_num_tokens", type=int, default=512)
    parser.add_argument("--sweep_load", type=float, nargs="*",
                        default=[0.25, 0.5, 0.75, 0.9, 1.0, 1.5, 2.0, 3.0],
                        help="rates of the equal-latency sweep, as multiples of static's "
                             "measured capacity (none: skip the sweep)")
    parser.add_argument("--sweep_requests", type=int, default=128)
    parser.add_argument("--sweep_seeds", type=int, nargs="+", default=[0, 1, 2],
                        help="workload seeds of the sweep (lengths and arrivals)")
    args = parser.parse_args()
    print(f"engine throughput on {jax.devices()[0].device_kind} ({jax.default_backend()}), "
          f"jax {jax.__version__}, python {platform.python_version()}")
    print(f"workload: {args.num_requests} requests, poisson {args.rate}/s, prompt "
          f"{args.prompt_len}, output {args.output_len}; batch cap {args.max_num_seqs}, "
          f"token budget {args.max_num_tokens}, fp32, greedy")
    for model in args.models:
        for clock in ("profiled", "wall"):
            spec = _spec(args, model, clock, num_requests=args.num_requests, rate=args.rate)
            start = time.perf_counter()
            engine = build_engine(spec, scheduler_config(spec))
            engine.warmup(scheduler_config_buckets(spec))
            warm_s = time.perf_counter() - start
            requests = build_workload(spec)
            ceiling = static_batching_ceiling([r.output_len for r in requests], args.max_num_seqs)
            rows = {}
            for policy in ("static", "orca"):
                summary, _ = run_policy(spec, policy, requests=requests, engine=engine,
                                        progress=False)
                rows[policy] = summary
            print(f"\nmodel={model} clock={clock} (warm-up {warm_s:.1f} s, "
                  f"{engine.facts()['num_compiles']} compiles)")
            print(f"{'policy':>8} {'tok/s':>9} {'p50 lat s':>10} {'p99 lat s':>10} {'steps':>6}")
            for policy, s in rows.items():
                print(f"{policy:>8} {s['throughput_tok_s']:>9.1f} {s['latency_p50_s']:>10.3f} "
                      f"{s['latency_p99_s']:>10.3f} {s['num_steps']:>6}")
            ratio = rows["orca"]["throughput_tok_s"] / rows["static"]["throughput_tok_s"]
            p50 = rows["orca"]["latency_p50_s"] / rows["static"]["latency_p50_s"]
            print(f"orca/static: throughput x{ratio:.2f}, p50 latency x{p50:.2f} "
                  f"(decode-step ceiling of this workload x{ceiling:.2f})")
            if clock == "profiled":
                capacity = rows["static"]["throughput_req_s"]  # requests/s at saturation
        if args.sweep_load:
            equal_latency_table(model, args, [round(capacity * x, 3) for x in args.sweep_load])


def equal_latency_table(model: str, args: argparse.Namespace, rates: list[float]) -> None:
    """Sweeps the rate (profiled clock) and compares throughput at equal or lower p50 latency.

    For each seed and each static point (rate r: throughput T_s, p50 latency L_s)
    it finds the highest throughput orca reaches at any swept rate of that seed with
    p50 <= L_s, as Orca's paper compares the systems at equal latency. The rates are
    multiples of static's capacity measured above, so the sweep spans both systems'
    saturation on any machine. Printed per rate: medians over the seeds, and the
    ratio's median, min and max.
    """
    spec = _spec(args, model, "profiled", num_requests=args.sweep_requests, rate=rates[0])
    engine = build_engine(spec, scheduler_config(spec))
    engine.warmup(scheduler_config_buckets(spec))
    # points[policy][seed] = [(throughput tok/s, p50 latency s) per rate]
    points: dict[str, dict[int, list[tuple[float, float]]]] = {"static": {}, "orca": {}}
    ceilings = []
    for seed in args.sweep_seeds:
        for rate in rates:
            rate_spec = point_spec(spec, rate, seed)
            requests = build_workload(rate_spec)
            for policy, by_seed in points.items():
                summary, _ = run_policy(rate_spec, policy, requests=requests, engine=engine,
                                        progress=False)
                by_seed.setdefault(seed, []).append(
                    (summary["throughput_tok_s"], summary["latency_p50_s"]))
        ceilings.append(static_batching_ceiling([r.output_len for r in requests],
                                                args.max_num_seqs))
    print(f"\nmodel={model}, profiled clock, rate sweep over seeds {args.sweep_seeds} "
          f"({args.sweep_requests} requests each): throughput at equal or lower p50 latency")
    print("decode-step ceilings of the seeds' workloads: "
          + ", ".join(f"x{c:.2f}" for c in ceilings))
    print(f"{'load':>5} {'rate':>7} {'static tok/s':>13} {'static p50':>11} {'orca tok/s':>11} "
          f"{'orca p50':>9} {'orca best at <= static p50':>27} {'ratio':>6} {'min':>5} {'max':>5}")
    for i, (load, rate) in enumerate(zip(args.sweep_load, rates)):
        static = [points["static"][seed][i] for seed in args.sweep_seeds]
        orca = [points["orca"][seed][i] for seed in args.sweep_seeds]
        best = []
        for seed, (s_tok, s_p50) in zip(args.sweep_seeds, static):
            feasible = [tok for tok, p50 in points["orca"][seed] if p50 <= s_p50]
            best.append(max(feasible) if feasible else float("nan"))
        ratios = [b / s_tok for b, (s_tok, _) in zip(best, static)]
        med = statistics.median
        print(f"{load:>5g} {rate:>7g} {med(t for t, _ in static):>13.1f} "
              f"{med(p for _, p in static):>11.3f} {med(t for t, _ in orca):>11.1f} "
              f"{med(p for _, p in orca):>9.3f} {med(best):>27.1f} {med(ratios):>6.2f} "
              f"{min(ratios):>5.2f} {max(ratios):>5.2f}")


def _spec(args: argparse.Namespace, model: str, clock: str, *, num_requests: int,
          rate: float) -> RunSpec:
    """A real-engine run of `model` on the command's workload and limits."""
    return RunSpec(
        workload=WorkloadSpec(num_requests=num_requests, rate=rate, prompt_len=args.prompt_len,
                              output_len=args.output_len),
        engine=JaxEngineSpec(model=model, clock=clock),
        limits=LimitsSpec(max_num_seqs=args.max_num_seqs, max_num_tokens=args.max_num_tokens))


def scheduler_config_buckets(spec: RunSpec) -> list[Bucket]:
    """The buckets a run of `spec` uses (warm-up happens before timing)."""
    config = scheduler_config(spec)
    limits = config.limits
    return bucket_config_for(max_num_tokens=limits.max_num_tokens,
                             max_num_seqs=limits.max_num_seqs,
                             max_model_len=limits.max_model_len, page_size=config.kv.page_size,
                             token_sizes=limits.token_buckets).buckets()


if __name__ == "__main__":
    main()
