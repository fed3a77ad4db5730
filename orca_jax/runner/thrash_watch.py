"""Warns, once and early, when a live run thrashes (`orca_jax.results.thrash`).

`ThrashWatch` is a periodic observer (`Scheduler.run(progress=...)` through the runner's
`_observers`, which calls it every `every = CHECK_EVERY_STEPS` iterations and at the
run's end): each call it reads the scheduler's
preemption and recompute counters and, the first time they pass the thresholds,
logs one warning line on stderr (absl logging). A run that has not preempted
`MIN_PREEMPTIONS` times costs one integer comparison a check; past that, a check
counts the finished requests (one `[N]` column) and adds up the tokens of the
steps logged since the last check, every `CHECK_EVERY_STEPS` iterations only.

A cluster's run has no per-step hook: its summary.json carries the figures.
"""

from __future__ import annotations

import numpy as np
from absl import logging

from orca_jax.core.loop.scheduler import Scheduler
from orca_jax.results.thrash import MIN_PREEMPTIONS, thrash_warning

# Iterations between two checks: a thrashing plugin at 7 ms a step runs ~8,000 steps a
# minute, so the line comes within seconds of passing a threshold.
CHECK_EVERY_STEPS = 256


class ThrashWatch:
    """Logs `thrash_warning`'s line the first time a live run passes a threshold.

    Args:
      label: the run's name in the line.
    """

    # Iterations between two calls (and the run's end): `_observers` calls it no more often.
    every = CHECK_EVERY_STEPS

    def __init__(self, label: str) -> None:
        self.label = label
        self.warned = False
        self._checked_preemptions = -1  # preemptions at the last full check
        self._computed_tokens = 0  # over the steps counted so far
        self._steps_counted = 0

    def __call__(self, scheduler: Scheduler) -> None:
        if self.warned:
            return
        record = scheduler.record
        preemptions = record.num_preemptions
        if preemptions < MIN_PREEMPTIONS or preemptions == self._checked_preemptions:
            return
        self._checked_preemptions = preemptions
        new = record.steps[self._steps_counted:]  # since the last count: O(steps) in all
        self._computed_tokens += sum(step.num_tokens for step in new)
        self._steps_counted += len(new)
        line = thrash_warning(
            self.label, num_preemptions=preemptions,
            num_finished=int(np.count_nonzero(np.isfinite(scheduler.table.finish_s))),
            recomputed_tokens=record.num_recomputed_tokens,
            computed_tokens=self._computed_tokens, num_steps=scheduler.num_steps)
        if line is not None:
            self.warned = True
            logging.warning("%s", line)
