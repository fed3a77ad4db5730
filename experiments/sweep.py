"""Sweeps policies x request rates x seeds: `python -m experiments.sweep`.

    python -m experiments.sweep --policies=static,orca --rates=2,4,8,16 --seeds=0,1,2 \
        --out_dir=runs/sweep --metric=normalized_latency --throughput=req

Every point runs on the same workload for its seed (a seed fixes the lengths;
a rate only compresses the arrivals), with the shared run flags (`--rate` and
`--seed` are replaced by `--rates` and `--seeds`). Each finished point is
appended to `points.jsonl` in --out_dir (see `orca_jax.results.sweep_store`), so a
killed sweep rerun with the same command runs only the missing points; a
rerun with another workload into the same folder is refused. A point that
raises is stored failed with its error and the sweep goes on (the command then
exits 1 naming it; a rerun retries it). `--executor=ray` runs each point as a
Ray task (a local Ray, `--ray_num_cpus`, or a cluster's `--ray_address`). Then sweep.png:
the chosen latency metric against throughput, one curve per policy, mean over
seeds with a band over seeds.

Setups, not only policies: `--variants` (or `--variants_file`), as compare takes
them (`experiments.variant_flags`), sweeps every policy under every variant, over
the same rates and seeds on the same workload, each (rate, seed)'s `fit:K` ladder
fitted by one pilot of the command's own setup. Two routers:

    python -m experiments.sweep --engine=sim --policies=vllm --num_replicas=2 \
      --rates=4,8,16 --variants=rr:router=round_robin,ca:router=cache_aware

A curve (its legend entry, its rows of sweep.txt) is `POLICY@VARIANT`; its
points' lines in points.jsonl carry `variant`, sweep.json each variant's
settings (a resumed sweep refuses a label that now sets something else; new
variants may be added), and `--point_runs` folders are
points/VARIANT/POLICY/rate_R_seed_S. A sweep without variants writes what it
always did.
"""

from __future__ import annotations

import os
import sys
from typing import Sequence

from experiments.process_exit import imports_uncollected, without_final_collection

with imports_uncollected(freeze=__name__ == "__main__"):
    from absl import app, flags

    from experiments import executor_flags, policy_flags, variant_flags
    from experiments import flags as run_flags
    from experiments.policy_flags import resolve_policies
    from orca_jax.core.json_files import write_text_atomic
    from orca_jax.results.metrics import format_table
    from orca_jax.results.plots import METRIC_LABELS, plot_sweep
    from orca_jax.results.sweep_store import aggregate, point_key
    from orca_jax.runner.figure_caption import figure_caption
    from orca_jax.runner.sweep import PolicyRun, run_sweep

METRICS = {"normalized_latency": "normalized_latency_mean_s", "ttft_p99": "ttft_p99_s",
           "tpot_p99": "tpot_p99_s", "goodput": "goodput_req_s",
           "slo_attainment": "slo_attainment"}
SLO_METRICS = ("goodput", "slo_attainment")  # need --ttft_slo_s or --tpot_slo_s
THROUGHPUTS = {"req": "throughput_req_s", "tok": "throughput_tok_s"}

# --help lists the shared flags but --rate and --seed, which --rates and --seeds replace.
for _flag in flags.FLAGS.get_flags_for_module(run_flags):
    if _flag.name not in ("rate", "seed"):
        flags.declare_key_flag(_flag.name)
flags.adopt_module_key_flags(policy_flags)
flags.adopt_module_key_flags(variant_flags)

flags.DEFINE_list("rates", ["2", "4", "8", "16"], "Request rates to sweep (requests/s).")
flags.DEFINE_list("seeds", ["0"], "Workload seeds to sweep (the band is over these).")
flags.DEFINE_enum("metric", "normalized_latency", list(METRICS), "Metric of the figure: a latency, "
                  "or goodput or slo_attainment (with --ttft_slo_s and/or --tpot_slo_s).")
flags.DEFINE_enum("throughput", "req", list(THROUGHPUTS), "Throughput axis: requests/s or "
                  "output tokens/s.")
flags.DEFINE_enum("band", "minmax", ["minmax", "std"], "Band over seeds: min-max or mean ± std.")
flags.DEFINE_bool("point_runs", False, "Also write each point's run folder (requests.jsonl, "
                  "steps.jsonl, ...) under --out_dir/points/.")
executor_flags.define_executor_flags()
flags.adopt_module_key_flags(executor_flags)
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


@run_flags.clean_errors()
def main(argv: list[str]) -> None:
    del argv
    # Each variant checked as resolved, on its own settings (not the command's alone).
    spec, setups = variant_flags.command_setups()
    if spec.workload.arrival == "burst":
        raise app.UsageError("--workload=burst has every request at t=0: there is no rate to "
                             "sweep (use poisson, gamma or a trace)")
    if FLAGS.metric in SLO_METRICS and spec.ttft_slo_s is None and spec.tpot_slo_s is None:
        raise app.UsageError(f"--metric={FLAGS.metric} counts requests within the SLOs; set "
                             "--ttft_slo_s and/or --tpot_slo_s")
    entries = resolve_policies(list(FLAGS.policies), FLAGS.policy_opts)
    rates = _parse_list("rates", FLAGS.rates, float)
    seeds = _parse_list("seeds", FLAGS.seeds, int)
    # Every policy and the router of every setup load, and every knob is valid, before the
    # first point.
    variant_flags.check_setups(setups, entries)
    variants = {setup.variant: setup.spec for setup in setups if setup.variant is not None}
    runs = [PolicyRun(entry.label, entry.spec, dict(entry.options)) for entry in entries]
    executor = executor_flags.executor_from_flags()
    # A sweep that cannot run as asked (SweepError), a folder of another sweep or in use
    # (SweepConfigError): usage errors, exit 2 (cli_errors).
    store, keys = run_sweep(spec, runs, rates, seeds, FLAGS.out_dir,
                            point_runs=FLAGS.point_runs, progress=True, executor=executor,
                            variants=variants)
    x_field, y_field = THROUGHPUTS[FLAGS.throughput], METRICS[FLAGS.metric]
    curves = aggregate(store.load(), keys, x_field, y_field, band=FLAGS.band)
    rows = [{"policy": c.label, "rate": r, "num_seeds": int(n), x_field: x, y_field: y,
             f"{y_field}_low": lo, f"{y_field}_high": hi}
            for c in curves for r, n, x, y, lo, hi in
            zip(c.rates, c.num_seeds, c.x_mean, c.y_mean, c.y_low, c.y_high)]
    table = format_table(rows, list(rows[0]) if rows else ["policy"])
    print(table)
    write_text_atomic(os.path.join(FLAGS.out_dir, "sweep.txt"), table + "\n")
    figure = os.path.join(FLAGS.out_dir, "sweep.png")
    band = "min–max over seeds" if FLAGS.band == "minmax" else "±1 std over seeds"
    if plot_sweep(curves, figure, x_field=x_field, y_field=y_field, band_label=band,
                  title=f"{METRIC_LABELS[y_field]} vs {METRIC_LABELS[x_field]} "
                        f"({len(seeds)} seed{'s' * (len(seeds) > 1)})",
                  caption=figure_caption(spec, rates=rates, seeds=seeds)
                  + variant_flags.caption_note(spec, setups)):
        print(f"figure: {figure}")
    else:
        print("matplotlib is not installed: no figure (the points are in points.jsonl)")
    print(f"points in {store.points_path}")
    wanted = set(keys)
    failed = [p for p in store.load() if p.get("error") and point_key(p) in wanted]
    if failed:
        first = failed[0]
        sys.exit(f"error: {len(failed)} of {len(keys)} points failed (first: "
                 f"{point_key(first).label} "
                 f"rate={first['rate']:g} seed={first['seed']}: {first['error']}); the others "
                 "are in the store, and a rerun runs the failed ones again")


if __name__ == "__main__":
    run_flags.run_command(without_final_collection(main))
