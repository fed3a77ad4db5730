"""Sweeps policies x request rates x seeds: `python -m experiments.sweep`.

    python -m experiments.sweep --policies=static,orca --rates=2,4,8,16 --seeds=0,1,2 \
        --out_dir=runs/sweep --metric=normalized_latency --throughput=req

Every point runs on the same workload for its seed (a seed fixes the lengths;
a rate only compresses the arrivals), with the shared run flags (`--rate` and
`--seed` are replaced by `--rates` and `--seeds`). Each finished point is
appended to `points.jsonl` in --out_dir (see `orca_jax.results.sweep_store`), so a
killed sweep rerun with the same command runs only the missing points; a
rerun with another workload into the same folder is refused. Then sweep.png:
the chosen latency metric against throughput, one curve per policy, mean over
seeds with a band over seeds.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import sys
import time
from typing import Any, Optional, Sequence

from absl import app, flags

from experiments import flags as run_flags
from experiments.policy_flags import options_by_policy, policy_label
from orca_jax.core.engine_api import Engine
from orca_jax.runner.experiment import (RunSpec, build_engine, build_workload, run_policy,
                                 scheduler_config)
from orca_jax.results.metrics import format_table
from orca_jax.results.plots import METRIC_LABELS, plot_sweep
from orca_jax.core.request import Request
from orca_jax.results.sweep_store import PointKey, SweepConfigError, SweepStore, aggregate, grid

METRICS = {"normalized_latency": "normalized_latency_mean_s", "ttft_p99": "ttft_p99_s",
           "tpot_p99": "tpot_p99_s"}
THROUGHPUTS = {"req": "throughput_req_s", "tok": "throughput_tok_s"}
# Test-only: the process dies (os._exit) right after this many points, as a kill would.
EXIT_AFTER_ENV = "ORCA_JAX_SWEEP_EXIT_AFTER"

flags.DEFINE_list("rates", ["2", "4", "8", "16"], "Request rates to sweep (requests/s).")
flags.DEFINE_list("seeds", ["0"], "Workload seeds to sweep (the band is over these).")
flags.DEFINE_enum("metric", "normalized_latency", list(METRICS), "Latency metric of the figure.")
flags.DEFINE_enum("throughput", "req", list(THROUGHPUTS), "Throughput axis: requests/s or "
                  "output tokens/s.")
flags.DEFINE_enum("band", "minmax", ["minmax", "std"], "Band over seeds: min-max or mean ± std.")
flags.DEFINE_bool("point_runs", False, "Also write each point's run folder (requests.jsonl, "
                  "steps.jsonl, ...) under --out_dir/points/.")
flags.FLAGS.set_default("out_dir", "runs/sweep")

FLAGS = flags.FLAGS


def _parse_list(name: str, values: Sequence[str], kind: type) -> list:
    try:
        parsed = [kind(v) for v in values]
    except ValueError:
        raise app.UsageError(f"--{name}={','.join(values)}: expected {kind.__name__}s") from None
    if not parsed:
        raise app.UsageError(f"--{name} is empty")
    if len(set(parsed)) != len(parsed):
        raise app.UsageError(f"--{name}={','.join(values)}: repeated values")
    if kind is float and any(not v > 0 for v in parsed):
        raise app.UsageError(f"--{name}={','.join(values)}: rates must be > 0")
    if kind is int and any(v < 0 for v in parsed):
        raise app.UsageError(f"--{name}={','.join(values)}: seeds must be >= 0")
    return parsed


def run_config(spec: RunSpec) -> dict[str, Any]:
    """The sweep's fingerprint of the workload and plumbing: the spec minus rate and seed."""
    config = {k: v for k, v in dataclasses.asdict(spec).items() if k not in ("rate", "seed")}
    if spec.trace:
        with open(spec.trace, "rb") as f:
            config["trace_sha256"] = hashlib.sha256(f.read()).hexdigest()
    return config


def workload_at(spec: RunSpec, base: list[Request], rate: float) -> list[Request]:
    """The seed's workload at `rate`: same requests, arrivals rescaled.

    Synthetic arrivals are drawn as unit gaps divided by the rate, so building
    at rate 1 and dividing by `rate` is the workload built at `rate`. A trace
    keeps its arrival pattern, rescaled so its mean rate is `rate`.
    """
    if spec.workload == "trace":
        span = max(r.arrival_s for r in base) - min(r.arrival_s for r in base)
        if span <= 0 or len(base) < 2:
            raise app.UsageError(f"--trace={spec.trace}: all arrivals at one time; a rate "
                                 "sweep needs arrivals spread in time")
        scale = (len(base) - 1) / span / rate
    else:
        scale = 1.0 / rate
    return [dataclasses.replace(r, arrival_s=r.arrival_s * scale) for r in base]


class _Progress:
    """`sweep: [###...] done/total points, elapsed` on one stderr line."""

    def __init__(self, total: int, done: int) -> None:
        self.total, self.done, self.skipped = total, done, done
        self.start = time.perf_counter()

    def show(self, current: Optional[PointKey] = None) -> None:
        width = 30
        filled = width * self.done // max(self.total, 1)
        now = (f" running {current.policy} rate={current.rate:g} seed={current.seed}"
               if current else "")
        line = (f"sweep: [{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} "
                f"points ({self.skipped} resumed), {time.perf_counter() - self.start:.0f}s{now}")
        if sys.stderr.isatty():  # redraw in place; a log file gets one line per update
            sys.stderr.write(f"\r{line}\033[K" + ("\n" if current is None else ""))
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()


def run_sweep(spec: RunSpec, policy_specs: Sequence[str], options: dict[str, dict[str, str]],
              rates: Sequence[float], seeds: Sequence[int], out_dir: str, *,
              point_runs: bool = False) -> tuple[SweepStore, list[PointKey]]:
    """Runs the missing points of the grid into `out_dir`; returns the store and the grid."""
    labels = [policy_label(p) for p in policy_specs]
    if len(set(labels)) != len(labels):
        raise app.UsageError(f"--policies={','.join(policy_specs)}: two policies share the "
                             f"label {labels}; the sweep keys its points by label")
    store = SweepStore(out_dir, run_config(spec),
                       {label: {"spec": p, "options": options.get(p, {})}
                        for label, p in zip(labels, policy_specs)},
                       run_defaults=dataclasses.asdict(RunSpec()))
    keys = grid(labels, rates, seeds)
    finished = store.finished_keys()
    spec_of = dict(zip(labels, policy_specs))
    progress = _Progress(len(keys), sum(k in finished for k in keys))
    exit_after = int(os.environ.get(EXIT_AFTER_ENV, "0"))
    num_ran = 0
    workloads: dict[int, list[Request]] = {}
    # One engine per seed (a real engine's random weights follow the seed), shared by its
    # points as compare shares one between policies: the same compiled steps for all.
    engines: dict[int, Engine] = {}
    for key in keys:
        if key in finished:
            continue
        progress.show(key)
        if key.seed not in workloads:
            workloads[key.seed] = build_workload(dataclasses.replace(spec, rate=1.0,
                                                                     seed=key.seed))
        point_spec = dataclasses.replace(spec, rate=key.rate, seed=key.seed)
        if key.seed not in engines:
            engines[key.seed] = build_engine(point_spec, scheduler_config(point_spec))
        run_dir = (os.path.join(out_dir, "points", key.policy,
                                f"rate_{key.rate:g}_seed_{key.seed}") if point_runs else None)
        start = time.perf_counter()
        summary, _ = run_policy(point_spec, spec_of[key.policy], options.get(spec_of[key.policy]),
                                out_dir=run_dir, progress=False, engine=engines[key.seed],
                                requests=workload_at(spec, workloads[key.seed], key.rate))
        extra = {"wall_s": time.perf_counter() - start}
        if run_dir:
            extra["run_dir"] = run_dir
        store.append(key, summary, extra)
        num_ran += 1
        progress.done += 1
        if exit_after and num_ran >= exit_after:
            sys.stderr.flush()
            os._exit(3)
    progress.show()
    return store, keys


@run_flags.clean_errors()
def main(argv: list[str]) -> None:
    del argv
    spec = run_flags.spec_from_flags()
    if spec.workload == "burst":
        raise app.UsageError("--workload=burst has every request at t=0: there is no rate to "
                             "sweep (use poisson, gamma or a trace)")
    names = list(FLAGS.policies)
    options = options_by_policy(FLAGS.policy_opts, names)
    rates = _parse_list("rates", FLAGS.rates, float)
    seeds = _parse_list("seeds", FLAGS.seeds, int)
    try:
        store, keys = run_sweep(spec, names, options, rates, seeds, FLAGS.out_dir,
                                point_runs=FLAGS.point_runs)
    except SweepConfigError as e:
        sys.exit(f"error: {e}")
    x_field, y_field = THROUGHPUTS[FLAGS.throughput], METRICS[FLAGS.metric]
    curves = aggregate(store.load(), keys, x_field, y_field, band=FLAGS.band)
    rows = [{"policy": c.policy, "rate": r, "num_seeds": int(n), x_field: x, y_field: y,
             f"{y_field}_low": lo, f"{y_field}_high": hi}
            for c in curves for r, n, x, y, lo, hi in
            zip(c.rates, c.num_seeds, c.x_mean, c.y_mean, c.y_low, c.y_high)]
    table = format_table(rows, list(rows[0]) if rows else ["policy"])
    print(table)
    with open(os.path.join(FLAGS.out_dir, "sweep.txt"), "w") as f:
        f.write(table + "\n")
    figure = os.path.join(FLAGS.out_dir, "sweep.png")
    band = "min–max over seeds" if FLAGS.band == "minmax" else "±1 std over seeds"
    if plot_sweep(curves, figure, x_field=x_field, y_field=y_field, band_label=band,
                  title=f"{METRIC_LABELS[y_field]} vs {METRIC_LABELS[x_field]} "
                        f"({len(seeds)} seed{'s' * (len(seeds) > 1)})"):
        print(f"figure: {figure}")
    else:
        print("matplotlib is not installed: no figure (the points are in points.jsonl)")
    print(f"points in {store.points_path}")


if __name__ == "__main__":
    app.run(main)
