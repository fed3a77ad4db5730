"""Continuous (orca) vs static batching on the real engine, on this machine's CPU.

For each model (`tiny`, `small`) one JaxEngine is built and warmed up once;
`static` and `orca` then serve the identical Poisson workload with uniform
lengths through the very same compiled steps. Printed per policy: output
tokens/s, p50 and p99 latency, under the profiled clock (each step advances
the virtual clock by its bucket's warm-up median: repeatable) and the wall
clock (the measured time of each step); then orca's throughput ratio over
static's.

    python benchmarks/engine_throughput.py [--models tiny small] [--num_requests 128]
"""

from __future__ import annotations

import argparse
import platform
import time

import jax

from orca_jax.experiment import RunSpec, build_engine, build_workload, run_policy, scheduler_config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["tiny", "small"])
    parser.add_argument("--num_requests", type=int, default=128)
    parser.add_argument("--rate", type=float, default=100.0)
    parser.add_argument("--prompt_len", default="uniform:16:128")
    parser.add_argument("--output_len", default="uniform:1:256")
    parser.add_argument("--max_batch_size", type=int, default=16)
    parser.add_argument("--token_budget", type=int, default=512)
    args = parser.parse_args()
    print(f"engine throughput on {jax.devices()[0].device_kind} ({jax.default_backend()}), "
          f"jax {jax.__version__}, python {platform.python_version()}")
    print(f"workload: {args.num_requests} requests, poisson {args.rate}/s, prompt "
          f"{args.prompt_len}, output {args.output_len}; batch cap {args.max_batch_size}, "
          f"token budget {args.token_budget}, fp32, greedy")
    for model in args.models:
        for clock in ("profiled", "wall"):
            spec = RunSpec(engine="jax", model=model, clock=clock,
                           num_requests=args.num_requests, rate=args.rate,
                           prompt_len=args.prompt_len, output_len=args.output_len,
                           max_batch_size=args.max_batch_size, token_budget=args.token_budget)
            start = time.perf_counter()
            engine = build_engine(spec, scheduler_config(spec))
            engine.warmup(scheduler_config_buckets(spec))
            warm_s = time.perf_counter() - start
            requests = build_workload(spec)
            rows = {}
            for policy in ("static", "orca"):
                summary, _ = run_policy(spec, policy, requests=requests, engine=engine,
                                        progress=False)
                rows[policy] = summary
            print(f"\nmodel={model} clock={clock} (warm-up {warm_s:.1f} s, "
                  f"{engine.num_compiles} compiles)")
            print(f"{'policy':>8} {'tok/s':>9} {'p50 lat s':>10} {'p99 lat s':>10} {'steps':>6}")
            for policy, s in rows.items():
                print(f"{policy:>8} {s['throughput_tok_s']:>9.1f} {s['latency_p50_s']:>10.3f} "
                      f"{s['latency_p99_s']:>10.3f} {s['num_steps']:>6}")
            ratio = rows["orca"]["throughput_tok_s"] / rows["static"]["throughput_tok_s"]
            p50 = rows["orca"]["latency_p50_s"] / rows["static"]["latency_p50_s"]
            print(f"orca/static: throughput x{ratio:.2f}, p50 latency x{p50:.2f}")


def scheduler_config_buckets(spec: RunSpec):
    """The buckets a run of `spec` uses (warm-up happens before timing)."""
    from orca_jax.packing import bucket_config_for
    config = scheduler_config(spec)
    return bucket_config_for(token_budget=config.token_budget,
                             max_num_seqs=config.max_batch_size,
                             max_model_len=config.max_model_len, page_size=config.page_size,
                             token_sizes=config.token_buckets).buckets()


if __name__ == "__main__":
    main()
