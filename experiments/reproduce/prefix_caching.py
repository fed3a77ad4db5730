"""Prefix caching: SGLang's longest-prefix-match scheduling, and the Mooncake conversation trace.

    python -m experiments.reproduce.prefix_caching

Two experiments on the simulator (LLaMA-3 8B on one A100 per replica):

(a) SGLang (RadixAttention, Zheng et al., NeurIPS'24) schedules waiting requests
by the longest cached prefix first (`lpm`) instead of FCFS, so requests that share
a cached system prompt run while it is still cached. On a shared-prefix workload
(`--workload=shared_prefix`: Zipf-popular system prompts and private suffixes) we
sweep the request rate for `lpm`, FCFS with caching (`vllm`) and FCFS without
caching, and read the prefix hit rate, throughput and TTFT. SGLang reports up to
6.4x the throughput of the baseline systems, which had no cross-request KV reuse.

(b) The Mooncake conversation trace (`hash_ids`: which 512-token blocks each
prompt shares with earlier ones; found in `$ORCA_JAX_TRACES`, docs/traces.md), its
first `--trace_requests` requests, `vllm` with caching: the hit rate against the KV
pool size, beside the ceiling an unbounded cache reaches
(`traces.prefix_cache_ceiling`), then 4 replicas behind the `cache_aware`,
`least_outstanding` and `prefix_hash` routers (hit rate, TTFT).
Mooncake's prompts average 12k tokens, past LLaMA-3 8B's 8,192 context, so the
model is `llama3.1-8b` (the same network and cost, a 128k context).
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Optional, Sequence

from absl import flags

from experiments.executor_flags import executor_from_flags
from experiments.reproduce.common import (
    PAPER_STEP_PADDING,
    PolicyRun,
    parse_flags,
    reproduction_flags,
    run_app,
    run_grid,
    write_figure_and_report,
    write_table,
)
from experiments.reproduce.trace_files import MOONCAKE, flag_help, trace_path
from orca_jax.results.sweep_store import aggregate
from orca_jax.runner.experiment import run_policy
from orca_jax.runner.spec import ClusterSpec, LimitsSpec, RunSpec, SimEngineSpec, WorkloadSpec
from orca_jax.runner.sweep import SweepExecutor
from orca_jax.workloads.traces import prefix_cache_ceiling

FIGURE = "prefix_caching_sglang.png"  # under --out_dir (docs/figures/ has the documented one)
RATE = "offered_rate_req_s"
THROUGHPUT = "throughput_req_s"
HIT_RATE = "prefix_hit_rate"
PAPER_MAX_SPEEDUP = 6.4  # SGLang's largest throughput gain over the baseline systems
ROUTERS = ("cache_aware", "least_outstanding", "prefix_hash")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PrefixCachingSetup:
    """The experiments (defaults: the documented figure and tables; a few minutes on 2 cores)."""

    num_requests: int = 300  # (a): requests per point
    rates: tuple[float, ...] = (4.0, 16.0, 32.0, 64.0)
    seeds: tuple[int, ...] = (0,)
    num_prefixes: int = 16
    prefix_len: str = "fixed:1024"
    suffix_len: str = "uniform:16:256"
    output_len: str = "uniform:1:128"
    max_num_seqs: int = 64
    # (a)'s pool: a few system prompts' worth (32k tokens), so the order of admission
    # decides which prompts stay cached (the whole A100 pool would hold every one).
    num_kv_pages: int = 2048
    trace: Optional[str] = None  # None: MOONCAKE in the traces folder (`trace_files`)
    trace_requests: int = 200  # (b): the trace's first N requests
    trace_time_scale: float = 4.0  # (b) one replica: a quarter of the trace's rate
    pool_pages: tuple[int, ...] = (2048, 8192, 32768, 10_000_000)  # the last: unbounded
    num_replicas: int = 4
    model: str = "llama3.1-8b"

    def sglang_spec(self) -> RunSpec:
        """(a)'s workload and plumbing (rate and seed are set per point)."""
        return RunSpec(
            workload=WorkloadSpec(arrival="shared_prefix", num_requests=self.num_requests,
                                  num_prefixes=self.num_prefixes, prefix_len=self.prefix_len,
                                  suffix_len=self.suffix_len, output_len=self.output_len),
            engine=SimEngineSpec(model=self.model, hardware="a100",
                                 step_padding=PAPER_STEP_PADDING),
            limits=LimitsSpec(max_num_seqs=self.max_num_seqs, num_kv_pages=self.num_kv_pages))

    def policy_runs(self) -> list[PolicyRun]:
        """(a)'s curves: SGLang's LPM, FCFS with caching, FCFS without."""
        seqs = {"max_num_seqs": str(self.max_num_seqs)}
        return [PolicyRun("FCFS, no cache", "vllm", {**seqs, "enable_prefix_caching": "false"}),
                PolicyRun("FCFS (vllm)", "vllm", seqs),
                PolicyRun("LPM (sglang)", "lpm")]  # capped by the scheduler's max_num_seqs

    def trace_spec(self, num_kv_pages: Optional[int], num_replicas: int = 1,
                   router: str = "round_robin", time_scale: float = 1.0) -> RunSpec:
        """(b)'s run: the trace's first N requests on `num_replicas` replicas."""
        return RunSpec(
            workload=WorkloadSpec(arrival="trace", trace=self.trace_file(),
                                  num_requests=self.trace_requests, trace_time_scale=time_scale),
            engine=SimEngineSpec(model=self.model, hardware="a100",
                                 step_padding=PAPER_STEP_PADDING),
            limits=LimitsSpec(max_num_seqs=self.max_num_seqs, num_kv_pages=num_kv_pages,
                              max_model_len=131072),
            cluster=ClusterSpec(num_replicas=num_replicas, router=router))

    def trace_file(self) -> str:
        """(b)'s trace: `trace`, else MOONCAKE in the traces folder (`trace_files.trace_path`)."""
        return trace_path(MOONCAKE, self.trace)


def sglang_rows(setup: PrefixCachingSetup, out_dir: str,
                executor: Optional[SweepExecutor] = None) -> tuple[list[dict[str, Any]], list]:
    """(a): every policy at every rate (on `executor`, default here); one row per point, and
    the throughput curves."""
    points, keys = run_grid(setup.sglang_spec(), setup.policy_runs(), setup.rates, setup.seeds,
                            out_dir, executor=executor)
    by_key = {(p["policy"], float(p["rate"]), int(p["seed"])): p["summary"] for p in points}
    rows = []
    for key in keys:
        summary = by_key[key.policy, key.rate, key.seed]
        summary[RATE] = key.rate
        rows.append({"policy": key.policy, "rate": key.rate, THROUGHPUT: summary[THROUGHPUT],
                     HIT_RATE: summary.get(HIT_RATE, 0.0), "ttft_p50_s": summary["ttft_p50_s"],
                     "ttft_p99_s": summary["ttft_p99_s"]})
    for point in points:
        point["summary"][RATE] = point["rate"]
    return rows, aggregate(points, keys, RATE, THROUGHPUT)


def best_throughput(rows: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Each policy's highest throughput over the swept rates."""
    best: dict[str, float] = {}
    for row in rows:
        best[row["policy"]] = max(best.get(row["policy"], 0.0), row[THROUGHPUT])
    return best


def trace_pool_rows(setup: PrefixCachingSetup) -> list[dict[str, Any]]:
    """(b): the hit rate against the pool size on one replica, and the ceiling."""
    ceiling = prefix_cache_ceiling(setup.trace_file(), page_size=16,
                                   max_requests=setup.trace_requests)
    rows = []
    for pages in setup.pool_pages:
        summary, _ = run_policy(setup.trace_spec(pages, time_scale=setup.trace_time_scale),
                                "vllm", {"max_num_seqs": str(setup.max_num_seqs)},
                                progress=False)
        rows.append({"num_kv_pages": pages, HIT_RATE: summary.get(HIT_RATE, 0.0),
                     "ceiling": ceiling, "num_evictions": summary.get("num_evictions", 0),
                     "ttft_p50_s": summary["ttft_p50_s"], "ttft_p99_s": summary["ttft_p99_s"]})
    return rows


def trace_router_rows(setup: PrefixCachingSetup) -> list[dict[str, Any]]:
    """(b): the trace at its own rate over `num_replicas` replicas, one row per router."""
    rows = []
    for router in ROUTERS:
        summary, _ = run_policy(setup.trace_spec(None, setup.num_replicas, router), "vllm",
                                {"max_num_seqs": str(setup.max_num_seqs)}, progress=False)
        rows.append({"router": router, HIT_RATE: summary.get(HIT_RATE, 0.0),
                     "ttft_p50_s": summary["ttft_p50_s"], "ttft_p99_s": summary["ttft_p99_s"],
                     THROUGHPUT: summary[THROUGHPUT]})
    return rows


FLAGS = reproduction_flags("prefix_caching", FIGURE, PrefixCachingSetup)
flags.DEFINE_string("trace", None, flag_help("(b): the Mooncake conversation trace", MOONCAKE),
                    flag_values=FLAGS)
flags.DEFINE_integer("trace_requests", PrefixCachingSetup.trace_requests,
                     "(b): the trace's first N requests", lower_bound=1, flag_values=FLAGS)


def main(argv: Optional[Sequence[str]] = None) -> None:
    """The command: run both experiments, print and write the tables and the figure.

    Args:
      argv: the flags (without the program name); None: the command line's.
    """
    args = parse_flags(FLAGS, argv)
    executor = executor_from_flags(args)
    setup = PrefixCachingSetup(num_requests=args.num_requests, rates=args.rates,
                               trace=trace_path(MOONCAKE, args.trace),  # before (a) runs
                               trace_requests=args.trace_requests)
    os.makedirs(args.out_dir, exist_ok=True)
    start = time.perf_counter()
    rows, curves = sglang_rows(setup, args.out_dir, executor)
    print(f"(a) shared prefix: {setup.num_prefixes} system prompts of {setup.prefix_len} "
          f"(Zipf 1.1), suffix {setup.suffix_len}, output {setup.output_len}, "
          f"{setup.num_kv_pages} KV pages of 16:")
    print(write_table(rows, ["policy", "rate", THROUGHPUT, HIT_RATE, "ttft_p50_s", "ttft_p99_s"],
                      args.out_dir, "sglang"))
    best = best_throughput(rows)
    baseline = best["FCFS, no cache"]
    print("best throughput over the rates, against FCFS without caching (SGLang: up to "
          f"{PAPER_MAX_SPEEDUP}x): "
          + ", ".join(f"{p} {v:.2f} req/s ({v / baseline:.2f}x)" for p, v in best.items()))
    pool = trace_pool_rows(setup)
    print(f"\n(b) Mooncake conversation, first {setup.trace_requests} requests at "
          f"1/{setup.trace_time_scale:g} of its rate, one replica: hit rate against the pool")
    print(write_table(pool, ["num_kv_pages", HIT_RATE, "ceiling", "num_evictions", "ttft_p50_s",
                             "ttft_p99_s"], args.out_dir, "mooncake_pool"))
    routers = trace_router_rows(setup)
    print(f"\n(b) the same requests at the trace's rate over {setup.num_replicas} replicas "
          "(each the whole A100 pool):")
    print(write_table(routers, ["router", HIT_RATE, "ttft_p50_s", "ttft_p99_s", THROUGHPUT],
                      args.out_dir, "mooncake_routers", {"setup": dataclasses.asdict(setup)}))
    write_figure_and_report(curves, args, figure_name=FIGURE,
                            max_y=float("inf"), x_field=RATE, y_field=THROUGHPUT,
                            title="LLaMA-3 8B, 1 x A100 (simulated): shared-prefix throughput",
                            tables=["sglang", "mooncake_pool", "mooncake_routers"], start=start)


if __name__ == "__main__":
    run_app(main, FLAGS, __doc__)
