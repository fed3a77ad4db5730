"""The KV interface's public answers: the view's room and fit, the old view attributes
that still read, the preemption registry and the tier chain's errors."""

import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orca_jax import (
    KVConfig,
    Request,
    RequestState,
    Scheduler,
    SchedulerConfig,
    StepLimits,
    make_policy,
)
from orca_jax.core.kv import DeviceTier, TierChain, make_pool, preempt, register_preemption_mode
from orca_jax.core.plans import view as view_module
from orca_jax.sim.cost_model import CostModelConfig
from orca_jax.sim.engine import SimEngine


def scheduler(config: SchedulerConfig, requests, policy="vllm") -> Scheduler:
    engine = SimEngine(CostModelConfig(mode="fixed", step_time_s=0.01))
    return Scheduler(requests, make_policy(policy), engine, config)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(pages=st.integers(4, 40), watermark=st.integers(0, 3), held=st.integers(0, 3),
       prompt=st.integers(1, 60))
def test_kv_room_is_the_fit_of_one_admission(pages, watermark, held, prompt):
    config = SchedulerConfig(
        limits=StepLimits(max_num_seqs=8, max_num_tokens=64, max_model_len=64),
        kv=KVConfig(num_kv_pages=pages, page_size=4, watermark_pages=watermark))
    requests = [Request(id=0, arrival_s=0.0, prompt_len=4 * held or 1, output_len=1),
                Request(id=1, arrival_s=0.0, prompt_len=prompt, output_len=1)]
    s = scheduler(config, requests)
    if held:
        s.step()  # request 0's prompt takes `held` pages (if it fits)
    view = s.view
    free = view.num_free_pages
    assert view.kv_room() == free - watermark and view.kv_room(admitting=False) == free
    np.testing.assert_array_equal(view.kv_room(np.array([5, 9])), [5 - watermark, 9 - watermark])
    if s.table.state[1] == RequestState.WAITING:  # the room and the whole question agree
        need = int(view.pages_needed([1], [prompt])[0])
        assert (need <= view.kv_room()) == view.kv_fits([1], [prompt])


def test_the_view_s_watermark_and_layout_still_read_with_a_warning_once(monkeypatch):
    monkeypatch.setattr(view_module, "_warned", set())
    config = SchedulerConfig(limits=StepLimits(max_model_len=64),
                             kv=KVConfig(num_kv_pages=40, page_size=4, watermark_pages=3,
                                         kv_layout="buddy", prefix_caching="off"))
    view = scheduler(config, [Request(id=0, arrival_s=0.0, prompt_len=4, output_len=2)],
                     policy="orca").view
    for name, value in [("watermark_pages", 3), ("kv_layout", "buddy")]:
        with pytest.warns(DeprecationWarning, match=f"SchedulerView.{name} is deprecated; ask"):
            assert getattr(view, name) == value
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert getattr(view, name) == value


def test_a_buddy_pool_refuses_what_its_free_total_would_take():
    # 16 pages: blocks of 4 at 0 and 8 held leave 8 free pages, but no block of 8.
    pool = make_pool(num_kv_pages=16, page_size=4, max_pages_per_seq=8, num_requests=4,
                     layout="buddy")
    pool.allocate(np.array([0, 1, 2]), np.array([16, 16, 16]))
    pool.free(np.array([1]))
    assert pool.num_free == 8 and pool.pages_needed(np.array([3]), np.array([32])).tolist() == [8]
    assert not pool.blocks_fit(np.array([3]), np.array([8]))
    assert pool.blocks_fit(np.array([3]), np.array([8]), freeing=np.array([2]))


def test_the_preemption_registry_names_its_errors():
    with pytest.raises(ValueError, match="'recompute' is already registered"):
        register_preemption_mode("recompute", object())
    config = SchedulerConfig(limits=StepLimits(max_model_len=64),
                             kv=KVConfig(num_kv_pages=40, page_size=4))
    s = scheduler(config, [Request(id=i, arrival_s=0.0, prompt_len=4, output_len=2)
                           for i in range(2)])
    with pytest.raises(ValueError, match="2 modes for 1 victims"):
        preempt(s.kv_memory, np.array([0]), ["recompute", "recompute"])


def test_the_tier_chain_starts_with_the_device_alone_and_names_its_tiers():
    chain = TierChain(DeviceTier(64), num_requests=4)
    assert chain.device_only and chain.away(np.arange(4)).size == 0
    with pytest.raises(ValueError, match="'device' is already in the chain"):
        chain.add(DeviceTier(8))
    with pytest.raises(KeyError, match="no KV tier 'host' in the chain \\(device\\)"):
        chain.index("host")


@settings(max_examples=30, deadline=None, derandomize=True)
@given(layout=st.sampled_from(["paged", "buddy"]), pages=st.integers(8, 48),
       watermark=st.integers(0, 2), held=st.lists(st.integers(1, 30), max_size=3),
       prompts=st.lists(st.integers(1, 40), min_size=1, max_size=6))
def test_a_budget_takes_what_the_whole_question_would_let_in(layout, pages, watermark, held,
                                                              prompts):
    # Requests 0.. run (their prompts computed), the rest wait; a greedy admission loop
    # over the budget must stop exactly where kv_fits of the plan so far says no.
    config = SchedulerConfig(
        limits=StepLimits(max_num_seqs=16, max_num_tokens=256, max_model_len=64),
        kv=KVConfig(num_kv_pages=pages, page_size=4, watermark_pages=watermark,
                    kv_layout=layout, prefix_caching="off"))
    requests = [Request(id=i, arrival_s=0.0, prompt_len=p, output_len=1)
                for i, p in enumerate(held)]
    requests += [Request(id=len(held) + i, arrival_s=1.0, prompt_len=p, output_len=4)
                 for i, p in enumerate(prompts)]
    s = scheduler(config, requests, policy="orca")
    if held:
        s.step()
    s.now_s = 1.0
    s._admit_arrivals()
    view = s.view
    running = view.running.tolist()
    budget = view.kv_budget(running, [1] * len(running))
    ids, tokens = list(running), [1] * len(running)
    for request in view.waiting.tolist():
        count = int(view.requests.num_uncomputed([request])[0])
        whole = (int(view.pages_needed([request], [count])[0]) <= budget.room
                 and view.kv_fits(ids + [request], tokens + [count]))
        room_before = budget.room
        taken = budget.take(request, count)
        assert taken == whole
        if not taken:
            assert budget.room == room_before  # a refusal leaves the budget as it was
            break
        ids.append(request)
        tokens.append(count)


def test_a_budget_on_a_fragmented_buddy_pool_refuses_what_the_free_total_would_take():
    # Three requests take blocks of 4 pages at 0, 4 and 8; the middle one finishes after
    # its prefill, leaving 8 free pages in two blocks of 4: no block of 8.
    config = SchedulerConfig(
        limits=StepLimits(max_num_seqs=8, max_num_tokens=256, max_model_len=64),
        kv=KVConfig(num_kv_pages=16, page_size=4, kv_layout="buddy",
                    prefix_caching="off"))
    requests = [Request(id=i, arrival_s=0.0, prompt_len=prompt, output_len=16 - prompt)
                for i, prompt in enumerate([6, 15, 6])]  # 16 tokens: 4 pages each
    requests.append(Request(id=3, arrival_s=1.0, prompt_len=29, output_len=1))
    s = Scheduler(requests, make_policy("orca", {"kv_reservation": "exact"}),
                  SimEngine(CostModelConfig(mode="fixed", step_time_s=0.01)), config)
    s.step()
    s.now_s = 1.0
    s._admit_arrivals()
    view = s.view
    assert view.running.tolist() == [0, 2] and view.num_free_pages == 8
    assert int(view.pages_needed([3], [29])[0]) == 8 == view.kv_room()  # the total fits
    budget = view.kv_budget([0, 2], [1, 1])
    assert not budget.take(3, 29) and budget.room == 8  # but no free block of 8
    assert not view.kv_fits([0, 2, 3], [1, 1, 29])
