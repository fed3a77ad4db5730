"""A sweep's errors, apart from the store and the runner that raise them.

The commands turn each into one line and exit status 2
(`experiments/cli_errors.py`'s `USAGE_ERRORS`); naming them from here lets every
command, a single run's included, do so without importing the sweep store
(`sweep_store`) and the sweep's point runner (`orca_jax.runner.sweep_point`),
which only a sweep uses. Both modules still export them under these names.
"""

from __future__ import annotations


class SweepError(ValueError):
    """A sweep that cannot run as asked (names the policies or the trace at fault)."""


class SweepConfigError(ValueError):
    """The sweep folder holds results of a different configuration."""


class SweepPointsError(ValueError):
    """A line of `points.jsonl` that is not a sweep point (and not a write cut short)."""
