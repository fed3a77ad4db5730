"""The fitted ladder's dynamic program (`core.bucket_fit`), against hand-computed ladders
and against every ladder a brute force can list."""

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orca_jax.core.step.bucket_fit import (
    fit_token_sizes,
    ladder_gap,
    ladder_gap_error,
    max_fitted_sizes,
    padded_tokens,
    parse_fit_ladder,
)
from orca_jax.core.step.packing import default_token_sizes

# Real tokens 250; rounded up to multiples of 8: 16, 24, 104, 120; the budget 128.
STEPS = [10, 20, 100, 120]
NO_RATIO = 1e9  # the program without the 2x rule: sizes only where steps round up to


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
def test_without_the_ratio_rule_the_fitted_sizes_are_the_hand_computed_optimum(
        num_sizes, sizes, padded):
    assert fit_token_sizes(STEPS, num_sizes, 128, max_ratio=NO_RATIO) == sizes
    assert padded_tokens(STEPS, sizes) == padded


@pytest.mark.parametrize("num_sizes, sizes, padded", [
    (1, (128,), 512),
    (2, (64, 128), 384),  # the next size down from 128 is 64 at least: every step pads to 64
    (3, (32, 64, 128), 320),  # 32+32+128+128; (24, 48, ...) cannot reach 128 in three
    # 104 and 128 take the two larger steps; 56 (the least under 104 by the rule, 104 / 2
    # rounded up to 8) bridges to 32: 32 + 32 + 104 + 128.
    (4, (32, 56, 104, 128), 296),
    (5, (16, 32, 56, 104, 128), 280),
    # 24 takes the 20-token step (24, 48 would need a size between 48 and 104): 16 + 24 +
    # 104 + 120 as unruled, with 32 and 56 bridging 24 to 104.
    (9, (16, 24, 32, 56, 104, 120, 128), 264),
])
def test_no_size_is_more_than_twice_the_one_below_it(num_sizes, sizes, padded):
    assert fit_token_sizes(STEPS, num_sizes, 128) == sizes
    assert padded_tokens(STEPS, sizes) == padded


def test_a_budget_off_the_multiples_of_8_and_no_steps():
    # 99 rounds up to 104, over the budget: it is padded to the budget, 100; under it,
    # 100 / 2 rounded up to 8, 56 (8 would be a 12.5x gap).
    assert fit_token_sizes([5, 99, 3], 2, 100) == (56, 100)
    assert fit_token_sizes([5, 99, 3], 2, 100, max_ratio=NO_RATIO) == (8, 100)
    assert fit_token_sizes([5, 99, 3], 1, 100) == (100,)
    assert fit_token_sizes([], 4, 64) == (64,)
    assert fit_token_sizes([3, 3, 3], 3, 4) == (4,)  # a budget under 8: the budget alone


def test_steps_are_weighed_as_asked():
    # Two steps of 100 tokens (one policy's) and one of 20 (another's), two sizes under
    # 208. By count, (104, 208) pads least: 3 * 104 = 312 against (24, 208)'s 24 + 2 * 208
    # = 440. Weighed by the inverse of each policy's real tokens (1/200 and 1/20), the
    # 20-token step counts for more than both others: (24, 208) costs 24/20 + 416/200 =
    # 3.28, (104, 208) 104/20 + 208/200 = 6.24.
    steps, weights = [100, 100, 20], [1 / 200, 1 / 200, 1 / 20]
    assert fit_token_sizes(steps, 2, 208, max_ratio=NO_RATIO) == (104, 208)
    assert fit_token_sizes(steps, 2, 208, max_ratio=NO_RATIO, weights=weights) == (24, 208)
    with pytest.raises(ValueError, match="weights must be 3 numbers >= 0"):
        fit_token_sizes(steps, 2, 208, weights=[1.0])
    with pytest.raises(ValueError, match="max_ratio must be > 1, got 1.0"):
        fit_token_sizes(steps, 2, 208, max_ratio=1.0)


@settings(max_examples=60, deadline=None)
@given(st.integers(8, 72), st.integers(1, 5), st.sampled_from([2.0, 1.5, 3.0, NO_RATIO]),
       st.data())
def test_no_ladder_of_as_many_sizes_within_the_ratio_pads_less(budget, num_sizes, ratio,
                                                               data):
    steps = data.draw(st.lists(st.integers(1, budget), min_size=1, max_size=20))
    fitted = fit_token_sizes(steps, num_sizes, budget, max_ratio=ratio)
    assert len(fitted) <= num_sizes and fitted[-1] == budget
    assert all(s % 8 == 0 for s in fitted[:-1]) and list(fitted) == sorted(set(fitted))
    assert ladder_gap(fitted, ratio) is None
    multiples = range(8, budget, 8)
    best = min(padded_tokens(steps, (*lower, budget))
               for r in range(num_sizes) for lower in itertools.combinations(multiples, r)
               if ladder_gap((*lower, budget), ratio) is None)
    assert padded_tokens(steps, fitted) == best


def test_a_gap_is_named_and_pow2_has_none():
    assert ladder_gap((16, 32, 64, 2048)) == (64, 2048)
    assert ladder_gap((16, 48, 96)) == (16, 48)
    assert ladder_gap(default_token_sizes(2048)) is None  # exactly 2x
    assert ladder_gap(default_token_sizes(3000)) is None  # 2048 -> 3000: 1.46x
    assert ladder_gap((2048,)) is None
    assert ladder_gap_error((16, 48, 96)) == (
        "16 -> 48 is a 3x gap; adjacent sizes may be at most 2x apart (a step just over 16 "
        "tokens would pay for 48)")
    assert ladder_gap_error((16, 32)) is None


def test_a_large_budget_fits_quickly_in_little_memory():
    # 8,192 candidates (the program works in column blocks), most steps at three sizes.
    steps = np.concatenate([np.arange(8, 65537, 8), np.repeat([10000, 30000, 50000], 100_000)])
    assert fit_token_sizes(steps, 4, 65536, max_ratio=NO_RATIO) == (10000, 30000, 50000, 65536)
    # 30,000 may have no size under it below 15,000.
    assert fit_token_sizes(steps, 4, 65536) == (15000, 30000, 50000, 65536)


def test_fit_ladder_parsing_and_how_many_sizes_fit():
    assert parse_fit_ladder("fit:16") == 16
    assert parse_fit_ladder("pow2") is None and parse_fit_ladder("step:8") is None
    for bad in ("fit:0", "fit:x", "fit:", "fit:-2"):
        with pytest.raises(ValueError, match=f"bucket ladder '{bad}': expected fit:K"):
            parse_fit_ladder(bad)
    assert max_fitted_sizes(2048) == 256 and max_fitted_sizes(100) == 13
    assert max_fitted_sizes(4) == 1
