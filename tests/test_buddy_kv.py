"""The buddy KV layout: the allocator, the page manager under it, and the scheduler's checks."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import policies  # noqa: F401  (registers the built-in policies)
from orca_jax import (
    KVConfig,
    PlanError,
    Request,
    RequestState,
    Scheduler,
    SchedulerConfig,
    StepLimits,
    StepPlan,
)
from orca_jax.core.api.policy import Policy, make_policy
from orca_jax.core.kv import make_pool
from orca_jax.core.kv.buddy import BuddyAllocator, block_order, block_pages
from orca_jax.sim.cost_model import CostModelConfig
from orca_jax.sim.engine import SimEngine
from orca_jax.workloads.synthetic import synthetic_workload


def ids(*values):
    return np.asarray(values, dtype=np.int64)


def buddy_manager(num_pages=16, page_size=4, max_pages_per_seq=8, num_requests=8):
    return make_pool(num_kv_pages=num_pages, page_size=page_size,
                     max_pages_per_seq=max_pages_per_seq, num_requests=num_requests,
                     layout="buddy")


# -------------------------------------------------------------- the allocator
def test_block_sizes_round_up_to_powers_of_two():
    assert [block_order(p) for p in (1, 2, 3, 4, 5, 8, 9)] == [0, 1, 2, 2, 3, 3, 4]
    np.testing.assert_array_equal(block_pages(ids(0, 1, 3, 4, 5, 100)), [0, 1, 4, 4, 8, 128])
    with pytest.raises(ValueError, match="at least 1 page"):
        block_order(0)


def test_a_pool_that_is_not_a_power_of_two_is_its_binary_decomposition():
    buddy = BuddyAllocator(12)
    assert buddy.free_blocks() == [(0, 8), (8, 4)]
    assert buddy.largest_block == 8 and buddy.num_free == 12


def test_splits_and_merges():
    buddy = BuddyAllocator(16)
    a = buddy.allocate(0)  # 16 -> 8 + 4 + 2 + 1 + [1]
    assert a == 0 and buddy.free_blocks() == [(1, 1), (2, 2), (4, 4), (8, 8)]
    b = buddy.allocate(1)  # the free 2-block, no split
    assert b == 2 and buddy.free_blocks() == [(1, 1), (4, 4), (8, 8)]
    c = buddy.allocate(2)
    assert c == 4 and buddy.num_free == 9
    buddy.release(a, 0)  # its buddy (page 1) is free: merges to [0, 2), whose buddy is held
    assert buddy.free_blocks() == [(0, 2), (8, 8)]
    buddy.release(b, 1)  # [0, 2) + [2, 4) -> [0, 4); its buddy [4, 8) is held
    assert buddy.free_blocks() == [(0, 4), (8, 8)]
    buddy.release(c, 2)  # merges all the way back
    assert buddy.free_blocks() == [(0, 16)]


def test_fragmentation_blocks_what_the_free_total_allows():
    buddy = BuddyAllocator(16)
    starts = [buddy.allocate(2) for _ in range(4)]  # four 4-page blocks
    buddy.release(starts[0], 2)
    buddy.release(starts[2], 2)  # 8 pages free, but in two 4-blocks that are not buddies
    assert buddy.num_free == 8
    assert not buddy.fits([3])  # an 8-page block does not exist
    assert buddy.fits([2, 2]) and not buddy.fits([2, 2, 0])
    with pytest.raises(RuntimeError, match="no free block of 8 pages"):
        buddy.allocate(3)


def test_fits_agrees_with_allocating():
    rng = np.random.default_rng(0)
    for _ in range(200):
        buddy = BuddyAllocator(int(rng.integers(1, 40)))
        held = []
        for _ in range(int(rng.integers(0, 6))):
            order = int(rng.integers(0, 4))
            if buddy.fits([order]):
                held.append((buddy.allocate(order), order))
        if held and rng.random() < 0.5:
            buddy.release(*held.pop(int(rng.integers(len(held)))))
        orders = rng.integers(0, 4, size=int(rng.integers(1, 5))).tolist()
        trial = buddy.copy()
        try:
            for order in sorted(orders, reverse=True):
                trial.allocate(order)
            allocated = True
        except RuntimeError:
            allocated = False
        assert buddy.fits(orders) == allocated


# -------------------------------------------------------- the page manager
def test_manager_gives_each_request_one_aligned_block():
    kv = buddy_manager(num_pages=16, page_size=4, max_pages_per_seq=8)
    # 3 pages (12 tokens) take a 4-block; 5 pages take an 8-block; 1 page a 1-block.
    np.testing.assert_array_equal(kv.pages_needed(ids(0, 1, 2), ids(12, 20, 1)), [4, 8, 1])
    kv.allocate(ids(0, 1, 2), ids(12, 20, 1))
    kv.check_consistency()
    assert kv.num_free == 16 - 13
    np.testing.assert_array_equal(kv.pages_of(1), np.arange(1, 9))  # largest first: [0, 8)
    np.testing.assert_array_equal(kv.pages_of(0), np.arange(9, 13))
    np.testing.assert_array_equal(kv.pages_of(2), [13])
    # The block covers the request's whole context: running on needs nothing new.
    np.testing.assert_array_equal(kv.pages_needed(ids(0, 1), ids(16, 32)), [0, 0])
    assert not kv.blocks_fit(ids(0), ids(1))  # a held block cannot grow
    with pytest.raises(RuntimeError, match="cannot grow"):
        kv.allocate(ids(0), ids(17))
    kv.free(ids(1, 0, 2))
    kv.check_consistency()
    assert kv.num_free == 16 and kv.free_blocks() == [(0, 16)]


def test_manager_fragmentation_refuses_what_paged_admits():
    kv = buddy_manager(num_pages=16, page_size=4, max_pages_per_seq=8)
    paged = make_pool(num_kv_pages=16, page_size=4, max_pages_per_seq=8, num_requests=8)
    for manager in (kv, paged):
        manager.allocate(ids(0, 1, 2, 3), ids(16, 16, 16, 16))  # four 4-page requests
        manager.free(ids(0, 2))
    need_kv = kv.pages_needed(ids(4), ids(32))  # 8 pages
    need_paged = paged.pages_needed(ids(4), ids(32))
    assert kv.num_free == paged.num_free == 8 == int(need_kv[0]) == int(need_paged[0])
    assert paged.blocks_fit(ids(4), need_paged)
    assert not kv.blocks_fit(ids(4), need_kv)
    # Once request 1 leaves, [0, 4) and [4, 8) merge: the 8-page block exists.
    assert kv.blocks_fit(ids(4), need_kv, freeing=ids(1))
    with pytest.raises(RuntimeError, match="overcommitted"):
        kv.allocate(ids(4), ids(32))
    kv.check_consistency()


def test_a_block_wider_than_the_row_lists_its_first_pages():
    kv = buddy_manager(num_pages=16, page_size=4, max_pages_per_seq=5)
    kv.allocate(ids(0), ids(20))  # 5 pages -> an 8-block; the row lists 5 of them
    assert kv.num_held[0] == 8 and kv.num_free == 8
    np.testing.assert_array_equal(kv.pages_of(0), np.arange(1, 6))
    kv.check_consistency()


# -------------------------------------------------------------- the scheduler
STEP_S = 0.01


def engine() -> SimEngine:
    return SimEngine(CostModelConfig(mode="fixed", step_time_s=STEP_S))


def test_buddy_needs_a_reserving_policy():
    with pytest.raises(ValueError, match="kv_layout"):
        SchedulerConfig(kv=KVConfig(kv_layout="contiguous"))
    requests = [Request(id=0, arrival_s=0.0, prompt_len=4, output_len=2)]
    with pytest.raises(ValueError, match="reserving kv_reservation"):
        Scheduler(requests, make_policy("vllm"), engine(),
                  SchedulerConfig(kv=KVConfig(kv_layout="buddy")))


class AdmitAll(Policy):
    """Runs every running request and admits every waiting one, fit or not."""

    name = "test_admit_all"
    kv_reservation = "exact"

    def schedule(self, view):
        ids = np.concatenate([view.running, view.waiting])
        return StepPlan(ids, np.minimum(view.requests.num_uncomputed(ids), 8))


def test_a_plan_no_block_fits_is_rejected_and_changes_nothing():
    # 16 pages of 4 tokens: four 16-token requests take four 4-blocks; after 0 and 2 finish,
    # 8 pages are free but no 8-block: a 32-token request does not fit.
    requests = ([Request(id=i, arrival_s=0.0, prompt_len=8, output_len=o)
                 for i, o in enumerate((1, 8, 1, 8))]
                + [Request(id=4, arrival_s=0.001, prompt_len=8, output_len=24)])
    config = SchedulerConfig(limits=StepLimits(max_num_seqs=8, max_num_tokens=64, max_model_len=32),
                             kv=KVConfig(num_kv_pages=16, page_size=4, kv_layout="buddy"))
    scheduler = Scheduler(requests, AdmitAll(), engine(), config)
    scheduler.step()  # admits 0-3 and computes their prompts; 0 and 2 finish
    assert scheduler.kv.num_free == 8
    before = (scheduler.table.num_computed.copy(), scheduler.kv.num_held.copy(),
              scheduler.kv.free_blocks(), scheduler.now_s, scheduler.num_steps)
    with pytest.raises(PlanError, match="kv_pages"):
        scheduler.step()  # 4 has arrived: the plan admits it
    assert scheduler.waiting.tolist() == [4]
    assert not scheduler.view.kv_fits(ids(4), ids(8))
    assert scheduler.view.pages_needed(ids(4), ids(8)).tolist() == [8]
    np.testing.assert_array_equal(scheduler.table.num_computed, before[0])
    np.testing.assert_array_equal(scheduler.kv.num_held, before[1])
    assert scheduler.kv.free_blocks() == before[2]
    assert (scheduler.now_s, scheduler.num_steps) == before[3:]
    scheduler.kv.check_consistency()


def test_a_request_larger_than_the_largest_block_is_rejected_up_front():
    # 12 pages: blocks of 8 and 4. A 9-page reservation rounds to 16: it never fits.
    requests = [Request(id=0, arrival_s=0.0, prompt_len=30, output_len=6),
                Request(id=1, arrival_s=0.0, prompt_len=8, output_len=4)]
    config = SchedulerConfig(limits=StepLimits(max_num_seqs=4, max_num_tokens=64, max_model_len=64),
                             kv=KVConfig(num_kv_pages=12, page_size=4, kv_layout="buddy"))
    scheduler = Scheduler(requests, make_policy("orca", {"kv_reservation": "exact"}), engine(),
                          config)
    assert scheduler.table.state[0] == RequestState.REJECTED
    assert "largest buddy block" in scheduler.table.reject_reason[0]
    scheduler.run()
    assert scheduler.table.state[1] == RequestState.FINISHED


@pytest.mark.parametrize("policy_name,reservation", [("orca", "max"), ("orca", "pow2"),
                                                     ("orca", "exact"), ("static", "exact")])
@settings(max_examples=10, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**16), num_pages=st.integers(16, 60),
       watermark=st.sampled_from([0, 0, 1]))
def test_reserving_policies_never_overcommit_a_buddy_pool(policy_name, reservation, seed,
                                                          num_pages, watermark):
    requests = synthetic_workload(num_requests=30, arrival="poisson", rate=200.0,
                                  prompt_len="lognormal:20:1", output_len="uniform:1:40",
                                  seed=seed)
    config = SchedulerConfig(limits=StepLimits(max_num_seqs=8, max_num_tokens=64, max_model_len=64),
                             kv=KVConfig(num_kv_pages=num_pages, page_size=4,
                                         watermark_pages=watermark, kv_layout="buddy"))
    policy = make_policy(policy_name, {"kv_reservation": reservation})
    scheduler = Scheduler(requests, policy, engine(), config)
    scheduler.engine.warmup(scheduler.bucket_config.buckets())
    steps = 0
    while not scheduler.done:
        scheduler.step()  # a plan that overcommits raises PlanError
        scheduler.kv.check_consistency()
        held = scheduler.kv.num_held
        assert scheduler.kv.num_free == num_pages - int(held.sum()) >= 0
        running = scheduler.running
        assert (held[running] * 4 >= scheduler.table.num_computed[running]).all()
        steps += 1
        assert steps < 20_000
    state = scheduler.table.state
    assert ((state == RequestState.FINISHED) | (state == RequestState.REJECTED)).all()
    finished = state == RequestState.FINISHED
    np.testing.assert_array_equal(scheduler.table.num_generated[finished],
                                  scheduler.table.output_len[finished])
    assert scheduler.kv.num_free == num_pages and scheduler.kv.free_blocks()[0][0] == 0
