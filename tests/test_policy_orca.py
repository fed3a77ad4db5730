"""The `orca` policy: FCFS, whole prompts when they fit, and a long prompt never stalls the queue.

Through the public API, on a simulator with a fixed step time, so the plans do
not depend on the cost model.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from policy_recorder import Recorder

import policies
from orca_jax import (
    KVConfig,
    Policy,
    Request,
    RequestState,
    Scheduler,
    SchedulerConfig,
    StepLimits,
    StepPlan,
)
from orca_jax.sim.cost_model import CostModelConfig
from orca_jax.sim.engine import SimEngine

STEP_S = 0.01


def _engine() -> SimEngine:
    return SimEngine(CostModelConfig(mode="fixed", model="llama3-8b", step_time_s=STEP_S))


def run(requests, policy, *, max_num_tokens=16, max_num_seqs=8, num_kv_pages=256,
        page_size=4, max_model_len=64):
    config = SchedulerConfig(limits=StepLimits(max_num_seqs=max_num_seqs,
                                               max_num_tokens=max_num_tokens,
                                               max_model_len=max_model_len),
                             kv=KVConfig(num_kv_pages=num_kv_pages, page_size=page_size))
    scheduler = Scheduler(requests, policy, _engine(), config)
    result = scheduler.run()
    table = scheduler.view.requests
    assert (table.state == RequestState.FINISHED).all()
    np.testing.assert_array_equal(table.num_generated, table.output_len)  # nothing lost
    return result


def recorded(requests, **config):
    recorder = Recorder(policies.make_policy("orca"))
    run(requests, recorder, **config)
    return [step.tokens for step in recorder.steps]


def requests_of(*lengths, arrivals=None):
    return [Request(id=i, arrival_s=0.0 if arrivals is None else arrivals[i], prompt_len=p,
                    output_len=o) for i, (p, o) in enumerate(lengths)]


def test_a_long_prompt_behind_a_decode_is_chunked_at_once_not_stalled():
    # The case at the default limits: a 100-token request decodes; a 3,000-token
    # prompt arrives 1 ms later. It can never fit whole beside that decode (3,000 >
    # 2,048 - 1), so it takes the budget left on the next step instead of waiting the
    # ~50 steps until the first request is done.
    requests = requests_of((100, 50), (3000, 10), arrivals=[0.0, 0.001])
    recorder = Recorder(policies.make_policy("orca"))
    result = run(requests, recorder, max_num_tokens=2048, max_num_seqs=64, num_kv_pages=2048,
                 page_size=16, max_model_len=8192)
    assert [step.tokens for step in recorder.steps[:3]] == [
        {0: 100}, {0: 1, 1: 2047}, {0: 1, 1: 953}]
    assert result.first_scheduled_s[1] == pytest.approx(STEP_S)  # the step after it arrived
    assert result.first_token_s[1] == pytest.approx(3 * STEP_S)


def test_prompts_run_whole_when_they_fit():
    assert recorded(requests_of((6, 2), (9, 1), (3, 1))) == [{0: 6, 1: 9}, {0: 1, 2: 3}]


def test_a_prompt_that_fits_beside_the_decodes_waits_for_a_running_prefill_then_runs_whole():
    # Request 0 (20 tokens) is chunked 16 + 4. Request 1 (14) does not fit the 12 left
    # beside 0's last chunk, but it does fit beside one decode (14 <= 16 - 1): it waits a
    # step and runs whole rather than in pieces.
    assert recorded(requests_of((20, 3), (14, 2))) == [
        {0: 16}, {0: 4}, {0: 1, 1: 14}, {0: 1, 1: 1}]


def test_nobody_overtakes_a_chunked_prompt():
    # Request 1 (30 tokens) never fits whole beside request 0's decode: it is chunked
    # 15 + 15 while the short request 2 behind it waits its turn (FCFS).
    assert recorded(requests_of((4, 6), (30, 1), (2, 2), arrivals=[0.0, 0.005, 0.005])) == [
        {0: 4}, {0: 1, 1: 15}, {0: 1, 1: 15}, {0: 1, 2: 2}, {0: 1, 2: 1}, {0: 1}]


class _HeadWatcher(Policy):
    """Runs orca and counts, per request, the steps it was passed over at the queue's head.

    The head (the oldest waiting request) is passed over when the plan leaves it out
    although the running requests left room for its prompt or a chunk of it: tokens in
    the budget, a seat under the batch cap, and the KV pages its admission needs.
    """

    def __init__(self) -> None:
        self.inner = policies.make_policy("orca")
        self.name = self.inner.name
        self.kv_reservation = self.inner.kv_reservation
        self.passed_over: dict[int, int] = {}

    def schedule(self, view) -> StepPlan:
        running = view.running.tolist()
        plan = self.inner.schedule(view)
        if view.waiting.size == 0:
            return plan
        head = int(view.waiting[0])
        planned = plan.as_dict()
        room = view.max_num_tokens - sum(planned.get(r, 0) for r in running)
        if head in planned or room <= 0 or len(running) >= view.max_num_seqs:
            return plan
        chunk = min(int(view.requests.num_uncomputed([head])[0]), room)
        if int(view.pages_needed([head], [chunk])[0]) <= view.num_free_pages:
            self.passed_over[head] = self.passed_over.get(head, 0) + 1
        return plan


@settings(max_examples=150, deadline=None, derandomize=True)
@given(lengths=st.lists(st.tuples(st.integers(1, 60), st.integers(1, 24),
                                  st.integers(0, 4)), min_size=1, max_size=10),
       max_num_tokens=st.integers(8, 32), max_num_seqs=st.integers(1, 6),
       num_kv_pages=st.integers(24, 120))
def test_the_head_of_the_queue_is_passed_over_at_most_one_step(lengths, max_num_tokens,
                                                               max_num_seqs, num_kv_pages):
    # Arrivals every 0 to 4 half-steps; every request reserves the 24 pages of its context.
    arrivals = np.cumsum([gap * STEP_S / 2 for _, _, gap in lengths])
    requests = requests_of(*[(p, o) for p, o, _ in lengths], arrivals=arrivals.tolist())
    watcher = _HeadWatcher()
    result = run(requests, watcher, max_num_tokens=max_num_tokens, max_num_seqs=max_num_seqs,
                 num_kv_pages=num_kv_pages, max_model_len=96)
    # A head that fits whole beside the running decodes waits only for a prefill in flight,
    # which finishes in the very step that leaves room over; any other head is chunked now.
    assert max(watcher.passed_over.values(), default=0) <= 1
    # FCFS: requests start in arrival order.
    assert (np.diff(result.first_scheduled_s) >= 0).all()
