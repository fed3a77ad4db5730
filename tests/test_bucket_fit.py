"""The fitted ladder's dynamic program (`core.bucket_fit`), against hand-computed ladders
and against every ladder a brute force can list."""

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orca_jax.core.step.bucket_fit import (
    fit_token_sizes,
    max_fitted_sizes,
    padded_tokens,
    parse_fit_ladder,
)

# Real tokens 250; rounded up to multiples of 8: 16, 24, 104, 120; the budget 128.
STEPS = [10, 20, 100, 120]


@pytest.mark.parametrize("num_sizes, sizes, padded", [
    (1, (128,), 512),
    (2, (24, 128), 304),  # 16+128*3=400, 24*2+128*2=304, 104*3+128=440, 120*4=480
    (3, (24, 104, 128), 280),  # beats (24, 120, 128): 288
    # A tie at 272: (24, 104, 120, 128) and (16, 24, 104, 128). From the top down the
    # second is smaller (104 < 120): it is taken.
    (4, (16, 24, 104, 128), 272),
    (5, (16, 24, 104, 120, 128), 264),  # every candidate: only the rounding to 8 pads
    (9, (16, 24, 104, 120, 128), 264),  # more sizes would pad nothing less: five
])
def test_the_fitted_sizes_are_the_hand_computed_optimum(num_sizes, sizes, padded):
    assert fit_token_sizes(STEPS, num_sizes, 128) == sizes
    assert padded_tokens(STEPS, sizes) == padded


def test_a_budget_off_the_multiples_of_8_and_no_steps():
    # 99 rounds up to 104, over the budget: it is padded to the budget, 100.
    assert fit_token_sizes([5, 99, 3], 2, 100) == (8, 100)
    assert fit_token_sizes([5, 99, 3], 1, 100) == (100,)
    assert fit_token_sizes([], 4, 64) == (64,)
    assert fit_token_sizes([3, 3, 3], 3, 4) == (4,)  # a budget under 8: the budget alone


def test_steps_outside_the_budget_and_no_sizes_are_refused():
    with pytest.raises(ValueError, match=r"\[1, 64\], got \[0, 9\]"):
        fit_token_sizes([0, 9], 2, 64)
    with pytest.raises(ValueError, match=r"got \[9, 65\]"):
        fit_token_sizes([9, 65], 2, 64)
    with pytest.raises(ValueError, match="num_sizes must be >= 1, got 0"):
        fit_token_sizes([9], 0, 64)


@settings(max_examples=60, deadline=None)
@given(st.integers(8, 72), st.integers(1, 5), st.data())
def test_no_ladder_of_as_many_sizes_pads_less(budget, num_sizes, data):
    steps = data.draw(st.lists(st.integers(1, budget), min_size=1, max_size=20))
    fitted = fit_token_sizes(steps, num_sizes, budget)
    assert len(fitted) <= num_sizes and fitted[-1] == budget
    assert all(s % 8 == 0 for s in fitted[:-1]) and list(fitted) == sorted(set(fitted))
    multiples = range(8, budget, 8)
    best = min(padded_tokens(steps, (*lower, budget))
               for r in range(num_sizes) for lower in itertools.combinations(multiples, r))
    assert padded_tokens(steps, fitted) == best


def test_a_large_budget_fits_quickly_in_little_memory():
    # 8,192 candidates (the program works in column blocks), most steps at three sizes.
    steps = np.concatenate([np.arange(8, 65537, 8), np.repeat([10000, 30000, 50000], 100_000)])
    assert fit_token_sizes(steps, 4, 65536) == (10000, 30000, 50000, 65536)


def test_fit_ladder_parsing_and_how_many_sizes_fit():
    assert parse_fit_ladder("fit:16") == 16
    assert parse_fit_ladder("pow2") is None and parse_fit_ladder("step:8") is None
    for bad in ("fit:0", "fit:x", "fit:", "fit:-2"):
        with pytest.raises(ValueError, match=f"bucket ladder '{bad}': expected fit:K"):
            parse_fit_ladder(bad)
    assert max_fitted_sizes(2048) == 256 and max_fitted_sizes(100) == 13
    assert max_fitted_sizes(4) == 1
