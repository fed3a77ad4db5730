"""Simulator fidelity: `python -m experiments.calibrate --model=tiny`.

Measures the real engine's step times on a fixed grid of step compositions
per bucket (wall clock, medians of repeats), fits the simulator's cost model
to them, saves the fit (--out_dir/cost_fit.json, usable as `--engine=sim
--cost_fit=PATH`), then runs the same workload and policies on the real engine
(wall clock) and on the fitted simulator and reports the relative error in
total time, mean TTFT and mean TPOT (calibration.txt, calibration.json).
"""

from __future__ import annotations

import dataclasses
import os
import statistics
from typing import Any, Mapping, Optional, Sequence

import numpy as np
from absl import app, flags

from experiments import flags as run_flags
from experiments.policy_flags import options_by_policy
from experiments.process_exit import without_final_collection
from orca_jax.core.json_files import to_json_value, write_json_atomic, write_jsonl_atomic
from orca_jax.core.requests.run_result import RunResult
from orca_jax.core.step.packing import bucket_config_for
from orca_jax.results import metrics
from orca_jax.runner import build, experiment
from orca_jax.runner.spec import JaxEngineSpec, RunSpec, SimEngineSpec
from orca_jax.sim.calibration import (
    COMPARED_METRICS,
    RecordingEngine,
    busy_time_ratio,
    fit_linear,
    predict,
    relative_errors,
    save_fit,
)
from orca_jax.sim.step_profile import profile_grid, samples_from_times, time_grid


def mean_latencies(result: RunResult) -> dict[str, Optional[float]]:
    """Mean TTFT and mean TPOT over a finished run's finished requests."""
    per_request = metrics.request_metrics(result.arrival_s, result.first_scheduled_s,
                                          result.first_token_s, result.finish_s,
                                          result.output_len, result.token_req,
                                          result.token_time_s, token_stats=result.token_stats)
    out = {}
    for name in ("ttft", "tpot"):
        values = per_request[f"{name}_s"]
        values = values[np.isfinite(values)]
        out[f"{name}_mean_s"] = float(values.mean()) if values.size else None
    return out


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


def run_calibration(spec: RunSpec, policies: Sequence[str], out_dir: str, *,
                    policy_options: Optional[Mapping[str, Mapping[str, str]]] = None,
                    num_repeats: int = 5, num_real_runs: int = 2, statistic: str = "median",
                    log: Any = print) -> dict[str, Any]:
    """Profiles the real engine, runs each policy on it, fits, then runs each on the fit.

    Profiling is `num_repeats` passes over the grid before the real runs and one
    more after each real run, so the fit samples the machine's load over the
    same minutes as the runs it is compared with; it never sees those runs.

    Args:
      spec: a `RunSpec` with a `JaxEngineSpec` engine (its clock is forced to `wall`).
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
    if not isinstance(spec.engine, JaxEngineSpec):
        raise ValueError(f"run_calibration: spec.engine is {spec.engine!r}, needs a "
                         "JaxEngineSpec")
    if num_real_runs < 1:
        raise ValueError(f"run_calibration: num_real_runs={num_real_runs} must be >= 1")
    engine_spec = dataclasses.replace(spec.engine, clock="wall")
    spec = dataclasses.replace(spec, engine=engine_spec)
    config = build.scheduler_config(spec)
    limits, page_size = config.limits, config.kv.page_size
    engine = build.build_engine(spec, config)
    buckets = bucket_config_for(max_num_tokens=limits.max_num_tokens,
                                max_num_seqs=limits.max_num_seqs,
                                max_model_len=limits.max_model_len, page_size=page_size,
                                token_sizes=limits.token_buckets).buckets()
    os.makedirs(out_dir, exist_ok=True)
    load_before = os.getloadavg()[0]
    engine.warmup(buckets)
    grid = profile_grid(buckets, max_model_len=limits.max_model_len, page_size=page_size,
                        pages_per_seq=engine.pages_per_seq, num_pages=engine.num_cache_pages)
    time_grid(engine, grid, 1)
    times = time_grid(engine, grid, num_repeats)
    requests = build.build_workload(spec)
    options = policy_options or {}
    real_runs: dict[str, list[dict[str, Any]]] = {}
    recorders: dict[str, list[RecordingEngine]] = {}
    for policy in policies:
        label = policy.replace("/", "_").replace(":", "_")
        for index in range(num_real_runs):
            recorder = RecordingEngine(engine)
            summary, run_result = experiment.run_policy(
                spec, policy, options.get(policy),
                out_dir=os.path.join(out_dir, "real", label, f"run{index}"),
                requests=requests, engine=recorder, progress=False)
            real_runs.setdefault(policy, []).append(
                {**summary, **mean_latencies(run_result), "load_average_1m": os.getloadavg()[0]})
            recorders.setdefault(policy, []).append(recorder)
            # One more profiling pass after every real run: the fit samples the
            # machine's load over the same minutes as the runs it is compared with.
            times += time_grid(engine, grid, 1)
            log(f"{policy} real run {index}: load {os.getloadavg()[0]:.2f}")

    samples = samples_from_times(grid, times)
    fit = fit_linear(samples, page_size, statistic)
    residuals = [predict(fit, s) / s.statistic(statistic) - 1 for s in samples]
    quality = {"num_samples": len(samples), "num_passes": len(times),
               "fit_abs_error_median": float(np.median(np.abs(residuals))),
               "fit_abs_error_max": float(np.max(np.abs(residuals))),
               "repeat_spread_median": float(np.median([s.spread for s in samples])),
               "load_average_1m": [load_before, os.getloadavg()[0]]}
    write_jsonl_atomic(os.path.join(out_dir, "profile.jsonl"), (
        {"bucket": sample.bucket.num_tokens, "q_lens": sample.q_lens, "kv_lens": sample.kv_lens,
         "seconds": sample.seconds, "mean_s": sample.mean_s, "min_s": sample.min_s,
         "spread": sample.spread,
         "fit_error": residual} for sample, residual in zip(samples, residuals)))
    fit_path = os.path.join(out_dir, "cost_fit.json")
    save_fit(fit_path, fit, {"model": engine_spec.model, "dtype": engine_spec.dtype, "attention":
                             engine.attention, "page_size": page_size,
                             "statistic": statistic, **quality})
    log(f"fit: {len(samples)} compositions x {len(times)} passes, median |error| "
        f"{100 * quality['fit_abs_error_median']:.1f}%, repeat spread "
        f"{100 * quality['repeat_spread_median']:.1f}% -> {fit_path}")

    sim_spec = dataclasses.replace(
        spec, engine=SimEngineSpec(model=engine_spec.model, tp=engine_spec.tp, cost_fit=fit_path),
        limits=dataclasses.replace(spec.limits, num_kv_pages=config.kv.num_kv_pages,
                                   max_model_len=limits.max_model_len))
    rows = []
    for policy in policies:
        label = policy.replace("/", "_").replace(":", "_")
        summary, run_result = experiment.run_policy(
            sim_spec, policy, options.get(policy), out_dir=os.path.join(out_dir, "sim", label),
            requests=requests, progress=False)
        simulated = {**summary, **mean_latencies(run_result)}
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
    result = {"model": engine_spec.model, "fit_path": fit_path, "fit_quality": quality,
              "load_average_1m_end": os.getloadavg()[0], "rows": rows}
    with open(os.path.join(out_dir, "calibration.txt"), "w") as f:
        f.write(table + "\n")
    write_json_atomic(os.path.join(out_dir, "calibration.json"), to_json_value(result),
                      sort_keys=False)
    log(table)
    return result


flags.DEFINE_integer("num_repeats", 5, "Timed repeats of each profiled step composition.",
                     lower_bound=1)
flags.DEFINE_integer("num_real_runs", 2, "Real-engine runs of each policy (their median is "
                     "the reference; their spread shows the machine's noise).", lower_bound=1)
flags.DEFINE_enum("fit_statistic", "median", ["median", "mean"], "What the fit follows for "
                  "each profiled composition: the median of its repeats (robust to bursts of "
                  "load) or their mean.")
run_flags.FLAGS.set_default("out_dir", "runs/calibration")
run_flags.FLAGS.set_default("policies", ["orca", "static"])


@run_flags.clean_errors()
def main(argv: list[str]) -> None:
    del argv
    if run_flags.FLAGS.engine != "jax":
        raise app.UsageError(f"--engine={run_flags.FLAGS.engine}: calibrate measures the real "
                             "engine; use --engine=jax")
    if run_flags.FLAGS.cost_fit:
        raise app.UsageError("--cost_fit: calibrate writes a fit; it does not read one")
    spec = run_flags.spec_from_flags()
    names = list(run_flags.FLAGS.policies)
    run_calibration(spec, names, run_flags.FLAGS.out_dir,
                    policy_options=options_by_policy(run_flags.FLAGS.policy_opts, names),
                    num_repeats=run_flags.FLAGS.num_repeats,
                    num_real_runs=run_flags.FLAGS.num_real_runs,
                    statistic=run_flags.FLAGS.fit_statistic)
    print(f"results in {run_flags.FLAGS.out_dir}")


if __name__ == "__main__":
    run_flags.run_command(without_final_collection(main))
