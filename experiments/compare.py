"""Compares policies on one identical workload: `python -m experiments.compare`.

Each policy runs on the same requests (built once from the seed) and the same
bucket set; results go to one subfolder per policy under --out_dir, with a
table (comparison.txt, comparison.json) and, with matplotlib installed, a figure
(comparison.png).
"""

from __future__ import annotations

import os

from absl import app

from experiments import flags as run_flags
from experiments.policy_flags import options_by_policy, policy_label
from orca_jax.core.json_files import to_json_value, write_json_atomic
from orca_jax.runner.build import build_engine, build_workload, scheduler_config
from orca_jax.runner.experiment import run_policy
from orca_jax.results.metrics import format_table

def _plot(summaries: list[dict], path: str) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    metrics = [("throughput_tok_s", "output tokens/s"), ("latency_p50_s", "latency p50 (s)"),
               ("normalized_latency_mean_s", "normalized latency (s/token)"),
               ("ttft_p99_s", "TTFT p99 (s)")]
    fig, axes = plt.subplots(1, len(metrics), figsize=(4 * len(metrics), 3.2))
    names = [s["policy_label"] for s in summaries]
    for ax, (key, label) in zip(axes, metrics):
        ax.bar(names, [s.get(key) or 0.0 for s in summaries], color="tab:blue")
        ax.set_title(label, fontsize=10)
        ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


@run_flags.clean_errors()
def main(argv: list[str]) -> None:
    del argv
    spec = run_flags.spec_from_flags()
    names = list(run_flags.FLAGS.policies)
    options = options_by_policy(run_flags.FLAGS.policy_opts, names)
    requests = build_workload(spec)
    # One engine for every policy: the very same compiled steps (and the same KV cache
    # buffers) serve each of them.
    engine = build_engine(spec, scheduler_config(spec))
    summaries = []
    for name in names:
        label = policy_label(name)
        summary, _ = run_policy(spec, name, options.get(name),
                                out_dir=os.path.join(run_flags.FLAGS.out_dir,
                                                     label.replace("/", "_")),
                                requests=requests, engine=engine)
        summary["policy_label"] = label
        summaries.append(summary)
    table = format_table(summaries, list(run_flags.TABLE_COLUMNS))
    print(table)
    out = run_flags.FLAGS.out_dir
    with open(os.path.join(out, "comparison.txt"), "w") as f:
        f.write(table + "\n")
    write_json_atomic(os.path.join(out, "comparison.json"), to_json_value(summaries),
                      sort_keys=False)
    if _plot(summaries, os.path.join(out, "comparison.png")):
        print(f"figure: {os.path.join(out, 'comparison.png')}")
    print(f"results in {out}")


if __name__ == "__main__":
    app.run(main)
