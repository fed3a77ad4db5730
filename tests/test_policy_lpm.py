"""lpm: longest cached prefix first, with SGLang's in-batch de-prioritisation.

Runs go through the public API on the simulator with a fixed step time, so a
request's first scheduled time says which step admitted it.
"""

import numpy as np
import pytest

import policies
from orca_jax import KVConfig, Request, Scheduler, SchedulerConfig, StepLimits
from orca_jax.results.summary import summarize
from orca_jax.sim.cost_model import CostModelConfig
from orca_jax.sim.engine import SimEngine
from orca_jax.workloads.prefix_workloads import shared_prefix_workload

PAGE = 4
STEP_S = 0.01


def prompt(prefix: int, suffix: int, prefix_len: int = 16, suffix_len: int = 3) -> np.ndarray:
    """`prefix_len` ids naming prefix `prefix`, then `suffix_len` ids naming suffix `suffix`."""
    return np.concatenate([np.full(prefix_len, 100 + prefix), np.full(suffix_len, 500 + suffix)]
                          ).astype(np.int32)


def request(i: int, tokens: np.ndarray, arrival_s: float, output_len: int = 2) -> Request:
    return Request(id=i, arrival_s=arrival_s, prompt_len=tokens.size, output_len=output_len,
                   prompt_tokens=tokens)


def run(requests, policy="lpm", *, max_num_seqs=4, num_kv_pages=64, **options):
    config = SchedulerConfig(limits=StepLimits(max_num_seqs=max_num_seqs, max_num_tokens=64,
                                               max_model_len=96),
                             kv=KVConfig(num_kv_pages=num_kv_pages, page_size=PAGE))
    engine = SimEngine(CostModelConfig(mode="fixed", step_time_s=STEP_S))
    options = {key: str(value) for key, value in options.items()}
    scheduler = Scheduler(requests, policies.make_policy(policy, options), engine, config)
    return scheduler.run()


def step_of(result, i):
    """The step that first scheduled request `i` (steps are `STEP_S` apart from 0)."""
    return round(float(result.first_scheduled_s[i]) / STEP_S)


def test_requests_whose_prefix_is_cached_go_before_older_ones_that_would_miss():
    # Request 0 leaves prefix 0 cached. At 1 s, 1 and 2 (prefixes 1 and 2, uncached) arrive
    # before 3 (prefix 0): with one seat, lpm runs 3 first, where FCFS runs 1.
    requests = [request(0, prompt(0, 0), 0.0), request(1, prompt(1, 1), 1.0),
                request(2, prompt(2, 2), 1.0), request(3, prompt(0, 3), 1.0)]
    lpm = run(requests, max_num_seqs=1)
    fcfs = run(requests, "vllm", max_num_seqs=1)
    assert step_of(lpm, 3) < step_of(lpm, 1) < step_of(lpm, 2)
    assert step_of(fcfs, 1) < step_of(fcfs, 2) < step_of(fcfs, 3)
    assert lpm.num_cached_tokens.tolist() == [0, 0, 0, 16]
    assert lpm.num_generated.tolist() == [2, 2, 2, 2]


def test_defer_admits_one_of_a_shared_uncached_prefix_per_step():
    # 0 and 1 share prefix 7, not cached; 2 has its own. Under `defer`, 1 waits a step and
    # finds 0's four prefix pages cached; `off` admits both at once, and both compute it.
    requests = [request(0, prompt(7, 0), 0.0), request(1, prompt(7, 1), 0.0),
                request(2, prompt(3, 2), 0.0)]
    deferred = run(requests, in_batch="defer", in_batch_prefix_tokens=PAGE)
    assert step_of(deferred, 0) == step_of(deferred, 2) == 0 and step_of(deferred, 1) == 1
    assert deferred.num_cached_tokens.tolist() == [0, 16, 0]
    together = run(requests, in_batch="off", in_batch_prefix_tokens=PAGE)
    assert [step_of(together, i) for i in range(3)] == [0, 0, 0]
    assert together.num_cached_tokens.tolist() == [0, 0, 0]
    # SGLang's `deprioritize` only ranks 1 last: with seats for everyone it still runs now.
    ranked = run(requests, in_batch_prefix_tokens=PAGE)
    assert [step_of(ranked, i) for i in range(3)] == [0, 0, 0]


def test_deprioritize_puts_a_shared_uncached_prefix_behind_the_rest():
    # Two seats: FCFS would take 0 and 1 (one uncached prefix, computed twice); lpm takes
    # 0 and 2, and 1 comes after, onto 0's cached pages.
    requests = [request(0, prompt(7, 0), 0.0, output_len=3),
                request(1, prompt(7, 1), 0.0, output_len=3),
                request(2, prompt(3, 2), 0.0, output_len=3)]
    result = run(requests, max_num_seqs=2, in_batch_prefix_tokens=PAGE)
    assert step_of(result, 0) == step_of(result, 2) == 0 < step_of(result, 1)
    assert result.num_cached_tokens.tolist() == [0, 16, 0]
    # A prefix shorter than `in_batch_prefix_tokens` is no conflict: plain FCFS.
    short = run(requests, max_num_seqs=2, in_batch_prefix_tokens=32)
    assert step_of(short, 0) == step_of(short, 1) == 0 < step_of(short, 2)


def test_lpm_caches_more_than_fcfs_when_prefixes_take_turns():
    # Four 48-token system prompts, arriving in a burst, interleaved; room for only a couple
    # of prefixes' pages besides the running requests. FCFS takes the prefixes in turn and
    # evicts each before it comes round again; lpm serves each prefix while it is cached.
    requests = shared_prefix_workload(num_requests=48, rate=2000.0, num_prefixes=4,
                                      prefix_len="fixed:48", prefix_zipf=0.0,
                                      suffix_len="uniform:1:8", output_len="uniform:4:12",
                                      seed=0, vocab_size=1000)
    lpm, fcfs = run(requests, max_num_seqs=2, num_kv_pages=48), run(
        requests, "vllm", max_num_seqs=2, num_kv_pages=48)
    assert lpm.num_generated.tolist() == [r.output_len for r in requests]
    assert fcfs.num_generated.tolist() == [r.output_len for r in requests]
    lpm_rate, fcfs_rate = summarize(lpm)["prefix_hit_rate"], summarize(fcfs)["prefix_hit_rate"]
    assert lpm_rate > fcfs_rate + 0.1, (lpm_rate, fcfs_rate)


def test_bad_knobs_are_refused_by_name():
    with pytest.raises(policies.PolicyLoadError, match="in_batch"):
        policies.make_policy("lpm", {"in_batch": "sometimes"})
    with pytest.raises(ValueError, match="in_batch_prefix_tokens"):
        policies.make_policy("lpm", {"in_batch_prefix_tokens": "0"})
