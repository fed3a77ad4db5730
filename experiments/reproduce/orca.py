"""Orca (OSDI'22), GPT-3 175B: iteration-level vs request-level batching, latency vs throughput.

    python -m experiments.reproduce.orca                             # TP16, the figure
    python -m experiments.reproduce.orca --layouts=tp16,tp8pp2       # and the paper's layout

The paper serves GPT-3 175B on 16 A100-40GB GPUs (tensor parallel 8 inside a
node x pipeline parallel 2 across two nodes) with Poisson arrivals, prompts of
U[32, 512] tokens and outputs of U[1, 128] tokens, and draws median normalized
latency (latency / output tokens) against throughput for FasterTransformer
(request-level batching) and Orca at several max batch sizes.

What is modelled here: the same model and workload on the per-operation roofline
simulator with **tensor parallel 16** over 16 A100-40GB (the simulator has no
pipeline parallelism; 175B in fp16 does not fit tp=8 on 40 GB parts), so every
layer's two all-reduces cross the two nodes (~444 us each, ~86 ms a step),
which the paper's TP8 x PP2 layout does not pay. `static` (the
FasterTransformer baseline: a batch runs until its longest member is done,
every step padded to the batch, answers returned together) at max batch sizes
1, 8, 16 and 32, against `orca` at 8, 16 and 32. Both reserve the model's
full 2,048-token context per request, which caps either at 27 requests in the
KV pool beside the weights. The ratio of throughputs at equal median
normalized latency is read off the curves (`throughput_at_bound`).

`--layouts` picks the parallel layouts (`LAYOUTS`): `tp16` as above; `tp8pp2`, the
paper's, tensor parallel 8 inside each node and two pipeline stages of 48 layers
across the nodes (`--pp=2`), with micro-batch balancing (`--pp_balance`) so the
static baseline splits its batch over the two micro-batches in flight as
FasterTransformer's pipeline does; `tp8pp2-unbalanced` without it. With more than
one, each runs under OUT_DIR/LAYOUT and a last table puts their ratios side by side
with the paper's.

The grid runner and the bound reader are shared with the other reproductions
(`experiments/reproduce/common.py`).
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Optional, Sequence

from absl import app, flags

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

FIGURE = "orca_gpt3_175b_latency_throughput.png"  # under --out_dir (docs/figures/: the doc's)
LATENCY = "normalized_latency_p50_s"
THROUGHPUT = "throughput_req_s"
PAPER_RATIO = 36.9  # the paper's throughput of Orca over FasterTransformer at equal latency
# Parallel layouts of the 16 GPUs: the engine's tp, pp and pp_balance. A pipeline steps
# one iteration at a time (no leaping: several times tp16's host time), so its layouts
# run the curves that were ever the best of their kind under tp16 (static at 8, 16 and
# 32, orca at 32: orca's larger caps dominate its smaller, and static bs=1 equals bs=8
# at low load and falls behind it above).
_PIPELINE_CURVES = {"static_batch_sizes": (8, 16, 32), "orca_batch_sizes": (32,)}
LAYOUTS: dict[str, dict[str, Any]] = {
    "tp16": {"tp": 16, "pp": 1, "pp_balance": False},
    "tp8pp2": {"tp": 8, "pp": 2, "pp_balance": True, **_PIPELINE_CURVES},
    "tp8pp2-unbalanced": {"tp": 8, "pp": 2, "pp_balance": False, **_PIPELINE_CURVES},
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class OrcaSetup:
    """The experiment (defaults: the documented figure)."""

    num_requests: int = 500
    # Low rates too: a static batch waits for its longest member, so its latency is
    # above Orca's tightest bounds from 0.25 req/s on.
    rates: tuple[float, ...] = (0.05, 0.1, 0.15, 0.2, 0.25, 0.5, 0.75, 1, 1.25, 1.5, 2, 2.5, 3,
                                4, 6)
    seeds: tuple[int, ...] = (0,)
    static_batch_sizes: tuple[int, ...] = (1, 8, 16, 32)
    orca_batch_sizes: tuple[int, ...] = (8, 16, 32)
    tp: int = 16
    pp: int = 1
    pp_balance: bool = False
    hardware: str = "a100-40gb"
    # Median normalized latencies (s/token) at which the throughputs are compared.
    # Per-op roofline, tp=16: an unloaded token takes ~0.11 s (two nodes' all-reduces);
    # tp8 x pp2 ~0.06 s (the first two bounds are for it).
    latency_bounds_s: tuple[float, ...] = (0.075, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 1.0)
    plot_max_s: float = 1.5

    def run_spec(self) -> RunSpec:
        """The workload and engine plumbing shared by every point."""
        cap = max(self.static_batch_sizes + self.orca_batch_sizes)
        # Orca (and FasterTransformer) put whole prompts in a step: a budget for a full
        # batch of the longest prompts never chunks one.
        return RunSpec(
            workload=WorkloadSpec(num_requests=self.num_requests, prompt_len="uniform:32:512",
                                  output_len="uniform:1:128"),
            engine=SimEngineSpec(model="gpt3-175b", hardware=self.hardware, tp=self.tp,
                                 pp=self.pp, pp_balance=self.pp_balance,
                                 step_padding=PAPER_STEP_PADDING),
            limits=LimitsSpec(max_num_seqs=cap, max_num_tokens=cap * 512))

    def policy_runs(self) -> list[PolicyRun]:
        """The curves: static and orca at each max batch size."""
        return ([PolicyRun(f"static bs={b}", "static", {"max_num_seqs": str(b)})
                 for b in self.static_batch_sizes]
                + [PolicyRun(f"orca bs={b}", "orca", {"max_num_seqs": str(b)})
                   for b in self.orca_batch_sizes])


@dataclasses.dataclass(frozen=True)
class OrcaResult:
    """The sweep's curves, its points and the throughput ratios."""

    curves: list[Curve]
    rows: list[dict[str, Any]]  # one per point: label, rate, throughput, latency, batch
    ratios: list[dict[str, Any]]  # one per latency bound: best static and orca, ratio


def run(setup: OrcaSetup, out_dir: str,
        executor: Optional[SweepExecutor] = None) -> OrcaResult:
    """Runs the sweep (on `executor`, default here) and reads the throughput ratio at each
    latency bound."""
    points, keys = run_grid(setup.run_spec(), setup.policy_runs(), setup.rates, setup.seeds,
                            out_dir, executor=executor)
    curves = aggregate(points, keys, THROUGHPUT, LATENCY)
    by_key = {PointKey(p["policy"], float(p["rate"]), int(p["seed"])): p["summary"]
              for p in points}
    rows = [{"policy": k.policy, "rate": k.rate, "seed": k.seed,
             THROUGHPUT: by_key[k][THROUGHPUT], LATENCY: by_key[k][LATENCY],
             "mean_batch_size": by_key[k]["mean_batch_size"]} for k in keys]
    ratios = []
    for bound in setup.latency_bounds_s:
        best = {"static": (None, 0.0), "orca": (None, 0.0)}
        for curve in curves:
            kind = curve.policy.split()[0]
            x = throughput_at_bound(curve, bound)
            if x is not None and x > best[kind][1]:
                best[kind] = (curve.policy, x)
        static_x, orca_x = best["static"][1], best["orca"][1]
        ratios.append({"latency_bound_s": bound, "best_static": best["static"][0],
                       "static_req_s": static_x or None, "best_orca": best["orca"][0],
                       "orca_req_s": orca_x or None,
                       "ratio": orca_x / static_x if static_x and orca_x else None,
                       "paper_ratio": PAPER_RATIO})
    return OrcaResult(curves=curves, rows=rows, ratios=ratios)


FLAGS = reproduction_flags("orca", FIGURE, OrcaSetup)
flags.DEFINE_list("layouts", ["tp16"], f"parallel layouts of the 16 GPUs to run, of "
                  f"{', '.join(LAYOUTS)} (tp16: the figure's)", flag_values=FLAGS)


def main(argv: Optional[Sequence[str]] = None) -> None:
    """The command: parse flags, run the sweep, print and write the tables and the figure.

    Args:
      argv: the flags (without the program name); None: the command line's.
    """
    args = parse_flags(FLAGS, argv)
    unknown = [name for name in args.layouts if name not in LAYOUTS]
    if unknown or not args.layouts:
        raise app.UsageError(f"--layouts: {','.join(unknown) or 'none given'}; choose from "
                             f"{', '.join(LAYOUTS)}")
    executor = executor_from_flags(args)
    os.makedirs(args.out_dir, exist_ok=True)
    start = time.perf_counter()
    several = len(args.layouts) > 1
    ratios: dict[str, list[dict[str, Any]]] = {}
    for name in args.layouts:
        setup = OrcaSetup(num_requests=args.num_requests, rates=args.rates, **LAYOUTS[name])
        out_dir = os.path.join(args.out_dir, name) if several else args.out_dir
        os.makedirs(out_dir, exist_ok=True)
        result = run(setup, out_dir, executor)
        print(f"\n== layout {name}: tp {setup.tp} x pp {setup.pp}"
              f"{' (balanced micro-batches)' if setup.pp_balance else ''}")
        print(write_table(result.rows, ["policy", "rate", THROUGHPUT, LATENCY,
                                        "mean_batch_size"], out_dir, "curves"))
        print("\nthroughput (req/s) at equal median normalized latency:")
        print(write_table(result.ratios, ["latency_bound_s", "best_static", "static_req_s",
                                          "best_orca", "orca_req_s", "ratio", "paper_ratio"],
                          out_dir, "ratios", {"setup": dataclasses.asdict(setup)}))
        ratios[name] = result.ratios
        if not several:
            write_figure_and_report(result.curves, args, figure_name=FIGURE,
                                    max_y=setup.plot_max_s, x_field=THROUGHPUT,
                                    y_field=LATENCY,
                                    title=f"GPT-3 175B, 16 x A100-40GB (tp={setup.tp}"
                                          f"{f' x pp={setup.pp}' if setup.pp > 1 else ''}, "
                                          "simulated): median normalized latency",
                                    tables=["curves", "ratios"], start=start)
    if several:
        print("\nOrca over static at equal median normalized latency, by layout:")
        print(write_table(layout_rows(ratios), ["latency_bound_s", *ratios, "paper_ratio"],
                          args.out_dir, "layouts"))
        print(f"tables: {args.out_dir}/layouts.txt ({time.perf_counter() - start:.0f} s)")


def layout_rows(ratios: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per latency bound: each layout's ratio (None where a curve does not reach
    the bound) and the paper's."""
    names = list(ratios)
    rows = []
    for i, first in enumerate(ratios[names[0]]):
        row: dict[str, Any] = {"latency_bound_s": first["latency_bound_s"]}
        for name in names:
            row[name] = ratios[name][i]["ratio"]
        row["paper_ratio"] = PAPER_RATIO
        rows.append(row)
    return rows


if __name__ == "__main__":
    run_app(main, FLAGS, __doc__)
