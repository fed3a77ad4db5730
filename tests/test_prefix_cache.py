"""Prefix caching: page names, the cache index, shared reference-counted pages, admission hits.

The unit tests drive `PrefixCache` and a `CachedPool` (`make_pool`) directly; the scheduler
tests run through the public API on the simulator and assert exact hits, step
counts and pool states someone could get wrong.
"""

import subprocess
import sys

import numpy as np
import pytest

from orca_jax.core.kv.prefix_cache import ROOT_HASH, PrefixCache, hash_page

PAGE = 4


def reader(tokens):
    tokens = np.asarray(tokens, dtype=np.int32)
    return lambda start, end: tokens[start:end]


# ------------------------------------------------------------------ names
def test_a_page_name_chains_over_its_parent():
    a, b = np.arange(4, dtype=np.int32), np.arange(4, 8, dtype=np.int32)
    first = hash_page(ROOT_HASH, a)
    assert hash_page(ROOT_HASH, a) == first and len(first) == 16
    assert hash_page(first, b) != hash_page(ROOT_HASH, b)  # same tokens, other prefix
    assert hash_page(ROOT_HASH, b) != first
    # int64 input names the same page as its int32 ids.
    assert hash_page(ROOT_HASH, a.astype(np.int64)) == first


def test_page_names_do_not_depend_on_the_process():
    # Python's own hash of bytes is salted per process; the page names must not be.
    code = ("import numpy as np; from orca_jax.core.kv.prefix_cache import hash_page;"
            "print(hash_page(b'', np.arange(4, dtype=np.int32)).hex())")
    runs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True, env={"PYTHONHASHSEED": str(seed), "JAX_PLATFORMS": "cpu"}
                           ).stdout for seed in (1, 2)}
    assert runs == {hash_page(ROOT_HASH, np.arange(4, dtype=np.int32)).hex() + "\n"}


def test_names_are_computed_once_per_page():
    cache = PrefixCache(num_kv_pages=8, page_size=PAGE, num_requests=2)
    calls = []

    def tokens(start, end):
        calls.append((start, end))
        return np.arange(start, end, dtype=np.int32)

    names = cache.names(0, 2, tokens)
    assert calls == [(0, 4), (4, 8)]
    assert cache.names(0, 3, tokens)[:2] == names and calls[-1] == (8, 12) and len(calls) == 3
    assert cache.names(0, 1, tokens) == names[:1] and len(calls) == 3


# ------------------------------------------------------------------ the index
def test_lookup_finds_the_longest_cached_run_and_reads_only():
    cache = PrefixCache(num_kv_pages=8, page_size=PAGE, num_requests=3)
    prompt = np.arange(100, 112)
    cache.commit(0, np.array([5, 6, 7], np.int32), reader(prompt))
    assert cache.num_cached == 3 and cache.is_cached[[5, 6, 7]].all()
    # Request 1 shares the first two pages, then differs.
    other = np.concatenate([prompt[:8], [1, 2, 3, 4]])
    assert cache.lookup(1, 3, reader(other)) == [5, 6]
    assert cache.lookup(1, 1, reader(other)) == [5]
    # A different first page misses everything, even with equal later pages.
    assert cache.lookup(2, 3, reader(np.concatenate([[0, 0, 0, 0], prompt[4:]]))) == []
    assert cache.num_cached == 3 and cache.num_free == 0
    cache.check_consistency()


def test_a_duplicate_page_stays_private():
    cache = PrefixCache(num_kv_pages=8, page_size=PAGE, num_requests=2)
    prompt = np.arange(8)
    cache.commit(0, np.array([1, 2], np.int32), reader(prompt))
    cache.commit(1, np.array([3, 4], np.int32), reader(prompt))  # same tokens, other pages
    assert cache.is_cached.tolist() == [False, True, True, False, False, False, False, False,
                                        False]
    assert cache.lookup(1, 2, reader(prompt)) == [1, 2]
    cache.check_consistency()


def test_commit_names_only_the_newly_full_pages():
    cache = PrefixCache(num_kv_pages=8, page_size=PAGE, num_requests=1)
    tokens = np.arange(12)
    cache.commit(0, np.array([3], np.int32), reader(tokens))
    cache.commit(0, np.array([3, 5, 8], np.int32), reader(tokens))
    assert np.flatnonzero(cache.is_cached).tolist() == [3, 5, 8]
    assert cache.num_committed[0] == 3
    cache.forget(0)
    assert cache.num_committed[0] == 0 and cache.num_cached == 3  # pages outlive the request


def test_free_cached_pages_are_evicted_least_recently_freed_first():
    cache = PrefixCache(num_kv_pages=8, page_size=PAGE, num_requests=2)
    cache.commit(0, np.array([1, 2, 3], np.int32), reader(np.arange(12)))
    cache.release(np.array([3, 2], np.int32))  # a request's tail first, as vLLM
    cache.release(np.array([1], np.int32))
    assert cache.num_free == 3 and cache.free_pages().tolist() == [3, 2, 1]
    cache.take(np.array([2], np.int32))  # a hit shares page 2 again
    assert cache.free_pages().tolist() == [3, 1]
    evicted = cache.evict(1)
    assert evicted.tolist() == [3] and not cache.is_cached[3] and cache.num_evictions == 1
    # Page 3's name is gone: a lookup of the same tokens stops before it.
    assert cache.lookup(1, 3, reader(np.arange(12))) == [1, 2]
    cache.check_consistency()


# ------------------------------------------------------------------ the scheduler
from orca_jax import (  # noqa: E402
    KVConfig,
    PlanError,
    Request,
    Scheduler,
    SchedulerConfig,
    StepLimits,
    StepPlan,
)
from orca_jax.core.api.policy import make_policy  # noqa: E402
from orca_jax.core.kv import make_pool  # noqa: E402
from orca_jax.results.summary import request_rows, step_rows, summarize  # noqa: E402
from orca_jax.sim.cost_model import CostModelConfig  # noqa: E402
from orca_jax.sim.engine import SimEngine  # noqa: E402

STEP_S = 0.01
SHARED = np.arange(1, 9, dtype=np.int32)  # two full pages every prompt below starts with


def request(i, tokens, arrival_s=0.0, output_len=2):
    tokens = np.asarray(tokens, dtype=np.int32)
    return Request(id=i, arrival_s=arrival_s, prompt_len=tokens.size, output_len=output_len,
                   prompt_tokens=tokens)


def scheduler_for(requests, *, num_kv_pages=16, policy="vllm", caching=True, **policy_opts):
    config = SchedulerConfig(limits=StepLimits(max_num_seqs=4, max_num_tokens=64, max_model_len=32),
                             kv=KVConfig(num_kv_pages=num_kv_pages, page_size=PAGE,
                                         prefix_caching="policy" if caching else "off"))
    engine = SimEngine(CostModelConfig(mode="fixed", step_time_s=STEP_S))
    scheduler = Scheduler(requests, make_policy(policy, policy_opts), engine, config)
    engine.warmup(scheduler.bucket_config.buckets())
    return scheduler


def step_until(scheduler, condition):
    for _ in range(200):
        if condition():
            return
        scheduler.step()
        scheduler.kv.check_consistency()
    raise AssertionError("condition never held")


def test_admissions_share_the_cached_prefix_and_start_past_it():
    # Request 0 fills three prompt pages; 1 shares the first two and differs after; 2 repeats
    # 0's prompt exactly: 12 tokens, a multiple of the page, so it recomputes its last page
    # (the last token is never taken from the cache), as vLLM's `get_computed_blocks`.
    prompt0 = np.concatenate([SHARED, [9, 10, 11, 12]])
    requests = [request(0, prompt0), request(1, np.concatenate([SHARED, [7, 7, 7, 7, 7]]), 1.0),
                request(2, prompt0, 1.0)]
    scheduler = scheduler_for(requests)
    kv, view = scheduler.kv, scheduler.view
    assert view.prefix_caching and view.num_cached_pages == 0
    step_until(scheduler, lambda: scheduler.table.state[0] == 3)  # finished
    # Its three full prompt pages stay cached, free; its page holding token 13 did not fill.
    assert view.num_cached_pages == 3 and kv.cache.num_free == 3 and view.num_used_pages == 0
    assert view.num_free_pages == 16
    seen = {}
    schedule = scheduler.policy.schedule

    def looking(view):  # what the policy sees with 1 and 2 waiting, before admitting them
        if view.waiting.size == 2 and not seen:
            seen["cached"] = view.cached_tokens([1, 2]).tolist()
            seen["needed"] = view.pages_needed([1, 2], [5, 4]).tolist()
            seen["fits"] = view.kv_fits([1, 2], [5, 4])
        return schedule(view)

    scheduler.policy.schedule = looking
    step_until(scheduler, lambda: scheduler.table.state[1] == 2)  # both admitted in one step
    # 13 and 12 tokens are 4 and 3 pages: each needs those past its 2-page hit, plus the two
    # free hit pages (sharing takes them from the pool), which the plan check counts once.
    assert seen == {"cached": [8, 8], "needed": [4, 3], "fits": True}
    assert scheduler.table.state[2] == 2
    steps = scheduler.num_steps - 1
    table = scheduler.table
    np.testing.assert_array_equal(table.num_cached_tokens[[0, 1, 2]], [0, 8, 8])
    np.testing.assert_array_equal(table.num_computed[[1, 2]], [13, 12])
    entry = scheduler.record.steps[steps]
    assert entry.num_tokens == 5 + 4 and entry.num_cached_tokens == 16
    shared = kv.pages_of(1)[:2]
    np.testing.assert_array_equal(kv.pages_of(2)[:2], shared)
    assert kv.ref_count[shared].tolist() == [2, 2] and kv.num_used == 2 + 2 + 1
    assert (kv.pages_of(1)[2:] != kv.pages_of(2)[2]).all()  # nobody writes a shared page
    np.testing.assert_array_equal(view.cached_tokens([1, 2]), [0, 0])  # running
    result = scheduler.run()
    assert result.num_generated.tolist() == [2, 2, 2]
    assert scheduler.kv.num_free == 16 and scheduler.kv.ref_count.sum() == 0
    scheduler.kv.check_consistency()


def test_a_shared_page_is_freed_by_its_last_holder_only():
    kv = make_pool(num_kv_pages=8, page_size=PAGE, max_pages_per_seq=4, num_requests=3,
                   prefix_cache=PrefixCache(num_kv_pages=8, page_size=PAGE, num_requests=3))
    kv.allocate(np.array([0]), np.array([12]))
    kv.cache.commit(0, kv.pages_of(0)[:2], reader(np.arange(12)))
    shared = kv.pages_of(0)[:2]
    kv.share(1, shared)
    kv.allocate(np.array([1]), np.array([10]))
    assert kv.ref_count[shared].tolist() == [2, 2] and kv.num_free == 8 - 4
    assert kv.num_freed_by(np.array([0])) == 1  # only its private page
    assert kv.num_freed_by(np.array([0, 1])) == 4
    assert kv.num_freed_by(np.array([0, 1]), kept=shared) == 2
    kv.free(np.array([0]))
    assert kv.ref_count[shared].tolist() == [1, 1] and kv.num_free == 5
    kv.check_consistency()
    kv.free(np.array([1]))
    assert kv.num_free == 8 and kv.cache.num_free == 2 and kv.cache.num_cached == 2
    # The shared pages are free but findable; the private ones went to the free stack.
    assert kv.cache.free_pages().tolist() == shared[::-1].tolist()
    kv.check_consistency()
    with pytest.raises(RuntimeError, match="holds pages"):
        kv.allocate(np.array([2]), np.array([4]))
        kv.share(2, shared)


def test_allocation_takes_uncached_pages_first_then_evicts_least_recently_freed():
    # Request 0's three prompt pages are cached when it ends; request 1 (another prompt)
    # comes to hold 5 of the 6 pages: the 3 uncached free pages, then 2 evicted cached
    # ones, the later pages of 0's prompt first. Request 2 (0's prompt) then hits one page.
    prompt0 = np.concatenate([SHARED, [9, 10, 11, 12]])
    requests = [request(0, prompt0), request(1, np.arange(100, 116), 1.0),
                request(2, prompt0, 2.0)]
    scheduler = scheduler_for(requests, num_kv_pages=6)
    step_until(scheduler, lambda: scheduler.table.state[0] == 3)
    first_pages = scheduler.kv.cache.free_pages()[::-1]  # 0's pages in prompt order
    step_until(scheduler, lambda: scheduler.table.state[1] == 3)  # 1 finished
    cache = scheduler.kv.cache
    assert cache.num_evictions == 2
    # An evicted page may be cached again, under request 1's name: look 0's prompt up.
    assert cache.lookup(2, 2, reader(prompt0)) == [int(first_pages[0])]
    result = scheduler.run()
    assert result.num_cached_tokens.tolist() == [0, 0, 4] and result.num_evictions >= 2
    summary = summarize(result)
    # Cached prompt tokens over the prompts of admitted requests: 4 / (12 + 16 + 12).
    assert summary["prefix_hit_rate"] == pytest.approx(4 / 40)
    assert summary["num_evictions"] == result.num_evictions
    assert [row["num_cached_tokens"] for row in request_rows(result)] == [0, 0, 4]
    assert sum(row["num_cached_tokens"] for row in step_rows(result)) == 4


def test_caching_off_or_not_opted_in_runs_as_before():
    prompt = np.concatenate([SHARED, [9, 10, 11, 12]])
    requests = [request(i, prompt, arrival_s=0.1 * i, output_len=3) for i in range(6)]
    on = scheduler_for(requests).run()
    off = scheduler_for(requests, caching=False).run()
    knob_off = scheduler_for(requests, enable_prefix_caching="false").run()
    assert on.prefix_caching and not off.prefix_caching and not knob_off.prefix_caching
    assert on.num_cached_tokens.tolist() == [0] + [8] * 5
    assert off.num_cached_tokens.tolist() == [0] * 6

    def steps(result):  # host time is wall-clock
        return [step._replace(host_s=0.0) for step in result.steps]

    assert steps(off) == steps(knob_off) and off.token_time_s.tolist() == (
        knob_off.token_time_s.tolist())
    # Without caching nothing is written about it; with it, hits shorten the prefills.
    assert "prefix_hit_rate" not in summarize(off) and "num_cached_tokens" not in (
        request_rows(off)[0]) and "num_cached_tokens" not in step_rows(off)[0]
    assert summarize(on)["prefix_hit_rate"] == pytest.approx(40 / 72)
    assert sum(s.num_tokens for s in on.steps) == sum(s.num_tokens for s in off.steps) - 40


def test_requests_without_token_ids_never_hit():
    # Same prompt lengths that share pages when they carry ids (test above): without ids
    # nothing can match, so no cache is kept, and the run is the one without caching.
    requests = [Request(id=i, arrival_s=0.1 * i, prompt_len=20, output_len=3) for i in range(3)]
    scheduler = scheduler_for(requests, num_kv_pages=6)
    result = scheduler.run()
    assert scheduler.prefix_caching and scheduler.view.prefix_caching
    assert scheduler.kv.cache is None and scheduler.view.num_cached_pages == 0
    assert result.prefix_caching and result.num_cached_tokens.tolist() == [0, 0, 0]
    off = scheduler_for(requests, num_kv_pages=6, caching=False).run()
    assert [s._replace(host_s=0.0) for s in result.steps] == [
        s._replace(host_s=0.0) for s in off.steps]
    assert result.token_time_s.tolist() == off.token_time_s.tolist()


def test_buddy_layout_and_caching_are_refused_together():
    requests = [request(0, SHARED)]
    config = SchedulerConfig(limits=StepLimits(max_num_seqs=4, max_num_tokens=64, max_model_len=32),
                             kv=KVConfig(num_kv_pages=16, page_size=PAGE, kv_layout="buddy"))
    engine = SimEngine(CostModelConfig(mode="fixed", step_time_s=STEP_S))
    reserving = make_policy("vllm")
    reserving.kv_reservation = "max"  # buddy needs a reservation; vllm has none of its own
    with pytest.raises(ValueError, match="prefix caching .* buddy"):
        Scheduler(requests, reserving, engine, config)
    Scheduler(requests, make_policy("orca"), engine, config)  # orca does not opt in


def test_a_rejected_plan_leaves_the_cache_unchanged():
    prompt0 = np.concatenate([SHARED, [9, 10, 11, 12]])
    requests = [request(0, prompt0), request(1, prompt0, 1.0), request(2, prompt0, 1.0)]
    scheduler = scheduler_for(requests)
    kv, cache = scheduler.kv, scheduler.kv.cache
    schedule = scheduler.policy.schedule
    bad = [StepPlan([1, 2], [12, 4]),  # 12 tokens: more than the 4 left past the hit
           StepPlan([1, 2], [4, 4], preempt=[0]),  # 0 is not running
           StepPlan([1, 2], [4, 4], min_bucket_tokens=1024)]  # over the budget
    seen = []

    def state():
        return (kv.ref_count.copy(), kv.num_free, cache.free_pages(), cache.version,
                cache.is_cached.copy(), scheduler.table.snapshot(), scheduler.waiting.copy())

    def bad_once(view):  # with 1 and 2 waiting on cached pages, a bad plan each step
        if view.waiting.size < 2:
            return schedule(view)
        seen.append(state())
        return bad[len(seen) - 1]

    scheduler.policy.schedule = bad_once
    for _ in bad:
        with pytest.raises(PlanError):
            for _ in range(10):
                scheduler.step()
        assert seen[-1][1] == 16 and cache.num_free == 3  # 0's pages, cached and free
        for a, b in zip(seen[-1], state()):
            if isinstance(a, dict):
                assert a.keys() == b.keys()
                for key in a:
                    np.testing.assert_array_equal(a[key], b[key], err_msg=key)
            else:
                np.testing.assert_array_equal(a, b)
