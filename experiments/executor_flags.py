"""Where a grid's points run: `--executor`, `--ray_address`, `--ray_num_cpus`.

One definition for every command that runs a grid through the sweep runner:
`experiments.sweep` defines them on absl's global flags, each reproduction on
its own `FlagValues` (`experiments.reproduce.common.reproduction_flags`).
"""

from __future__ import annotations

from absl import app, flags

from orca_jax.runner.sweep import SweepExecutor


def define_executor_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
    """Defines `--executor`, `--ray_address` and `--ray_num_cpus` on `flag_values`."""
    flags.DEFINE_enum("executor", "serial", ["serial", "ray"], "Where points run: here, one "
                      "after another, or one Ray task each (pip install -e \".[ray]\"); this "
                      "process alone writes the store either way.", flag_values=flag_values)
    flags.DEFINE_string("ray_address", None, "--executor=ray: a running Ray cluster's address "
                        "(ray start --head prints it); unset starts a local Ray.",
                        flag_values=flag_values)
    flags.DEFINE_integer("ray_num_cpus", None, "--executor=ray without --ray_address: the "
                         "local Ray's CPUs, i.e. points at once (default: every CPU).",
                         lower_bound=1, flag_values=flag_values)


def executor_from_flags(flag_values: flags.FlagValues = flags.FLAGS) -> SweepExecutor:
    """The `SweepExecutor` the parsed flags name.

    Raises:
      app.UsageError: `--ray_address` or `--ray_num_cpus` without `--executor=ray`.
    """
    if flag_values.executor != "ray" and (flag_values.ray_address or flag_values.ray_num_cpus):
        raise app.UsageError("--ray_address and --ray_num_cpus need --executor=ray")
    return SweepExecutor(flag_values.executor, flag_values.ray_address,
                         flag_values.ray_num_cpus)
