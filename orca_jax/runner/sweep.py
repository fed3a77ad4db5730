"""The sweep runner: policies x request rates x seeds (x variants), into a resumable
`SweepStore`.

The sweep command (`experiments/sweep.py`) and the paper reproductions
(`experiments/reproduce/`) both run their grids through `run_sweep`. Each
finished point is appended to the store at once, so a killed sweep rerun with
the same arguments runs only the points it lacks.

A point's spec is the sweep's spec at that point's rate and seed
(`point_spec`); the sweep's fingerprint is the spec without them, flat
(`run_config`). Every point of a seed shares one engine, as `compare` shares
one between policies: the same compiled steps serve every policy, and a real
engine's random weights follow the seed.

Variants (`variants`: label -> spec) are setups of their own on the sweep's
workload, as `compare --variants` runs them: every policy is swept under every
variant, on the very requests of the sweep's own spec at each rate and seed (a
variant may not change the workload), its ladder fitted by the pilots of the
sweep's own spec, one per policy (`PointSpecs`). A point's key and its line in `points.jsonl`
carry its variant; sweep.json records each variant's settings, so a resumed sweep
refuses a label that now means another setup.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import sys
from typing import Callable, Mapping, Optional, Sequence

from orca_jax.cluster.routing import make_router
from orca_jax.core.api.plugins import current_options
from orca_jax.core.api.policy import make_policy, parse_options, resolve_policy_class
from orca_jax.core.requests.run_result import RunResult
from orca_jax.core.step.engine_api import Engine
from orca_jax.results.run_folder import check_writable_dir
from orca_jax.results.sweep_store import PointKey, SweepLock, SweepStore, point_key
from orca_jax.runner.build import build_engine, build_workload, scheduler_config
from orca_jax.runner.progress import Progress
from orca_jax.runner.spec import JaxEngineSpec, RunSpec
from orca_jax.runner.sweep_point import (
    PointOutcome,
    PointSpecs,
    PointWorkloads,
    PolicyRun,
    SweepError,
    SweepExecutor,
    point_run_dir,
    point_spec,
    row_saturated,
    run_point,
    workload_at,
)

__all__ = ["EXIT_AFTER_ENV", "PointOutcome", "PolicyRun", "SweepError", "SweepExecutor",
           "point_spec", "run_config", "run_sweep", "workload_at"]

# Test-only: the process dies (os._exit) right after this many points, as a kill would.
EXIT_AFTER_ENV = "ORCA_JAX_SWEEP_EXIT_AFTER"
# The fingerprint's settings by the names a sweep.json written before the spec had
# parts (and before the knobs were renamed) gives them: such a sweep still resumes.
OLD_SETTING_NAMES = {"workload": "arrival", "max_batch_size": "max_num_seqs",
                     "token_budget": "max_num_tokens"}


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
    if spec.workload.arrival == "trace" and spec.workload.output_len is None:
        # The trace's own output lengths: nothing to compare. (A trace sweep stored before
        # the commands left --output_len unset for a trace holds the engine's default here,
        # which that trace never read; it still resumes.)
        del config["output_len"]
    if spec.workload.trace:
        with open(spec.workload.trace, "rb") as f:
            config["trace_sha256"] = hashlib.sha256(f.read()).hexdigest()
    return config


def variant_settings(spec: RunSpec, variant: RunSpec) -> dict[str, object]:
    """What a variant sets: its settings (as `run_config` names them) that differ from the
    sweep's `spec` (sweep.json's `variants`)."""
    base = _settings(spec)
    return {key: value for key, value in _settings(variant).items()
            if key not in ("rate", "seed") and base.get(key) != value}


def _check_variants(spec: RunSpec, variants: Mapping[str, RunSpec]) -> None:
    """Refuses a variant that would run another workload than the sweep's.

    Raises:
      SweepError: a variant's workload, model, context limit or engine kind differs.
    """
    for label, variant in variants.items():
        changed = [name for name, ours, theirs in (
            ("workload", spec.workload, variant.workload),
            ("engine", spec.engine.kind, variant.engine.kind),
            ("model", spec.engine.model, variant.engine.model),
            ("max_model_len", spec.limits.max_model_len, variant.limits.max_model_len))
            if ours != theirs]
        if changed:
            raise SweepError(f"variant {label}: its {', '.join(changed)} differs from the "
                             "sweep's; every variant runs on the sweep's workload")


def run_sweep(spec: RunSpec, policies: Sequence[PolicyRun], rates: Sequence[float],
              seeds: Sequence[int], out_dir: str, *, build_per_point: bool = False,
              saturated: Optional[Callable[[float, Mapping[str, object]], bool]] = None,
              extra_metrics: Optional[Callable[[RunResult], Mapping[str, object]]] = None,
              point_runs: bool = False, progress: bool = False,
              executor: Optional["SweepExecutor"] = None,
              variants: Optional[Mapping[str, RunSpec]] = None
              ) -> tuple[SweepStore, list[PointKey]]:
    """Runs the grid's missing points into the store in `out_dir`.

    Points run policy-major, then rate, then seed (with variants, variant-major first).
    Points already in the store are not run again (their stored summaries count, e.g.
    for `saturated`).

    Args:
      spec: the workload and engine plumbing (its rate and seed are replaced per point).
      policies: the curves, each under its own label (their `variant` unset: `variants`
        sets it).
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
      progress: show progress on stderr (`orca_jax.runner.progress`): finished points.
      executor: where points run: here, one after another (the default), or as Ray tasks
        (`SweepExecutor("ray")`). Either way this process alone appends to the store, and a
        point that raises is recorded failed with its error (`error` in its line, an empty
        summary) while the sweep goes on; a rerun retries failed points.
      variants: label -> spec of the setups to sweep every policy under (rate and seed
        replaced per point, as `spec`'s), each on `spec`'s workload; None or empty: `spec`
        alone. Labels name folders (`point_runs`).

    Returns:
      The store and the keys that were run or found (the grid to aggregate).

    Raises:
      SweepError: two policies share a label, `build_per_point` with a trace, a trace
        whose arrivals are all at one time, or a variant with another workload.
      TraceError: the trace does not load (nothing is written).
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
    if any(run.variant is not None for run in policies):
        raise SweepError(f"policies {labels}: a policy's variant is set by `variants`, "
                         "not given with it")
    variants = dict(variants or {})
    _check_variants(spec, variants)
    if build_per_point and spec.workload.arrival in ("trace", "program_trace"):
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
    for setup in list(variants.values()) or [spec]:
        if setup.cluster.num_replicas > 1:
            make_router(setup.cluster.router, parse_options(setup.cluster.router_opts))
    executor = executor or SweepExecutor()
    if executor.kind not in ("serial", "ray"):
        raise SweepError(f"executor {executor.kind!r}: expected 'serial' or 'ray'")
    if executor.kind == "ray":
        from orca_jax.runner.ray_sweep import import_ray  # Ray is an extra: only when asked
        import_ray()  # missing: one line, before the folder is touched
    if spec.workload.arrival in ("trace", "program_trace"):
        # A trace that does not load, or has no rate, is refused before the folder is
        # touched (not stored as every point's failure, in a folder then holding a sweep).
        workload_at(spec, build_workload(point_spec(spec, 1.0, int(seeds[0]))),
                    float(rates[0]))
    with SweepLock(out_dir):  # creates the folder
        return _run_grid(spec, policies, classes, rates, seeds, out_dir,
                         build_per_point=build_per_point, saturated=saturated,
                         extra_metrics=extra_metrics, point_runs=point_runs, progress=progress,
                         executor=executor, variants=variants)


def _run_grid(spec: RunSpec, policies: Sequence[PolicyRun], classes: Mapping[str, type],
              rates: Sequence[float], seeds: Sequence[int], out_dir: str, *,
              variants: Mapping[str, RunSpec],
              build_per_point: bool,
              saturated: Optional[Callable[[float, Mapping[str, object]], bool]],
              extra_metrics: Optional[Callable[[RunResult], Mapping[str, object]]],
              point_runs: bool, progress: bool,
              executor: "SweepExecutor") -> tuple[SweepStore, list[PointKey]]:
    """`run_sweep` once its policies have loaded and it holds the folder's lock."""
    store = SweepStore(out_dir, run_config(spec),
                       {run.label: {"spec": run.spec, "options": dict(run.options)}
                        for run in policies},
                       run_defaults={**_settings(RunSpec(engine=JaxEngineSpec())),
                                     **_settings(RunSpec())},
                       renamed_settings=OLD_SETTING_NAMES,
                       renamed_options={label: cls.renamed_options
                                        for label, cls in classes.items()},
                       variants={label: variant_settings(spec, variant)
                                 for label, variant in variants.items()})
    # The curves: every policy under every variant (variant-major, as compare's rows).
    curves = ([dataclasses.replace(run, variant=label) for label in variants for run in policies]
              if variants else list(policies))
    points = {point_key(p): p for p in store.load()}
    rate_order = sorted(float(r) for r in rates) if saturated else [float(r) for r in rates]
    grid_keys = [run.point(rate, seed) for run in curves for rate in rate_order for seed in seeds]
    num_resumed = sum(k in points and not points[k].get("error") for k in grid_keys)
    bar = Progress(f"sweep, {num_resumed} resumed", len(grid_keys), "points",
                   initial=num_resumed, delay_s=0.0) if progress else None
    record = _Recorder(store, points, bar)
    rows = [(run, rate) for run in curves for rate in rate_order]
    if executor.kind == "ray":
        from orca_jax.runner.ray_sweep import run_rows_on_ray  # only when asked: Ray is an extra
        run_rows_on_ray(executor, spec, rows, seeds, out_dir, points, record,
                        build_per_point=build_per_point, saturated=saturated,
                        extra_metrics=extra_metrics, point_runs=point_runs, variants=variants)
    else:
        _run_rows_serially(spec, rows, seeds, out_dir, points, record,
                           build_per_point=build_per_point, saturated=saturated,
                           extra_metrics=extra_metrics, point_runs=point_runs,
                           variants=variants)
    if bar:
        bar.close()
    keys: list[PointKey] = []
    for run in curves:  # the grid up to each curve's last run rate
        for rate in rate_order:
            row = [run.point(rate, seed) for seed in seeds]
            keys += row
            if row_saturated(saturated, rate, row, points):
                break
    return store, keys


class _Recorder:
    """The driver's side of finished points: appends each to the store (alone, so lines
    never interleave), keeps it in `points`, moves the bar, and honours the test-only
    kill (`EXIT_AFTER_ENV`)."""

    def __init__(self, store: SweepStore, points: dict[PointKey, dict[str, object]],
                 bar: Optional[Progress]) -> None:
        self.store, self.points, self.bar = store, points, bar
        self.exit_after = int(os.environ.get(EXIT_AFTER_ENV, "0"))
        self.num_recorded = 0
        self.failed: list[PointKey] = []

    def running(self, note: str) -> None:
        if self.bar:
            self.bar.update(self.bar.count, note)

    def __call__(self, key: PointKey, outcome: "PointOutcome") -> None:
        extra: dict[str, object] = {"wall_s": outcome.wall_s}
        if outcome.run_dir:
            extra["run_dir"] = outcome.run_dir
        if outcome.error is not None:
            extra["error"] = outcome.error
            self.failed.append(key)
        self.points[key] = self.store.append(key, outcome.summary, extra)
        self.num_recorded += 1
        if self.bar:
            self.bar.update(self.bar.count + 1,
                            f"{len(self.failed)} failed" if self.failed else "")
        if self.exit_after and self.num_recorded >= self.exit_after:
            sys.stderr.flush()
            ray = sys.modules.get("ray")
            if ray is not None and ray.is_initialized():
                # A local Ray's agents outlive an os._exit of the process that started it:
                # tests must not leave them behind. The store is already as a kill leaves it.
                ray.shutdown()
            os._exit(3)


def _run_rows_serially(spec: RunSpec, rows: Sequence[tuple[PolicyRun, float]],
                       seeds: Sequence[int], out_dir: str,
                       points: Mapping[PointKey, Mapping[str, object]], record: _Recorder, *,
                       build_per_point: bool,
                       saturated: Optional[Callable[[float, Mapping[str, object]], bool]],
                       extra_metrics: Optional[Callable[[RunResult], Mapping[str, object]]],
                       point_runs: bool, variants: Mapping[str, RunSpec]) -> None:
    """Runs the rows' missing points in this process, one engine per seed (and variant), and
    one fitted ladder (`fit:K`) per rate and seed, shared by every policy there."""
    workloads = PointWorkloads(spec, build_per_point)
    specs = PointSpecs(spec, workloads, variants, policies=[run for run, _ in rows])
    engines: dict[tuple[Optional[str], int], Engine] = {}
    done: set[tuple[str, Optional[str]]] = set()  # curves past saturation
    for run, rate in rows:
        if run.curve in done:
            continue
        row = [run.point(rate, seed) for seed in seeds]
        for key in row:
            if key in points and not points[key].get("error"):
                continue
            record.running(f"running {key.label} rate={key.rate:g} seed={key.seed}")
            this_spec, bucket_fit = specs.at(rate, key.seed, key.variant)

            def engine_of_seed(seed: int = key.seed, variant: Optional[str] = key.variant,
                               this_spec: RunSpec = this_spec) -> Engine:
                if (variant, seed) not in engines:
                    engines[variant, seed] = build_engine(this_spec, scheduler_config(this_spec))
                return engines[variant, seed]

            record(key, run_point(key, this_spec, run, lambda k=key: workloads.at(k.rate, k.seed),
                                  engine_of_seed, point_run_dir(out_dir, key, point_runs),
                                  extra_metrics, bucket_fit))
        if row_saturated(saturated, rate, row, points):
            done.add(run.curve)
