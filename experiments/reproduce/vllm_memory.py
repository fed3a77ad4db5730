"""vLLM (SOSP'23), OPT-13B on one A100-40GB: paged KV on demand vs Orca's reservations.

    python -m experiments.reproduce.vllm_memory

The paper serves OPT-13B on one A100-40GB with ShareGPT requests (mean 161
prompt and 338 output tokens) and compares vLLM with three Orca variants that
differ only in how much KV memory a request reserves at admission: its
maximum context ("Max", 2,048 tokens), its prompt + output rounded up to a
power of two ("Pow2"), or exactly its prompt + output ("Oracle"). Reserved
but unused slots cap the batch, so vLLM batches more requests and sustains a
higher request rate at the same normalized latency.

Modelled here on the per-operation roofline simulator: `orca` with `kv_reservation` = max,
pow2, exact, and `vllm` (pages on demand, preemption by recompute) with
chunked prefill off, as the vLLM of the paper ran whole prompts. The KV pool is
what 90% of 40 GiB holds beside the 26 GB of fp16 weights (15,824 tokens).
The Orca variants run a second time under the buddy KV layout
(`kv_layout="buddy"`: each reservation one contiguous power-of-two block of
pages from a buddy allocator, admitted only when a free block of its size
exists), the external fragmentation the paper's Orca baselines suffered.
Lengths are lognormal with the ShareGPT means and sigma 0.8 (the real trace is
heavy-tailed too; sigma 0.8 puts about 1% of the requests over the 2,048-token
context, which the core rejects up front). Each policy's capacity
is the request rate at which its mean normalized latency crosses
`latency_bound_s` (linear between swept rates).
"""

from __future__ import annotations

import dataclasses
import math
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
    throughput_at_bound,
    write_figure_and_report,
    write_table,
)
from orca_jax.results.sweep_store import Curve, PointKey, aggregate
from orca_jax.runner.spec import LimitsSpec, RunSpec, SimEngineSpec, WorkloadSpec
from orca_jax.runner.sweep import SweepExecutor

FIGURE = "vllm_opt13b_sharegpt.png"  # under --out_dir (docs/figures/ has the documented one)
LATENCY = "normalized_latency_mean_s"
RATE = "offered_rate_req_s"  # the paper plots against the offered load
THROUGHPUT = "throughput_req_s"
RESERVATIONS = {"Orca (Max)": "max", "Orca (Pow2)": "pow2", "Orca (Oracle)": "exact"}
# The paper's Fig. 13a: mean batched requests at 2 req/s of ShareGPT, vLLM's over each Orca.
PAPER_BATCH_RATIO = {"Orca (Max)": 4.3, "Orca (Oracle)": 2.2}
SUMMARY_COLUMNS = ["policy", "batch_at_rate", "batch_at_heaviest_load", "capacity_req_s",
                   "vllm_over_this", "vllm_batch_over_this", "vllm_heaviest_batch_over_this",
                   "paper_batch_ratio"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class VLLMSetup:
    """The experiment (defaults: the documented figure)."""

    num_requests: int = 1000
    rates: tuple[float, ...] = (0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0)
    seeds: tuple[int, ...] = (0,)
    prompt_len: str = "lognormal:161:0.8"
    output_len: str = "lognormal:338:0.8"
    latency_bound_s: float = 0.05  # mean normalized latency (s/token) a rate must keep
    batch_rate: float = 2.0  # the rate whose mean batch sizes the summary table holds (paper's)
    buddy: bool = True  # also run the Orca variants under the buddy KV layout
    plot_max_s: float = 0.5

    def run_spec(self) -> RunSpec:
        """The workload and engine plumbing shared by every point."""
        return RunSpec(
            workload=WorkloadSpec(num_requests=self.num_requests, prompt_len=self.prompt_len,
                                  output_len=self.output_len),
            engine=SimEngineSpec(model="opt-13b", hardware="a100-40gb",
                                 step_padding=PAPER_STEP_PADDING),
            limits=LimitsSpec(max_num_seqs=256, max_num_tokens=2048))

    def policy_runs(self) -> list[PolicyRun]:
        """The curves: Orca with each reservation, and vLLM."""
        return ([PolicyRun(label, "orca", {"kv_reservation": mode})
                 for label, mode in RESERVATIONS.items()]
                + [PolicyRun("vLLM", "vllm", {"enable_chunked_prefill": "false"})])


@dataclasses.dataclass(frozen=True)
class VLLMResult:
    """The sweep's curves, its points and the per-policy summaries."""

    curves: list[Curve]  # mean normalized latency against offered rate (buddy curves last)
    rows: list[dict[str, Any]]  # one per point
    # One per policy: mean batch at batch_rate and at its heaviest load swept (past its
    # capacity, where the KV pool, not the arrivals, sets the batch), capacity, vLLM's ratios.
    summary: list[dict[str, Any]]
    buddy_summary: list[dict[str, Any]]  # the Orca variants under the buddy KV layout


def _sweep(setup: VLLMSetup, spec: RunSpec, runs: list[PolicyRun], out_dir: str,
           executor: Optional[SweepExecutor]) -> tuple[list[Curve], list[dict[str, Any]]]:
    """Runs one grid; returns its curves and its rows."""
    rates = tuple(sorted(set(setup.rates) | {setup.batch_rate}))
    # Past 3x the bound the curve only climbs: the rest of the sweep would add nothing.
    points, keys = run_grid(spec, runs, rates, setup.seeds, out_dir,
                            saturated=lambda rate, s: not (s.get(LATENCY) or math.inf)
                            <= 3 * setup.latency_bound_s, executor=executor)
    for point in points:  # the paper plots against the offered rate
        point["summary"][RATE] = point["rate"]
    curves = aggregate(points, keys, RATE, LATENCY)
    by_key = {PointKey(p["policy"], float(p["rate"]), int(p["seed"])): p["summary"]
              for p in points}
    rows = [{"policy": k.policy, "rate": k.rate, "seed": k.seed,
             THROUGHPUT: by_key[k][THROUGHPUT], LATENCY: by_key[k][LATENCY],
             "mean_batch_size": by_key[k]["mean_batch_size"],
             "num_preemptions": by_key[k]["num_preemptions"],
             "num_rejected": by_key[k]["num_rejected"]} for k in keys]
    return curves, rows


def _summary(setup: VLLMSetup, curves: list[Curve], rows: list[dict[str, Any]],
             vllm: dict[str, Any]) -> list[dict[str, Any]]:
    """Each curve's batches and capacity, and vLLM's (`vllm`: its own row) over them."""
    out = []
    for curve in curves:
        at_rate = [r["mean_batch_size"] for r in rows
                   if r["policy"] == curve.policy and r["rate"] == setup.batch_rate]
        row = {"policy": curve.policy,
               "batch_at_rate": sum(at_rate) / len(at_rate) if at_rate else None,
               "batch_at_heaviest_load": max(r["mean_batch_size"] for r in rows
                                             if r["policy"] == curve.policy),
               "capacity_req_s": throughput_at_bound(curve, setup.latency_bound_s)}
        out.append(row)
    vllm = vllm or next((r for r in out if r["policy"] == "vLLM"), {})
    for row in out:
        for ratio, field in (("vllm_over_this", "capacity_req_s"),
                             ("vllm_batch_over_this", "batch_at_rate"),
                             ("vllm_heaviest_batch_over_this", "batch_at_heaviest_load")):
            mine, theirs = row[field], vllm.get(field)
            row[ratio] = theirs / mine if theirs and mine else None
        base = row["policy"].split(",")[0]
        row["paper_batch_ratio"] = PAPER_BATCH_RATIO.get(base)
    return out


def run(setup: VLLMSetup, out_dir: str, executor: Optional[SweepExecutor] = None
        ) -> VLLMResult:
    """Runs the sweeps (on `executor`, default here); reads each policy's capacity and its
    mean batch at `batch_rate`.

    The Orca variants run again under the buddy KV layout (`setup.buddy`), in
    `out_dir/buddy`, against the same (paged) vLLM.
    """
    curves, rows = _sweep(setup, setup.run_spec(), setup.policy_runs(), out_dir, executor)
    summary = _summary(setup, curves, rows, {})
    buddy_summary: list[dict[str, Any]] = []
    if setup.buddy:
        spec = setup.run_spec()
        spec = dataclasses.replace(spec, limits=dataclasses.replace(spec.limits,
                                                                    kv_layout="buddy"))
        runs = [PolicyRun(f"{label}, buddy", "orca", {"kv_reservation": mode})
                for label, mode in RESERVATIONS.items()]
        buddy_curves, buddy_rows = _sweep(setup, spec, runs, os.path.join(out_dir, "buddy"),
                                          executor)
        vllm = next(r for r in summary if r["policy"] == "vLLM")
        buddy_summary = _summary(setup, buddy_curves, buddy_rows, vllm)
        curves, rows = curves + buddy_curves, rows + buddy_rows
    return VLLMResult(curves=curves, rows=rows, summary=summary, buddy_summary=buddy_summary)


FLAGS = reproduction_flags("vllm_memory", FIGURE, VLLMSetup)
flags.DEFINE_float("latency_bound_s", VLLMSetup.latency_bound_s, "capacity: the rate at which "
                   "mean normalized latency reaches this (s/token)", flag_values=FLAGS)
flags.DEFINE_bool("buddy", True, "also run the Orca variants under the buddy KV layout "
                  "(--nobuddy: not)", flag_values=FLAGS)


def main(argv: Optional[Sequence[str]] = None) -> None:
    """The command: parse flags, run the sweep, print and write the tables and the figure.

    Args:
      argv: the flags (without the program name); None: the command line's.
    """
    args = parse_flags(FLAGS, argv)
    executor = executor_from_flags(args)
    setup = VLLMSetup(num_requests=args.num_requests, rates=args.rates,
                      latency_bound_s=args.latency_bound_s, buddy=args.buddy)
    os.makedirs(args.out_dir, exist_ok=True)
    start = time.perf_counter()
    result = run(setup, args.out_dir, executor)
    print(write_table(result.rows, ["policy", "rate", THROUGHPUT, LATENCY, "mean_batch_size",
                                    "num_preemptions", "num_rejected"], args.out_dir, "curves"))
    print(f"\nmean batched requests at {setup.batch_rate:g} req/s and at the heaviest load; "
          f"capacity: the rate at which mean normalized latency reaches "
          f"{setup.latency_bound_s:g} s/token:")
    print(write_table(result.summary, SUMMARY_COLUMNS, args.out_dir, "summary",
                      {"setup": dataclasses.asdict(setup)}))
    if result.buddy_summary:
        print("\nthe Orca variants under the buddy KV layout (each reservation one "
              "power-of-two block), against the same vLLM:")
        print(write_table(result.buddy_summary, SUMMARY_COLUMNS, args.out_dir, "summary_buddy",
                          {"setup": dataclasses.asdict(setup)}))
    write_figure_and_report(result.curves, args, figure_name=FIGURE,
                            max_y=setup.plot_max_s, x_field=RATE,
                            y_field=LATENCY, title="OPT-13B, 1 x A100-40GB (simulated), "
                                                   "ShareGPT-like lognormal lengths",
                            tables=["curves", "summary"] + (["summary_buddy"] if
                                                            result.buddy_summary else []),
                            start=start)


if __name__ == "__main__":
    run_app(main, FLAGS, __doc__)
