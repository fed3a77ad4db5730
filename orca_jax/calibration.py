"""Simulator fidelity: measure the real engine's steps, fit the cost model, compare runs.

Three parts, used in order by `experiments.calibrate`:

1. **Measure** (`orca_jax.step_profile`). A grid of step compositions per bucket,
   fixed by the bucket and the context limit rather than any workload, each run
   on a real engine's compiled step (`JaxEngine.step`, wall clock), repeatedly.
2. **Fit.** `fit_linear` fits, per bucket, the `cost_model.LinearStepTime`
   model `base_s + per_seq_s * S + per_tile_s * tiles` by non-negative least
   squares on relative residuals (a 2 ms step matters as much as a 60 ms one).
   `save_fit` / `load_fit` write and read it as JSON; `cost_config_from_fit`
   turns it into the SimEngine's `CostModelConfig(mode="fitted")`.
3. **Compare.** `relative_errors` puts a simulated run's metrics beside the
   real run's. The evaluation workload is never seen by the fit.

Host module: nothing here imports jax (the real engine is built by
`orca_jax.experiment`, which imports it lazily).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import statistics
from typing import Any, Mapping, Optional, Sequence

import numpy as np
from numpy.typing import NDArray

from orca_jax import cost_model
from orca_jax.engine_api import Bucket, Engine, StepInputs
from orca_jax.step_profile import (StepSample, profile_grid, reference_tiles,
                                   samples_from_times, time_grid)

FIT_FORMAT = "orca_jax.cost_fit/1"
COMPARED_METRICS = ("duration_s", "ttft_mean_s", "tpot_mean_s")
FIT_STATISTICS = ("median", "mean")
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
      statistic: fit each composition's `median` (robust to bursts of load) or
        `mean` (what sums of step times follow when the load is the same later).

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
        seconds = np.array([g.seconds if statistic == "median" else g.mean_s
                            for g in group])  # [num_samples]
        coef = _nnls(features / seconds[:, None], np.ones_like(seconds))
        fit[bucket.num_tokens] = cost_model.LinearStepTime(
            base_s=float(coef[0]), per_seq_s=float(coef[1]), per_tile_s=float(coef[2]),
            q_tile=q_tile, kv_tile=kv_tile)
    return fit


class RecordingEngine:
    """Wraps an engine and keeps `(bucket tokens, q_lens, kv_lens, step_s)` of every step.

    Lets a real run's own steps be priced by a fit afterwards (a diagnostic of
    where simulated and real runs part; nothing is fitted to it).
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.steps: list[tuple[int, NDArray[np.int64], NDArray[np.int64], float]] = []

    @property
    def name(self) -> str:
        return self.engine.name

    @property
    def needs_token_ids(self) -> bool:
        return self.engine.needs_token_ids

    def warmup(self, buckets: Sequence[Bucket]) -> None:
        self.engine.warmup(buckets)

    def step(self, inputs: StepInputs) -> Any:
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
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


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


def mean_latencies(scheduler: Any) -> dict[str, Optional[float]]:
    """Mean TTFT and mean TPOT over a finished run's finished requests (a `Scheduler`)."""
    from orca_jax import metrics
    table = scheduler.table
    per_request = metrics.request_metrics(table.arrival_s, table.first_scheduled_s,
                                          table.first_token_s, table.finish_s, table.output_len,
                                          *scheduler.record.token_log())
    out = {}
    for name in ("ttft", "tpot"):
        values = per_request[f"{name}_s"]
        values = values[np.isfinite(values)]
        out[f"{name}_mean_s"] = float(values.mean()) if values.size else None
    return out


def relative_errors(real: Mapping[str, Optional[float]], simulated: Mapping[str, Optional[float]],
                    keys: Sequence[str] = COMPARED_METRICS) -> dict[str, Optional[float]]:
    """`(simulated - real) / real` per metric (None where either is missing or real is 0)."""
    errors = {}
    for key in keys:
        r, s = real.get(key), simulated.get(key)
        errors[key] = None if r is None or s is None or r == 0 else (s - r) / r
    return errors


def _format_table(rows: Sequence[Mapping[str, Any]]) -> str:
    header = (f"{'policy':<10} {'metric':<12} {'real (each run)':<28} {'real':>9} {'sim':>9} "
              f"{'error':>8}")
    lines = [header, "-" * len(header)]
    for row in rows:
        runs = ", ".join(f"{v:.4f}" for v in row["real_runs"])
        error = "n/a" if row["error"] is None else f"{100 * row['error']:+.1f}%"
        lines.append(f"{row['policy']:<10} {row['metric']:<12} {runs:<28} {row['real']:>9.4f} "
                     f"{row['sim']:>9.4f} {error:>8}")
    return "\n".join(lines)


def run_calibration(spec: Any, policies: Sequence[str], out_dir: str, *,
                    policy_options: Optional[Mapping[str, Mapping[str, str]]] = None,
                    num_repeats: int = 5, num_real_runs: int = 2, statistic: str = "median",
                    log: Any = print) -> dict[str, Any]:
    """Profiles the real engine, runs each policy on it, fits, then runs each on the fit.

    Profiling is `num_repeats` passes over the grid before the real runs and one
    more after each real run, so the fit samples the machine's load over the
    same minutes as the runs it is compared with; it never sees those runs.

    Args:
      spec: an `experiment.RunSpec` with `engine="jax"` (its clock is forced to `wall`).
      policies: policy specs evaluated on the spec's workload, real and simulated.
      policy_options: each policy's knobs as text, by policy spec.
      out_dir: gets cost_fit.json, profile.jsonl, calibration.txt, calibration.json and
        one results folder per run (real/POLICY/runN, sim/POLICY).
      num_repeats: timed passes over the grid before the first real run.
      num_real_runs: real runs per policy; the reference value is their median.
      statistic: what the fit follows per composition (`fit_linear`).
      log: where progress lines go.

    Returns:
      The calibration.json content: fit quality, noise, and the error rows.
    """
    from orca_jax import experiment
    from orca_jax.packing import bucket_config_for

    if spec.engine != "jax":
        raise ValueError(f"run_calibration: spec.engine={spec.engine!r}, needs 'jax'")
    if num_real_runs < 1:
        raise ValueError(f"run_calibration: num_real_runs={num_real_runs} must be >= 1")
    spec = dataclasses.replace(spec, clock="wall")
    config = experiment.scheduler_config(spec)
    engine = experiment.build_engine(spec, config)
    buckets = bucket_config_for(token_budget=config.token_budget,
                                max_num_seqs=config.max_batch_size,
                                max_model_len=config.max_model_len, page_size=config.page_size,
                                token_sizes=config.token_buckets).buckets()
    os.makedirs(out_dir, exist_ok=True)
    load_before = os.getloadavg()[0]
    engine.warmup(buckets)
    grid = profile_grid(buckets, max_model_len=config.max_model_len, page_size=config.page_size,
                        pages_per_seq=engine.pages_per_seq, num_pages=engine.num_pages)
    time_grid(engine, grid, 1)
    times = time_grid(engine, grid, num_repeats)
    requests = experiment.build_workload(spec)
    options = policy_options or {}
    real_runs: dict[str, list[dict[str, Any]]] = {}
    recorders: dict[str, list[RecordingEngine]] = {}
    for policy in policies:
        label = policy.replace("/", "_").replace(":", "_")
        for index in range(num_real_runs):
            recorder = RecordingEngine(engine)
            summary, scheduler = experiment.run_policy(
                spec, policy, options.get(policy),
                out_dir=os.path.join(out_dir, "real", label, f"run{index}"),
                requests=requests, engine=recorder, progress=False)
            real_runs.setdefault(policy, []).append(
                {**summary, **mean_latencies(scheduler), "load_average_1m": os.getloadavg()[0]})
            recorders.setdefault(policy, []).append(recorder)
            # One more profiling pass after every real run: the fit samples the
            # machine's load over the same minutes as the runs it is compared with.
            times += time_grid(engine, grid, 1)
            log(f"{policy} real run {index}: load {os.getloadavg()[0]:.2f}")

    samples = samples_from_times(grid, times)
    fit = fit_linear(samples, config.page_size, statistic)
    residuals = [predict(fit, s) / (s.seconds if statistic == "median" else s.mean_s) - 1
                 for s in samples]
    quality = {"num_samples": len(samples), "num_passes": len(times),
               "fit_abs_error_median": float(np.median(np.abs(residuals))),
               "fit_abs_error_max": float(np.max(np.abs(residuals))),
               "repeat_spread_median": float(np.median([s.spread for s in samples])),
               "load_average_1m": [load_before, os.getloadavg()[0]]}
    with open(os.path.join(out_dir, "profile.jsonl"), "w") as f:
        for sample, residual in zip(samples, residuals):
            f.write(json.dumps({"bucket": sample.bucket.num_tokens, "q_lens": sample.q_lens,
                                "kv_lens": sample.kv_lens, "seconds": sample.seconds,
                                "mean_s": sample.mean_s, "spread": sample.spread,
                                "fit_error": residual}) + "\n")
    fit_path = os.path.join(out_dir, "cost_fit.json")
    save_fit(fit_path, fit, {"model": spec.model, "dtype": spec.dtype, "attention":
                             engine.attention, "page_size": config.page_size,
                             "statistic": statistic, **quality})
    log(f"fit: {len(samples)} compositions x {len(times)} passes, median |error| "
        f"{100 * quality['fit_abs_error_median']:.1f}%, repeat spread "
        f"{100 * quality['repeat_spread_median']:.1f}% -> {fit_path}")

    sim_spec = dataclasses.replace(spec, engine="sim", cost_fit=fit_path,
                                   num_kv_pages=config.num_kv_pages,
                                   max_model_len=config.max_model_len)
    rows = []
    for policy in policies:
        label = policy.replace("/", "_").replace(":", "_")
        summary, scheduler = experiment.run_policy(
            sim_spec, policy, options.get(policy), out_dir=os.path.join(out_dir, "sim", label),
            requests=requests, progress=False)
        simulated = {**summary, **mean_latencies(scheduler)}
        runs = real_runs[policy]
        real = {key: statistics.median(run[key] for run in runs) for key in COMPARED_METRICS}
        errors = relative_errors(real, simulated)
        on_own_steps = [busy_time_ratio(fit, r.steps) for r in recorders[policy]]
        for key in COMPARED_METRICS:
            rows.append({"policy": policy, "metric": key,
                         "real_load_average_1m": [run["load_average_1m"] for run in runs],
                         "fit_on_real_steps": on_own_steps,
                         "real_runs": [run[key] for run in runs], "real": real[key],
                         "sim": simulated[key], "error": errors[key]})
        log(f"{policy}: fit on the real runs' own steps {on_own_steps}")
        log(f"{policy}: " + ", ".join(f"{k} {100 * e:+.1f}%" for k, e in errors.items()
                                      if e is not None))
    table = _format_table(rows)
    result = {"model": spec.model, "fit_path": fit_path, "fit_quality": quality,
              "load_average_1m_end": os.getloadavg()[0], "rows": rows}
    with open(os.path.join(out_dir, "calibration.txt"), "w") as f:
        f.write(table + "\n")
    with open(os.path.join(out_dir, "calibration.json"), "w") as f:
        json.dump(result, f, indent=2)
    log(table)
    return result
