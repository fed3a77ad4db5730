"""A fitted bucket ladder: the K step sizes that pad a run's steps least.

No rule of thumb (powers of two, a geometric ratio, multiples of N) pads the
default simulator workload's steps by at most 10% with at most 16 sizes: their
token counts spread over a few hundred to about a thousand tokens, sums of
Poisson-arriving prompts. `fit_token_sizes` picks the sizes from the step token
counts themselves (a pilot run's, `orca_jax.runner.bucket_pilot`): an exact
dynamic program over the candidate sizes, each a multiple of `FIT_ALIGN`.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
from numpy.typing import ArrayLike

FIT_ALIGN = 8  # every fitted size but the budget is a multiple of this (a sublane's rows)
# No size of a ladder may be more than this over the next smaller one (issue 50): a policy
# whose steps sit just above a size pays the gap in padding, and on a ladder with a 3x gap
# one policy's verdict was the ladder's. pow2 is exactly 2x.
MAX_SIZE_RATIO = 2.0
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
                    align: int = FIT_ALIGN, *, weights: Optional[ArrayLike] = None,
                    max_ratio: float = MAX_SIZE_RATIO) -> tuple[int, ...]:
    """The at most `num_sizes` step sizes that minimise the padded tokens of these steps,
    no size more than `max_ratio` times the one below it.

    Each step is padded to the smallest size that holds it; the sizes are multiples
    of `align` (the smallest >= `align`) but for the largest, which is always
    `max_num_tokens`. Without the ratio rule an optimal ladder would only use sizes
    that some step rounds up to (a size between two such pads no step less); with it,
    a size that no step rounds up to is there only to bridge a gap, and then it is as
    low as the rule lets it be: the size above it over `max_ratio`, rounded up to
    `align` (lower would break the rule, higher would pad the steps under it more).
    So every size of an optimal ladder lies on the halving chain (`_bridged`) of a
    size some step rounds up to, or of the budget, and the exact dynamic program runs
    over those candidates, O(K m^2) for m candidates (m <= max_num_tokens / align).
    The rule holds between adjacent sizes only: steps below the smallest size pad up
    to it, so a small K under a large budget raises the smallest size rather than
    break the rule. Of the ladders that pad least, the one of fewest sizes is taken,
    and among those the one whose sizes, from the top down, are the smallest. No
    steps: the budget alone.

    Args:
      step_tokens: the real tokens of each step, `[S]`, each in [1, max_num_tokens].
      num_sizes: K, the most sizes the ladder may have (>= 1).
      max_num_tokens: the per-step budget, the largest size.
      align: the sizes' multiple.
      weights: what each step's padded tokens count for, `[S]` (default 1 each): a fit
        to several policies' steps weighs each policy's by the inverse of its real
        tokens, so each policy's padding fraction counts alike however many steps it ran.
      max_ratio: the most a size may be over the next smaller one (> 1).

    Returns:
      The sizes, ascending, the last `max_num_tokens`.

    Raises:
      ValueError: K < 1, a ratio <= 1, a step outside [1, max_num_tokens], or weights
        of another shape or negative.
    """
    if num_sizes < 1:
        raise ValueError(f"fit_token_sizes: num_sizes must be >= 1, got {num_sizes}")
    if not max_ratio > 1:
        raise ValueError(f"fit_token_sizes: max_ratio must be > 1, got {max_ratio}")
    tokens = np.asarray(step_tokens, dtype=np.int64).reshape(-1)  # [S]
    if tokens.size and (tokens.min() < 1 or tokens.max() > max_num_tokens):
        raise ValueError(f"fit_token_sizes: step token counts must lie in [1, "
                         f"{max_num_tokens}], got [{tokens.min()}, {tokens.max()}]")
    weight = (np.ones(tokens.size) if weights is None
              else np.asarray(weights, dtype=np.float64).reshape(-1))  # [S]
    if weight.shape != tokens.shape or (weight.size and weight.min() < 0):
        raise ValueError(f"fit_token_sizes: weights must be {tokens.size} numbers >= 0, got "
                         f"shape {weight.shape}")
    rounded = np.minimum(-(-tokens // align) * align, max_num_tokens)  # [S]
    candidates = _bridged(np.unique(np.append(rounded, max_num_tokens)), align, max_ratio)
    num_candidates = len(candidates)
    # below[j]: the weight of the steps that round up to candidate j or less.
    weight_at = np.bincount(np.searchsorted(candidates, rounded), weights=weight,
                            minlength=num_candidates)  # [m]
    below = np.concatenate([[0.0], np.cumsum(weight_at)])  # [m + 1]
    size = candidates.astype(np.float64)  # [m]
    # lowest[j]: the smallest candidate that may be the next size down from candidate j.
    lowest = np.searchsorted(size * max_ratio, size, side="left")  # [m]
    # cost[j]: least padded tokens (weighted) of the steps up to candidate j with k sizes,
    # the largest candidate j (sum of the sizes the steps are padded to; the real tokens
    # are the same for every ladder). Candidate i < j is the next size down.
    cost = size * below[1:]  # k = 1: [m]
    most = min(num_sizes, num_candidates)
    choice = np.zeros((most, num_candidates), dtype=np.int64)  # [K, m] next size down
    at_budget = [cost[-1]]  # least cost of exactly k sizes, k = 1..
    for k in range(1, most):
        cost, choice[k] = _one_more_size(cost, size, below, lowest)
        at_budget.append(cost[-1])
    # The fewest sizes that pad least (a size that pads nothing less is no size).
    best = min(at_budget)
    num_best = next(k + 1 for k, c in enumerate(at_budget) if c == best)
    sizes = [num_candidates - 1]
    for k in range(num_best - 1, 0, -1):
        sizes.append(int(choice[k, sizes[-1]]))
    return tuple(int(candidates[j]) for j in reversed(sizes))


def _bridged(candidates: np.ndarray, align: int, max_ratio: float) -> np.ndarray:
    """The candidates with each one's halving chain: c, then c / max_ratio rounded up to
    `align`, and so on down to `align` (a chain stops where it meets one already there:
    from there on it is that one's). Ascending, distinct.

    Args:
      candidates: ascending distinct sizes, `[m]`.
    """
    found = set(int(c) for c in candidates)
    for top in candidates.tolist():
        size = int(top)
        while size > align:
            lower = max(align, -(-int(np.ceil(size / max_ratio)) // align) * align)
            if lower >= size or lower in found:
                break
            found.add(lower)
            size = lower
    return np.array(sorted(found), dtype=np.int64)


def ladder_gap(token_sizes: Sequence[int], max_ratio: float = MAX_SIZE_RATIO
               ) -> Optional[tuple[int, int]]:
    """The first pair of adjacent sizes more than `max_ratio` apart (lower, upper), or
    None: a step just over the lower one pads to the upper, so a policy whose steps
    fall there pays up to that ratio in tokens that others may not."""
    for lower, upper in zip(token_sizes, token_sizes[1:]):
        if upper > max_ratio * lower:
            return int(lower), int(upper)
    return None


def ladder_gap_error(token_sizes: Sequence[int], max_ratio: float = MAX_SIZE_RATIO
                     ) -> Optional[str]:
    """What is wrong with a ladder whose adjacent sizes are more than `max_ratio` apart
    (the first such gap, named), or None."""
    gap = ladder_gap(token_sizes, max_ratio)
    if gap is None:
        return None
    return (f"{gap[0]} -> {gap[1]} is a {gap[1] / gap[0]:.3g}x gap; adjacent sizes may be at "
            f"most {max_ratio:g}x apart (a step just over {gap[0]} tokens would pay for "
            f"{gap[1]})")


def widest_ratio(token_sizes: Sequence[int]) -> float:
    """The largest ratio between adjacent sizes (1.0 for a single size)."""
    return max((upper / lower for lower, upper in zip(token_sizes, token_sizes[1:])),
               default=1.0)


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


def _one_more_size(cost: np.ndarray, size: np.ndarray, below: np.ndarray,
                   lowest: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One step of `fit_token_sizes`'s program: from the least cost with k sizes, the
    least with k + 1, and the next size down of each.

    Args:
      cost: least cost with k sizes, the largest candidate i, `[m]`.
      size: the candidates, `[m]`.
      below: the weight of the steps rounding up to candidate j or less at j + 1,
        `[m + 1]`.
      lowest: the smallest candidate that may be the next size down from j (the ratio
        rule), `[m]`.
    """
    num_candidates = len(size)
    rows = np.arange(num_candidates)
    new_cost = np.empty(num_candidates)  # [m]
    choice = np.empty(num_candidates, dtype=np.int64)  # [m]
    for start in range(0, num_candidates, _COLUMNS_AT_ONCE):
        columns = np.arange(start, min(start + _COLUMNS_AT_ONCE, num_candidates))
        # through[i, j]: candidate i the next size down, the steps in (i, j] padded to j.
        through = cost[:, None] + size[columns] * (below[columns + 1] - below[1:, None])
        # i < j only, and i no lower than the ratio rule lets it be
        through[(rows[:, None] >= columns[None, :])
                | (rows[:, None] < lowest[columns][None, :])] = np.inf
        choice[columns] = np.argmin(through, axis=0)  # the first: the smaller size on a tie
        new_cost[columns] = through[choice[columns], columns - start]
    return new_cost, choice
