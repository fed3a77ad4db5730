"""A fitted bucket ladder: the K step sizes that pad a run's steps least.

No rule of thumb (powers of two, a geometric ratio, multiples of N) pads the
default simulator workload's steps by at most 10% with at most 16 sizes: their
token counts spread over a few hundred to about a thousand tokens, sums of
Poisson-arriving prompts. `fit_token_sizes` picks the sizes from the step token
counts themselves (a pilot run's, `orca_jax.runner.bucket_pilot`): an exact
dynamic program over the candidate sizes, each a multiple of `FIT_ALIGN`.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
from numpy.typing import ArrayLike

FIT_ALIGN = 8  # every fitted size but the budget is a multiple of this (a sublane's rows)
FIT_LADDER = "fit:K"


def max_fitted_sizes(max_num_tokens: int, align: int = FIT_ALIGN) -> int:
    """How many sizes a fitted ladder can have: the multiples of `align` below the budget,
    and the budget."""
    return -(-max_num_tokens // align)


def parse_fit_ladder(ladder: str) -> Optional[int]:
    """K of a `fit:K` ladder; None for any other ladder.

    Raises:
      ValueError: `fit:` with a K that is not an integer >= 1, naming the ladder.
    """
    kind, _, arg = ladder.partition(":")
    if kind != "fit":
        return None
    try:
        num_sizes = int(arg)
    except ValueError:
        num_sizes = 0
    if num_sizes < 1:
        raise ValueError(f"bucket ladder {ladder!r}: expected {FIT_LADDER} with K an integer "
                         ">= 1 (the number of step sizes)")
    return num_sizes


def capped_fit_ladder(ladder: str, max_num_tokens: int) -> str:
    """A `fit:K` ladder with K lowered to what fits under the budget (`max_fitted_sizes`);
    any other ladder as it is. A default of `fit:16` then serves every budget: under 128
    tokens every candidate size is one."""
    num_sizes = parse_fit_ladder(ladder)
    if num_sizes is None:
        return ladder
    return f"fit:{min(num_sizes, max_fitted_sizes(max_num_tokens))}"


def fit_token_sizes(step_tokens: ArrayLike, num_sizes: int, max_num_tokens: int,
                    align: int = FIT_ALIGN) -> tuple[int, ...]:
    """The at most `num_sizes` step sizes that minimise the padded tokens of these steps.

    Each step is padded to the smallest size that holds it; the sizes are multiples
    of `align` (the smallest >= `align`) but for the largest, which is always
    `max_num_tokens`. An optimal ladder only uses sizes that some step rounds up to
    (a size between two such would pad no step less), so the exact dynamic program
    runs over those candidates, O(K m^2) for m candidates (m <= max_num_tokens /
    align). With at least as many sizes allowed as there are candidates, every
    candidate is a size (fewer than `num_sizes`: more would pad nothing less). Among
    ladders that pad equally, the one whose sizes, from the top down, are the
    smallest is taken. No steps: the budget alone.

    Args:
      step_tokens: the real tokens of each step, `[S]`, each in [1, max_num_tokens].
      num_sizes: K, the most sizes the ladder may have (>= 1).
      max_num_tokens: the per-step budget, the largest size.
      align: the sizes' multiple.

    Returns:
      The sizes, ascending, the last `max_num_tokens`.

    Raises:
      ValueError: K < 1, or a step outside [1, max_num_tokens].
    """
    if num_sizes < 1:
        raise ValueError(f"fit_token_sizes: num_sizes must be >= 1, got {num_sizes}")
    tokens = np.asarray(step_tokens, dtype=np.int64).reshape(-1)  # [S]
    if tokens.size and (tokens.min() < 1 or tokens.max() > max_num_tokens):
        raise ValueError(f"fit_token_sizes: step token counts must lie in [1, "
                         f"{max_num_tokens}], got [{tokens.min()}, {tokens.max()}]")
    rounded = np.minimum(-(-tokens // align) * align, max_num_tokens)  # [S]
    candidates, counts = np.unique(np.append(rounded, max_num_tokens), return_counts=True)
    counts[-1] -= 1  # the budget was appended once so that it is always a candidate
    num_candidates = len(candidates)
    if num_sizes >= num_candidates:
        return tuple(int(c) for c in candidates)
    # below[j]: steps that round up to candidate j or less.
    below = np.concatenate([[0], np.cumsum(counts)])  # [m + 1]
    size = candidates.astype(np.float64)  # [m]
    # cost[j]: least padded tokens of the steps up to candidate j with k sizes, the
    # largest candidate j (sum of the sizes the steps are padded to; the real tokens are
    # the same for every ladder). Candidate i < j is the next size down.
    cost = size * below[1:]  # k = 1: [m]
    choice = np.zeros((num_sizes, num_candidates), dtype=np.int64)  # [K, m] next size down
    for k in range(1, num_sizes):
        cost, choice[k] = _one_more_size(cost, size, below)
    sizes = [num_candidates - 1]
    for k in range(num_sizes - 1, 0, -1):
        sizes.append(int(choice[k, sizes[-1]]))
    return tuple(int(candidates[j]) for j in reversed(sizes))


def padded_tokens(step_tokens: ArrayLike, token_sizes: tuple[int, ...]) -> int:
    """The tokens of these steps, each padded to the smallest of `token_sizes` holding it.

    Args:
      step_tokens: the real tokens of each step, `[S]`, none above the largest size.
      token_sizes: ascending step sizes.
    """
    tokens = np.asarray(step_tokens, dtype=np.int64).reshape(-1)  # [S]
    sizes = np.asarray(token_sizes, dtype=np.int64)
    return int(sizes[np.searchsorted(sizes, tokens)].sum())


_COLUMNS_AT_ONCE = 256  # bounds the [m, columns] table of a step of the program


def _one_more_size(cost: np.ndarray, size: np.ndarray, below: np.ndarray
                   ) -> tuple[np.ndarray, np.ndarray]:
    """One step of `fit_token_sizes`'s program: from the least cost with k sizes, the
    least with k + 1, and the next size down of each.

    Args:
      cost: least cost with k sizes, the largest candidate i, `[m]`.
      size: the candidates, `[m]`.
      below: steps rounding up to candidate j or less at j + 1, `[m + 1]`.
    """
    num_candidates = len(size)
    rows = np.arange(num_candidates)
    new_cost = np.empty(num_candidates)  # [m]
    choice = np.empty(num_candidates, dtype=np.int64)  # [m]
    for start in range(0, num_candidates, _COLUMNS_AT_ONCE):
        columns = np.arange(start, min(start + _COLUMNS_AT_ONCE, num_candidates))
        # through[i, j]: candidate i the next size down, the steps in (i, j] padded to j.
        through = cost[:, None] + size[columns] * (below[columns + 1] - below[1:, None])
        through[rows[:, None] >= columns[None, :]] = np.inf  # i < j only
        choice[columns] = np.argmin(through, axis=0)  # the first: the smaller size on a tie
        new_cost[columns] = through[choice[columns], columns - start]
    return new_cost, choice
