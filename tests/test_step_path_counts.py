"""The per-step path counts a step once: what the plan check counted serves the step, the
page rows are read only for an engine that reads the descriptor, and the cost model's
step work is the same figure however it is summed."""

import numpy as np
import pytest

import policies
from orca_jax import KVConfig, Request, Scheduler, SchedulerConfig, StepLimits
from orca_jax.core.kv import make_pool
from orca_jax.core.plans.plan import StepPlan
from orca_jax.core.plans.plan_checks import check_plan
from orca_jax.sim.cost_model import CostModelConfig
from orca_jax.sim.engine import SimEngine
from orca_jax.sim.roofline import _step_work

CONFIG = SchedulerConfig(limits=StepLimits(max_num_seqs=8, max_num_tokens=64, max_model_len=128),
                         kv=KVConfig(num_kv_pages=64, page_size=8))


def _scheduler() -> Scheduler:
    requests = [Request(id=i, arrival_s=0.0, prompt_len=10 + 7 * i, output_len=12)
                for i in range(6)]
    return Scheduler(requests, policies.make_policy("vllm", {"max_num_tokens": 64}),
                     SimEngine(CostModelConfig()), CONFIG)


def test_the_check_returns_the_counts_the_step_is_made_of():
    scheduler = _scheduler()
    scheduler.step()  # the first prompts run (the fourth in part); two still wait
    table = scheduler.table
    assert scheduler.waiting.size == 2
    ids = np.concatenate([scheduler.running, scheduler.waiting[:1]])
    tokens = np.minimum(table.num_uncomputed(ids), 3)
    needed, computed, context, uncomputed, states = check_plan(scheduler, StepPlan(ids, tokens))
    np.testing.assert_array_equal(needed, scheduler.capacity.pages_needed(ids, tokens))
    np.testing.assert_array_equal(computed, table.num_computed[ids])
    np.testing.assert_array_equal(context, table.num_computed[ids] + tokens)
    np.testing.assert_array_equal(uncomputed, table.num_uncomputed(ids))
    np.testing.assert_array_equal(states, table.state[ids])
    assert needed[-1] > 0  # the waiting one's first pages


def test_a_step_samples_exactly_where_it_computes_all_a_request_knows():
    scheduler = _scheduler()
    steps = []
    real_schedule = scheduler.schedule

    def schedule():
        step = real_schedule()
        steps.append(step)
        return step

    scheduler.schedule = schedule
    scheduler.step()
    for _ in range(12):
        scheduler.step()
    step = steps[-1]
    table = scheduler.table
    # After the update: a sampled request computed all it knew but the token it sampled.
    ids = step.request_ids
    known_before = table.prompt_len[ids] + table.num_generated[ids] - step.samples
    np.testing.assert_array_equal(step.samples, step.kv_lens == known_before)
    # And the steps' masks: some of the first step's requests were only part way through
    # their prompts (no sample), a later step's decodes all sample.
    assert steps[0].samples.any() and not steps[0].samples.all()


def test_the_descriptor_reads_the_page_table_within_the_step_and_never_after_it():
    scheduler = _scheduler()
    steps = []
    real_schedule = scheduler.schedule
    scheduler.schedule = lambda: steps.append(real_schedule()) or steps[-1]
    scheduler.step()
    first = steps[0]
    # The simulator prices lengths: the descriptor was never built, and cannot be now that
    # the step's update may have freed or grown the rows it would list.
    assert first.packed._inputs is None
    with pytest.raises(RuntimeError, match="updated before its descriptor was read"):
        first.packed.inputs
    # Read within the step (before the update), it lists each request's pages.
    scheduler.step()
    scheduler.step()
    pending = real_schedule()
    inputs = pending.packed.inputs
    n = pending.request_ids.size
    for i, request in enumerate(pending.request_ids.tolist()):
        held = scheduler.kv.pages_of(request)
        used = -(-int(pending.kv_lens[i]) // 8)
        np.testing.assert_array_equal(inputs.page_indices[i, :used], held[:used])
    assert inputs.page_indices[n:].sum() == 0


def test_a_free_of_requests_holding_alike_gives_their_pages_back_in_request_order():
    # As a free of requests of different widths does (test_kv_and_pack): the next grant
    # takes the freed pages in the free's request order, each request's in its order.
    kv = make_pool(num_kv_pages=12, page_size=2, max_pages_per_seq=6, num_requests=6)
    kv.allocate(np.array([0, 1, 2], np.int64), np.array([6, 6, 2], np.int64))  # 3, 3, 1
    held = {request: kv.pages_of(request) for request in (0, 1)}
    rows = kv.row_of[[0, 1]].copy()
    kv.free(np.array([1, 0], np.int64))
    assert kv.num_free == 11 and (kv.row_of[[0, 1]] == -1).all()
    assert not kv.page_table[rows].any()
    kv.check_consistency()
    kv.allocate(np.array([3], np.int64), np.array([12], np.int64))
    np.testing.assert_array_equal(kv.pages_of(3), np.concatenate([held[1], held[0]]))


def _work_by_definition(q, k):
    """`_step_work` by its definition: every query of a prefill chunk sees the keys before
    it and itself; a sequence of one new token is a decode; one of fewer is in neither."""
    prefill = [(a, b) for a, b in zip(q, k) if a > 1]
    pairs = sum(b - a + j + 1 for a, b in prefill for j in range(a))
    return (sum(q), len(q), float(sum(b for a, b in zip(q, k) if a == 1)),
            float(sum(b for _, b in prefill)), float(pairs))


@pytest.mark.parametrize("num_prefills", [0, 1, 3, 16, 17, 40])
def test_the_step_work_is_its_definition_with_few_or_many_prefills(num_prefills):
    rng = np.random.default_rng(num_prefills)
    q = np.ones(60, np.int64)
    q[rng.choice(60, num_prefills, replace=False)] = rng.integers(2, 300, num_prefills)
    q[rng.integers(0, 60)] = 0  # a row of no tokens (an estimate may ask): in neither sum
    k = q + rng.integers(0, 2000, 60)
    assert _step_work(q, k) == _work_by_definition(q.tolist(), k.tolist())
