"""A profiled clock that follows what each step holds: the real engine runs, a fit prices it.

The virtual clock of a real-engine run can advance by the wall time each step
took (repeatable only on an idle machine) or by a price fixed ahead of the run
(repeatable anywhere). A price per bucket alone — the bucket's warm-up time
with every sequence at full context — ignores how many sequences a step runs
and how long their contexts really are, so it favours whichever policy fills
buckets with short contexts. `ProfiledClock` prices a step by what it holds:

1. At warm-up it times the `step_profile` grid of compositions of every bucket
   (decodes of 1..S sequences at short to full contexts, prompts, chunks) on
   the wrapped engine, which must report wall time, and fits
   `base_s + per_seq_s * S + per_tile_s * tiles` per bucket (`fit_linear`).
2. Each step then runs on the wrapped engine (its tokens are the real ones),
   and its `step_s` is the fit's price of the step's real query and KV
   lengths.

The same step always costs the same within a run, and a fit saved with
`calibration.save_fit` can be passed back (`fit=`) so runs in other processes
price identically. That makes it reproducible, not exact: the fit's error
against the wall clock is what `benchmarks/engine_throughput.py` reports.
Nothing here imports jax.
"""

from __future__ import annotations

import logging
import time
from typing import Mapping, Optional

from orca_jax.core.engine_api import Bucket, Engine, EngineWrapper, StepInputs, StepOutput
from orca_jax.sim.calibration import fit_linear
from orca_jax.sim.cost_model import LinearStepTime, real_lengths
from orca_jax.sim.step_profile import measure_step_times

_log = logging.getLogger(__name__)


class ProfiledClock(EngineWrapper):
    """Runs `engine`'s steps and prices each by a per-bucket fit of what it holds.

    Args:
      engine: a real engine that reports measured wall time as `step_s`.
      max_model_len: the context limit (sets the grid's contexts).
      page_size: tokens per KV page.
      pages_per_seq: the engine's page-table width.
      num_pages: pages in the engine's cache, the null page included.
      num_repeats: timed passes over the grid at warm-up (the fit follows each
        composition's median over them).
      fit: a fit to price by instead of profiling (`{bucket tokens: LinearStepTime}`,
        e.g. `calibration.load_fit(path)[0]`); it must cover every warmed bucket.
    """

    def __init__(self, engine: Engine, *, max_model_len: int, page_size: int,
                 pages_per_seq: int, num_pages: int, num_repeats: int = 2,
                 fit: Optional[Mapping[int, LinearStepTime]] = None) -> None:
        if num_repeats < 1:
            raise ValueError(f"ProfiledClock: num_repeats={num_repeats} must be >= 1")
        super().__init__(engine)
        self._grid = dict(max_model_len=max_model_len, page_size=page_size,
                          pages_per_seq=pages_per_seq, num_pages=num_pages)
        self.num_repeats = num_repeats
        self._fit: dict[int, LinearStepTime] = dict(fit or {})
        self._fit_given = fit is not None
        self._warm: frozenset[Bucket] = frozenset()

    @property
    def fit(self) -> dict[int, LinearStepTime]:
        """The per-bucket price model (empty before warm-up unless one was given)."""
        return dict(self._fit)

    def _prepare(self, buckets: list[Bucket]) -> None:
        missing = [b for b in buckets if b.num_tokens not in self._fit]
        if missing and self._fit_given:
            raise ValueError(f"ProfiledClock.warmup: the given fit has no price for buckets "
                             f"{[b.num_tokens for b in missing]}; fitted: {sorted(self._fit)}")
        if missing:  # profiled once: a later warm-up of the same buckets (compare) reuses it
            _log.info("profiled clock: timing a grid of step compositions of %d buckets",
                      len(missing))
            start = time.perf_counter()
            samples = measure_step_times(self.engine, missing, num_repeats=self.num_repeats,
                                         **self._grid)
            self._fit.update(fit_linear(samples, self._grid["page_size"]))
            _log.info("profiled clock: fitted in %.1f s", time.perf_counter() - start)
        else:
            self.engine.warmup(buckets)
        self._warm = self._warm | frozenset(buckets)

    def step(self, inputs: StepInputs) -> StepOutput:
        """Runs the step on the wrapped engine; `step_s` is the fit's price of it."""
        self._check_warm(inputs.bucket, self._warm)
        output = self.engine.step(inputs)
        q_lens, kv_lens = real_lengths(inputs)
        return StepOutput(sampled_tokens=output.sampled_tokens,
                          step_s=self._fit[inputs.bucket.num_tokens].seconds(q_lens, kv_lens))
