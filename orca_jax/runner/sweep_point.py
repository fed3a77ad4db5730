"""One point of a sweep, wherever it runs: its spec, workload, outcome and run.

What the serial sweep (`orca_jax.runner.sweep`) and the Ray tasks
(`orca_jax.runner.ray_sweep`) share, kept apart from both so that neither
imports the other.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Callable, Mapping, Optional, Sequence

from orca_jax.core.requests.request import Request
from orca_jax.core.requests.run_result import RunResult
from orca_jax.core.step.engine_api import Engine
from orca_jax.results.sweep_errors import SweepError
from orca_jax.results.sweep_store import PointKey, curve_label
from orca_jax.runner.bucket_pilot import BucketFit, PilotPolicy, needs_fit, with_fitted_buckets
from orca_jax.runner.build import build_workload
from orca_jax.runner.experiment import run_policy
from orca_jax.runner.spec import RunSpec
from orca_jax.workloads.arrival_rate import rescaled_to_rate
from orca_jax.workloads.programs import rescale_starts


@dataclasses.dataclass(frozen=True)
class PolicyRun:
    """One curve of a sweep: a policy with its knobs, under a label (and a variant)."""

    label: str  # the policy's name, and the key of its points in the store
    spec: str  # registered name, `package.module:Class` or `file.py:Class`
    options: Mapping[str, str] = dataclasses.field(default_factory=dict)
    # The setup it runs under: a label of `run_sweep`'s `variants`; None: the sweep's spec.
    variant: Optional[str] = None

    @property
    def curve(self) -> tuple[str, Optional[str]]:
        """What identifies the curve among a sweep's: (label, variant)."""
        return self.label, self.variant

    def point(self, rate: float, seed: int) -> PointKey:
        """The key of this curve's point at `rate` and `seed`."""
        return PointKey(self.label, float(rate), int(seed), self.variant)


@dataclasses.dataclass(frozen=True)
class SweepExecutor:
    """Where a sweep's points run.

    Attributes:
      kind: `serial` (this process, one point after another) or `ray` (one Ray task per point).
      ray_address: a running Ray cluster's address (`ray start --head` prints it); None
        starts a local Ray in this process.
      num_cpus: a local Ray's CPUs (points at once); None: every CPU of the machine.
    """

    kind: str = "serial"
    ray_address: Optional[str] = None
    num_cpus: Optional[int] = None


def point_spec(spec: RunSpec, rate: float, seed: int) -> RunSpec:
    """The spec of one point: the sweep's spec at `rate` and `seed`."""
    return dataclasses.replace(spec, workload=dataclasses.replace(spec.workload, rate=rate),
                               seed=seed)


def workload_at(spec: RunSpec, base: list[Request], rate: float) -> list[Request]:
    """The seed's workload at `rate`: same requests, arrivals rescaled.

    Synthetic arrivals are drawn as unit gaps divided by the rate, so building
    at rate 1 and scaling by 1 / `rate` is the workload built at `rate` (its
    arrival times up to rounding in the last bit). A trace keeps its arrival
    pattern, rescaled so its mean rate is `rate`. Agent programs: their starts are
    rescaled, their tool pauses kept (`workloads.programs.rescale_starts`).

    Raises:
      SweepError: a trace whose arrivals are all at one time (it has no rate).
    """
    programs = spec.workload.arrival in ("programs", "program_trace")
    if spec.workload.arrival in ("trace", "program_trace"):
        try:
            return rescaled_to_rate(base, rate, programs=programs)
        except ValueError as e:
            raise SweepError(f"trace {spec.workload.trace}: {e}") from e
    if programs:
        # The rate is of program starts (calls without parents); later calls arrive as
        # their parents and tool pauses let them, which a rate does not scale.
        return rescale_starts(base, 1.0 / rate)
    scale = 1.0 / rate  # as before: a stored point's arrivals to the last bit
    return [dataclasses.replace(r, arrival_s=r.arrival_s * scale) for r in base]


def row_saturated(saturated: Optional[Callable[[float, Mapping[str, object]], bool]],
                  rate: float, row: Sequence[PointKey],
                  points: Mapping[PointKey, Mapping[str, object]]) -> bool:
    """Whether a row (one policy's seeds at `rate`) ends its policy's rates: every seed
    finished and saturated. A failed point is not saturated (its summary is empty)."""
    return bool(saturated) and all(
        key in points and not points[key].get("error") and saturated(rate, points[key]["summary"])
        for key in row)


def point_run_dir(out_dir: str, key: PointKey, point_runs: bool) -> Optional[str]:
    """Where a point's run folder goes (with `point_runs`): points/POLICY/rate_R_seed_S, or
    points/VARIANT/POLICY/... under a variant (as compare's OUT_DIR/VARIANT/POLICY); else
    None."""
    if not point_runs:
        return None
    return os.path.join(out_dir, "points", *(() if key.variant is None else (key.variant,)),
                        key.policy, f"rate_{key.rate:g}_seed_{key.seed}")


class PointWorkloads:
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


class PointSpecs:
    """Each point's spec with its `fit:K` sizes, fitted once per rate and seed to the pilots
    of every policy of the sweep (`policies`) there, and shared by all of them.

    Under variants (`variants`: label -> the variant's spec), as in compare
    (`experiments.variant_flags.fit_setups`): the pilots play the sweep's own spec, and
    every variant with the sweep's ladder and token budget takes its sizes, whatever
    cluster, router or engine settings it sets, so variants differ by what they set and
    not by a ladder fitted to each; a variant with a ladder or budget of its own (whose
    steps differ anyway) gets a pilot of its own.
    """

    def __init__(self, spec: RunSpec, workloads: PointWorkloads,
                 variants: Optional[Mapping[str, RunSpec]] = None, *,
                 policies: Sequence[PolicyRun]) -> None:
        self.spec, self.workloads = spec, workloads
        # One pilot per policy (a curve's label), whatever variants it runs under.
        labels = {run.label: run for run in policies}
        self.pilots = [PilotPolicy(run.label, run.spec, run.options) for run in labels.values()]
        self.variants = dict(variants or {})
        # (rate, seed, ladder, budget) -> the pilot's fitted spec and its fit
        self._fits: dict[tuple[float, int, Optional[str], int],
                         tuple[RunSpec, Optional[BucketFit]]] = {}

    def at(self, rate: float, seed: int,
           variant: Optional[str] = None) -> tuple[RunSpec, Optional[BucketFit]]:
        """The point's spec (fitted) under `variant` (None: the sweep's own) and how it was
        fitted (None: nothing to fit, or its pilot failed: the point's run fails on it)."""
        unfitted = point_spec(self.spec if variant is None else self.variants[variant],
                              rate, seed)
        if not needs_fit(unfitted):
            return unfitted, None
        limits = unfitted.limits
        ladder = (limits.bucket_ladder, limits.max_num_tokens)
        key = (rate, seed, *ladder)
        if key not in self._fits:
            own = ladder == (self.spec.limits.bucket_ladder, self.spec.limits.max_num_tokens)
            pilot = point_spec(self.spec, rate, seed) if own else unfitted
            try:
                self._fits[key] = with_fitted_buckets(pilot, self.workloads.at(rate, seed),
                                                      policies=self.pilots)
            except Exception:  # noqa: BLE001 -- the point's own run fails on it, recorded
                self._fits[key] = pilot, None
        fitted, fit = self._fits[key]
        if fit is None:
            return unfitted, None
        return dataclasses.replace(unfitted, limits=dataclasses.replace(
            limits, token_buckets=fitted.limits.token_buckets)), fit


@dataclasses.dataclass(frozen=True)
class PointOutcome:
    """How one point ended: its summary, or the error it raised (summary empty)."""

    summary: Mapping[str, object]
    wall_s: float
    error: Optional[str] = None  # `Type: message` of what the point raised
    run_dir: Optional[str] = None


def run_point(key: PointKey, spec: RunSpec, run: PolicyRun,
              requests: Callable[[], list[Request]], engine: Callable[[], Engine],
              run_dir: Optional[str],
              extra_metrics: Optional[Callable[[RunResult], Mapping[str, object]]],
              bucket_fit: Optional[BucketFit] = None) -> PointOutcome:
    """Runs one point, here or in a Ray task. A point that raises (an `Exception`: a
    policy's bug, a plan error, a run folder that cannot be written) comes back as a
    failed outcome, so the sweep goes on; a Ctrl-C still stops the sweep.

    Args:
      key: the point.
      spec: the point's spec (`point_spec`).
      run: the policy.
      requests: builds (or hands over) the point's workload.
      engine: builds (or hands over) the engine of the point's seed; not called for a
        cluster, whose replicas build their own.
      run_dir: the point's run folder, or None.
      extra_metrics: more summary fields from the finished run.
      bucket_fit: how the spec's `fit:K` sizes were fitted, if the caller fitted them (a
        spec with its sizes not yet fitted is fitted by `run_policy`, the same for every
        policy at the point: the pilot's policy is fixed).
    """
    del key  # named for the caller's logs; the spec already holds rate and seed
    start = time.perf_counter()
    cluster = spec.cluster.disaggregated or spec.cluster.colocated_cluster
    try:
        summary, result = run_policy(spec, run.spec, dict(run.options), out_dir=run_dir,
                                     requests=requests(), engine=None if cluster else engine(),
                                     progress=False,
                                     label=curve_label(run.label, run.variant),
                                     bucket_fit=bucket_fit)
        if extra_metrics:
            summary.update(extra_metrics(result))
    except Exception as e:  # noqa: BLE001 -- recorded with the point, the sweep goes on
        return PointOutcome({}, time.perf_counter() - start, f"{type(e).__name__}: {e}", run_dir)
    return PointOutcome(summary, time.perf_counter() - start, None, run_dir)
