"""The `sarathi` policy: stall-free batching under a token budget."""


import numpy as np
import pytest
from policy_recorder import Recorder, Step

import policies
from orca_jax import KVConfig, Request, RequestState, Scheduler, SchedulerConfig, StepLimits
from orca_jax.sim.cost_model import CostModelConfig
from orca_jax.sim.engine import SimEngine


def run(requests, *, budget, scheduler_budget=64, num_kv_pages=64, scheduler_max_num_seqs=8,
        **options):
    """Runs `sarathi` with token budget `budget` to the end; checks nothing was lost."""
    options = {"max_num_tokens": str(budget), **{k: str(v) for k, v in options.items()}}
    recorder = Recorder(policies.make_policy("sarathi", options))
    config = SchedulerConfig(limits=StepLimits(max_num_seqs=scheduler_max_num_seqs,
                                               max_num_tokens=scheduler_budget, max_model_len=128),
                             kv=KVConfig(num_kv_pages=num_kv_pages, page_size=4))
    engine = SimEngine(CostModelConfig(mode="fixed", model="tiny", step_time_s=1.0))
    scheduler = Scheduler(requests, recorder, engine, config)
    scheduler.run()
    table = scheduler.view.requests
    assert (table.state == RequestState.FINISHED).all()
    np.testing.assert_array_equal(table.num_generated, table.output_len)
    return recorder.steps, scheduler


def at_zero(*lengths):
    return [Request(id=i, arrival_s=0.0, prompt_len=p, output_len=o)
            for i, (p, o) in enumerate(lengths)]


def test_decodes_then_the_running_chunk_then_new_prefills_in_the_budget_left():
    steps, _ = run(at_zero((4, 5), (12, 2), (6, 1)), budget=8)
    # Step 1: 0 decodes, 1's prompt continues with the 7 tokens left and 2 waits;
    # step 2: 1's last prompt token beside 0's decode leaves 6 for 2's whole prompt.
    assert [s.tokens for s in steps] == [
        {0: 4, 1: 4}, {0: 1, 1: 7}, {0: 1, 1: 1, 2: 6}, {0: 1, 1: 1}, {0: 1}]


def test_a_long_prompt_is_spread_over_steps_beside_running_decodes():
    # Three short requests are decoding when a 40-token prompt arrives: it gets
    # the 5 tokens the decodes leave, step after step, and no decode skips a step.
    requests = at_zero((2, 12), (2, 12), (2, 12)) + [
        Request(id=3, arrival_s=1.5, prompt_len=40, output_len=2)]
    steps, _ = run(requests, budget=8)
    assert [s.tokens for s in steps[2:10]] == [{0: 1, 1: 1, 2: 1, 3: 5}] * 8
    # 3 sampled its first token with its last chunk; it decodes like the others.
    assert steps[10].tokens == {0: 1, 1: 1, 2: 1, 3: 1}


def test_admission_stops_at_max_num_seqs():
    steps, _ = run(at_zero(*[(3, 2)] * 3), budget=64, max_num_seqs=2)
    assert [s.tokens for s in steps] == [{0: 3, 1: 3}, {0: 1, 1: 1}, {2: 3}, {2: 1}]


def test_out_of_pages_a_decode_preempts_the_newest_request_not_yet_scheduled():
    # 4 pages of 4 tokens: three 4-token prompts take 3; request 0's decode takes
    # the last, and request 1's needs request 2's page.
    steps, _ = run(at_zero((4, 3), (4, 3), (4, 3)), budget=16, num_kv_pages=4)
    assert steps[:3] == [Step({0: 4, 1: 4, 2: 4}, []), Step({0: 1, 1: 1}, [2]),
                         Step({0: 1, 1: 1}, [])]
    # Back once 0 and 1 are done: prompt and its one output token, recomputed.
    assert steps[3].tokens == {2: 5}


@pytest.mark.parametrize("budget", [16, 48])
def test_never_over_budget_and_never_delays_a_decode_on_random_workloads(budget):
    rng = np.random.default_rng(budget)
    requests = [Request(id=i, arrival_s=float(rng.uniform(0, 30)),
                        prompt_len=int(rng.integers(4, 100)), output_len=int(rng.integers(1, 30)))
                for i in range(80)]
    steps, scheduler = run(requests, budget=budget, num_kv_pages=48, scheduler_max_num_seqs=12)
    assert max(sum(s.tokens.values()) for s in steps) == budget
    for s in steps:
        assert set(s.decoding) - set(s.preempt) <= set(s.tokens)
        assert all(s.tokens[r] == 1 for r in s.decoding if r in s.tokens)
    assert scheduler.record.num_preemptions > 0  # the stall-free rule held under KV pressure


def test_bad_knob_is_rejected_with_its_name():
    with pytest.raises(policies.PolicyLoadError, match="max_num_tokens must be >= 1"):
        policies.make_policy("sarathi", {"max_num_tokens": "0"})
