"""What the paper reproductions share: a resumable policy x rate grid and reading it.

`run_grid` runs every policy at every rate (and seed) on the simulator through
the sweep store, so a killed reproduction resumes; `throughput_at_bound` reads
the highest throughput a curve reaches under a latency bound, which is how the
papers compare systems at equal latency.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np

import policies  # noqa: F401  (registers the built-in policies)
from orca_jax.results import metrics
from orca_jax.runner.experiment import (RunSpec, build_engine, build_workload, run_policy,
                                        scheduler_config)
from orca_jax.results.metrics import format_table
from orca_jax.results.plots import plot_sweep
from orca_jax.core.request import Request
from orca_jax.core.scheduler import Scheduler
from orca_jax.results.sweep_store import Curve, PointKey, SweepStore


@dataclasses.dataclass(frozen=True)
class PolicyRun:
    """One curve of a reproduction: a policy with its knobs, under a label."""

    label: str
    spec: str  # registered policy name
    options: Mapping[str, str] = dataclasses.field(default_factory=dict)


def request_percentiles(scheduler: Scheduler) -> dict[str, Optional[float]]:
    """Medians the run summary lacks: normalized latency (Orca's metric) and queueing delay."""
    table = scheduler.table
    token_req, token_time = scheduler.record.token_log()
    per_request = metrics.request_metrics(table.arrival_s, table.first_scheduled_s,
                                          table.first_token_s, table.finish_s, table.output_len,
                                          token_req, token_time)
    finished = np.isfinite(table.finish_s)
    out: dict[str, Optional[float]] = {}
    for name, field in (("normalized_latency_p50_s", "normalized_latency_s"),
                        ("queueing_delay_p50_s", "queueing_delay_s")):
        values = per_request[field][finished]
        out[name] = float(np.median(values)) if values.size else None
    return out


def run_grid(spec: RunSpec, runs: Sequence[PolicyRun], rates: Sequence[float],
             seeds: Sequence[int], out_dir: str, *,
             saturated: Optional[Callable[[float, Mapping[str, Any]], bool]] = None
             ) -> tuple[list[dict[str, Any]], list[PointKey]]:
    """Runs every policy over ascending rates and seeds, into a resumable `SweepStore`.

    Each policy's rates run in ascending order and stop after the first rate at
    which `saturated(rate, summary)` holds for every seed (default
    `falls_behind`): past saturation the queue only grows, and an overloaded run
    of a slow policy costs the most steps.
    Points already in `out_dir/points.jsonl` are not run again.

    Args:
      spec: the workload and engine plumbing (its rate and seed are replaced per point).
      runs: the curves to draw.
      rates: request rates (req/s).
      seeds: workload seeds.
      out_dir: the store's folder.
      saturated: whether a point (its rate, its summary) is past the policy's capacity.

    Returns:
      The store's points and the keys that were run or found (the grid to aggregate).
    """
    saturated = saturated or falls_behind
    store = SweepStore(out_dir, {k: v for k, v in dataclasses.asdict(spec).items()
                                 if k not in ("rate", "seed")},
                       {r.label: {"spec": r.spec, "options": dict(r.options)} for r in runs})
    by_key = {PointKey(p["policy"], float(p["rate"]), int(p["seed"])): p for p in store.load()}
    engine = build_engine(spec, scheduler_config(spec))  # stateless: shared by every point
    workloads: dict[tuple[float, int], list[Request]] = {}
    keys: list[PointKey] = []
    for run in runs:
        for rate in sorted(float(r) for r in rates):
            summaries = []
            for seed in seeds:
                key = PointKey(run.label, rate, int(seed))
                keys.append(key)
                if key not in by_key:
                    point_spec = dataclasses.replace(spec, rate=rate, seed=int(seed))
                    if (rate, seed) not in workloads:  # the seed fixes lengths, the rate arrivals
                        workloads[rate, seed] = build_workload(point_spec)
                    start = time.perf_counter()
                    summary, scheduler = run_policy(point_spec, run.spec, dict(run.options),
                                                    requests=workloads[rate, seed],
                                                    engine=engine, progress=False)
                    summary.update(request_percentiles(scheduler))
                    by_key[key] = store.append(key, summary,
                                               {"wall_s": time.perf_counter() - start})
                summaries.append(by_key[key]["summary"])
            if all(saturated(rate, s) for s in summaries):
                break
    return store.load(), keys


def falls_behind(rate: float, summary: Mapping[str, Any]) -> bool:
    """Whether a run served less than 80% of its offered rate (its queue kept growing)."""
    return not (summary.get("throughput_req_s") or 0.0) >= 0.8 * rate


def throughput_at_bound(curve: Curve, bound: float) -> Optional[float]:
    """Throughput at which a latency curve first rises past `bound` (linear between points).

    Returns None when the curve's first point is already above the bound, and the
    last point's throughput when it never rises past it (a lower bound of the
    true value: the sweep stopped first).
    """
    y, x = curve.y_mean, curve.x_mean  # [R] each, ascending rate
    if y.size == 0 or not y[0] <= bound:
        return None
    above = np.flatnonzero(~(y <= bound))
    if above.size == 0:
        return float(x[-1])
    i = int(above[0])
    fraction = (bound - y[i - 1]) / (y[i] - y[i - 1])
    return float(x[i - 1] + fraction * (x[i] - x[i - 1]))


def clipped(curves: Sequence[Curve], max_y: float) -> list[Curve]:
    """The curves without their points above `max_y` (so a plot keeps a readable y range)."""
    out = []
    for c in curves:
        keep = c.y_mean <= max_y
        out.append(Curve(policy=c.policy, rates=c.rates[keep], x_mean=c.x_mean[keep],
                         y_mean=c.y_mean[keep], y_low=c.y_low[keep], y_high=c.y_high[keep],
                         num_seeds=c.num_seeds[keep]))
    return out


def write_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str], out_dir: str,
                name: str, extra: Optional[Mapping[str, Any]] = None) -> str:
    """Prints nothing; writes `name.txt` (aligned text) and `name.json` (rows + extra)."""
    table = format_table(list(rows), list(columns))
    with open(os.path.join(out_dir, f"{name}.txt"), "w") as f:
        f.write(table + "\n")
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump({"rows": list(rows), **(extra or {})}, f, indent=2, default=_json_number)
        f.write("\n")
    return table


def write_figure_and_report(curves: Sequence[Curve], args: argparse.Namespace, *,
                            max_y: float, x_field: str, y_field: str, title: str,
                            tables: Sequence[str], start: float) -> None:
    """Draws the curves (clipped at `max_y`) to `--figure`, then says where the figure
    and the `tables` went and how long the reproduction took since `start`."""
    os.makedirs(os.path.dirname(args.figure) or ".", exist_ok=True)
    if plot_sweep(clipped(curves, max_y), args.figure, x_field=x_field, y_field=y_field,
                  title=title):
        print(f"figure: {args.figure}")
    print(f"tables: {', '.join(f'{args.out_dir}/{name}.txt' for name in tables)} "
          f"({time.perf_counter() - start:.0f} s)")


def _json_number(value: Any) -> Any:
    if isinstance(value, (np.integer, np.floating)):
        return value.item()
    raise TypeError(f"not JSON serializable: {value!r}")


def reproduction_parser(doc: str, name: str, figure: str,
                        setup_defaults: Any) -> argparse.ArgumentParser:
    """The flags every reproduction takes: --out_dir, --figure, --num_requests, --rates.

    Args:
      doc: the module docstring (its first line describes the command).
      name: the reproduction's name (its default output folder).
      figure: the PNG it writes by default.
      setup_defaults: its setup class, whose `num_requests` and `rates` are the defaults.
    """
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--out_dir", default=f"runs/reproduce/{name}",
                        help="points.jsonl (resumable) and the tables")
    parser.add_argument("--figure", default=figure, help="the PNG to write")
    parser.add_argument("--num_requests", type=int, default=setup_defaults.num_requests)
    parser.add_argument("--rates", type=parse_rates, default=setup_defaults.rates)
    return parser


def parse_rates(text: str) -> tuple[float, ...]:
    """`0.5,1,2` -> (0.5, 1.0, 2.0); every rate > 0."""
    try:
        rates = tuple(float(r) for r in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--rates={text}: expected comma-separated numbers")
    if not rates or any(not r > 0 for r in rates):
        raise argparse.ArgumentTypeError(f"--rates={text}: every rate must be > 0")
    return rates
