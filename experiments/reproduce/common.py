"""What the paper reproductions share: a resumable policy x rate grid and reading it.

`run_grid` runs every policy at every rate (and seed) on the simulator through
the sweep runner (`orca_jax.runner.sweep`), so a killed reproduction resumes;
`throughput_at_bound` reads the highest throughput a curve reaches under a
latency bound, which is how the papers compare systems at equal latency.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np
from absl import app, flags

import policies  # noqa: F401  (registers the built-in policies)
from experiments.cli_errors import clean_errors, run_command
from experiments.executor_flags import define_executor_flags
from orca_jax.core.json_files import to_json_value, write_json_atomic
from orca_jax.core.requests.run_result import RunResult
from orca_jax.results import metrics
from orca_jax.results.metrics import format_table
from orca_jax.results.plots import plot_sweep
from orca_jax.results.sweep_store import Curve, PointKey, point_key
from orca_jax.runner.spec import RunSpec
from orca_jax.runner.sweep import PolicyRun, SweepError, SweepExecutor, run_sweep

# The papers' engines run ragged token stacks (Orca's selective batching, vLLM's and
# Sarathi-Serve's varlen prefill kernels, DistServe's), so the reproductions price a step
# by its real tokens, as those engines pay, not by the bucket this project's compiled
# steps pad to (the simulator's default since 0.2, `SimEngineSpec.step_padding`).
PAPER_STEP_PADDING = "ragged"


def request_percentiles(result: RunResult) -> dict[str, Optional[float]]:
    """Medians the run summary lacks: normalized latency (Orca's metric) and queueing delay."""
    per_request = metrics.request_metrics(result.arrival_s, result.first_scheduled_s,
                                          result.first_token_s, result.finish_s,
                                          result.output_len, result.token_req,
                                          result.token_time_s, token_stats=result.token_stats)
    finished = np.isfinite(result.finish_s)
    out: dict[str, Optional[float]] = {}
    for name, field in (("normalized_latency_p50_s", "normalized_latency_s"),
                        ("queueing_delay_p50_s", "queueing_delay_s")):
        values = per_request[field][finished]
        out[name] = float(np.median(values)) if values.size else None
    return out


def run_grid(spec: RunSpec, runs: Sequence[PolicyRun], rates: Sequence[float],
             seeds: Sequence[int], out_dir: str, *,
             saturated: Optional[Callable[[float, Mapping[str, Any]], bool]] = None,
             executor: Optional[SweepExecutor] = None,
             variants: Optional[Mapping[str, RunSpec]] = None,
             extra_metrics: Optional[Callable[[RunResult], Mapping[str, Any]]] = None
             ) -> tuple[list[dict[str, Any]], list[PointKey]]:
    """Runs every policy over ascending rates and seeds, into a resumable `SweepStore`.

    The reproductions' use of `orca_jax.runner.sweep.run_sweep`: each (rate, seed)'s
    workload is built from its own spec (as the published numbers were made), each
    policy's rates stop after the first at which every seed is `saturated`, and each
    summary gets the medians of `request_percentiles`.
    Points already in `out_dir/points.jsonl` are not run again.

    Args:
      spec: the workload and engine plumbing (its rate and seed are replaced per point).
      runs: the curves to draw.
      rates: request rates (req/s).
      seeds: workload seeds.
      out_dir: the store's folder.
      saturated: whether a point (its rate, its summary) is past the policy's capacity
        (default `falls_behind`).
      executor: where the points run (`orca_jax.runner.sweep.SweepExecutor`; default
        serially in this process, `SweepExecutor("ray")` as Ray tasks).
      variants: label -> spec of setups (KV tiers, pool sizes) to run every policy under,
        on `spec`'s workload (`run_sweep`'s); None: `spec` alone.
      extra_metrics: more summary fields from a finished run, beside `request_percentiles`'.

    Returns:
      The store's points and the keys that were run or found (the grid to aggregate).

    Raises:
      SweepError: a point raised (it is stored failed, with its error; the others ran).
    """
    def metrics_of(result: RunResult) -> dict[str, Any]:
        return {**request_percentiles(result), **(extra_metrics(result) if extra_metrics
                                                  else {})}

    store, keys = run_sweep(spec, runs, rates, seeds, out_dir, build_per_point=True,
                            saturated=saturated or falls_behind,
                            extra_metrics=metrics_of if extra_metrics else request_percentiles,
                            executor=executor, variants=variants)
    points = store.load()
    wanted = set(keys)
    failed = [p for p in points if p.get("error") and point_key(p) in wanted]
    if failed:  # the tables need every point; the finished ones stay in the store
        first = failed[0]
        raise SweepError(f"{out_dir}: {len(failed)} of {len(keys)} points failed (first: "
                         f"{first['policy']} rate={first['rate']:g} seed={first['seed']}: "
                         f"{first['error']}); a rerun runs them again")
    return points, keys


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
    """The curves without their points above `max_y` (so a plot keeps a readable y range;
    each keeps its policy and variant, so its legend entry)."""
    out = []
    for c in curves:
        keep = c.y_mean <= max_y
        out.append(dataclasses.replace(c, rates=c.rates[keep], x_mean=c.x_mean[keep],
                                       y_mean=c.y_mean[keep], y_low=c.y_low[keep],
                                       y_high=c.y_high[keep], num_seeds=c.num_seeds[keep]))
    return out


def write_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str], out_dir: str,
                name: str, extra: Optional[Mapping[str, Any]] = None) -> str:
    """Prints nothing; writes `name.txt` (aligned text) and `name.json` (rows + extra)."""
    table = format_table(list(rows), list(columns))
    with open(os.path.join(out_dir, f"{name}.txt"), "w") as f:
        f.write(table + "\n")
    write_json_atomic(os.path.join(out_dir, f"{name}.json"),
                      to_json_value({"rows": list(rows), **(extra or {})}), sort_keys=False)
    return table


def figure_path(figure: Optional[str], out_dir: str, file_name: str) -> str:
    """Where a reproduction draws its figure: `--figure` where given, else `file_name`
    under `--out_dir` (never into the tracked docs/figures/ unless asked to)."""
    return figure or os.path.join(out_dir, file_name)


def write_figure_and_report(curves: Sequence[Curve], args: flags.FlagValues, *,
                            figure_name: str, max_y: float, x_field: str, y_field: str,
                            title: str, tables: Sequence[str], start: float,
                            per_point: Optional[str] = None,
                            x_label: Optional[str] = None) -> None:
    """Draws the curves (clipped at `max_y`) to `--figure` (default: `figure_name` under
    `--out_dir`), then says where the figure and the `tables` went and how long the
    reproduction took since `start`. `per_point`: what one point runs and its rate's unit
    (default: `--num_requests` requests, req/s); `x_label`: the x axis's, where the swept
    rate is not requests/s."""
    path = figure_path(args.figure, args.out_dir, figure_name)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    # The title names model and hardware; the caption what each point is.
    rates = ', '.join(f'{r:g}' for r in args.rates)
    caption = (f"engine sim; {args.num_requests} requests per point; rates {rates} req/s; "
               "one seed" if per_point is None else
               f"engine sim; {per_point.format(rates=rates)}; one seed")
    if plot_sweep(clipped(curves, max_y), path, x_field=x_field, y_field=y_field,
                  title=title, caption=caption, x_label=x_label):
        print(f"figure: {path}")
    print(f"tables: {', '.join(f'{args.out_dir}/{name}.txt' for name in tables)} "
          f"({time.perf_counter() - start:.0f} s)")


class RatesParser(flags.ArgumentParser):
    """`0.5,1,2` -> (0.5, 1.0, 2.0), every rate > 0 (a tuple default is taken as it is)."""

    syntactic_help = "comma-separated request rates > 0 (req/s)"

    def parse(self, argument: Any) -> tuple[float, ...]:
        return parse_rates(argument if isinstance(argument, str)
                           else ",".join(str(r) for r in argument))

    def flag_type(self) -> str:
        return "list of floats"


def reproduction_flags(name: str, figure: str, setup_defaults: Any) -> flags.FlagValues:
    """The flags every reproduction takes: --out_dir, --figure, --num_requests, --rates,
    and where the grid's points run (the sweep's --executor, --ray_address, --ray_num_cpus;
    `experiments.executor_flags.executor_from_flags` reads them).

    Each reproduction holds its flags in a `FlagValues` of its own, not absl's global
    one: they reuse the names of the run flags (`--out_dir`, `--num_requests`,
    `--workload`, `--trace`) with other defaults and meanings, and a process (the
    tests) may import them all. `run_app` makes one an absl app; `parse_flags` parses
    a command line into it.

    Args:
      name: the reproduction's name (its default output folder).
      figure: the file name of its PNG: under --out_dir unless --figure names a path
        (docs/figures/ holds the one the docs show, of the default flags).
      setup_defaults: its setup class, whose `num_requests` and `rates` are the defaults.
    """
    flag_values = flags.FlagValues()
    flags.DEFINE_string("out_dir", f"runs/reproduce/{name}", "points.jsonl (resumable) and "
                        "the tables", flag_values=flag_values)
    flags.DEFINE_string("figure", None, f"the PNG to write (default: OUT_DIR/{figure}; the "
                        f"docs show docs/figures/{figure})", flag_values=flag_values)
    flags.DEFINE_integer("num_requests", setup_defaults.num_requests, "requests per point",
                         lower_bound=1, flag_values=flag_values)
    flags.DEFINE(RatesParser(), "rates", setup_defaults.rates, "the request rates to sweep",
                 flag_values=flag_values, serializer=flags.ListSerializer(","))
    define_executor_flags(flag_values)
    return flag_values


def parse_flags(flag_values: flags.FlagValues,
                argv: Optional[Sequence[str]] = None) -> flags.FlagValues:
    """Parses a reproduction's command line (without the program name; None: `sys.argv`'s)
    into its flags, from their defaults; returns them.

    Raises:
      app.UsageError: a flag is unknown or its value bad (one line naming it).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if flag_values.is_parsed():  # parse again from the defaults (absl logs a line for it)
        flag_values.unparse_flags()
    try:
        rest = flag_values([sys.argv[0], *argv])
    except flags.Error as e:
        raise app.UsageError(str(e)) from None
    if len(rest) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(rest[1:])}")
    return flag_values


def run_app(main: Callable[[Sequence[str]], None], flag_values: flags.FlagValues,
            doc: str) -> None:
    """Runs a reproduction's `main(argv)` (argv without the program name) as an absl app;
    `--help` lists the reproduction's own flags.

    `main` runs under `clean_errors`, so a bad flag that `parse_flags` refuses (an
    `app.UsageError`) is one line naming the flag and its value, exit status 2, not
    absl's usage text and exit status 1."""

    def parse(argv: list[str]) -> list[str]:
        if any(arg in ("-h", "-?", "--help", "--helpshort", "--helpfull") for arg in argv[1:]):
            print(f"{doc.strip().splitlines()[0]}\n\nflags:\n"
                  f"{flag_values.get_help(include_special_flags=False)}")
            sys.exit(0)
        flags.FLAGS(argv[:1])  # absl's own flags keep their defaults
        return argv

    @clean_errors()
    def run(argv: list[str]) -> None:
        main(argv[1:])

    run_command(run, flags_parser=parse)


def parse_rates(text: str) -> tuple[float, ...]:
    """`0.5,1,2` -> (0.5, 1.0, 2.0); every rate > 0.

    Raises:
      ValueError: a rate is not a number, or not > 0.
    """
    try:
        rates = tuple(float(r) for r in text.split(","))
    except ValueError:
        raise ValueError("expected comma-separated numbers") from None
    if not rates or any(not r > 0 for r in rates):
        raise ValueError("every rate must be > 0")
    return rates


if __name__ == "__main__":  # a helper module: `--help` says so, not nothing
    from experiments.cli_errors import not_a_command
    not_a_command("experiments.reproduce.common",
                  "what the reproductions share",
                  'python -m experiments.reproduce.orca --help (or another: docs/reproductions.md)')
