"""The summary of a large run: a slice of the token log at a time, the same numbers."""

import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orca_jax.core.requests import token_stats
from orca_jax.results import metrics


def _run(num_requests: int, num_tokens: int, seed: int) -> dict[str, np.ndarray]:
    """A run's arrays: tokens of random requests at non-decreasing (often equal) times."""
    rng = np.random.default_rng(seed)
    req = rng.integers(0, num_requests, num_tokens)
    times = np.sort(rng.integers(0, max(num_tokens // 3, 1), num_tokens)).astype(np.float64)
    out_len = np.bincount(req, minlength=num_requests)
    finish = np.where(rng.random(num_requests) < 0.8, times[-1] + 1.0 if num_tokens else 1.0,
                      np.nan)
    zeros = np.zeros(num_requests)
    return dict(arrival_s=zeros, first_scheduled_s=zeros, first_token_s=zeros + 0.5,
                finish_s=finish, output_len=np.maximum(out_len, 1), token_req=req,
                token_time_s=times)


@settings(max_examples=60, deadline=None)
@given(num_requests=st.integers(1, 12), num_tokens=st.integers(0, 80), seed=st.integers(0, 99),
       chunk=st.integers(1, 9))
def test_slices_of_the_token_log_give_the_whole_log_s_gaps(num_requests, num_tokens, seed,
                                                           chunk):
    run = _run(num_requests, num_tokens, seed)
    whole = metrics.run_summary(**run)
    per_request = metrics.request_metrics(**run)
    # Every gap and each request's largest, from the whole log sorted at once.
    gap_req, gaps = metrics.inter_token_gaps_by_request(run["token_req"], run["token_time_s"])
    expected_max = np.full(num_requests, np.nan)
    for r in range(num_requests):
        if (gap_req == r).any() and np.isfinite(run["finish_s"][r]):
            expected_max[r] = gaps[gap_req == r].max()
    finished_gaps = gaps[np.isfinite(run["finish_s"])[gap_req]]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(token_stats, "CHUNK_TOKENS", chunk)
        sliced = metrics.run_summary(**run)
        sliced_max = metrics.request_metrics(**run)["max_itl_s"]
    np.testing.assert_array_equal(sliced_max, expected_max)
    np.testing.assert_array_equal(per_request["max_itl_s"], expected_max)
    assert sliced == whole
    assert sliced["itl_p99_s"] == (float(np.percentile(finished_gaps, 99))
                                   if finished_gaps.size else None)


def test_the_summary_of_two_million_tokens_takes_less_than_the_token_log():
    # Sorting the whole log took about 3x its size (10^5 requests: +214 MB of RSS over the
    # simulation's peak); slices take the finished gaps (half the log) and a little more.
    run = _run(20_000, 2_000_000, seed=0)
    log_bytes = run["token_req"].nbytes + run["token_time_s"].nbytes
    tracemalloc.start()
    try:
        metrics.run_summary(**run)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 0.9 * log_bytes, peak / log_bytes
