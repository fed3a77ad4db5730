"""DistServe (OSDI'24) and Splitwise (ISCA'24): goodput of disaggregated against colocated serving.

    python -m experiments.reproduce.distserve

DistServe runs each request's prompt on prefill GPUs and its decode on other
GPUs, so a long prefill never stalls a running decode and each phase gets its
own batch; it pays a KV transfer per request and may leave one pool idle while
the other is the bottleneck. It reports up to 7.4x the requests served within
both a TTFT and a TPOT SLO (goodput) of colocated vLLM; Splitwise reports 1.4x
the throughput at 20% lower cost. We compare, at equal GPU count (2 GPUs:
2 colocated replicas against 1 prefill + 1 decode; 4 GPUs: 4 against 2+2 and
3+1), colocated `vllm` (whole prompts, as DistServe's vLLM baseline), colocated
`sarathi` (prompts in 512-token chunks beside the decodes) and disaggregated
`vllm` pools, on the simulator. Goodput per GPU: requests per second that meet
both SLOs, over the GPUs; capacity: the highest rate per GPU at which 90% of the
requests meet both SLOs (DistServe's measure), linear between swept rates.

Two workloads, served by LLaMA-3 8B on A100s (bf16, one GPU per replica, KV
moved over NVLink as DistServe places a prefill and a decode instance in one
node): `synthetic`, Poisson arrivals of long prompts (lognormal, mean 1,500
tokens) and short answers (mean 150, sigma 0.5 each), DistServe's long-prompt
regime where a whole prefill stalls the decodes batched with it; and `azure`,
the Azure LLM inference conversation trace (2023) read in place from `--trace`
(default: in `$ORCA_JAX_TRACES`, docs/traces.md),
its first requests with their arrival pattern rescaled to each rate. SLOs:
TTFT 1 s, and TPOT 15 ms (tight: a decode step of a growing batch) or 50 ms
(loose). A system's rates stop once fewer than 30% of its requests meet the
loose SLO.

DistServe's other reading, the SLO scale (`experiments.reproduce.slo_scale`): at a
fixed rate per GPU (`--slo_scale_rates`), both SLOs multiplied by one factor, the
tightest factor at which each system still meets 90% attainment, and how many
times tighter that is than colocated `vllm`'s on as many GPUs (the paper's "12.6x
tighter SLO"). Both SLO pairs above serve as the base (scale 1).
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from typing import Optional, Sequence

from absl import app, flags

import policies  # noqa: F401  (registers the built-in policies)
from experiments.cli_errors import clean_errors, run_command
from experiments.reproduce import slo_scale
from experiments.reproduce.common import PAPER_STEP_PADDING, figure_path
from experiments.reproduce.trace_files import AZURE_CONV, flag_help, trace_path
from orca_jax.core.json_files import to_json_value, write_json_atomic
from orca_jax.results.metrics import format_table
from orca_jax.results.summary import summarize
from orca_jax.runner.disaggregated import num_gpus
from orca_jax.runner.experiment import run_policy
from orca_jax.runner.spec import ClusterSpec, LimitsSpec, RunSpec, SimEngineSpec, WorkloadSpec

FIGURE = "distserve_goodput.png"  # under --out_dir (docs/figures/ has the documented one)
SLO_SCALE_FIGURE = "distserve_slo_scale.png"
ATTAINMENT_TARGET = 0.9  # DistServe's: 90% of the requests within both SLOs
# The papers' headline numbers, as their abstracts state them.
PAPER_CLAIMS = (
    "DistServe (OSDI'24): 7.4x more requests, or 12.6x tighter SLOs, within the latency "
    "targets for > 90% of requests, against colocated vLLM and DeepSpeed-MII; "
    "2.0x-4.6x higher rate per GPU than vLLM on its OPT-13B chatbot workload",
    "Splitwise (ISCA'24): 1.4x the throughput at 20% lower cost, or 2.35x the throughput "
    "at the same cost and power, against colocated serving")


@dataclasses.dataclass(frozen=True)
class System:
    """One way to spend the GPUs: colocated replicas of one policy, or two pools."""

    label: str
    policy: str
    num_gpus: int
    num_prefill: int = 0  # 0: colocated
    num_decode: int = 0

    @property
    def disaggregated(self) -> bool:
        return self.num_prefill > 0


SYSTEMS = (System("vllm x2", "vllm", 2), System("sarathi x2", "sarathi", 2),
           System("disagg 1+1", "vllm", 2, 1, 1),
           System("vllm x4", "vllm", 4), System("sarathi x4", "sarathi", 4),
           System("disagg 2+2", "vllm", 4, 2, 2), System("disagg 3+1", "vllm", 4, 3, 1))
POLICY_OPTIONS = {"vllm": {"enable_chunked_prefill": "false", "max_num_tokens": "8192"},
                  "sarathi": {"max_num_tokens": "512"}}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Workload:
    """A workload and the model that serves it, with its SLOs."""

    name: str
    model: str
    ttft_slo_s: float
    tpot_slos_s: tuple[float, float]  # (tight, loose)
    prompt_len: str = ""
    output_len: str = ""
    trace: Optional[str] = None

    def spec(self, setup: "DistServeSetup", system: System, rate_per_gpu: float) -> RunSpec:
        """The run of `system` at `rate_per_gpu` requests/s per GPU."""
        rate = rate_per_gpu * system.num_gpus
        if self.trace is None:
            workload = WorkloadSpec(arrival="poisson", num_requests=setup.num_requests,
                                    rate=rate, prompt_len=self.prompt_len,
                                    output_len=self.output_len)
        else:
            workload = WorkloadSpec(arrival="trace", trace=self.trace,
                                    num_requests=setup.num_requests,
                                    trace_time_scale=trace_rate(self.trace, setup.num_requests)
                                    / rate)
        cluster = (ClusterSpec(num_prefill_replicas=system.num_prefill,
                               num_decode_replicas=system.num_decode, kv_link=setup.kv_link)
                   if system.disaggregated else
                   ClusterSpec(num_replicas=system.num_gpus, router="least_outstanding"))
        return RunSpec(workload=workload, engine=SimEngineSpec(model=self.model, hardware="a100",
                                                               step_padding=PAPER_STEP_PADDING),
                       limits=LimitsSpec(max_num_seqs=setup.max_num_seqs, max_num_tokens=8192),
                       cluster=cluster, seed=setup.seed)


def trace_rate(path: str, num_requests: int) -> float:
    """The mean request rate of a trace's first `num_requests` arrivals (req/s)."""
    from orca_jax.workloads.traces import load_trace

    arrivals = [r.arrival_s for r in load_trace(path, max_requests=num_requests)]
    return (len(arrivals) - 1) / (max(arrivals) - min(arrivals))


@dataclasses.dataclass(frozen=True, kw_only=True)
class DistServeSetup:
    """The experiment (defaults: the documented figure and table; about 2 minutes)."""

    num_requests: int = 150
    rates: tuple[float, ...] = (1.0, 2.0, 3.0, 4.0, 6.0, 8.0)  # per GPU
    model: str = "llama3-8b"
    tpot_slos_s: tuple[float, float] = (0.015, 0.05)  # (tight, loose)
    systems: tuple[System, ...] = SYSTEMS
    max_num_seqs: int = 128
    kv_link: str = "nvlink"
    seed: int = 0
    trace: Optional[str] = None  # None: AZURE_CONV in the traces folder (`trace_files`)
    slo_scale_rates: tuple[float, ...] = (1.0, 2.0, 4.0)  # per GPU; () runs no SLO-scale sweep

    def workloads(self) -> tuple[Workload, ...]:
        return (Workload(name="synthetic", model=self.model, ttft_slo_s=1.0,
                         tpot_slos_s=self.tpot_slos_s, prompt_len="lognormal:1500:0.5",
                         output_len="lognormal:150:0.5"),
                Workload(name="azure", model=self.model, ttft_slo_s=1.0,
                         tpot_slos_s=self.tpot_slos_s,
                         trace=trace_path(AZURE_CONV, self.trace)))


def run(setup: DistServeSetup, out_dir: Optional[str] = None) -> tuple[list[dict], list[dict]]:
    """Every system at every rate on both workloads; each rate's goodput under both SLOs.

    A system's rates stop after the first at which fewer than 30% of the requests
    meet the loose SLO (it is far past its capacity).

    Returns:
      The points (one row per workload, system, rate and TPOT SLO) and the
      capacities (one row per workload, TPOT SLO and system).
    """
    points = []
    for workload in setup.workloads():
        for system in setup.systems:
            for rate in setup.rates:
                spec = workload.spec(setup, system, rate)
                _, result = run_policy(spec, system.policy, POLICY_OPTIONS[system.policy],
                                       progress=False)
                loose_attainment = 1.0
                for slo_name, tpot_slo in zip(("tight", "loose"), workload.tpot_slos_s):
                    summary = summarize(result, ttft_slo_s=workload.ttft_slo_s,
                                        tpot_slo_s=tpot_slo, num_gpus=num_gpus(spec))
                    points.append({
                        "workload": workload.name, "tpot_slo": slo_name,
                        "tpot_slo_s": tpot_slo, "system": system.label,
                        "num_gpus": system.num_gpus, "rate_per_gpu": rate,
                        "goodput_per_gpu": summary["goodput_req_s_per_gpu"] or 0.0,
                        "attainment": summary["slo_attainment"],
                        "ttft_p90_s": summary.get("ttft_p90_s"),
                        "tpot_p90_s": summary.get("tpot_p90_s"),
                        "num_rejected": summary["num_rejected"]})
                    loose_attainment = summary["slo_attainment"]
                if loose_attainment < 0.3:
                    break
    capacity = capacities(points, setup)
    if out_dir is not None:
        os.makedirs(out_dir, exist_ok=True)
        write_json_atomic(os.path.join(out_dir, "points.json"),
                          to_json_value({"setup": dataclasses.asdict(setup), "points": points,
                                         "capacity": capacity}), sort_keys=False)
    return points, capacity


def capacity_at(rates: Sequence[float], attainment: Sequence[float],
                target: float = ATTAINMENT_TARGET) -> Optional[float]:
    """The rate at which the attainment curve first falls below `target` (linear between
    rates); None if the first rate is already below it, the last rate if it never falls."""
    for i, value in enumerate(attainment):
        if value < target:
            if i == 0:
                return None
            fraction = (attainment[i - 1] - target) / (attainment[i - 1] - value)
            return rates[i - 1] + fraction * (rates[i] - rates[i - 1])
    return rates[-1] if rates else None


def capacities(points: Sequence[dict], setup: DistServeSetup) -> list[dict]:
    """Per workload, TPOT SLO and system: its capacity per GPU, and over colocated vllm's
    at the same GPU count."""
    rows = []
    for workload in setup.workloads():
        for slo in ("tight", "loose"):
            found = {}
            for system in setup.systems:
                curve = [p for p in points if (p["workload"], p["tpot_slo"], p["system"])
                         == (workload.name, slo, system.label)]
                found[system] = capacity_at([p["rate_per_gpu"] for p in curve],
                                            [p["attainment"] for p in curve])
            for system, value in found.items():
                baseline = found[next(s for s in setup.systems
                                      if s.num_gpus == system.num_gpus and s.policy == "vllm"
                                      and not s.disaggregated)]
                rows.append({"workload": workload.name, "tpot_slo": slo,
                             "system": system.label, "num_gpus": system.num_gpus,
                             "capacity_per_gpu": value,
                             # never below the target: the capacity is past the swept range
                             "past_range": value is not None and value >= setup.rates[-1],
                             "over_vllm": (value / baseline if value is not None and baseline
                                           else None)})
    return rows


def run_slo_scale(setup: DistServeSetup, out_dir: Optional[str] = None
                  ) -> tuple[list[dict], list[dict]]:
    """Every system once at each of `setup.slo_scale_rates`, read under scaled SLOs.

    Returns:
      The rows (one per workload, base SLO pair, rate and system: its tightest
      scale at 90% attainment, how many times tighter than colocated vllm's on as
      many GPUs, and its attainment at each of `slo_scale.SCALES`) and the curves
      for `slo_scale.plot` (each with its `[N]` needed scales).
    """
    rows, curves = [], []
    for workload in setup.workloads():
        for rate in setup.slo_scale_rates:
            results = {}
            for system in setup.systems:
                spec = workload.spec(setup, system, rate)
                _, results[system] = run_policy(spec, system.policy,
                                                POLICY_OPTIONS[system.policy], progress=False)
            for base, tpot_slo in zip(("tight", "loose"), workload.tpot_slos_s):
                need = {system: slo_scale.needed_scales(result, workload.ttft_slo_s, tpot_slo)
                        for system, result in results.items()}
                tightest = {system: slo_scale.tightest_scale(values, ATTAINMENT_TARGET)
                            for system, values in need.items()}
                for system in setup.systems:
                    baseline = next(s for s in setup.systems if s.num_gpus == system.num_gpus
                                    and s.policy == "vllm" and not s.disaggregated)
                    rows.append({
                        "workload": workload.name, "base_slo": base,
                        "ttft_slo_s": workload.ttft_slo_s, "tpot_slo_s": tpot_slo,
                        "rate_per_gpu": rate, "system": system.label,
                        "num_gpus": system.num_gpus, "tightest_scale": tightest[system],
                        "tighter_than_vllm": slo_scale.ratio(tightest[baseline],
                                                             tightest[system]),
                        "attainment": {f"{s:g}": slo_scale.attainment(need[system], s)
                                       for s in slo_scale.SCALES}})
                    curves.append({
                        "base_slo": base, "workload": workload.name,
                        "num_gpus": system.num_gpus, "rate_per_gpu": rate,
                        "panel": (f"{workload.name}, {system.num_gpus} GPUs, {rate:g} req/s per "
                                  f"GPU: scale x (TTFT {workload.ttft_slo_s:g} s, TPOT "
                                  f"{tpot_slo * 1e3:g} ms)"),
                        "label": system.label, "disaggregated": system.disaggregated,
                        "need": need[system]})
    if out_dir is not None:
        os.makedirs(out_dir, exist_ok=True)
        write_json_atomic(os.path.join(out_dir, "slo_scale.json"),
                          to_json_value({"scales": slo_scale.SCALES, "rows": rows}),
                          sort_keys=False)
    return rows, curves


def slo_scale_summary(rows: Sequence[dict]) -> list[dict]:
    """Per workload, base SLOs, rate and GPU count: colocated vllm's tightest scale, the
    best disaggregated split's, and how many times tighter it is (the paper's 12.6x)."""
    out = []
    groups = dict.fromkeys((r["workload"], r["base_slo"], r["rate_per_gpu"], r["num_gpus"])
                           for r in rows)
    for key in groups:
        mine = [r for r in rows
                if (r["workload"], r["base_slo"], r["rate_per_gpu"], r["num_gpus"]) == key]
        vllm = next(r for r in mine if r["system"].startswith("vllm"))
        split = [r for r in mine if r["system"].startswith("disagg")
                 and r["tightest_scale"] is not None]
        best = min(split, key=lambda r: r["tightest_scale"]) if split else None
        out.append({"workload": key[0], "base_slo": key[1], "rate_per_gpu": key[2],
                    "num_gpus": key[3], "vllm_tightest": vllm["tightest_scale"],
                    "best_disagg": best["system"] if best else None,
                    "disagg_tightest": best["tightest_scale"] if best else None,
                    "tighter": best["tighter_than_vllm"] if best else None})
    return out


def goodput_rows(points: Sequence[dict], setup: DistServeSetup) -> list[dict]:
    """One row per workload, TPOT SLO and system: its goodput per GPU at each rate."""
    rows = []
    for workload in setup.workloads():
        for slo in ("tight", "loose"):
            for system in setup.systems:
                row: dict = {"workload": workload.name, "tpot_slo": slo, "system": system.label}
                for p in points:
                    if (p["workload"], p["tpot_slo"], p["system"]) == (workload.name, slo,
                                                                       system.label):
                        row[f"{p['rate_per_gpu']:g}"] = p["goodput_per_gpu"]
                rows.append(row)
    return rows


def plot(points: Sequence[dict], setup: DistServeSetup, path: str) -> bool:
    """Goodput per GPU against rate per GPU: a row per workload and SLO, a column per GPU
    count. Returns False without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    workloads = setup.workloads()
    gpu_counts = sorted({s.num_gpus for s in setup.systems})
    panels = [(w, slo) for w in workloads for slo in ("tight", "loose")]
    fig, axes = plt.subplots(len(panels), len(gpu_counts), squeeze=False,
                             figsize=(4.6 * len(gpu_counts), 2.7 * len(panels)))
    for row, (workload, slo) in enumerate(panels):
        tpot = dict(zip(("tight", "loose"), workload.tpot_slos_s))[slo]
        for col, gpus in enumerate(gpu_counts):
            ax = axes[row][col]
            for system in (s for s in setup.systems if s.num_gpus == gpus):
                curve = [p for p in points if (p["workload"], p["tpot_slo"], p["system"])
                         == (workload.name, slo, system.label)]
                ax.plot([p["rate_per_gpu"] for p in curve],
                        [p["goodput_per_gpu"] for p in curve], marker="o",
                        linestyle="--" if system.disaggregated else "-", label=system.label)
            ax.set_title(f"{workload.name} ({workload.model}), {gpus} GPUs: TTFT <= "
                         f"{workload.ttft_slo_s:g} s, TPOT <= {tpot:g} s", fontsize=9)
            ax.set_xlabel("offered rate per GPU (req/s)")
            ax.set_ylabel("goodput per GPU (req/s)")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return True


def tpot_rows(points: Sequence[dict], setup: DistServeSetup) -> list[dict]:
    """One row per workload and system: its TPOT p90 (ms) at each rate (SLO-independent)."""
    rows = []
    for workload in setup.workloads():
        for system in setup.systems:
            row: dict = {"workload": workload.name, "system": system.label}
            for p in points:
                if (p["workload"], p["tpot_slo"], p["system"]) == (workload.name, "tight",
                                                                   system.label):
                    value = p["tpot_p90_s"]
                    row[f"{p['rate_per_gpu']:g}"] = None if value is None else value * 1e3
            rows.append(row)
    return rows


def define_flags() -> None:
    """The command's flags (defined only when it runs, so importing it defines none)."""
    for name, default, text in (
            ("out_dir", "runs/reproduce/distserve", "where points.json goes"),
            ("figure", None, f"the PNG to write (default: OUT_DIR/{FIGURE}; the docs show "
                             f"docs/figures/{FIGURE})"),
            ("slo_scale_figure", None,
             f"the SLO-scale PNG to write (default: OUT_DIR/{SLO_SCALE_FIGURE}; the docs "
             f"show docs/figures/{SLO_SCALE_FIGURE})"),
            ("trace", None, flag_help("the Azure conversation trace (read in place)",
                                      AZURE_CONV))):
        if name not in flags.FLAGS:
            flags.DEFINE_string(name, default, text)
    if "num_requests" not in flags.FLAGS:
        flags.DEFINE_integer("num_requests", DistServeSetup.num_requests, "requests per point")
    if "rates" not in flags.FLAGS:
        flags.DEFINE_list("rates", [f"{r:g}" for r in DistServeSetup.rates],
                          "request rates per GPU (req/s)")
    if "slo_scale_rates" not in flags.FLAGS:
        flags.DEFINE_list("slo_scale_rates", [f"{r:g}" for r in DistServeSetup.slo_scale_rates],
                          "rates per GPU (req/s) at which to sweep the SLO scale (empty: "
                          "no SLO-scale sweep)")


def _rates(name: str, given: Sequence[str], *, allow_empty: bool) -> tuple[float, ...]:
    """The rates of flag `name`, or a UsageError naming the flag and its value."""
    try:
        rates = tuple(float(r) for r in given)
    except ValueError:
        raise app.UsageError(f"--{name}={','.join(given)}: expected numbers") from None
    if (not rates and not allow_empty) or any(not r > 0 or not math.isfinite(r)
                                              for r in rates):
        raise app.UsageError(f"--{name}={','.join(given)}: every rate must be > 0")
    return rates


@clean_errors()
def main(argv: Sequence[str]) -> None:
    """The command: run the grid, print the capacity table, draw the figure; then the
    SLO-scale sweep, its table and its figure."""
    del argv
    values = flags.FLAGS
    rates = _rates("rates", values.rates, allow_empty=False)
    scale_rates = _rates("slo_scale_rates", values.slo_scale_rates, allow_empty=True)
    setup = DistServeSetup(num_requests=values.num_requests, rates=rates,
                           trace=trace_path(AZURE_CONV, values.trace),  # before any run
                           slo_scale_rates=scale_rates)
    out_dir = values.out_dir or "runs/reproduce/distserve"
    start = time.perf_counter()
    points, capacity = run(setup, out_dir)
    table = format_table(capacity, ["workload", "tpot_slo", "system", "num_gpus",
                                    "capacity_per_gpu", "past_range", "over_vllm"])
    with open(os.path.join(out_dir, "capacity.txt"), "w") as f:
        f.write(table + "\n")
    print("goodput per GPU (req/s) at each offered rate per GPU (req/s); '-': not run, "
          "past the system's capacity:")
    print(format_table(goodput_rows(points, setup), ["workload", "tpot_slo", "system",
                                                     *(f"{r:g}" for r in setup.rates)]))
    print("\nTPOT p90 (ms) at each offered rate per GPU (req/s):")
    print(format_table(tpot_rows(points, setup), ["workload", "system",
                                                  *(f"{r:g}" for r in setup.rates)]))
    print(f"\ncapacity: the rate per GPU (req/s) at which {ATTAINMENT_TARGET:.0%} of the requests "
          "meet both SLOs, and its ratio to colocated vllm on as many GPUs:")
    print(table)
    figure = figure_path(values.figure, out_dir, FIGURE)
    if plot(points, setup, figure):
        print(f"figure: {figure}")
    if setup.slo_scale_rates:
        print_slo_scale(setup, out_dir, values.slo_scale_figure)
    print("\nthe papers: " + "; ".join(PAPER_CLAIMS))
    print(f"points: {out_dir}/points.json ({time.perf_counter() - start:.0f} s)")


def print_slo_scale(setup: DistServeSetup, out_dir: str, figure: Optional[str]) -> None:
    """Runs the SLO-scale sweep, prints its tables (paper beside ours), draws its figure."""
    rows, curves = run_slo_scale(setup, out_dir)
    shown = ("0.25", "0.5", "1", "2", "4", "8")
    print(f"\nSLO scale: both SLOs x scale at a fixed rate per GPU; attainment at some scales, "
          f"the tightest scale at which {ATTAINMENT_TARGET:.0%} of the requests meet both "
          "(exact, from each request's needed scale) and how many times tighter than "
          "colocated vllm's on as many GPUs:")
    print(format_table([{**{k: v for k, v in r.items() if k != "attainment"},
                         **{f"@{s}": r["attainment"][s] for s in shown}} for r in rows],
                       ["workload", "base_slo", "tpot_slo_s", "rate_per_gpu", "system",
                        *(f"@{s}" for s in shown), "tightest_scale", "tighter_than_vllm"]))
    summary = slo_scale_summary(rows)
    print("\nSLO scale, paper beside ours: DistServe reports up to 12.6x tighter SLOs than "
          "colocated vLLM at 90% attainment; ours, the best disaggregated split over colocated "
          "vllm on as many GPUs:")
    print(format_table(summary, ["workload", "base_slo", "rate_per_gpu", "num_gpus",
                                 "vllm_tightest", "best_disagg", "disagg_tightest", "tighter"]))
    path = figure_path(figure, out_dir, SLO_SCALE_FIGURE)
    rates = ", ".join(f"{r:g}" for r in setup.slo_scale_rates)
    model = setup.workloads()[0].model
    # The figure shows the tight base only (the loose one is in the tables): a row per
    # workload and GPU count, a column per rate.
    names = [w.name for w in setup.workloads()]
    tight = sorted((c for c in curves if c["base_slo"] == "tight"),
                   key=lambda c: (names.index(c["workload"]), c["num_gpus"], c["rate_per_gpu"]))
    if slo_scale.plot(tight, path, cols=len(setup.slo_scale_rates),
                      title=f"DistServe SLO scale: attainment as both SLOs (TTFT 1 s, TPOT 15 ms "
                            f"at scale 1) tighten, {model} on simulated A100s, at {rates} req/s "
                            f"per GPU",
                      caption=f"engine sim (per-op cost model, priced ragged); "
                              f"{setup.num_requests} requests per run; seed {setup.seed}; "
                              f"dotted line: {ATTAINMENT_TARGET:.0%}; dashed: disaggregated"):
        print(f"figure: {path}")


if __name__ == "__main__":
    define_flags()
    run_command(main)
