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
   lengths. Through pipeline stages (a wrapped engine of `num_stages` > 1 and
   `stage_layers`) the price is split over the stages by their layers, known at
   dispatch (`dispatch_stages`), so micro-batches stay in flight.

Each composition's price is the fastest of `num_repeats` timed passes (after
one untimed one): other processes' load can only add to a step's time, so the
minimum moves least with it (the median of two passes, before, followed the load).

The same step always costs the same within a run. Across processes the table
is what repeats a run, two ways:

* `store` (`orca_jax.sim.profile_store`, what commands use by default): the
  table is kept in a folder of the user's cache under a key of everything that
  changes a step's time (`identity`, `setup`: the machine and the compiled
  step's variant, the warmed buckets, the grid and the timing method); a later
  process with the same key reads it and times nothing, so two commands on one
  machine price steps identically, loaded or idle. `fresh` times it again and
  replaces it; a stored table that cannot be used is reported in one line and
  timed again.
* `table_file` names a file (the `calibration.save_fit` format, so it also
  serves the simulator as a `--cost_fit`) that is loaded if it exists — checked
  against `identity`, what the table was measured for (model, dtype, attention,
  page geometry) and the warmed buckets, not the machine (another host may price
  by it) — and written after profiling otherwise; a rerun with it prices every
  step bit for bit as the first run did.

That makes it reproducible, not exact: the fit's error against the wall clock
is what `benchmarks/profiled_clock.py` reports. Nothing here imports jax.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from typing import Any, Mapping, Optional

import numpy as np
from numpy.typing import NDArray

from orca_jax.core.json_files import to_json_value
from orca_jax.core.step.engine_api import (
    Bucket,
    Engine,
    EngineConfigError,
    EngineWrapper,
    PackedStep,
    PendingStep,
    StepInputs,
    StepOutput,
)
from orca_jax.sim.calibration import fit_linear, load_fit, save_fit
from orca_jax.sim.cost_model import LinearStepTime, real_lengths
from orca_jax.sim.profile_store import ProfileStore, StoredTable, machine_name, table_key
from orca_jax.sim.step_profile import measure_grid, profile_grid

_log = logging.getLogger(__name__)
# Timed passes over the grid at warm-up, each composition priced by its fastest: with
# fresh tables beside two busy loops on 2 cores the main job's tok/s moved ~3% (medians;
# the median of 2 passes, before: -40%, issue 50), and each pass adds ~0.6 s to a
# first run there (docs/calibration.md).
NUM_REPEATS = 5


class ProfiledClock(EngineWrapper):
    """Runs `engine`'s steps and prices each by a per-bucket fit of what it holds.

    Args:
      engine: a real engine that reports measured wall time as `step_s`.
      max_model_len: the context limit (sets the grid's contexts).
      page_size: tokens per KV page.
      pages_per_seq: the engine's page-table width.
      num_pages: pages in the engine's cache, the null page included.
      num_repeats: timed passes over the grid at warm-up (the fit follows each
        composition's fastest).
      fit: a fit to price by instead of profiling (`{bucket tokens: LinearStepTime}`,
        e.g. `calibration.load_fit(path)[0]`); it must cover every warmed bucket.
      table_file: the per-bucket table's file: loaded (and checked against
        `identity` and the warmed buckets) if it exists, else written once profiled.
      identity: what the table is measured for (JSON values: the model, dtype,
        attention, ...); a loaded table must say the same. The grid's geometry
        (context, page size, page-table width, pages) is always part of it.
      store: where tables are kept across processes (`profile_store.current()`):
        a warm-up reads the table of its key there, else times the grid and
        stores it. Not with `fit` or `table_file`.
      setup: what else changes a step's time, beyond `identity` (JSON values: the
        machine, `profile_store.describe_machine`, and the compiled step's
        variant): part of a stored table's key, not checked in a `table_file`.
      fresh: with `store`: time the grid even where a table is stored, and
        replace it.

    Raises:
      EngineConfigError: `table_file` exists but is no table, or one measured for
        something else (naming the file and the first field that differs).
    """

    def __init__(self, engine: Engine, *, max_model_len: int, page_size: int,
                 pages_per_seq: int, num_pages: int, num_repeats: int = NUM_REPEATS,
                 fit: Optional[Mapping[int, LinearStepTime]] = None,
                 table_file: Optional[str] = None,
                 identity: Optional[Mapping[str, Any]] = None,
                 store: Optional[ProfileStore] = None,
                 setup: Optional[Mapping[str, Any]] = None, fresh: bool = False) -> None:
        if num_repeats < 1:
            raise ValueError(f"ProfiledClock: num_repeats={num_repeats} must be >= 1")
        if fit is not None and table_file is not None:
            raise ValueError("ProfiledClock: give a fit or a table_file, not both")
        if store is not None and (fit is not None or table_file is not None):
            raise ValueError("ProfiledClock: a store keeps the tables this clock times; "
                             "not with a given fit or table_file")
        super().__init__(engine)
        self._grid = dict(max_model_len=max_model_len, page_size=page_size,
                          pages_per_seq=pages_per_seq, num_pages=num_pages)
        self.num_repeats = num_repeats
        self.identity: dict[str, Any] = to_json_value({**dict(identity or {}), **self._grid})
        self.store, self.fresh = store, fresh
        self.setup: dict[str, Any] = to_json_value(dict(setup or {}))
        # The stored tables this clock priced by, one per warm-up that had new buckets.
        self.stored: list[StoredTable] = []
        self.num_timed_steps = 0  # steps run to time the grid (none when every table was read)
        self.table_file = table_file
        self.table_loaded = table_file is not None and os.path.exists(table_file)
        if self.table_loaded:
            fit = self._load_table(table_file)
        self._fit: dict[int, LinearStepTime] = dict(fit or {})
        self._fit_given = fit is not None
        self._warm: frozenset[Bucket] = frozenset()

    @property
    def fit(self) -> dict[int, LinearStepTime]:
        """The per-bucket price model (empty before warm-up unless one was given)."""
        return dict(self._fit)

    def _load_table(self, path: str) -> dict[int, LinearStepTime]:
        try:
            fit, metadata = load_fit(path)
        except (OSError, ValueError) as e:
            raise EngineConfigError(f"profile table {path}: {e}") from None
        differ = [f"{key}={metadata.get(key)!r} (this run: {want!r})"
                  for key, want in self.identity.items() if metadata.get(key) != want]
        if differ:
            raise EngineConfigError(
                f"profile table {path} was measured for another setup: {', '.join(differ)}; "
                f"give another --profile_table (a missing one is measured and written)")
        return fit

    def _prepare(self, buckets: list[Bucket]) -> None:
        tokens = sorted({b.num_tokens for b in buckets})
        if self.table_loaded and sorted(self._fit) != tokens:
            raise EngineConfigError(f"profile table {self.table_file} has buckets "
                                    f"{sorted(self._fit)}, this run has {tokens}")
        missing = [b for b in buckets if b.num_tokens not in self._fit]
        if missing and self._fit_given:
            raise ValueError(f"ProfiledClock.warmup: the given fit has no price for buckets "
                             f"{[b.num_tokens for b in missing]}; fitted: {sorted(self._fit)}")
        if missing:  # profiled once: a later warm-up of the same buckets (compare) reuses it
            self._fit.update(self._table_of(missing))
            if self.table_file is not None:
                self.save_table(self.table_file)
        else:
            self.engine.warmup(buckets)
        self._warm = self._warm | frozenset(buckets)

    def _table_of(self, buckets: list[Bucket]) -> dict[int, LinearStepTime]:
        """The table of `buckets`, read from the store or timed (and stored); the
        wrapped engine warmed up on them either way."""
        grid = profile_grid(buckets, **self._grid)
        key = None
        if self.store is not None:
            key = table_key(self.identity, self.setup,
                            [(b.num_tokens, b.num_seqs) for b in buckets],
                            [(b.num_tokens, b.num_seqs, q, k) for b, q, k, _ in grid],
                            self.num_repeats)
            found = None if self.fresh else self.store.load(key, [b.num_tokens for b in buckets])
            if found is not None:
                fit, table = found
                self.engine.warmup(buckets)
                self.table_loaded = not self.num_timed_steps
                self.stored.append(table)
                _log.info("%s", table.line())
                return fit
        _log.info("profiled clock: timing a grid of step compositions of %d buckets",
                  len(buckets))
        start = time.perf_counter()
        samples = measure_grid(self.engine, grid, self.num_repeats)
        self.num_timed_steps += len(grid) * (1 + self.num_repeats)
        self.table_loaded = False
        fit = fit_linear(samples, self._grid["page_size"], statistic="min")
        _log.info("profiled clock: fitted in %.1f s", time.perf_counter() - start)
        if key is not None:  # timed for the store
            assert self.store is not None
            table = self.store.save(key, fit, {"kind": "profiled_clock", **self.identity},
                                    machine=machine_name(self.setup))
            self.stored.append(table)
            _log.info("%s", table.line())
        return fit

    def save_table(self, path: str) -> str:
        """Writes the per-bucket table (with `identity`) to `path`; returns its sha256."""
        if not self._fit:
            raise ValueError("ProfiledClock.save_table: nothing profiled yet (warm up first)")
        save_fit(path, self._fit, metadata={"kind": "profiled_clock", **self.identity})
        return table_digest(path)

    def step(self, inputs: StepInputs) -> StepOutput:
        """Runs the step on the wrapped engine; `step_s` is the fit's price of it."""
        self._check_warm(inputs.bucket, self._warm)
        output = self.engine.step(inputs)
        return StepOutput(sampled_tokens=output.sampled_tokens, step_s=self._price(inputs))

    @property
    def feeds_tokens(self) -> bool:
        return self.engine.feeds_tokens

    def step_async(self, inputs: StepInputs,
                   token_source: Optional[NDArray[np.int32]] = None) -> PendingStep:
        """Dispatches the step on the wrapped engine; its price is known at once, so
        the scheduler plans the next step without waiting for this one."""
        self._check_warm(inputs.bucket, self._warm)
        return _PricedStep(self.engine.step_async(inputs, token_source), self._price(inputs))

    @property
    def num_stages(self) -> int:
        return self.engine.num_stages

    def step_stages(self, packed: PackedStep) -> tuple[StepOutput, list[float]]:
        pending, stages = self.dispatch_stages(packed)
        return pending.output(), stages

    def dispatch_stages(self, packed: PackedStep) -> tuple[PendingStep, list[float]]:
        """Dispatches the step through the wrapped engine's stages; the step's price is
        split over them by their layers (`stage_layers`: the grid timed whole steps, so
        each stage's share of the embedding, LM head and transfers is not its own)."""
        inputs = packed.inputs
        self._check_warm(inputs.bucket, self._warm)
        price = self._price(inputs)
        pending = _PricedStep(self.engine.step_async(inputs), price)
        layers = getattr(self.engine, "stage_layers", (1,))
        total = sum(layers)
        return pending, [price * count / total for count in layers]

    def _price(self, inputs: StepInputs) -> float:
        q_lens, kv_lens = real_lengths(inputs)
        return self._fit[inputs.bucket.num_tokens].seconds(q_lens, kv_lens)


class _PricedStep(PendingStep):
    """A wrapped engine's pending step, with the profiled clock's price as its time."""

    def __init__(self, pending: PendingStep, step_s: float) -> None:
        self._pending, self._step_s = pending, step_s

    @property
    def step_s(self) -> float:
        return self._step_s

    def output(self) -> StepOutput:
        return StepOutput(sampled_tokens=self._pending.output().sampled_tokens,
                          step_s=self._step_s)


def table_digest(path: str) -> str:
    """sha256 of a table file's bytes: config.json names the table a run used by it."""
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()
