"""Small numpy helpers that several policies share (no jax; part of the policy API)."""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray


def fit_to_budget(ids: NDArray[np.int64],  # [n] in priority order
                  tokens: NDArray[np.int64],  # [n] tokens each wants
                  budget: int) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    """Takes requests in order while their tokens fit `budget`; chunks the first that does not.

    Returns:
      `(ids[:k], tokens[:k])` where the last one may be cut to the budget left,
      so a prompt longer than the whole budget is chunked rather than starved.
    """
    if ids.size == 0 or budget <= 0:
        return ids[:0], tokens[:0]
    cumulative = np.cumsum(tokens)
    if int(cumulative[-1]) <= budget:
        return ids, tokens
    whole = int(np.searchsorted(cumulative, budget, side="right"))
    left = budget - (int(cumulative[whole - 1]) if whole else 0)
    if left <= 0:
        return ids[:whole], tokens[:whole]
    cut = tokens[:whole + 1].copy()
    cut[whole] = left
    return ids[:whole + 1], cut
