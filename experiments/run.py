"""Runs one policy: `python -m experiments.run --policy=orca --engine=sim ...`.

Writes config.json, requests.jsonl, steps.jsonl and summary.json to --out_dir
and prints the summary as a table.
"""

from __future__ import annotations

from absl import app, flags

import policies
from experiments import flags as run_flags
from orca_jax.results.metrics import format_table
from orca_jax.runner.experiment import run_policy

flags.DEFINE_string("policy", "orca", "Policy: a registered name, package.module:Class, or "
                    "path/to/file.py:Class.")


@run_flags.clean_errors()
def main(argv: list[str]) -> None:
    del argv
    spec = run_flags.spec_from_flags()
    options = policies.parse_options(run_flags.FLAGS.policy_opts)
    summary, _ = run_policy(spec, run_flags.FLAGS.policy, options,
                            out_dir=run_flags.FLAGS.out_dir)
    print(format_table([summary], list(run_flags.TABLE_COLUMNS)))
    print(f"results in {run_flags.FLAGS.out_dir}")


if __name__ == "__main__":
    app.run(main, flags_parser=run_flags.parse_flags)
