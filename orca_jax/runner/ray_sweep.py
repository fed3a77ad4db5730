"""A sweep's points as Ray tasks (`experiments.sweep --executor=ray`).

Each missing point is one Ray task that builds its own workload and engine
from the point's spec and returns a `PointOutcome`; the driver (this process)
alone appends finished points to the store, as they finish, so the store's
format, its resumption and its refusal of a changed workload are those of a
serial sweep. A point's result does not depend on where it ran: its workload
and engine follow from its spec and seed (a serial sweep shares one engine
between a seed's points only to compile once). A `fit:K` ladder is fitted in the
driver, once per rate and seed, and every policy's task there gets the fitted
spec, as in a serial sweep.

With `saturated`, a policy's rates still go in ascending order: the next row
(its seeds at the next rate) is submitted when the row before has finished and
was not saturated; different policies' rows run side by side.

Ray is an extra (`pip install -e ".[ray]"`): this module imports it lazily.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Mapping, Optional, Sequence

from orca_jax.core.requests.run_result import RunResult
from orca_jax.results.sweep_store import PointKey
from orca_jax.runner.bucket_pilot import BucketFit
from orca_jax.runner.build import build_engine, scheduler_config
from orca_jax.runner.spec import RunSpec
from orca_jax.runner.sweep_point import (
    PointOutcome,
    PointSpecs,
    PointWorkloads,
    PolicyRun,
    SweepError,
    SweepExecutor,
    point_run_dir,
    row_saturated,
    run_point,
)


def _point_task(key: PointKey, spec: RunSpec, this_spec: RunSpec,
                bucket_fit: Optional[BucketFit], run: PolicyRun, build_per_point: bool,
                run_dir: Optional[str],
                extra_metrics: Optional[Callable[[RunResult], Mapping[str, object]]],
                cwd: str) -> PointOutcome:
    """One point, in a Ray worker: the workload of the sweep's `spec` at the point, the
    engine of the point's (fitted) `this_spec`, then `run_point`."""
    os.chdir(cwd)  # relative paths (a `file.py:Class` policy, a trace) as the driver saw them
    return run_point(key, this_spec, run,
                     lambda: PointWorkloads(spec, build_per_point).at(key.rate, key.seed),
                     lambda: build_engine(this_spec, scheduler_config(this_spec)),
                     run_dir, extra_metrics, bucket_fit)


def import_ray() -> Any:
    """The `ray` module.

    Raises:
      SweepError: Ray is not installed (saying how to install it).
    """
    try:
        import ray
    except ImportError:
        raise SweepError("--executor=ray needs Ray: pip install -e \".[ray]\"") from None
    return ray


def run_rows_on_ray(executor: SweepExecutor, spec: RunSpec,
                    rows: Sequence[tuple[PolicyRun, float]], seeds: Sequence[int],
                    out_dir: str, points: Mapping[PointKey, Mapping[str, object]],
                    record: Callable[[PointKey, PointOutcome], None], *,
                    build_per_point: bool,
                    saturated: Optional[Callable[[float, Mapping[str, object]], bool]],
                    extra_metrics: Optional[Callable[[RunResult], Mapping[str, object]]],
                    point_runs: bool,
                    variants: Optional[Mapping[str, RunSpec]] = None) -> None:
    """Runs the rows' missing points as Ray tasks; `record` takes each as it finishes.

    Args:
      executor: the Ray cluster's address, or a local Ray's CPUs.
      spec: the sweep's spec.
      rows: (curve, rate) in the grid's order (a curve: a policy, under its variant).
      seeds: the workload seeds of each row.
      out_dir: the store's folder (point run folders go under it).
      points: the store's points so far, by key (`record` adds to it).
      record: appends a finished point to the store (the driver's only write).
      build_per_point, saturated, extra_metrics, point_runs, variants: as in `run_sweep`.
    """
    ray = import_ray()
    started_here = not ray.is_initialized()
    if started_here:
        ray.init(address=executor.ray_address,
                 num_cpus=None if executor.ray_address else executor.num_cpus,
                 include_dashboard=False, logging_level="WARNING", log_to_driver=False)
    task = ray.remote(num_cpus=1)(_point_task)
    cwd = os.getcwd()
    # Fitted here, in the driver: every policy's task at a rate and seed gets the same fit.
    specs = PointSpecs(spec, PointWorkloads(spec, build_per_point), variants,
                       policies=[run for run, _ in rows])
    # Each curve's rows in order; with `saturated` only one row of a curve is in flight.
    CurveId = tuple[str, Optional[str]]  # (policy label, variant)
    queues: dict[CurveId, list[float]] = {}
    for run, rate in rows:
        queues.setdefault(run.curve, []).append(rate)
    runs = {run.curve: run for run, _ in rows}
    in_flight: dict[Any, PointKey] = {}  # object ref -> its point
    open_rows: dict[CurveId, list[PointKey]] = {}  # curve -> the row it waits on

    def submit_next(curve: CurveId) -> None:
        """Submits the curve's next row that has missing points (all rows without
        `saturated`); a finished row that saturates ends the curve's rates."""
        while queues[curve]:
            rate = queues[curve].pop(0)
            row = [runs[curve].point(rate, seed) for seed in seeds]
            todo = [k for k in row if k not in points or points[k].get("error")]
            for key in todo:
                this_spec, bucket_fit = specs.at(key.rate, key.seed, key.variant)
                ref = task.remote(key, spec, this_spec, bucket_fit, runs[curve],
                                  build_per_point, point_run_dir(out_dir, key, point_runs),
                                  extra_metrics, cwd)
                in_flight[ref] = key
            if saturated is None:
                continue
            if todo:
                open_rows[curve] = row
                return
            if row_saturated(saturated, rate, row, points):
                queues[curve].clear()

    try:
        for curve in queues:
            submit_next(curve)
        while in_flight:
            done, _ = ray.wait(list(in_flight), num_returns=1)
            key = in_flight.pop(done[0])
            try:
                outcome = ray.get(done[0])
            except ray.exceptions.RayError as e:  # the worker died (out of memory, a signal)
                outcome = PointOutcome({}, 0.0, f"{type(e).__name__}: {e}".splitlines()[0])
            record(key, outcome)
            curve = (key.policy, key.variant)
            row = open_rows.get(curve)
            if row and not any(k in in_flight.values() for k in row):
                del open_rows[curve]
                if row_saturated(saturated, key.rate, row, points):
                    queues[curve].clear()
                submit_next(curve)
    finally:
        for ref in in_flight:
            ray.cancel(ref, force=True)
        if started_here:
            ray.shutdown()
