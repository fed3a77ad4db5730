"""Buckets and `pack_step()`: from a checked StepPlan to fixed-shape StepInputs.

A bucket is a compiled step shape `(T tokens, S sequences)`. The configured
token sizes are the only shapes an engine ever sees; a step is padded to the
smallest that holds its real tokens, with `S = min(T, max_num_seqs)` (a step
never has more sequences than tokens, so that S always fits). Dynamic counts
travel as arrays, never as Python ints, so they never trigger a compile.
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import Callable, Optional, Sequence, Union

import numpy as np
from numpy.typing import NDArray

from orca_jax.core.step.engine_api import NULL_PAGE, Bucket, PackedStep, StepInputs


def default_token_sizes(max_num_tokens: int, smallest: int = 16) -> tuple[int, ...]:
    """Powers of two from `smallest` up to and including `max_num_tokens`."""
    sizes = []
    size = smallest
    while size < max_num_tokens:
        sizes.append(size)
        size *= 2
    sizes.append(max_num_tokens)
    return tuple(sizes)


BUCKET_LADDERS = ("pow2", "geometric:R", "step:N")
_LADDER_ALIGN = 8  # geometric sizes round up to a multiple of this (a sublane's rows)
# Most sizes a rule ladder may give: each is a compiled step shape (and a warm-up), and a
# rule that gives more (step:8 under a budget of 10^10) would take time and memory in
# proportion to the budget before the run starts.
MAX_LADDER_SIZES = 8192


def ladder_token_sizes(ladder: str, max_num_tokens: int, smallest: int = 16) -> tuple[int, ...]:
    """The step token sizes of a named ladder, up to and including `max_num_tokens`.

    `pow2`: powers of two from `smallest` (`default_token_sizes`). `geometric:R`: from
    `smallest`, each size about R times the last (R > 1), rounded up to a multiple of 8;
    padding wastes at most a fraction 1 - 1/R of a step, against 1/2 for pow2. `step:N`:
    the multiples of N, as vLLM's CUDA-graph sizes are (at most N - 1 padded tokens a step).
    The largest size is always `max_num_tokens`. Work and sizes are bounded by
    `MAX_LADDER_SIZES`, whatever the budget.

    Raises:
      ValueError: an unknown ladder or a bad R or N, or one giving more than
        `MAX_LADDER_SIZES` sizes, naming the ladder.
    """
    kind, _, arg = ladder.partition(":")
    if kind == "pow2" and not arg:
        return default_token_sizes(max_num_tokens, smallest)
    try:
        value = float(arg) if kind == "geometric" else int(arg)
    except ValueError:
        value = None
    if kind == "geometric" and value is not None and value > 1.0:
        sizes = [min(smallest, max_num_tokens)]
        while sizes[-1] < max_num_tokens:
            if len(sizes) == MAX_LADDER_SIZES:
                raise _too_many(ladder, max_num_tokens, f"more than {MAX_LADDER_SIZES}")
            grown = -(-int(np.ceil(sizes[-1] * value)) // _LADDER_ALIGN) * _LADDER_ALIGN
            sizes.append(min(max(grown, sizes[-1] + 1), max_num_tokens))
        return tuple(sizes)
    if kind == "step" and value is not None and value >= 1:
        num_sizes = -(-max_num_tokens // int(value))
        if num_sizes > MAX_LADDER_SIZES:
            raise _too_many(ladder, max_num_tokens, str(num_sizes))
        return tuple(range(int(value), max_num_tokens, int(value))) + (max_num_tokens,)
    raise ValueError(f"bucket ladder {ladder!r}: expected one of {', '.join(BUCKET_LADDERS)} "
                     "(R > 1, N >= 1)")


def _too_many(ladder: str, max_num_tokens: int, count: str) -> ValueError:
    """The error of a rule ladder with more than `MAX_LADDER_SIZES` sizes."""
    return ValueError(f"bucket ladder {ladder!r} gives {count} sizes up to "
                      f"max_num_tokens={max_num_tokens}, over the {MAX_LADDER_SIZES} a ladder "
                      "may have; use a coarser rule (a larger N or R, or pow2)")


@dataclasses.dataclass(frozen=True)
class BucketConfig:
    """The set of step shapes.

    Attributes:
      token_sizes: ascending T values; the largest is the per-step token budget.
      max_num_seqs: the largest S (the batch cap).
      pages_per_seq: page-table width P of every bucket.
    """

    token_sizes: tuple[int, ...]
    max_num_seqs: int
    pages_per_seq: int

    def __post_init__(self) -> None:
        sizes = tuple(int(s) for s in self.token_sizes)
        if not sizes or any(s < 1 for s in sizes) or list(sizes) != sorted(set(sizes)):
            raise ValueError(f"bucket token sizes must be distinct, ascending and >= 1, "
                             f"got {self.token_sizes}")
        if self.max_num_seqs < 1 or self.pages_per_seq < 1:
            raise ValueError(f"max_num_seqs and pages_per_seq must be >= 1, got "
                             f"{self.max_num_seqs}, {self.pages_per_seq}")
        object.__setattr__(self, "token_sizes", sizes)
        # Selected every step: made once (a Bucket is immutable, so one serves every step).
        object.__setattr__(self, "_buckets",
                           tuple(Bucket(t, min(t, self.max_num_seqs)) for t in sizes))

    @property
    def max_num_tokens(self) -> int:
        return self.token_sizes[-1]

    def buckets(self) -> list[Bucket]:
        """Every configured bucket, smallest first."""
        return [Bucket(t, min(t, self.max_num_seqs)) for t in self.token_sizes]

    def select(self, num_tokens: int) -> Bucket:
        """The smallest bucket holding `num_tokens` tokens."""
        index = bisect.bisect_left(self.token_sizes, num_tokens)
        if index == len(self.token_sizes):
            raise ValueError(f"{num_tokens} tokens exceed the largest bucket "
                             f"({self.max_num_tokens})")
        return self._buckets[index]


@dataclasses.dataclass(frozen=True)
class SamplingArrays:
    """Per-request sampling parameters, indexed by request index."""

    temperature: NDArray[np.float32]  # [N]
    top_k: NDArray[np.int32]  # [N]
    top_p: NDArray[np.float32]  # [N]
    rng_seeds: NDArray[np.uint32]  # [N]


def pages_per_seq_for(max_model_len: int, page_size: int) -> int:
    """Page-table width P: the pages one sequence of `max_model_len` tokens fills."""
    return -(-max_model_len // page_size)


def build_step_inputs(bucket: Bucket, *,
                      num_tokens: NDArray[np.int64],  # [n] new tokens of each sequence, >= 1
                      num_computed: NDArray[np.int64],  # [n] tokens cached before the step
                      page_rows: NDArray[np.int32],  # [n, P] each sequence's pages, in order
                      page_size: int,
                      token_ids: Optional[NDArray[np.int32]] = None,  # [sum(num_tokens)] or None
                      sampling: Optional[SamplingArrays] = None,
                      sampling_rows: Optional[NDArray[np.int64]] = None,  # [n] or None
                      pages_per_seq: Optional[int] = None,
                      ) -> StepInputs:
    """The step descriptor of `n` real sequences, padded to `bucket` (engine_api's layout).

    The one writer of the padding and null-page conventions: `pack_step()`, the
    engine's warm-up and the profiling grid all build their descriptors here.
    Sequence i's new tokens sit at positions `num_computed[i]` onwards and write
    their K/V through `page_rows[i]`; padding rows write into the null page, and
    padded sequences have no tokens, no KV and sample row 0. The caller keeps
    `n <= bucket.num_seqs` and `sum(num_tokens) <= bucket.num_tokens` (this runs
    every iteration, so it checks nothing).

    Args:
      bucket: the compiled step shape to pad to.
      num_tokens: tokens each sequence computes this step (>= 1).
      num_computed: tokens each sequence has in its KV cache before the step.
      page_rows: each sequence's KV pages, in order: at least the pages of its context
        after the step (the scheduler cuts the rows to the step's widest context, so a step's
        page-table work follows the real contexts, not `max_model_len`).
      page_size: tokens per KV page.
      token_ids: the flat ids of the new tokens, or None (zeros) for an engine
        that needs none.
      sampling: sampling parameters by row, or None for greedy.
      sampling_rows: the row of `sampling` each sequence takes (None: row i for
        sequence i).
      pages_per_seq: the page-table width P of the descriptor (None: `page_rows`'
        width); columns past `page_rows` hold the null page.

    Returns:
      The padded StepInputs.
    """
    num_seqs = num_tokens.shape[0]
    t, s = bucket.num_tokens, bucket.num_seqs

    cu_q_lens = np.empty(s + 1, dtype=np.int32)
    cu_q_lens[0] = 0
    np.cumsum(num_tokens, out=cu_q_lens[1:num_seqs + 1])
    total = int(cu_q_lens[num_seqs])
    cu_q_lens[num_seqs + 1:] = total

    kv_lens = np.zeros(s, dtype=np.int32)
    kv_lens[:num_seqs] = num_computed + num_tokens

    positions = np.zeros(t, dtype=np.int32)
    slot_mapping = np.full(t, NULL_PAGE * page_size, dtype=np.int32)
    if total == num_seqs:  # all decodes: one token each, no repeats needed
        real_positions = num_computed
        seq_of_token = np.arange(num_seqs)
    else:
        seq_of_token = np.repeat(np.arange(num_seqs), num_tokens)
        first = num_computed - cu_q_lens[:num_seqs]  # position of flat row 0, per sequence
        real_positions = np.arange(total) + np.repeat(first, num_tokens)
    positions[:total] = real_positions
    slot_mapping[:total] = (page_rows[seq_of_token, real_positions // page_size] * page_size
                            + real_positions % page_size)

    width = page_rows.shape[1]
    page_indices = np.zeros((s, width if pages_per_seq is None else pages_per_seq), np.int32)
    page_indices[:num_seqs, :width] = page_rows

    sample_indices = np.zeros(s, dtype=np.int32)
    sample_indices[:num_seqs] = cu_q_lens[1:num_seqs + 1] - 1

    tokens = np.zeros(t, dtype=np.int32)
    if token_ids is not None:
        tokens[:total] = token_ids

    if sampling is None:
        temperature, top_k = np.zeros(s, np.float32), np.zeros(s, np.int32)
        top_p, rng_seeds = np.ones(s, np.float32), np.zeros(s, np.uint32)
    else:
        rows = slice(num_seqs) if sampling_rows is None else sampling_rows
        temperature = _per_seq(sampling.temperature, rows, num_seqs, s, 0.0, np.float32)
        top_k = _per_seq(sampling.top_k, rows, num_seqs, s, 0, np.int32)
        top_p = _per_seq(sampling.top_p, rows, num_seqs, s, 1.0, np.float32)
        rng_seeds = _per_seq(sampling.rng_seeds, rows, num_seqs, s, 0, np.uint32)

    return StepInputs(
        bucket=bucket, token_ids=tokens, positions=positions, cu_q_lens=cu_q_lens,
        kv_lens=kv_lens, page_indices=page_indices, slot_mapping=slot_mapping,
        sample_indices=sample_indices, num_seqs=np.array([num_seqs], dtype=np.int32),
        temperature=temperature, top_k=top_k, top_p=top_p, rng_seeds=rng_seeds)


def _per_seq(values: NDArray[np.generic],  # [N] one per row
             rows: Union[slice, NDArray[np.int64]],  # each sequence's row
             num_seqs: int, num_padded: int, fill: float,
             dtype: type[np.generic]) -> NDArray[np.generic]:  # [num_padded]
    out = np.full(num_padded, fill, dtype=dtype)
    out[:num_seqs] = values[rows]
    return out


def pack_step(*, bucket_config: BucketConfig,
              request_ids: NDArray[np.int64],  # [n] in pack order
              num_tokens: NDArray[np.int64],  # [n] tokens to compute for each
              num_computed: NDArray[np.int64],  # [n] tokens already in each one's KV cache
              page_rows: Union[NDArray[np.int32],  # [n, W] each request's pages, W <= P
                               Callable[[], NDArray[np.int32]]],
              page_size: int,
              sampling: SamplingArrays,
              token_ids: Optional[NDArray[np.int32]] = None,  # [sum(num_tokens)] or None
              min_bucket_tokens: int = 0,
              num_real_tokens: Optional[int] = None,
              spec_tokens: Optional[NDArray[np.int64]] = None,  # [n] or None
              kv_lens: Optional[NDArray[np.int64]] = None,  # [n] or None
              ) -> PackedStep:
    """Packs one step's requests: the smallest fitting bucket, and the padded descriptor
    (StepInputs), built only when an engine reads it.

    The step's bucket and lengths are known at once; `PackedStep.inputs` builds the
    descriptor (with `build_step_inputs`) on its first read. The arrays given are
    kept as they are: pass copies (fancy-indexed rows are), not views of state that
    changes after the step.

    Args:
      bucket_config: the configured step shapes.
      request_ids: the plan's requests, in the order their tokens are stacked.
      num_tokens: tokens each computes this step (>= 1).
      num_computed: tokens each has in its KV cache before the step.
      page_rows: each request's pages (the core allocated enough for this step), at
        least its context after the step; the descriptor is padded to the configured
        width with the null page. Or a function that reads them, called at the first
        read of the descriptor (the scheduler's: an engine that prices lengths never
        has the rows copied; `PackedStep.close` ends the time it may be called).
      page_size: tokens per KV page.
      sampling: per-request sampling parameters (indexed by request index).
      token_ids: the flat ids of the tokens to compute, or None (zeros) for an
        engine that needs none.
      min_bucket_tokens: pad to a bucket of at least this many tokens.
      num_real_tokens: the step's computed tokens (`sum(num_tokens)`, plus
        `sum(spec_tokens)`), if the caller has it already.
      spec_tokens: draft tokens each verifies after its `num_tokens` (speculative
        decoding; None: none). They are computed positions like any: the descriptor
        holds `num_tokens + spec_tokens` queries each (`token_ids` covers them, the
        drafts as placeholders) and the pages must hold them.
      kv_lens: `num_computed + num_tokens (+ spec_tokens)`, if the caller has it
        already (kept as it is: a copy, as the other arrays).

    Returns:
      The packed step.
    """
    if spec_tokens is not None:  # the k draft positions are verified tokens of the step
        num_tokens = num_tokens + spec_tokens
    total = int(num_tokens.sum()) if num_real_tokens is None else num_real_tokens
    bucket = bucket_config.select(max(total, min_bucket_tokens))

    def build() -> StepInputs:
        return build_step_inputs(bucket, num_tokens=num_tokens, num_computed=num_computed,
                                 page_rows=page_rows() if callable(page_rows) else page_rows,
                                 page_size=page_size,
                                 token_ids=token_ids, sampling=sampling,
                                 sampling_rows=request_ids,
                                 pages_per_seq=bucket_config.pages_per_seq)

    return PackedStep(bucket, num_tokens,
                      num_computed + num_tokens if kv_lens is None else kv_lens, build,
                      request_ids, spec_tokens)


def bucket_config_for(*, max_num_tokens: int, max_num_seqs: int, max_model_len: int,
                      page_size: int,
                      token_sizes: Optional[Sequence[int]] = None) -> BucketConfig:
    """Builds the bucket set for a scheduler configuration (default: powers of two)."""
    sizes = tuple(token_sizes) if token_sizes else default_token_sizes(max_num_tokens)
    if sizes[-1] != max_num_tokens:
        raise ValueError(f"the largest bucket ({sizes[-1]}) must equal max_num_tokens "
                         f"({max_num_tokens})")
    return BucketConfig(token_sizes=sizes, max_num_seqs=max_num_seqs,
                        pages_per_seq=pages_per_seq_for(max_model_len, page_size))
