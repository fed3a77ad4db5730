"""The sweep runner: policies x request rates x seeds, into a resumable `SweepStore`.

The sweep command (`experiments/sweep.py`) and the paper reproductions
(`experiments/reproduce/`) both run their grids through `run_sweep`. Each
finished point is appended to the store at once, so a killed sweep rerun with
the same arguments runs only the points it lacks.

A point's spec is the sweep's spec at that point's rate and seed
(`point_spec`); the sweep's fingerprint is the spec without them, flat
(`run_config`). Every point of a seed shares one engine, as `compare` shares
one between policies: the same compiled steps serve every policy, and a real
engine's random weights follow the seed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import sys
import time
from typing import Callable, Mapping, Optional, Sequence

from orca_jax.cluster.routing import make_router
from orca_jax.core.engine_api import Engine
from orca_jax.core.plugins import current_options
from orca_jax.core.policy import make_policy, parse_options, resolve_policy_class
from orca_jax.core.request import Request
from orca_jax.core.run_result import RunResult
from orca_jax.results.run_folder import check_writable_dir
from orca_jax.results.sweep_store import PointKey, SweepLock, SweepStore, point_key
from orca_jax.runner.build import build_engine, build_workload, scheduler_config
from orca_jax.runner.experiment import run_policy
from orca_jax.runner.progress import Progress
from orca_jax.runner.spec import JaxEngineSpec, RunSpec

# Test-only: the process dies (os._exit) right after this many points, as a kill would.
EXIT_AFTER_ENV = "ORCA_JAX_SWEEP_EXIT_AFTER"
# The fingerprint's settings by the names a sweep.json written before the spec had
# parts (and before the knobs were renamed) gives them: such a sweep still resumes.
OLD_SETTING_NAMES = {"workload": "arrival", "max_batch_size": "max_num_seqs",
                     "token_budget": "max_num_tokens"}


class SweepError(ValueError):
    """A sweep that cannot run as asked (names the policies or the trace at fault)."""


@dataclasses.dataclass(frozen=True)
class PolicyRun:
    """One curve of a sweep: a policy with its knobs, under a label."""

    label: str  # the curve's name, and the key of its points in the store
    spec: str  # registered name, `package.module:Class` or `file.py:Class`
    options: Mapping[str, str] = dataclasses.field(default_factory=dict)


def point_spec(spec: RunSpec, rate: float, seed: int) -> RunSpec:
    """The spec of one point: the sweep's spec at `rate` and `seed`."""
    return dataclasses.replace(spec, workload=dataclasses.replace(spec.workload, rate=rate),
                               seed=seed)


def _settings(spec: RunSpec) -> dict[str, object]:
    """Every setting of `spec` one level deep, under its own name; the engine's kind is
    `engine`. (The parts' field names are distinct, so nothing is lost.)"""
    settings: dict[str, object] = {}
    for name, value in dataclasses.asdict(spec).items():
        if isinstance(value, dict):
            settings.update(("engine" if key == "kind" else key, leaf)
                            for key, leaf in value.items())
        else:
            settings[name] = value
    return settings


def run_config(spec: RunSpec) -> dict[str, object]:
    """The sweep's fingerprint of the workload and plumbing: the spec minus rate and seed,
    flat (as sweep.json has always held it)."""
    config = {k: v for k, v in _settings(spec).items() if k not in ("rate", "seed")}
    if spec.workload.trace:
        with open(spec.workload.trace, "rb") as f:
            config["trace_sha256"] = hashlib.sha256(f.read()).hexdigest()
    return config


def workload_at(spec: RunSpec, base: list[Request], rate: float) -> list[Request]:
    """The seed's workload at `rate`: same requests, arrivals rescaled.

    Synthetic arrivals are drawn as unit gaps divided by the rate, so building
    at rate 1 and scaling by 1 / `rate` is the workload built at `rate` (its
    arrival times up to rounding in the last bit). A trace keeps its arrival
    pattern, rescaled so its mean rate is `rate`.

    Raises:
      SweepError: a trace whose arrivals are all at one time (it has no rate).
    """
    if spec.workload.arrival == "trace":
        span = (max(r.arrival_s for r in base) - min(r.arrival_s for r in base)
                if len(base) >= 2 else 0.0)
        if span <= 0:
            raise SweepError(f"trace {spec.workload.trace}: all arrivals at one time; a rate sweep "
                             "needs arrivals spread in time")
        scale = (len(base) - 1) / span / rate
    else:
        scale = 1.0 / rate
    return [dataclasses.replace(r, arrival_s=r.arrival_s * scale) for r in base]


def run_sweep(spec: RunSpec, policies: Sequence[PolicyRun], rates: Sequence[float],
              seeds: Sequence[int], out_dir: str, *, build_per_point: bool = False,
              saturated: Optional[Callable[[float, Mapping[str, object]], bool]] = None,
              extra_metrics: Optional[Callable[[RunResult], Mapping[str, object]]] = None,
              point_runs: bool = False,
              progress: bool = False) -> tuple[SweepStore, list[PointKey]]:
    """Runs the grid's missing points into the store in `out_dir`.

    Points run policy-major, then rate, then seed. Points already in the store
    are not run again (their stored summaries count, e.g. for `saturated`).

    Args:
      spec: the workload and engine plumbing (its rate and seed are replaced per point).
      policies: the curves, each under its own label.
      rates: request rates (req/s), run in this order (ascending with `saturated`).
      seeds: workload seeds.
      out_dir: the store's folder.
      build_per_point: build each (rate, seed)'s workload from its own spec, as the
        reproductions' published numbers were made; by default each seed's workload is
        built once at rate 1 and rescaled per rate (`workload_at`), which also sweeps a
        trace. The two give the same synthetic requests, their arrival times equal up to
        rounding in the last bit.
      saturated: whether a point (its rate, its summary) is past the policy's capacity.
        When given, each policy's rates run ascending and stop after the first rate at
        which every seed is saturated: past saturation the queue only grows, and an
        overloaded run of a slow policy costs the most steps. None runs every rate.
      extra_metrics: more summary fields from a finished run (the second value of
        `run_policy`), stored with the point.
      point_runs: also write each point's run folder under `out_dir/points/`.
      progress: show progress on stderr (`orca_jax.runner.progress`).

    Returns:
      The store and the keys that were run or found (the grid to aggregate).

    Raises:
      SweepError: two policies share a label, or `build_per_point` with a trace.
      OutDirError: `out_dir` is a file, or cannot be created or written.
      SweepConfigError: `out_dir` holds a sweep of another configuration.
      SweepLockedError: another sweep is running into `out_dir` (a `SweepConfigError`).
      PolicyLoadError: a policy, knob or router does not load (nothing is written).
    """
    check_writable_dir(out_dir)
    labels = [run.label for run in policies]
    if len(set(labels)) != len(labels):
        raise SweepError(f"policies {[run.spec for run in policies]}: two share a label "
                         f"({labels}); a sweep keys its points by label")
    if build_per_point and spec.workload.arrival == "trace":
        raise SweepError(f"trace {spec.workload.trace}: its arrivals do not follow a rate; "
                         "sweep it by rescaling (build_per_point=False)")
    # Options under their names now, so an old name and the new one are the same sweep.
    classes = {run.label: resolve_policy_class(run.spec) for run in policies}
    policies = [dataclasses.replace(run, options=current_options(classes[run.label],
                                                                  run.options, "policy"))
                for run in policies]
    # Every policy, knob and router loads before the folder is touched: a typo leaves no
    # sweep.json behind to refuse the corrected rerun.
    for run in policies:
        make_policy(run.spec, run.options)
    if spec.cluster.num_replicas > 1:
        make_router(spec.cluster.router, parse_options(spec.cluster.router_opts))
    with SweepLock(out_dir):
        return _run_grid(spec, policies, classes, rates, seeds, out_dir,
                         build_per_point=build_per_point, saturated=saturated,
                         extra_metrics=extra_metrics, point_runs=point_runs, progress=progress)


def _run_grid(spec: RunSpec, policies: Sequence[PolicyRun], classes: Mapping[str, type],
              rates: Sequence[float], seeds: Sequence[int], out_dir: str, *,
              build_per_point: bool,
              saturated: Optional[Callable[[float, Mapping[str, object]], bool]],
              extra_metrics: Optional[Callable[[RunResult], Mapping[str, object]]],
              point_runs: bool, progress: bool) -> tuple[SweepStore, list[PointKey]]:
    """`run_sweep` once its policies have loaded and it holds the folder's lock."""
    labels = [run.label for run in policies]
    store = SweepStore(out_dir, run_config(spec),
                       {run.label: {"spec": run.spec, "options": dict(run.options)}
                        for run in policies},
                       run_defaults={**_settings(RunSpec(engine=JaxEngineSpec())),
                                     **_settings(RunSpec())},
                       renamed_settings=OLD_SETTING_NAMES,
                       renamed_options={label: cls.renamed_options
                                        for label, cls in classes.items()})
    points = {point_key(p): p for p in store.load()}
    rate_order = sorted(float(r) for r in rates) if saturated else [float(r) for r in rates]
    grid_keys = [PointKey(label, rate, int(seed))
                 for label in labels for rate in rate_order for seed in seeds]
    num_resumed = sum(k in points for k in grid_keys)
    bar = Progress(f"sweep, {num_resumed} resumed", len(grid_keys), "points",
                   initial=num_resumed, delay_s=0.0) if progress else None
    exit_after = int(os.environ.get(EXIT_AFTER_ENV, "0"))
    num_ran = 0
    workloads = _Workloads(spec, build_per_point)
    engines: dict[int, Engine] = {}
    keys: list[PointKey] = []
    for run in policies:
        for rate in rate_order:
            row = [PointKey(run.label, rate, int(seed)) for seed in seeds]
            keys += row
            for key in row:
                if key in points:
                    continue
                if bar:
                    bar.update(bar.count, f"running {key.policy} rate={key.rate:g} "
                                          f"seed={key.seed}")
                this_spec = point_spec(spec, rate, key.seed)
                if key.seed not in engines:
                    engines[key.seed] = build_engine(this_spec, scheduler_config(this_spec))
                run_dir = (os.path.join(out_dir, "points", key.policy,
                                        f"rate_{key.rate:g}_seed_{key.seed}")
                           if point_runs else None)
                points[key] = _run_point(store, key, this_spec, run, workloads.at(rate, key.seed),
                                         engines[key.seed], run_dir, extra_metrics)
                num_ran += 1
                if bar:
                    bar.update(bar.count + 1)
                if exit_after and num_ran >= exit_after:
                    sys.stderr.flush()
                    os._exit(3)
            if saturated and all(saturated(rate, points[key]["summary"]) for key in row):
                break
    if bar:
        bar.close()
    return store, keys


class _Workloads:
    """Each point's requests; a built workload is kept for the next policy's points."""

    def __init__(self, spec: RunSpec, build_per_point: bool) -> None:
        # A conversation's think times do not follow the rate: rescaling its arrivals
        # would compress them too, so each point is built at its own rate.
        self.spec = spec
        self.build_per_point = build_per_point or spec.workload.arrival == "conversation"
        self._per_point: dict[tuple[float, int], list[Request]] = {}
        self._at_rate_1: dict[int, list[Request]] = {}  # by seed

    def at(self, rate: float, seed: int) -> list[Request]:
        """The requests of the point at `rate` and `seed`."""
        if self.build_per_point:
            if (rate, seed) not in self._per_point:
                self._per_point[rate, seed] = build_workload(point_spec(self.spec, rate, seed))
            return self._per_point[rate, seed]
        if seed not in self._at_rate_1:
            self._at_rate_1[seed] = build_workload(point_spec(self.spec, 1.0, seed))
        return workload_at(self.spec, self._at_rate_1[seed], rate)


def _run_point(store: SweepStore, key: PointKey, spec: RunSpec, run: PolicyRun,
               requests: list[Request], engine: Engine, run_dir: Optional[str],
               extra_metrics: Optional[Callable[[RunResult], Mapping[str, object]]]
               ) -> dict[str, object]:
    """Runs one point and appends it to the store; returns its stored line."""
    start = time.perf_counter()
    summary, result = run_policy(spec, run.spec, dict(run.options), out_dir=run_dir,
                                 requests=requests, engine=engine, progress=False,
                                 label=run.label)
    if extra_metrics:
        summary.update(extra_metrics(result))
    extra: dict[str, object] = {"wall_s": time.perf_counter() - start}
    if run_dir:
        extra["run_dir"] = run_dir
    return store.append(key, summary, extra)
