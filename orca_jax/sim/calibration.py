"""Simulator fidelity: measure the real engine's steps, fit the cost model, compare runs.

Three parts, used in order by `experiments.calibrate`:

1. **Measure** (`orca_jax.sim.step_profile`). A grid of step compositions per bucket,
   fixed by the bucket and the context limit rather than any workload, each run
   on a real engine's compiled step (`JaxEngine.step`, wall clock), repeatedly.
2. **Fit.** `fit_linear` fits, per bucket, the `cost_model.LinearStepTime`
   model `base_s + per_seq_s * S + per_tile_s * tiles` by non-negative least
   squares on relative residuals (a 2 ms step matters as much as a 60 ms one).
   `save_fit` / `load_fit` write and read it as JSON; `cost_config_from_fit`
   turns it into the SimEngine's `CostModelConfig(mode="fitted")`.
3. **Compare.** `relative_errors` puts a simulated run's metrics beside the
   real run's. The evaluation workload is never seen by the fit.

The driver that runs all three against a real engine is `experiments/calibrate.py`.
Nothing here imports jax.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from typing import Any, Mapping, Optional, Sequence

import numpy as np
from numpy.typing import NDArray

from orca_jax.core.json_files import write_json_atomic
from orca_jax.core.step.engine_api import Bucket, Engine, EngineWrapper, StepInputs, StepOutput
from orca_jax.sim import cost_model
from orca_jax.sim.step_profile import SAMPLE_STATISTICS, StepSample, reference_tiles

FIT_FORMAT = "orca_jax.cost_fit/1"
COMPARED_METRICS = ("duration_s", "ttft_mean_s", "tpot_mean_s")
FIT_STATISTICS = SAMPLE_STATISTICS


def _nnls(features: NDArray[np.float64], target: NDArray[np.float64]) -> NDArray[np.float64]:
    """Least squares with non-negative coefficients, by trying every support (3 columns)."""
    best, best_residual = np.zeros(features.shape[1]), math.inf
    columns = range(features.shape[1])
    for size in range(1, features.shape[1] + 1):
        for support in itertools.combinations(columns, size):
            sub = features[:, support]
            coef = np.linalg.lstsq(sub, target, rcond=None)[0]
            if np.any(coef < 0):
                continue
            residual = float(np.sum((sub @ coef - target) ** 2))
            if residual < best_residual:
                best_residual = residual
                best = np.zeros(features.shape[1])
                best[list(support)] = coef
    return best


def fit_linear(samples: Sequence[StepSample], page_size: int, statistic: str = "median"
               ) -> dict[int, cost_model.LinearStepTime]:
    """Fits `LinearStepTime` per bucket to measured samples (relative residuals, coefs >= 0).

    Args:
      samples: measured compositions (at least 3 per bucket: the model has 3 coefficients).
      page_size: tokens per KV page (sets the KV tile).
      statistic: fit each composition's `median` (robust to bursts of load),
        `mean` (what sums of step times follow when the load is the same later) or
        `min` (what load inflates least: the profiled clock's, for one price of a
        step whatever the machine was doing while it was timed).

    Raises:
      ValueError: a bucket has fewer than 3 samples, or an unknown statistic.
    """
    if statistic not in FIT_STATISTICS:
        raise ValueError(f"fit_linear: statistic={statistic!r}, choose one of {FIT_STATISTICS}")
    by_bucket: dict[Bucket, list[StepSample]] = {}
    for sample in samples:
        by_bucket.setdefault(sample.bucket, []).append(sample)
    fit = {}
    for bucket, group in sorted(by_bucket.items(), key=lambda item: item[0].num_tokens):
        if len(group) < 3:
            raise ValueError(f"fit_linear: bucket {bucket} has {len(group)} samples, needs >= 3")
        q_tile, kv_tile = reference_tiles(bucket, page_size)
        features = np.array([[1.0, len(g.q_lens),
                              cost_model.attention_tiles(np.array(g.q_lens), np.array(g.kv_lens),
                                                         q_tile=q_tile, kv_tile=kv_tile)]
                             for g in group])  # [num_samples, 3]
        seconds = np.array([g.statistic(statistic) for g in group])  # [num_samples]
        coef = _nnls(features / seconds[:, None], np.ones_like(seconds))
        fit[bucket.num_tokens] = cost_model.LinearStepTime(
            base_s=float(coef[0]), per_seq_s=float(coef[1]), per_tile_s=float(coef[2]),
            q_tile=q_tile, kv_tile=kv_tile)
    return fit


class RecordingEngine(EngineWrapper):
    """Wraps an engine and keeps `(bucket tokens, q_lens, kv_lens, step_s)` of every step.

    Lets a real run's own steps be priced by a fit afterwards (a diagnostic of
    where simulated and real runs part; nothing is fitted to it).
    """

    def __init__(self, engine: Engine) -> None:
        super().__init__(engine)
        self.steps: list[tuple[int, NDArray[np.int64], NDArray[np.int64], float]] = []

    def step(self, inputs: StepInputs) -> StepOutput:
        output = self.engine.step(inputs)
        self.steps.append((inputs.bucket.num_tokens, *cost_model.real_lengths(inputs),
                           output.step_s))
        return output


def busy_time_ratio(fit: Mapping[int, cost_model.LinearStepTime],
                    steps: Sequence[tuple[int, NDArray[np.int64], NDArray[np.int64], float]]
                    ) -> dict[str, float]:
    """How a fit prices a real run's own steps: predicted/measured, in total, per step
    (median), and per bucket; and the measured steps' mean over their median (a heavy
    tail from other processes' load shows here)."""
    predicted = np.array([fit[t].seconds(q, k) for t, q, k, _ in steps])  # [num_steps]
    measured = np.array([seconds for *_, seconds in steps])  # [num_steps]
    buckets = np.array([t for t, *_ in steps])  # [num_steps]
    by_bucket = {str(t): round(float(predicted[buckets == t].sum() / measured[buckets == t].sum()),
                               3) for t in sorted(set(buckets.tolist()))}
    return {"sum_ratio": float(predicted.sum() / measured.sum()),
            "median_ratio": float(np.median(predicted / measured)),
            "measured_mean_over_median": float(measured.mean() / np.median(measured)),
            "sum_ratio_by_bucket": by_bucket}


def predict(fit: Mapping[int, cost_model.LinearStepTime], sample: StepSample) -> float:
    """The fitted seconds of a sample's composition."""
    return fit[sample.bucket.num_tokens].seconds(np.array(sample.q_lens), np.array(sample.kv_lens))


def save_fit(path: str, fit: Mapping[int, cost_model.LinearStepTime],
             metadata: Optional[Mapping[str, Any]] = None) -> None:
    """Writes a fit as JSON (atomically: a temporary file, then a rename)."""
    payload = {"format": FIT_FORMAT, "metadata": dict(metadata or {}),
               "buckets": {str(t): dataclasses.asdict(entry) for t, entry in sorted(fit.items())}}
    write_json_atomic(path, payload, sort_keys=False)


def load_fit(path: str) -> tuple[dict[int, cost_model.LinearStepTime], dict[str, Any]]:
    """Reads a fit written by `save_fit`: `({bucket tokens: LinearStepTime}, metadata)`.

    Raises:
      ValueError: the file is not a fit, or an entry is malformed (named by bucket and field).
    """
    with open(path) as f:
        try:
            payload = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not JSON ({e})") from None
    if not isinstance(payload, dict) or payload.get("format") != FIT_FORMAT:
        raise ValueError(f"{path}: not a cost fit (expected format {FIT_FORMAT!r})")
    fields = {f.name for f in dataclasses.fields(cost_model.LinearStepTime)}
    fit = {}
    for key, entry in payload.get("buckets", {}).items():
        if not isinstance(entry, dict) or set(entry) != fields:
            raise ValueError(f"{path}: buckets[{key!r}] must have exactly the fields "
                             f"{sorted(fields)}, got {entry!r}")
        try:
            fit[int(key)] = cost_model.LinearStepTime(**entry)
        except ValueError as e:
            raise ValueError(f"{path}: buckets[{key!r}]: {e}") from None
    if not fit:
        raise ValueError(f"{path}: the fit has no buckets")
    return fit, dict(payload.get("metadata", {}))


def cost_config_from_fit(path: str, model: str) -> cost_model.CostModelConfig:
    """The SimEngine's cost model from a fit file (`model` sizes the placeholder vocab)."""
    fit, _ = load_fit(path)
    return cost_model.CostModelConfig(mode="fitted", model=model, fitted_step_s=fit)


def relative_errors(real: Mapping[str, Optional[float]], simulated: Mapping[str, Optional[float]],
                    keys: Sequence[str] = COMPARED_METRICS) -> dict[str, Optional[float]]:
    """`(simulated - real) / real` per metric (None where either is missing or real is 0)."""
    errors = {}
    for key in keys:
        r, s = real.get(key), simulated.get(key)
        errors[key] = None if r is None or s is None or r == 0 else (s - r) / r
    return errors
