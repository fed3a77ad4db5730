"""smartspec picks each step's draft tokens for the most estimated goodput (policies/smartspec.py).

A batch of `n` decodes of a given context and acceptance history is made by a
real scheduler on the simulator (LLaMA-2 70B on 4 A100s, a 7B draft); smartspec's
choice is then compared with the cost model's own verdict on every candidate.
"""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orca_jax import KVConfig, Request, Scheduler, SchedulerConfig, StepLimits
from orca_jax.sim.cost_model import CostModelConfig
from orca_jax.sim.engine import SimEngine
from orca_jax.sim.speculation import SpecConfig
from policies.smartspec import SmartSpec, expected_tokens
from policies.vllm import VLLM

TARGET = CostModelConfig(model="llama2-70b", hardware="a100", tp=4, step_padding="ragged")
DRAFT = CostModelConfig(model="llama2-7b", hardware="a100", tp=4, step_padding="ragged")


def decoding_batch(n: int, context: int, acceptance: float, judged: int = 200,
                   speculates: bool = True):
    """A scheduler whose `n` requests all decode, each with `judged` draft positions
    judged at `acceptance` so far; its smartspec policy; and that step's vLLM plan."""
    budget = 1 << int(np.ceil(np.log2(n * context + 1)))
    requests = [Request(id=i, arrival_s=0.0, prompt_len=context, output_len=64)
                for i in range(n)]
    config = SchedulerConfig(
        limits=StepLimits(max_num_seqs=n, max_num_tokens=budget, max_model_len=context + 64),
        kv=KVConfig(num_kv_pages=n * (context // 16 + 6), page_size=16, prefix_caching="off"))
    policy = SmartSpec(max_num_seqs=n, max_num_tokens=budget)
    engine = SimEngine(TARGET, speculation=SpecConfig(acceptance=acceptance, draft=DRAFT)
                       if speculates else None)
    scheduler = Scheduler(requests, policy, engine, config)
    scheduler.step()  # every prompt at once: all decode from here
    counts = scheduler.table.speculation
    if counts is not None:
        accepted = int(round(acceptance * judged))
        counts.accepted[:] = accepted
        counts.rejections[:] = judged - accepted
        counts.total_accepted, counts.total_judged = n * accepted, n * judged
    view = scheduler.view
    assert bool(view.requests.prefill_done(view.running).all())
    return scheduler, policy, VLLM.schedule(policy, view)


def goodput(policy, view, plan, ks):
    """The estimated goodput of `plan` with draft tokens `ks`, as smartspec weighs it."""
    requests = view.requests
    acceptance = requests.acceptance_rate(
        plan.request_ids, requests.pooled_acceptance_rate(policy.prior_acceptance,
                                                          policy.prior_weight),
        policy.request_weight)
    context = requests.num_computed[plan.request_ids] + plan.num_tokens
    decoding = np.ones(plan.request_ids.size, bool)
    return policy._goodput(view, plan.num_tokens, context, ks, acceptance, decoding)


@settings(max_examples=12, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(1, 96), context=st.integers(64, 1536),
       acceptance=st.floats(0.0, 1.0))
def test_the_choice_beats_k0_and_every_uniform_k_by_the_cost_model(n, context, acceptance):
    scheduler, policy, plan = decoding_batch(n, context, acceptance)
    view = scheduler.view
    chosen = policy.choose_k(view, plan)
    zero = np.zeros(n, np.int64)
    base = goodput(policy, view, plan, zero)
    uniform = [goodput(policy, view, plan, np.full(n, k, np.int64))
               for k in range(1, policy.max_k + 1)
               if n * (k + 1) <= view.max_num_tokens]
    if chosen is None:  # k = 0 everywhere: no uniform k beats it by the estimate
        assert all(value <= base * (1 + 1e-12) for value in uniform)
    else:
        value = goodput(policy, view, plan, chosen)
        assert value > base
        assert all(value >= other * (1 - 1e-12) for other in uniform)
        assert chosen.min() >= 0 and chosen.max() <= policy.max_k


@pytest.mark.parametrize("n,context,acceptance", [(96, 1024, 0.2), (128, 512, 0.35),
                                                  (64, 2048, 0.1)])
def test_k0_at_a_large_batch_of_low_acceptance(n, context, acceptance):
    scheduler, policy, plan = decoding_batch(n, context, acceptance)
    assert policy.choose_k(scheduler.view, plan) is None
    # The cost model agrees: one draft token each already loses goodput.
    view = scheduler.view
    assert (goodput(policy, view, plan, np.ones(n, np.int64))
            < goodput(policy, view, plan, np.zeros(n, np.int64)))


@pytest.mark.parametrize("n,acceptance", [(1, 0.9), (4, 0.8), (8, 0.95)])
def test_k_above_0_at_a_small_batch_of_high_acceptance(n, acceptance):
    scheduler, policy, plan = decoding_batch(n, 256, acceptance)
    chosen = policy.choose_k(scheduler.view, plan)
    assert chosen is not None and chosen.min() >= 2
    # And the plan it returns carries them, within the budget.
    out = policy.schedule(scheduler.view)
    assert out.spec_tokens.sum() == chosen.sum()


def test_no_speculation_on_an_engine_that_does_not_speculate():
    scheduler, policy, plan = decoding_batch(4, 256, 0.9, speculates=False)
    assert not policy.schedule(scheduler.view).speculates


def test_expected_tokens_is_the_geometric_sum():
    a = np.array([0.0, 0.5, 1.0, 0.7])
    k = np.array([3, 2, 4, 0])
    np.testing.assert_allclose(expected_tokens(a, k), [1.0, 1.75, 5.0, 1.0])


def test_smartspec_runs_to_the_end_and_speculates_less_as_the_batch_grows():
    """Over a run: every request gets its output, and drafts per decode fall at a large
    batch (the cost model's verdict) against a small one."""
    def drafts_per_decode(n):
        requests = [Request(id=i, arrival_s=0.0, prompt_len=256, output_len=48)
                    for i in range(n)]
        config = SchedulerConfig(limits=StepLimits(max_num_seqs=n, max_num_tokens=8192,
                                                   max_model_len=512),
                                 kv=KVConfig(num_kv_pages=n * 24, page_size=16))
        engine = SimEngine(TARGET, speculation=SpecConfig(acceptance=0.6, draft=DRAFT))
        scheduler = Scheduler(requests, SmartSpec(max_num_tokens=8192), engine, config)
        result = scheduler.run()
        assert (result.num_generated == 48).all()
        counts = scheduler.table.speculation
        return counts.drafted.sum() / max(counts.spec_steps.sum(), 1), counts.drafted.sum()

    small, _ = drafts_per_decode(2)
    large, large_total = drafts_per_decode(128)
    assert small >= 2 and large < small


@pytest.mark.parametrize("options,words", [({"max_k": -1}, "max_k must be >= 0"),
                                           ({"prior_acceptance": 1.5}, "prior_acceptance"),
                                           ({"max_num_tokens": 0}, "max_num_tokens")])
def test_bad_knobs_are_refused_naming_them(options, words):
    with pytest.raises(ValueError, match=words):
        SmartSpec(**options)
