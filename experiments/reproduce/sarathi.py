"""Sarathi-Serve (OSDI'24), Mistral-7B on one A100: tail time-between-tokens and capacity.

    python -m experiments.reproduce.sarathi                     # synthetic lengths
    python -m experiments.reproduce.sarathi --workload=arxiv    # the paper's arXiv data set

The paper shows that a scheduler which runs whole prompts in one iteration
(vLLM at the time, with prefills prioritized) stalls every running decode for
the length of a prefill, so its p99 time between tokens (TBT) breaks a tight
SLO at low load, while Sarathi-Serve's chunked prefills under a per-step token
budget (512 or 2,048) keep every step short. It reports 2.6x the capacity of
vLLM for Mistral-7B on one A100 under a p99 TBT SLO.

What "vLLM" means here: our `vllm` policy (vLLM v1's scheduler) with chunked
prefill **off** and a step budget of the whole context, so a prompt always
runs whole in one step, as the vLLM of the paper's comparison did (its
prefill-only steps differ from our mixed steps only in that the decodes ride
along in the long step instead of skipping it; either way each running
request waits the whole prefill for its next token). With chunked prefill on at
the same budget, today's `vllm` behaves like `sarathi`, which is why vLLM
adopted the technique. Both run at most 128 requests.

Two workloads (`--workload`), both with Poisson arrivals and an 8,192-token
context: `synthetic` (our choice), prompts lognormal with mean 1,500 tokens
and outputs lognormal with mean 300 (sigma 0.8 each); and `arxiv`, the paper's
Arxiv-Summarization data set, its prompt and output lengths drawn (each
independently, with replacement) from the lengths file
`arxiv_summarization_lengths.csv` (`--lengths_file`; default: in
`$ORCA_JAX_TRACES`, docs/traces.md), as the
paper drew that data set's requests under Poisson arrivals. That file is
Vidur's processed copy, cut to LLaMA-2's 4,096-token context (prompt mean
2,588, median 2,730; output mean 291, median 167), so every request fits
Mistral-7B's 8,192-token limit we keep for both. Capacity is the throughput (served
requests/s) at which the p99 TBT (`itl_p99_s`, over every inter-token gap)
reaches the SLO or the median queueing delay reaches 2 s, whichever comes
first (linear between swept rates). SLOs: 0.1 s (strict) and 0.5 s (relaxed).
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
from experiments.reproduce.trace_files import ARXIV_LENGTHS, flag_help, trace_path
from orca_jax.results.sweep_store import Curve, PointKey, aggregate
from orca_jax.runner.spec import LimitsSpec, RunSpec, SimEngineSpec, WorkloadSpec
from orca_jax.runner.sweep import SweepExecutor

FIGURE = "sarathi_mistral7b_tbt.png"  # under --out_dir (docs/figures/ has the documented one)
TBT = "itl_p99_s"
QUEUEING = "queueing_delay_p50_s"
RATE = "offered_rate_req_s"
THROUGHPUT = "throughput_req_s"
# The paper's capacity gain over vLLM, Mistral-7B on one A100 (strict SLO, budget 512).
PAPER_GAIN = {(0.1, "Sarathi 512"): 2.6}
WORKLOADS = ("synthetic", "arxiv")
# The paper's Arxiv-Summarization lengths (never copied here: read from the shared traces).
ARXIV_RATES = (0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0)
TITLES = {"synthetic": "lognormal lengths", "arxiv": "Arxiv-Summarization lengths"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class SarathiSetup:
    """The experiment (defaults: the documented figure)."""

    # Enough requests that an overloaded rate's queue (and median queueing delay) grows
    # well past the 2 s bound before the run ends.
    num_requests: int = 1000
    rates: tuple[float, ...] = (0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5, 5.0, 5.5, 6.0, 7.0,
                                8.0)
    seeds: tuple[int, ...] = (0,)
    prompt_len: str = "lognormal:1500:0.8"
    output_len: str = "lognormal:300:0.8"
    max_model_len: int = 8192
    max_num_seqs: int = 128
    budgets: tuple[int, ...] = (512, 2048)
    tbt_slos_s: tuple[float, ...] = (0.1, 0.5)
    max_queueing_s: float = 2.0  # median queueing delay a sustained rate must keep
    plot_max_s: float = 1.5

    def for_workload(self, workload: str,
                     lengths_file: Optional[str] = None) -> "SarathiSetup":
        """This setup on `synthetic` lengths, or on the `arxiv` lengths file (with rates
        scaled to its longer prompts; None: ARXIV_LENGTHS in the traces folder,
        `trace_files.trace_path`)."""
        if workload == "synthetic":
            return self
        if workload != "arxiv":
            raise ValueError(f"workload {workload!r} is not one of {WORKLOADS}")
        lengths_file = trace_path(ARXIV_LENGTHS, lengths_file, flag="--lengths_file")
        return dataclasses.replace(
            self, rates=ARXIV_RATES if self.rates == SarathiSetup.rates else self.rates,
            prompt_len=f"empirical:{lengths_file}:num_prefill_tokens",
            output_len=f"empirical:{lengths_file}:num_decode_tokens")

    def run_spec(self) -> RunSpec:
        """The workload and engine plumbing shared by every point."""
        return RunSpec(
            workload=WorkloadSpec(num_requests=self.num_requests, prompt_len=self.prompt_len,
                                  output_len=self.output_len),
            engine=SimEngineSpec(model="mistral-7b", hardware="a100",
                                 step_padding=PAPER_STEP_PADDING),
            limits=LimitsSpec(max_model_len=self.max_model_len, max_num_seqs=self.max_num_seqs,
                              max_num_tokens=self.max_model_len))

    def policy_runs(self) -> list[PolicyRun]:
        """The curves: vLLM without chunking, and Sarathi at each budget."""
        seqs = str(self.max_num_seqs)
        return ([PolicyRun("vLLM (no chunking)", "vllm",
                           {"enable_chunked_prefill": "false", "max_num_seqs": seqs,
                            "max_num_tokens": str(self.max_model_len)})]
                + [PolicyRun(f"Sarathi {b}", "sarathi",
                             {"max_num_tokens": str(b), "max_num_seqs": seqs})
                   for b in self.budgets])


@dataclasses.dataclass(frozen=True)
class SarathiResult:
    """The sweep's curves, its points and the capacities."""

    curves: list[Curve]  # p99 TBT against offered rate
    rows: list[dict[str, Any]]  # one per point
    capacity: list[dict[str, Any]]  # one per policy and SLO


def run(setup: SarathiSetup, out_dir: str,
        executor: Optional[SweepExecutor] = None) -> SarathiResult:
    """Runs the sweep (on `executor`, default here) and reads each policy's capacity under
    each TBT SLO."""
    def saturated(rate: float, summary: dict[str, Any]) -> bool:
        # The queue, not the tail of a finite run, says a rate is past capacity.
        queueing = summary.get(QUEUEING)
        return not (queueing if queueing is not None else math.inf) <= 2 * setup.max_queueing_s

    points, keys = run_grid(setup.run_spec(), setup.policy_runs(), setup.rates, setup.seeds,
                            out_dir, saturated=saturated, executor=executor)
    for point in points:
        point["summary"][RATE] = point["rate"]
    curves = aggregate(points, keys, RATE, TBT)
    # Capacity is read in served requests/s: past capacity a finite run's queue grows
    # slowly, so the offered rate at which the median queueing delay reaches the bound
    # overstates what the policy serves.
    served_tbt = aggregate(points, keys, THROUGHPUT, TBT)
    queueing = {c.policy: c for c in aggregate(points, keys, THROUGHPUT, QUEUEING)}
    by_key = {PointKey(p["policy"], float(p["rate"]), int(p["seed"])): p["summary"]
              for p in points}
    rows = [{"policy": k.policy, "rate": k.rate, "seed": k.seed,
             THROUGHPUT: by_key[k][THROUGHPUT], TBT: by_key[k][TBT],
             "tpot_p99_s": by_key[k]["tpot_p99_s"], "ttft_p50_s": by_key[k]["ttft_p50_s"],
             QUEUEING: by_key[k][QUEUEING], "mean_batch_size": by_key[k]["mean_batch_size"]}
            for k in keys]
    queue_limit = {p: throughput_at_bound(c, setup.max_queueing_s) for p, c in queueing.items()}
    capacity = []
    for slo in setup.tbt_slos_s:
        by_policy = {}
        for curve in served_tbt:
            limits = [throughput_at_bound(curve, slo), queue_limit[curve.policy]]
            by_policy[curve.policy] = (None if any(x is None for x in limits)
                                       else min(limits))
        baseline = next(iter(by_policy.values()))  # vLLM, the first curve
        for policy, value in by_policy.items():
            capacity.append({"tbt_slo_s": slo, "policy": policy, "capacity_req_s": value,
                             "over_vllm": (value / baseline if value and baseline else None),
                             "paper_over_vllm": PAPER_GAIN.get((slo, policy))})
    return SarathiResult(curves=curves, rows=rows, capacity=capacity)


FLAGS = reproduction_flags("sarathi", FIGURE, SarathiSetup)
flags.DEFINE_enum("workload", "synthetic", list(WORKLOADS), "synthetic lognormal lengths, or "
                  "the paper's arXiv lengths file (default out_dir and figure get an _arxiv "
                  "suffix)", flag_values=FLAGS)
flags.DEFINE_string("lengths_file", None, flag_help(
    "the Arxiv-Summarization lengths CSV of --workload=arxiv", ARXIV_LENGTHS), flag_values=FLAGS)


def figure_name(workload: str) -> str:
    """The figure's file name: FIGURE, with `_WORKLOAD` before `.png` but for synthetic."""
    return FIGURE if workload == "synthetic" else FIGURE.replace(".png", f"_{workload}.png")


def main(argv: Optional[Sequence[str]] = None) -> None:
    """The command: parse flags, run the sweep, print and write the tables and the figure.

    Args:
      argv: the flags (without the program name); None: the command line's.
    """
    args = parse_flags(FLAGS, argv)
    executor = executor_from_flags(args)
    if args.workload != "synthetic":
        if args.out_dir == args["out_dir"].default:
            args.out_dir += f"_{args.workload}"
    setup = SarathiSetup(num_requests=args.num_requests, rates=args.rates).for_workload(
        args.workload, args.lengths_file)
    os.makedirs(args.out_dir, exist_ok=True)
    start = time.perf_counter()
    result = run(setup, args.out_dir, executor)
    print(write_table(result.rows, ["policy", "rate", THROUGHPUT, TBT, "tpot_p99_s",
                                    "ttft_p50_s", QUEUEING, "mean_batch_size"],
                      args.out_dir, "curves"))
    print(f"\ncapacity: the throughput at which p99 TBT reaches the SLO or the median queueing "
          f"delay reaches {setup.max_queueing_s:g} s:")
    print(write_table(result.capacity, ["tbt_slo_s", "policy", "capacity_req_s", "over_vllm",
                                        "paper_over_vllm"],
                      args.out_dir, "capacity", {"setup": dataclasses.asdict(setup)}))
    write_figure_and_report(result.curves, args, figure_name=figure_name(args.workload),
                            max_y=setup.plot_max_s, x_field=RATE,
                            y_field=TBT, title="Mistral-7B, 1 x A100-80GB (simulated): p99 "
                                               f"TBT, {TITLES[args.workload]}",
                            tables=["curves", "capacity"], start=start)


if __name__ == "__main__":
    run_app(main, FLAGS, __doc__)
