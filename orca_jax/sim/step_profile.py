"""Profiling the real engine's steps: a fixed grid of step compositions, timed.

`profile_shapes` lays out, per bucket, a grid of step compositions (decodes of
1..S sequences at short to full contexts, whole prompts, a long chunk, a prefill
among decodes) fixed by the bucket and the context limit, not by any workload.
`step_inputs` builds each as a real `StepInputs`; `time_grid` times passes over
the whole grid through an engine's `step` (so load bursts spread over every
composition), and `measure_step_times` keeps each composition's repeats as a
`StepSample`. `orca_jax.sim.calibration` fits the cost model to them.

Host module: nothing here imports jax.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Sequence

import numpy as np

from orca_jax.core.step.engine_api import Bucket, Engine, StepInputs
from orca_jax.core.step.packing import build_step_inputs
from pallas_kernels.reference_tiling import reference_blocks


def reference_tiles(bucket: Bucket, page_size: int) -> tuple[int, int]:
    """`(q_tile, kv_tile)` of pallas_kernels' jnp reference attention (the CPU path)
    in `bucket`."""
    return reference_blocks(bucket.num_tokens, bucket.num_seqs, page_size)


SAMPLE_STATISTICS = ("median", "mean", "min")


@dataclasses.dataclass(frozen=True)
class StepSample:
    """One measured step composition: its real sequences and its seconds over repeats."""

    bucket: Bucket
    q_lens: tuple[int, ...]  # [num_seqs] new tokens per sequence
    kv_lens: tuple[int, ...]  # [num_seqs] attended tokens per sequence
    seconds: float  # median over repeats
    spread: float  # (max - min) / median over repeats
    mean_s: float  # mean over repeats
    min_s: float  # fastest repeat: other processes' load can only add to a step's time

    def statistic(self, name: str) -> float:
        """The seconds `name` (`median`, `mean` or `min`) of the repeats says."""
        if name not in SAMPLE_STATISTICS:
            raise ValueError(f"StepSample: statistic={name!r}, choose one of {SAMPLE_STATISTICS}")
        return {"median": self.seconds, "mean": self.mean_s, "min": self.min_s}[name]


def profile_shapes(bucket: Bucket, max_model_len: int
                   ) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The grid of `(q_lens, kv_lens)` compositions measured in `bucket`.

    Decodes of 1, S/4, S/2 and S sequences at contexts 32, 160, half and all
    of `max_model_len` separate the per-sequence cost from the per-tile cost;
    one whole prompt of T tokens, one T-token chunk deep into a context, a batch
    of fresh prompts, and one prompt among S-1 decodes cover prefill tiling.
    """
    t, s, top = bucket.num_tokens, bucket.num_seqs, max_model_len
    shapes: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    contexts = sorted({min(top, k) for k in (32, 160, top // 2, top)})
    for n in sorted({1, max(1, s // 4), max(1, s // 2), s}):
        shapes += [((1,) * n, (k,) * n) for k in contexts]
    prompt = min(t, top)
    shapes.append(((prompt,), (prompt,)))
    deep = min(top, prompt + top // 2)
    shapes.append(((prompt,), (deep,)))
    num_prompts = max(1, min(s, t // 16))
    each = min(top, t // num_prompts)
    shapes.append(((each,) * num_prompts, (each,) * num_prompts))
    if t >= 2 * s and s > 1:
        chunk = min(top, t - (s - 1))
        shapes.append(((1,) * (s - 1) + (chunk,), (min(top, 160),) * (s - 1) + (chunk,)))
    return shapes


def step_inputs(bucket: Bucket, q_lens: Sequence[int], kv_lens: Sequence[int], *,
                page_size: int, pages_per_seq: int, num_pages: int) -> StepInputs:
    """A well-formed step descriptor for real sequences `q_lens`, `kv_lens` (greedy).

    Each sequence gets its own run of pages (cycling through pages 1..num_pages-1),
    so the attention gathers from distinct memory as in a real batch.

    Raises:
      ValueError: the sequences do not fit the bucket or the page table.
    """
    t, s = bucket.num_tokens, bucket.num_seqs
    n = len(q_lens)
    if n != len(kv_lens) or n > s or sum(q_lens) > t:
        raise ValueError(f"step_inputs: {n} sequences with {sum(q_lens)} tokens do not fit "
                         f"bucket {bucket} (or q_lens and kv_lens differ in length)")
    if any(not 1 <= q <= k <= pages_per_seq * page_size for q, k in zip(q_lens, kv_lens)):
        raise ValueError(f"step_inputs: need 1 <= q_len <= kv_len <= {pages_per_seq * page_size}"
                         f", got q_lens={list(q_lens)}, kv_lens={list(kv_lens)}")
    pages = np.zeros((n, pages_per_seq), np.int32)  # [n, P]
    next_page = 0
    for i, k in enumerate(kv_lens):
        used = -(-k // page_size)
        pages[i, :used] = (np.arange(next_page, next_page + used) % (num_pages - 1)) + 1
        next_page += used
    new = np.asarray(q_lens, np.int64)  # [n]
    return build_step_inputs(bucket, num_tokens=new, num_computed=np.asarray(kv_lens) - new,
                             page_rows=pages, page_size=page_size)


ProfileGrid = list[tuple[Bucket, tuple[int, ...], tuple[int, ...], StepInputs]]


def profile_grid(buckets: Sequence[Bucket], *, max_model_len: int, page_size: int,
                 pages_per_seq: int, num_pages: int) -> ProfileGrid:
    """Every `profile_shapes` composition of every bucket, with its step descriptor."""
    return [(bucket, tuple(q_lens), tuple(kv_lens),
             step_inputs(bucket, q_lens, kv_lens, page_size=page_size,
                         pages_per_seq=pages_per_seq, num_pages=num_pages))
            for bucket in buckets for q_lens, kv_lens in profile_shapes(bucket, max_model_len)]


def time_grid(engine: Engine, grid: ProfileGrid, num_passes: int) -> list[list[float]]:
    """`num_passes` timed passes over the whole grid: `[pass][composition]` step seconds.

    Passes over the whole grid, rather than repeats back to back, spread a burst
    of load from other processes over every composition instead of corrupting
    a few, and keep consecutive steps different, as in a real run.
    """
    return [[engine.step(inputs).step_s for *_, inputs in grid] for _ in range(num_passes)]


def samples_from_times(grid: ProfileGrid, times: Sequence[Sequence[float]]) -> list[StepSample]:
    """One `StepSample` per composition: median, spread, mean and minimum over its passes."""
    samples = []
    for index, (bucket, q_lens, kv_lens, _) in enumerate(grid):
        runs = [row[index] for row in times]
        median = statistics.median(runs)
        samples.append(StepSample(bucket, q_lens, kv_lens, median,
                                  (max(runs) - min(runs)) / median, statistics.fmean(runs),
                                  min(runs)))
    return samples


def measure_step_times(engine: Engine, buckets: Sequence[Bucket], *, max_model_len: int,
                       page_size: int, pages_per_seq: int, num_pages: int,
                       num_repeats: int = 5) -> list[StepSample]:
    """Times every `profile_shapes` composition of every bucket on `engine` (its `step_s`).

    The engine must report measured time (a `JaxEngine`).
    One untimed pass over the grid, then `num_repeats` timed passes (`time_grid`).
    """
    grid = profile_grid(buckets, max_model_len=max_model_len, page_size=page_size,
                        pages_per_seq=pages_per_seq, num_pages=num_pages)
    return measure_grid(engine, grid, num_repeats)


def measure_grid(engine: Engine, grid: ProfileGrid, num_repeats: int) -> list[StepSample]:
    """Warms `engine` up on the grid's buckets, runs one untimed pass over `grid`, then
    `num_repeats` timed ones (`time_grid`): one `StepSample` per composition.

    Raises:
      ValueError: `num_repeats` < 1.
    """
    if num_repeats < 1:
        raise ValueError(f"measure_step_times: num_repeats={num_repeats} must be >= 1")
    engine.warmup(list(dict.fromkeys(bucket for bucket, *_ in grid)))
    time_grid(engine, grid, 1)
    return samples_from_times(grid, time_grid(engine, grid, num_repeats))
