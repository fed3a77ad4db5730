"""Up-front rejection asks what admission asks: no request is stranded, for any policy.

The core rejects before the run every request that no admission could take
(its context too long, or the KV rule refusing it alone in the empty pool,
watermark included, in every `kv_reservation` mode and under the buddy
layout); every other request must finish. A watermark once stranded requests:
their whole context fit the pool but not beside the watermark, they were never
rejected and never admitted, and the run died with `no_progress`.
"""


import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_scheduler_invariants import BUILTIN_POLICIES, make_builtin, sim_engine

from orca_jax import (
    KVConfig,
    Request,
    RequestState,
    Scheduler,
    SchedulerConfig,
    StepLimits,
    make_policy,
)
from orca_jax.core.api.policy import Policy

RESERVING = ("orca", "static")  # the policies with a kv_reservation knob
MAX_STEPS = 5_000


def build(name: str, reservation: str) -> Policy:
    if name in RESERVING:
        return make_policy(name, {"kv_reservation": reservation})
    return make_builtin(name)


def run_to_end(scheduler: Scheduler) -> None:
    for _ in range(MAX_STEPS):
        if scheduler.done:
            return
        scheduler.step()
    raise AssertionError(f"{scheduler.policy.name}: not done after {MAX_STEPS} steps")


def assert_each_finished_or_rejected_with_reason(scheduler: Scheduler) -> None:
    table = scheduler.table
    for i in range(len(table)):
        state = RequestState(table.state[i])
        assert state in (RequestState.FINISHED, RequestState.REJECTED), (i, state)
        if state == RequestState.FINISHED:
            assert table.num_generated[i] == table.output_len[i]
        else:
            assert table.reject_reason[i], i


@pytest.mark.parametrize("policy_name", BUILTIN_POLICIES)
def test_the_watermark_case_is_rejected_up_front_with_its_reason(policy_name):
    # Prompt 15 + output 1 = 16 pages of 1 token: the whole pool, 2 more than fit beside
    # the watermark; the nine on-demand policies used to die here with no_progress.
    config = SchedulerConfig(limits=StepLimits(max_num_seqs=4, max_num_tokens=16, max_model_len=16),
                             kv=KVConfig(num_kv_pages=16, page_size=1, watermark_pages=2))
    requests = [Request(id=0, arrival_s=0.0, prompt_len=15, output_len=1)]
    scheduler = Scheduler(requests, make_builtin(policy_name), sim_engine(), config)
    assert scheduler.table.state[0] == RequestState.REJECTED
    assert scheduler.table.reject_reason[0] == (
        "needs 16 KV pages, the pool has 14 beside the watermark of 2")
    run_to_end(scheduler)
    assert scheduler.done and scheduler.num_steps == 0


@pytest.mark.parametrize("policy_name", BUILTIN_POLICIES)
def test_a_request_that_fits_beside_the_watermark_runs(policy_name):
    # One token less: 15 pages of 16 with a watermark of 1 leaves the watermark free.
    config = SchedulerConfig(limits=StepLimits(max_num_seqs=4, max_num_tokens=16, max_model_len=15),
                             kv=KVConfig(num_kv_pages=16, page_size=1, watermark_pages=1))
    requests = [Request(id=0, arrival_s=0.0, prompt_len=14, output_len=1)]
    scheduler = Scheduler(requests, make_builtin(policy_name), sim_engine(), config)
    run_to_end(scheduler)
    assert scheduler.table.state[0] == RequestState.FINISHED


@st.composite
def small_runs(draw):
    """A handful of requests in a tiny pool: page sizes, watermarks and contexts that bind."""
    page_size = draw(st.sampled_from([1, 2, 4, 16]))
    max_model_len = draw(st.sampled_from([8, 16, 32, 64]))
    num_kv_pages = draw(st.integers(2, 24))
    config = SchedulerConfig(limits=StepLimits(max_num_seqs=draw(st.integers(1, 4)),
                                               max_num_tokens=draw(st.sampled_from([4, 8, 64])),
                                               max_model_len=max_model_len),
                             kv=KVConfig(num_kv_pages=num_kv_pages, page_size=page_size,
                                         watermark_pages=draw(
                                             st.integers(0, min(4, num_kv_pages - 1))),
                                         prefix_caching=draw(
                                             st.sampled_from(["policy", "off", "on"]))))
    requests = [Request(id=i, arrival_s=draw(st.sampled_from([0.0, 0.0, 0.005, 0.05])),
                        prompt_len=draw(st.integers(1, 70)), output_len=draw(st.integers(1, 20)))
                for i in range(draw(st.integers(1, 6)))]
    return requests, config, draw(st.sampled_from(["max", "pow2", "exact"])), draw(
        st.sampled_from(["paged", "buddy"]))


@pytest.mark.parametrize("policy_name", BUILTIN_POLICIES)
@settings(max_examples=25, deadline=None, derandomize=True)
@given(run=small_runs())
def test_every_request_finishes_or_is_rejected_with_a_reason(policy_name, run):
    requests, config, reservation, layout = run
    if layout == "buddy" and policy_name in RESERVING:  # buddy needs a reserving policy
        config = config.with_knobs(kv_layout="buddy", prefix_caching="off")
    scheduler = Scheduler(requests, build(policy_name, reservation), sim_engine(), config)
    run_to_end(scheduler)  # a stranded request would raise PlanError (no_progress)
    assert_each_finished_or_rejected_with_reason(scheduler)
    rejected = scheduler.table.state == RequestState.REJECTED
    # Nothing that fits is turned away: a request whose whole context fits beside the
    # watermark (unreserved) always runs.
    total = scheduler.table.prompt_len + scheduler.table.output_len  # arrival order
    kv = config.kv
    fits = ((-(-total // kv.page_size) + kv.watermark_pages <= kv.num_kv_pages)
            & (total <= config.limits.max_model_len))
    if policy_name not in RESERVING:
        np.testing.assert_array_equal(rejected, ~fits)
