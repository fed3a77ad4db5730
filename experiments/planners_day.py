"""A day of an Azure 2023 trace on an elastic cluster: planners beside a static one.

    python -m experiments.planners_day

The trace (default: Azure's 2023 code trace, one hour) is made a day long by
playing it `repeat` times back to back, each copy stretched `time_scale` times
(`--trace_repeat`, `--trace_time_scale`; repeat x time_scale = 24 hours). Each
setup runs the same requests on replicas of `model` on `tp` GPUs of `hardware`,
`vllm` on each, routed to the least outstanding:

  * `static`: `max_replicas` replicas all day;
  * `threshold`: from `max_replicas`, the fixed-threshold planner;
  * `sla`: from `max_replicas`, the Dynamo-style predictive planner (a linear trend of
    the arrival rate over the profiled throughput of one replica at the TPOT SLO).

Both planners are asked every `interval_s` and may go down to `min_replicas`; a started
replica is ready after its weights load over NVMe (`--replica_load_link`'s default).
Printed per setup: requests, SLO attainment (TTFT and TPOT SLOs), TTFT and TPOT p99,
replica-hours and their mean count, goodput per replica-second, planner calls and
replica starts; the figure is each setup's replica count over the day.

Raw output: `benchmarks/results/planners_day.txt`; figure `docs/figures/planners_day.png`.
"""

from __future__ import annotations

import dataclasses
import os
import resource
import time
from typing import Any, Optional, Sequence

from absl import flags

from experiments.reproduce.common import parse_flags, run_app, write_table
from orca_jax.cluster.elastic import planner_figures
from orca_jax.results.plots import pyplot
from orca_jax.results.summary import summarize_run
from orca_jax.runner.build import build_cluster, build_workload, scheduler_config
from orca_jax.runner.spec import ClusterSpec, LimitsSpec, RunSpec, SimEngineSpec, WorkloadSpec

SETUPS = ("static", "threshold", "sla")


@dataclasses.dataclass(frozen=True)
class DaySetup:
    """The setting (see the module docstring)."""

    trace: str = "../shared/traces/azure_code_2023.csv"
    repeat: int = 1
    time_scale: float = 24.0
    model: str = "llama3-70b"
    tp: int = 4
    hardware: str = "a100"
    max_replicas: int = 8
    min_replicas: int = 1
    interval_s: float = 300.0
    ttft_slo_s: float = 2.0
    tpot_slo_s: float = 0.1
    threshold_opts: str = "scale_up_load=4,scale_down_load=1"
    sla_opts: str = "predictor=linear_trend,window=6,headroom=1.2"

    def spec(self, setup: str) -> RunSpec:
        """One setup's run."""
        planner = None if setup == "static" else setup
        return RunSpec(
            workload=WorkloadSpec(arrival="trace", trace=self.trace, num_requests=None,
                                  trace_repeat=self.repeat, trace_time_scale=self.time_scale),
            engine=SimEngineSpec(model=self.model, tp=self.tp, hardware=self.hardware),
            limits=LimitsSpec(),  # pow2 step sizes: no pilot run
            cluster=ClusterSpec(
                num_replicas=self.max_replicas, router="least_outstanding", planner=planner,
                planner_opts={"static": "", "threshold": self.threshold_opts,
                              "sla": self.sla_opts}[setup],
                planner_interval_s=None if planner is None else self.interval_s,
                min_replicas=None if planner is None else self.min_replicas),
            ttft_slo_s=self.ttft_slo_s, tpot_slo_s=self.tpot_slo_s)


def run_setup(setup: DaySetup, name: str) -> tuple[dict[str, Any], list[tuple[float, int]]]:
    """One setup: its table row and its replica count over time `[(time_s, count)]`."""
    spec = setup.spec(name)
    workload = build_workload(spec)
    config = scheduler_config(spec)
    start = time.perf_counter()
    cluster = build_cluster(spec, "vllm", None, config, workload)
    result = cluster.run()
    wall = time.perf_counter() - start
    summary, _ = summarize_run(result, ttft_slo_s=spec.ttft_slo_s,
                               tpot_slo_s=spec.tpot_slo_s)
    end = result.virtual_end_s
    attainment = summary["slo_attainment"]
    met = round(attainment * len(workload))
    if cluster.elastic is not None:
        figures = planner_figures(cluster.elastic, end, met)
        timeline = [(row["time_s"], row["replicas"]) for row in cluster.elastic.timeline()]
    else:
        seconds = spec.cluster.num_replicas * end
        figures = {"replica_seconds": seconds, "replicas_mean": float(spec.cluster.num_replicas),
                   "goodput_per_replica_s": met / seconds, "num_planner_calls": 0,
                   "num_replica_starts": 0, "replica_startup_s": None}
        timeline = [(0.0, spec.cluster.num_replicas)]
    timeline.append((end, timeline[-1][1]))
    row = {"setup": name, "requests": len(workload), "finished": summary["num_finished"],
           "slo_attainment": attainment, "ttft_p99_s": summary["ttft_p99_s"],
           "tpot_p99_s": summary["tpot_p99_s"],
           "replica_hours": figures["replica_seconds"] / 3600.0,
           "replicas_mean": figures["replicas_mean"],
           "goodput_per_replica_s": figures["goodput_per_replica_s"],
           "planner_calls": figures["num_planner_calls"],
           "starts": figures["num_replica_starts"], "day_h": end / 3600.0,
           "steps": result.num_steps, "run_s": wall}
    return row, timeline


def plot_replicas(timelines: dict[str, list[tuple[float, int]]], path: str,
                  caption: str) -> bool:
    """Each setup's replica count over the day (a step line); False without matplotlib."""
    plt = pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(8, 3.6))
    for name, points in timelines.items():
        hours = [t / 3600.0 for t, _ in points]
        ax.step(hours, [c for _, c in points], where="post", label=name)
    ax.set_xlabel("virtual time (hours)")
    ax.set_ylabel("replicas holding a GPU")
    ax.set_ylim(bottom=0)
    ax.legend()
    ax.set_title("Replicas over a day: static and planned")
    fig.text(0.01, 0.01, caption, fontsize=7)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


COLUMNS = ["setup", "requests", "finished", "slo_attainment", "ttft_p99_s", "tpot_p99_s",
           "replica_hours", "replicas_mean", "goodput_per_replica_s", "planner_calls",
           "starts", "day_h", "steps", "run_s"]
FLAGS = flags.FlagValues()
flags.DEFINE_string("out_dir", "runs/planners_day", "the tables and the figure",
                    flag_values=FLAGS)
flags.DEFINE_string("figure", None, "the PNG to write (default: OUT_DIR/planners_day.png; "
                    "the docs show docs/figures/planners_day.png)", flag_values=FLAGS)
flags.DEFINE_string("trace", DaySetup.trace, "the trace file", flag_values=FLAGS)
flags.DEFINE_integer("repeat", DaySetup.repeat, "copies of the trace, back to back",
                     lower_bound=1, flag_values=FLAGS)
flags.DEFINE_float("time_scale", DaySetup.time_scale, "each copy's time stretch",
                   lower_bound=0.0, flag_values=FLAGS)
flags.DEFINE_float("interval_s", DaySetup.interval_s, "seconds between the planners' calls",
                   lower_bound=0.0, flag_values=FLAGS)
flags.DEFINE_list("setups", list(SETUPS), "the setups to run", flag_values=FLAGS)


def main(argv: Optional[Sequence[str]] = None) -> None:
    """The command: every setup, the table, the figure and the time it took."""
    args = parse_flags(FLAGS, argv)
    setup = DaySetup(trace=args.trace, repeat=args.repeat, time_scale=args.time_scale,
                     interval_s=args.interval_s)
    os.makedirs(args.out_dir, exist_ok=True)
    start = time.perf_counter()
    rows, timelines = [], {}
    for name in args.setups:
        if name not in SETUPS:
            raise ValueError(f"--setups: unknown setup {name!r}; choose from "
                             f"{', '.join(SETUPS)}")
    for name in args.setups:
        row, timelines[name] = run_setup(setup, name)
        rows.append(row)
    print(write_table(rows, COLUMNS, args.out_dir, "planners_day",
                      {"setup": dataclasses.asdict(setup)}))
    static = next((r for r in rows if r["setup"] == "static"), None)
    for row in rows:
        if static is not None and row is not static:
            print(f"{row['setup']}: {row['replica_hours'] / static['replica_hours']:.2f}x the "
                  f"static cluster's replica-hours, SLO attainment {row['slo_attainment']:.3f} "
                  f"(static {static['slo_attainment']:.3f})")
    path = args.figure or os.path.join(args.out_dir, "planners_day.png")
    caption = (f"engine sim; {os.path.basename(setup.trace)} x{setup.repeat} back to back, "
               f"each stretched x{setup.time_scale:g}; {setup.model} tp={setup.tp} "
               f"{setup.hardware}; vllm, least_outstanding; one seed")
    if plot_replicas(timelines, path, caption):
        print(f"figure: {path}")
    cpu = resource.getrusage(resource.RUSAGE_SELF)
    print(f"({time.perf_counter() - start:.0f} s wall, {cpu.ru_utime + cpu.ru_stime:.0f} s "
          f"process, {rows[0]['requests'] if rows else 0} requests a setup)")


if __name__ == "__main__":
    run_app(main, FLAGS, __doc__)
