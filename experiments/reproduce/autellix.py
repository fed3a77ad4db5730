"""Autellix (arXiv 2502.13965): program-level scheduling of agent programs, PLAS and ATLAS vs vLLM.

    python -m experiments.reproduce.autellix

Autellix (Luo et al., 2025) treats an agent's program (many LLM calls with tool
pauses between them) as the unit of scheduling: a call is ranked by its
*program's* attained service (PLAS, for sequential programs) or by its program's
longest chain of calls (ATLAS, for programs with parallel threads), so short
programs are not stuck behind long ones, and a load balancer keeps a program's
calls on the engine holding its context. On sequential (chatbot, ReAct) and
multi-threaded (MCTS-like) programs with LLaMA-3.1 8B/70B on A100s it reports
4-15x the throughput of vLLM at the same program latency.

Here, on the simulator: LLaMA-3 8B on one A100 (and four, each its own replica),
`--workload=programs` in the paper's two shapes:

  * `sequential`: one chain of calls per program, a heavy-tailed count of them
    (lognormal, mean 6), each after a tool pause (lognormal, mean 0.5 s); each
    call's prompt the program's context so far;
  * `parallel`: stages of a planning call fanning out to 4 thread calls that join,
    a heavy-tailed count of stages (lognormal, mean 2), then a final call.

`vllm` (FCFS per call, prefix caching on) against `plas` and `atlas` at rising
program rates, each capped at `max_num_seqs` running calls so that a queue forms
at these loads (the order of the queue is what the policies decide). Program
completion time is the first call's arrival to the last call's finish (mean,
p50, p99). Throughput at equal program latency: the highest program rate at which
each policy's mean program completion time stays under a bound
(`bound_factors`: 1.1 and 1.25 x the best policy's mean at the lowest rate), read between the
swept rates (`common.throughput_at_bound`; the last rate where no curve crosses:
a lower bound, printed with `>=`).

Then: four replicas behind `least_outstanding` and `program_affinity`
(policies/program_routers.py) at four times a rate, and the Copilot-statistics
generator (`--program_shape=copilot` with its defaults) with its KV pinned
across tool pauses (`--kv_pin_s`) against not pinned, on a small KV pool.

Raw output: `benchmarks/results/autellix.txt`.
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
from orca_jax.results.sweep_store import Curve, aggregate
from orca_jax.runner.experiment import run_policy
from orca_jax.runner.spec import ClusterSpec, LimitsSpec, RunSpec, SimEngineSpec, WorkloadSpec
from orca_jax.runner.sweep import SweepExecutor

FIGURE = "autellix_program_time.png"  # under --out_dir (docs/figures/ has the documented one)
RATE = "offered_rate_programs_s"  # the sweep's rate: programs per second
MEAN = "program_completion_mean_s"
P50 = "program_completion_p50_s"
P99 = "program_completion_p99_s"
POLICIES = ("vllm", "plas", "atlas")
ROUTERS = ("least_outstanding", "program_affinity")
PAPER_GAIN = (4.0, 15.0)  # Autellix: 4-15x vLLM's throughput at the same program latency
# The shapes' program knobs (WorkloadSpec's program_* fields); the rest are the generator's.
SHAPES = {
    "sequential": dict(program_shape="copilot", program_turns="fixed:1",
                       program_calls_per_turn="lognormal:6:1", program_tool_ms="lognormal:500:1"),
    "parallel": dict(program_shape="parallel", program_turns="lognormal:2:0.8",
                     program_fanout=4, program_tool_ms="lognormal:500:1"),
}
def differs(programs: int) -> str:
    """The sentence on what differs from the paper, for a run of `programs` programs a point."""
    return ("What differs: LLaMA-3 8B on a simulated A100 roofline, not their testbed; "
            "synthetic programs of the paper's two shapes (heavy-tailed call counts, our "
            "lengths and tool times), not ShareGPT/BFCL/LATS traces; a queue made by a cap of "
            f"running calls rather than by a saturated real engine; {programs} programs per "
            f"point (the same {programs} at every rate, only started faster), where the paper "
            "serves thousands of programs; and no preemption of long programs' running calls "
            "for new ones (ours never preempts for an admission).")


@dataclasses.dataclass(frozen=True, kw_only=True)
class AutellixSetup:
    """The experiment (defaults: the documented tables; a few minutes on 2 cores)."""

    # Programs per point, every call of each (`--program_count`): the same programs at
    # every rate, only their starts scaled, so the curves compare like with like.
    programs: int = 60
    num_requests: int = 400  # the cluster's calls: twice this (one rate, the first calls)
    rates: tuple[float, ...] = (1.0, 2.0, 4.0, 8.0)  # programs per second
    seeds: tuple[int, ...] = (0,)
    model: str = "llama3-8b"
    hardware: str = "a100"
    max_num_seqs: int = 32
    first_prompt: str = "lognormal:1024:0.5"
    prompt_growth: str = "lognormal:128:1"
    completion_len: str = "lognormal:128:1"
    # The program-latency bounds: each this x the best policy's mean at the lowest rate.
    bound_factors: tuple[float, ...] = (1.1, 1.25)
    num_replicas: int = 4
    cluster_rate_factor: float = 4.0  # the cluster's rate: this x the middle rate
    pin_requests: int = 300  # the Copilot-statistics runs: calls
    pin_rate: float = 0.5  # programs per second
    pin_pages: int = 3000  # a small pool (pages of 16), so unpinned history is evicted
    pin_ttl_s: float = 5.0  # continuum's TTL
    pin_seconds: tuple[float, ...] = (0.0, 5.0, math.inf)

    def spec(self, shape: str, num_replicas: int = 1, router: str = "round_robin") -> RunSpec:
        """A shape's workload and engine (rate and seed are set per point)."""
        return RunSpec(
            workload=WorkloadSpec(arrival="programs", num_requests=self.num_requests,
                                  program_count=self.programs,
                                  rate=self.rates[0], program_first_prompt=self.first_prompt,
                                  program_prompt_growth=self.prompt_growth,
                                  program_completion_len=self.completion_len, **SHAPES[shape]),
            engine=SimEngineSpec(model=self.model, hardware=self.hardware,
                                 step_padding=PAPER_STEP_PADDING),
            limits=LimitsSpec(max_num_seqs=self.max_num_seqs),
            cluster=ClusterSpec(num_replicas=num_replicas, router=router))

    def policy_runs(self) -> list[PolicyRun]:
        return [PolicyRun(name, name, {}) for name in POLICIES]


def _row(label: dict[str, Any], summary: dict[str, Any]) -> dict[str, Any]:
    return {**label, MEAN: summary.get(MEAN), P50: summary.get(P50), P99: summary.get(P99),
            "programs_done": summary.get("num_programs_completed"),
            "waiting_share": summary.get("program_waiting_share"),
            "throughput_req_s": summary.get("throughput_req_s")}


def run_shape(setup: AutellixSetup, shape: str, out_dir: str,
              executor: Optional[SweepExecutor] = None
              ) -> tuple[list[dict[str, Any]], list[Curve]]:
    """Every policy at every rate on one shape: one row per point, and the mean program
    completion time curves against the program rate."""
    folder = os.path.join(out_dir, shape)
    points, keys = run_grid(setup.spec(shape), setup.policy_runs(), setup.rates, setup.seeds,
                            folder, saturated=lambda *_: False, executor=executor)
    by_key = {(p["policy"], float(p["rate"]), int(p["seed"])): p["summary"] for p in points}
    rows = [_row({"shape": shape, "policy": k.policy, "rate": k.rate},
                 by_key[k.policy, k.rate, k.seed]) for k in keys]
    for point in points:
        point["summary"][RATE] = point["rate"]
    curves = aggregate(points, keys, RATE, MEAN)
    return rows, [dataclasses.replace(c, policy=f"{c.policy} ({shape})") for c in curves]


def gain_rows(setup: AutellixSetup, shape: str, curves: Sequence[Curve], factor: float
              ) -> list[dict[str, Any]]:
    """Each policy's highest program rate under the bound (`factor` x the best policy's
    mean at the lowest rate), and its ratio to vllm's."""
    ours = [c for c in curves if c.policy.endswith(f"({shape})")]
    lowest = [float(c.y_mean[0]) for c in ours if c.y_mean.size]
    if not lowest:
        return []
    bound = factor * min(lowest)
    top = max(setup.rates)
    sustained = {c.policy.split(" ")[0]: throughput_at_bound(c, bound) for c in ours}
    base = sustained.get("vllm")
    rows = []
    for policy, rate in sustained.items():
        capped = rate is not None and rate >= top  # never crossed: a lower bound
        rows.append({"shape": shape, "policy": policy, "bound_s": round(bound, 2),
                     "rate_at_bound": (None if rate is None
                                       else f"{'>=' if capped else ''}{rate:.3g}"),
                     "vs_vllm": (f"{rate / base:.2f}x" if rate and base else None)})
    return rows


def cluster_rows(setup: AutellixSetup) -> list[dict[str, Any]]:
    """The sequential shape on `num_replicas` replicas, each router x policy, one rate."""
    rate = setup.cluster_rate_factor * sorted(setup.rates)[len(setup.rates) // 2]
    rows = []
    for router in ROUTERS:
        spec = setup.spec("sequential", setup.num_replicas, router)
        spec = dataclasses.replace(spec, workload=dataclasses.replace(
            spec.workload, rate=rate, num_requests=setup.num_requests * 2,
            program_count=None))
        for policy in ("vllm", "plas"):
            summary, _ = run_policy(spec, policy, {}, progress=False)
            rows.append(_row({"router": router, "policy": policy, "rate": rate},
                             summary) | {"prefix_hit_rate": summary.get("prefix_hit_rate")})
    return rows


def pin_rows(setup: AutellixSetup) -> list[dict[str, Any]]:
    """The Copilot-statistics generator (its defaults) on a small pool: vllm with KV
    pinned for each of `pin_seconds` after a call (0: not pinned), and continuum (pinned
    for `pin_ttl_s` when the tool pause after the call is at most that)."""
    rows = []
    for policy, seconds in [("vllm", s) for s in setup.pin_seconds] + [("continuum", 0.0)]:
        spec = RunSpec(
            workload=WorkloadSpec(arrival="programs", num_requests=setup.pin_requests,
                                  rate=setup.pin_rate),
            engine=SimEngineSpec(model=setup.model, hardware=setup.hardware,
                                 step_padding=PAPER_STEP_PADDING),
            limits=LimitsSpec(max_num_seqs=setup.max_num_seqs, num_kv_pages=setup.pin_pages,
                              kv_pin_s=seconds))
        options = {"pin_ttl_s": str(setup.pin_ttl_s)} if policy == "continuum" else {}
        summary, _ = run_policy(spec, policy, options, progress=False)
        rows.append({"policy": policy, "kv_pin_s": seconds if policy == "vllm" else
                     f"ttl {setup.pin_ttl_s:g} if pause <= ttl",
                     "prefix_hit_rate": summary.get("prefix_hit_rate"),
                     "num_evictions": summary.get("num_evictions"),
                     "ttft_p50_s": summary.get("ttft_p50_s"), MEAN: summary.get(MEAN),
                     P99: summary.get(P99), "kv_pins": summary.get("kv_pins"),
                     "kv_pin_hits": summary.get("kv_pin_hits"),
                     "kv_pinned_pages_max": summary.get("kv_pinned_pages_max")})
    return rows


FLAGS = reproduction_flags("autellix", FIGURE, AutellixSetup)
flags.DEFINE_integer("programs", AutellixSetup.programs, "programs per point (every call "
                     "of each; the same programs at every rate)", lower_bound=1,
                     flag_values=FLAGS)
flags.DEFINE_boolean("cluster", True, "also run four replicas behind each router",
                     flag_values=FLAGS)
flags.DEFINE_boolean("pins", True, "also run the Copilot-statistics generator with and "
                     "without KV pinned across tool pauses", flag_values=FLAGS)

COLUMNS = ["shape", "policy", "rate", MEAN, P50, P99, "programs_done", "waiting_share",
           "throughput_req_s"]


def main(argv: Optional[Sequence[str]] = None) -> None:
    """The command: run both shapes (and the cluster, the pins), print and write the tables
    and the figure.

    Args:
      argv: the flags (without the program name); None: the command line's.
    """
    args = parse_flags(FLAGS, argv)
    executor = executor_from_flags(args)
    setup = AutellixSetup(programs=args.programs, num_requests=args.num_requests,
                          rates=args.rates)
    os.makedirs(args.out_dir, exist_ok=True)
    start = time.perf_counter()
    rows: list[dict[str, Any]] = []
    curves: list[Curve] = []
    gains: list[dict[str, Any]] = []
    for shape in SHAPES:
        shape_rows, shape_curves = run_shape(setup, shape, args.out_dir, executor)
        rows += shape_rows
        curves += shape_curves
        gains += [row for factor in setup.bound_factors
                  for row in gain_rows(setup, shape, shape_curves, factor)]
    print(f"{setup.model} on one {setup.hardware} (simulated), {setup.programs} programs "
          f"per point (the same at every rate), at most {setup.max_num_seqs} running; "
          f"rate: programs/s; prompt "
          f"{setup.first_prompt} then +{setup.prompt_growth} per call, answers "
          f"{setup.completion_len}; shapes {SHAPES}:")
    tables = ["programs", "paper"]
    print(write_table(rows, COLUMNS, args.out_dir, "programs",
                      {"setup": dataclasses.asdict(setup)}))
    print(f"\nthroughput at equal program latency (highest program rate with mean completion "
          f"under the bound; paper: plas/atlas {PAPER_GAIN[0]:g}-{PAPER_GAIN[1]:g}x vllm):")
    print(write_table(gains, ["shape", "policy", "bound_s", "rate_at_bound", "vs_vllm"],
                      args.out_dir, "paper"))
    print(differs(setup.programs))
    if args.cluster:
        print(f"\nsequential programs on {setup.num_replicas} replicas, "
              f"{setup.num_requests * 2} calls:")
        print(write_table(cluster_rows(setup), ["router", "policy", "rate", MEAN, P50, P99,
                                                "prefix_hit_rate", "programs_done"],
                          args.out_dir, "cluster"))
        tables.append("cluster")
    if args.pins:
        print(f"\nKV pinned across tool pauses: the Copilot-statistics generator (defaults), "
              f"{setup.pin_requests} calls at {setup.pin_rate:g} programs/s, "
              f"{setup.pin_pages} KV pages of 16:")
        print(write_table(pin_rows(setup), ["policy", "kv_pin_s", "prefix_hit_rate",
                                            "num_evictions", "ttft_p50_s", MEAN, P99, "kv_pins",
                                            "kv_pin_hits", "kv_pinned_pages_max"],
                          args.out_dir, "pins"))
        tables.append("pins")
    write_figure_and_report(curves, args, figure_name=FIGURE, max_y=float("inf"),
                            x_field=RATE, y_field=MEAN,
                            title=f"{setup.model}, 1 x {setup.hardware} (simulated): mean "
                                  "program completion time",
                            tables=tables, start=start,
                            per_point=f"{setup.programs} programs per point (the same at "
                                      "every rate); rates {rates} programs/s")


if __name__ == "__main__":
    run_app(main, FLAGS, __doc__)
