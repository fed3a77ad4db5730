"""Issue 27's done-when on the Mooncake conversation trace: prefix hits across KV tiers.

    python -m experiments.reproduce.kv_tiers_mooncake          # the whole trace
    python -m experiments.reproduce.kv_tiers_mooncake --num_requests=2000   # a quick look

One replica of `llama3.1-8b` on an A100 (simulated), `vllm` with prefix caching, the
trace (`--trace`; default: in `$ORCA_JAX_TRACES`, docs/traces.md) at 1/`time_scale` of
its rate (as `experiments.reproduce.prefix_caching`):

1. an unbounded device pool: its peak of pages held by requests, and its hit rate;
2. a device pool of a tenth of that peak, device only: the hit rate falls;
3. the same device pool over a host tier of the whole working set (every page the
   trace names, `prefix_cache_ceiling`'s count): the hit rate against the trace's
   ceiling (0.3736 at page 16);
4. LRU, LFU and ARC on host tiers of two sizes (a tenth and a third of the working set).

The tables go to `--out_dir` (`tiers` and `cache_policies`, `.txt` and `.json`); raw
output of the documented run: `benchmarks/results/kv_tiers_mooncake.txt`.
"""

from __future__ import annotations

import os
import time
from typing import Any, Optional, Sequence

from absl import flags

from experiments.cli_errors import clean_errors
from experiments.reproduce.common import parse_flags, run_app, write_table
from experiments.reproduce.trace_files import MOONCAKE, flag_help, trace_path
from orca_jax.runner.experiment import run_policy
from orca_jax.runner.spec import LimitsSpec, RunSpec, SimEngineSpec, WorkloadSpec
from orca_jax.workloads.traces import prefix_cache_ceiling

HIT_RATE = "prefix_hit_rate"
FLAGS = flags.FlagValues()
flags.DEFINE_string("out_dir", "runs/reproduce/kv_tiers_mooncake", "the tables",
                    flag_values=FLAGS)
flags.DEFINE_string("trace", None, flag_help("the Mooncake conversation trace", MOONCAKE),
                    flag_values=FLAGS)
flags.DEFINE_integer("num_requests", None, "its first N requests (None: all)", flag_values=FLAGS)
flags.DEFINE_float("time_scale", 4.0, "multiplies the trace's arrival times", flag_values=FLAGS)
flags.DEFINE_integer("max_num_seqs", 64, "the batch cap", flag_values=FLAGS)


def spec(trace: str, num_kv_pages: int, **tiers: Any) -> RunSpec:
    return RunSpec(
        workload=WorkloadSpec(arrival="trace", trace=trace,
                              num_requests=FLAGS.num_requests,
                              trace_time_scale=FLAGS.time_scale),
        engine=SimEngineSpec(model="llama3.1-8b", hardware="a100"),
        limits=LimitsSpec(max_num_seqs=FLAGS.max_num_seqs, num_kv_pages=num_kv_pages,
                          max_model_len=131072, **tiers))


def run(trace: str, label: str, num_kv_pages: int, **tiers: Any) -> dict[str, Any]:
    start = time.perf_counter()
    summary, result = run_policy(spec(trace, num_kv_pages, **tiers), "vllm",
                                 {"max_num_seqs": str(FLAGS.max_num_seqs)}, progress=False)
    free = result.steps.column("num_free_pages")
    row = {"run": label, "device_pages": num_kv_pages,
           "host_pages": tiers.get("kv_host_pages", 0), "policy": tiers.get(
               "kv_cache_policy", "-") if tiers else "-",
           HIT_RATE: round(summary.get(HIT_RATE, 0.0), 4),
           "host_hit_tokens": summary.get("kv_tiers.host.hit_tokens", 0),
           "host_read_GB": round(summary.get("kv_tiers.host.read_bytes", 0) / 1e9, 2),
           "stall_s": round(summary.get("kv_stall_s_total", 0.0), 2),
           "ttft_p50_s": round(summary["ttft_p50_s"], 2),
           "peak_held_pages": int(num_kv_pages - free.min()),
           "wall_s": round(time.perf_counter() - start, 1)}
    print(row, flush=True)
    return row


def main(argv: Optional[Sequence[str]] = None) -> None:
    """The command: the four runs above, printed as they finish; the tables written to
    `--out_dir`.

    Args:
      argv: the flags (without the program name); None: the command line's.
    """
    parse_flags(FLAGS, argv)
    with clean_errors():
        start = time.perf_counter()
        trace = trace_path(MOONCAKE, FLAGS.trace)
        ceiling = prefix_cache_ceiling(trace, page_size=16, max_requests=FLAGS.num_requests)
        working_set = ceiling_pages(trace, FLAGS.num_requests)
        os.makedirs(FLAGS.out_dir, exist_ok=True)
        print(f"trace {trace}: {FLAGS.num_requests or 'all'} requests, ceiling "
              f"{ceiling:.4f}, working set {working_set} pages of 16 tokens", flush=True)
        unbounded = run(trace, "unbounded device", 4_000_000)
        device = max(unbounded["peak_held_pages"] // 10, 1)
        rows = [unbounded, run(trace, "device only, 1/10 of peak", device),
                run(trace, "device + host (working set)", device, kv_host_pages=working_set)]
        setup = {"trace": trace, "num_requests": FLAGS.num_requests,
                 "time_scale": FLAGS.time_scale, "max_num_seqs": FLAGS.max_num_seqs,
                 "ceiling": ceiling, "working_set_pages": working_set}
        print(write_table(rows, list(rows[0]), FLAGS.out_dir, "tiers", {"setup": setup}))
        host = rows[-1][HIT_RATE]
        print(f"done-when: device-only hit rate {rows[1][HIT_RATE]:.4f}; with a host tier "
              f"{host:.4f} against the ceiling {ceiling:.4f} ({(ceiling - host) / ceiling:+.2%} "
              "short)")
        table = [run(trace, f"{policy}, host 1/{share}", device,
                     kv_host_pages=working_set // share, kv_cache_policy=policy)
                 for share in (10, 3) for policy in ("lru", "lfu", "arc")]
        print(write_table(table, ["policy", "host_pages", HIT_RATE, "host_hit_tokens",
                                  "host_read_GB", "stall_s", "ttft_p50_s"], FLAGS.out_dir,
                          "cache_policies", {"setup": setup}))
        print(f"tables: {FLAGS.out_dir}/tiers.txt, {FLAGS.out_dir}/cache_policies.txt "
              f"({time.perf_counter() - start:.0f} s)")


def ceiling_pages(trace: str, num_requests: Optional[int]) -> int:
    """Distinct full pages of 16 tokens the trace's prompts name (the working set)."""
    import json
    seen: set[tuple[int, int]] = set()
    with open(trace) as f:
        for k, line in enumerate(f):
            if num_requests is not None and k >= num_requests:
                break
            record = json.loads(line)
            full = record["input_length"] // 16
            for page in range(full):
                # a page is named by its block chain up to it: (last block id, page in it)
                seen.add((record["hash_ids"][page * 16 // 512], page % 32))
    return len(seen)


if __name__ == "__main__":
    run_app(main, FLAGS, __doc__)
