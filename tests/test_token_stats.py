"""Counting a run's tokens (`TokenTally`) gives the metrics what its token log gives."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import policies
from orca_jax import KVConfig, Scheduler, SchedulerConfig, StepLimits
from orca_jax.core.requests import token_stats
from orca_jax.core.requests.token_stats import TokenStats, TokenTally
from orca_jax.results import metrics
from orca_jax.results.summary import summarize
from orca_jax.runner.build import build_engine, build_workload, scheduler_config
from orca_jax.runner.experiment import run_policy
from orca_jax.runner.spec import LimitsSpec, RunSpec, WorkloadSpec
from orca_jax.sim.cost_model import CostModelConfig
from orca_jax.sim.engine import SimEngine
from orca_jax.workloads.synthetic import synthetic_workload


def _calls(num_requests: int, num_calls: int, seed: int) -> list[tuple[np.ndarray, float]]:
    """Calls of distinct requests at non-decreasing (often equal) times, some requests
    skipping calls (a preemption, a prefill between two tokens)."""
    rng = np.random.default_rng(seed)
    calls, now = [], 0.0
    for _ in range(num_calls):
        now += float(rng.choice([0.0, 0.25, rng.random()]))
        chosen = np.flatnonzero(rng.random(num_requests) < 0.6)
        calls.append((rng.permutation(chosen).astype(np.int64), now))
    return calls


@settings(max_examples=80, deadline=None)
@given(num_requests=st.integers(1, 10), num_calls=st.integers(0, 40), seed=st.integers(0, 999),
       chunk=st.sampled_from([1, 3, 1 << 16]))
def test_a_tally_gives_the_stats_of_the_whole_token_log(num_requests, num_calls, seed, chunk):
    calls = _calls(num_requests, num_calls, seed)
    tally = TokenTally(num_requests)
    for requests, time_s in calls:
        tally.add(requests, time_s)
    token_req = np.concatenate([r for r, _ in calls] or [np.zeros(0, np.int64)])
    token_time = np.concatenate([np.full(r.size, t) for r, t in calls] or [np.zeros(0)])
    finished = np.random.default_rng(seed).random(num_requests) < 0.7
    with pytest.MonkeyPatch.context() as patch:  # slices of the log, and of the runs
        patch.setattr(token_stats, "CHUNK_TOKENS", chunk)
        counted = tally.stats(finished)
        logged = TokenStats.from_log(token_req, token_time, finished)
    for field in ("num_tokens", "last_token_s", "max_gap_s", "gap_values", "gap_counts"):
        np.testing.assert_array_equal(getattr(counted, field), getattr(logged, field), field)
    np.testing.assert_array_equal(counted.num_tokens, np.bincount(token_req,
                                                                  minlength=num_requests))
    gap_req, gaps = metrics.inter_token_gaps_by_request(token_req, token_time)
    kept = gaps[finished[gap_req]]
    assert int(counted.gap_counts.sum()) == kept.size
    expected = np.percentile(kept, 99) if kept.size else np.nan
    # Bit for bit numpy's percentile over every gap, found from the counts.
    np.testing.assert_array_equal(counted.gap_percentile(99), expected)
    if kept.size:
        for p in (0, 37.5, 50, 90, 100):
            assert counted.gap_percentile(p) == np.percentile(kept, p)


@settings(max_examples=40, deadline=None)
@given(size=st.integers(1, 3000), distinct=st.integers(1, 40), seed=st.integers(0, 99),
       p=st.sampled_from([1, 50, 90, 99, 99.9]))
def test_the_percentile_of_counted_values_is_numpy_s_over_the_values(size, distinct, seed, p):
    rng = np.random.default_rng(seed)
    values = rng.choice(rng.random(distinct) * 1e-2, size)
    unique, counts = np.unique(values, return_counts=True)
    stats = TokenStats(num_tokens=np.zeros(0, np.int64), last_token_s=np.zeros(0),
                       max_gap_s=np.zeros(0), gap_values=unique, gap_counts=counts)
    assert stats.gap_percentile(p) == np.percentile(values, p)


def test_a_tally_holds_bytes_per_request_and_call_not_per_token():
    num_requests, num_calls = 2000, 4000
    tally = TokenTally(num_requests)
    requests = np.arange(num_requests, dtype=np.int64)
    for call in range(num_calls):  # every request a token every call: 8 million tokens
        tally.add(requests, call * 0.01)
    held = sum(a.nbytes for a in vars(tally).values() if isinstance(a, np.ndarray))
    assert held < 40 * (num_requests + num_calls), held  # a token log: 16 B x 8e6
    stats = tally.stats(np.ones(num_requests, bool))
    assert stats.num_tokens.tolist() == [num_calls] * num_requests
    assert int(stats.gap_counts.sum()) == num_requests * (num_calls - 1)


def test_a_run_that_counts_its_tokens_has_the_summary_of_one_that_logs_them():
    # vllm under KV pressure: preemptions break requests' runs of consecutive tokens.
    config = SchedulerConfig(limits=StepLimits(max_num_seqs=8, max_num_tokens=256,
                                               max_model_len=512),
                             kv=KVConfig(num_kv_pages=30, page_size=16))
    requests = synthetic_workload(num_requests=90, arrival="poisson", rate=400.0,
                                  prompt_len="uniform:8:120", output_len="uniform:1:60", seed=3)

    def run(log_tokens):
        engine = SimEngine(CostModelConfig(mode="fixed", model="tiny", step_time_s=0.01))
        return Scheduler(requests, policies.make_policy("vllm"), engine, config,
                         log_tokens=log_tokens).run()

    logged, counted = run(True), run(False)
    assert counted.token_req is None and logged.token_req.size == logged.num_generated.sum()
    assert counted.total_preemptions > 0
    with_log, without = summarize(logged), summarize(counted)
    assert with_log.pop("host_us_per_step_median") and without.pop("host_us_per_step_median")
    assert with_log == without
    assert with_log["itl_p99_s"] > 0.01  # a gap across a preemption (steps take 0.01 s)
    columns = (logged.arrival_s, logged.first_scheduled_s, logged.first_token_s,
               logged.finish_s, logged.output_len)
    from_log = metrics.request_metrics(*columns, logged.token_req, logged.token_time_s)
    from_stats = metrics.request_metrics(*columns, None, None, token_stats=counted.token_stats)
    for name, values in from_log.items():
        np.testing.assert_array_equal(from_stats[name], values, name)


def test_a_runner_run_keeps_no_log_of_every_token_and_summarizes_as_one_that_does():
    spec = RunSpec(workload=WorkloadSpec(num_requests=150, rate=32.0),
                   limits=LimitsSpec(max_num_tokens=1024, bucket_ladder=None))
    summary, result = run_policy(spec, "vllm", progress=False)
    assert result.token_req is None and result.token_time_s is None
    assert result.token_stats.num_tokens.tolist() == result.num_generated.tolist()
    config = scheduler_config(spec)
    logged = Scheduler(build_workload(spec), policies.make_policy("vllm"),
                       build_engine(spec, config), config).run()
    assert logged.token_req.size == int(result.num_generated.sum())
    expected = summarize(logged)
    expected.pop("host_us_per_step_median"), summary.pop("host_us_per_step_median")
    assert {k: v for k, v in summary.items() if k in expected} == expected  # + engine facts
