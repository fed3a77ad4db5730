"""Simulator fidelity: `python -m experiments.calibrate --model=tiny`.

Measures the real engine's step times on a fixed grid of step compositions
per bucket (wall clock, medians of repeats), fits the simulator's cost model
to them, saves the fit (--out_dir/cost_fit.json, usable as `--engine=sim
--cost_fit=PATH`), then runs the same workload and policies on the real engine
(wall clock) and on the fitted simulator and reports the relative error in
total time, mean TTFT and mean TPOT (calibration.txt, calibration.json).
"""

from __future__ import annotations

from absl import app, flags

from experiments import flags as run_flags
from experiments.policy_flags import options_by_policy
from orca_jax.calibration import run_calibration

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
    app.run(main)
