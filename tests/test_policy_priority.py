"""Strict priority: a more urgent arrival preempts when the batch cap or the KV pool is full."""

import numpy as np

import policies  # noqa: F401  (registers the built-in policies)
from orca_jax import KVConfig, Request, Scheduler, SchedulerConfig, StepLimits, make_policy
from orca_jax.sim.cost_model import CostModelConfig
from orca_jax.sim.engine import SimEngine


def run(requests, policy, cap, num_kv_pages=256):
    scheduler = Scheduler(requests, make_policy(policy),
                          SimEngine(CostModelConfig(mode="fixed", step_time_s=1.0)),
                          SchedulerConfig(limits=StepLimits(max_num_seqs=cap, max_num_tokens=64,
                                                            max_model_len=128),
                                          kv=KVConfig(num_kv_pages=num_kv_pages, page_size=4)))
    scheduler.run()
    table = scheduler.table
    assert (table.num_generated == table.output_len).all()
    return table


def test_an_urgent_arrival_preempts_the_least_urgent_running_request_at_the_cap():
    requests = [Request(id=0, arrival_s=0.0, prompt_len=4, output_len=10, priority=5),
                Request(id=1, arrival_s=0.0, prompt_len=4, output_len=10, priority=5),
                Request(id=2, arrival_s=3.5, prompt_len=4, output_len=2, priority=0)]
    table = run(requests, "priority", cap=2)
    # Request 1 (same priority as 0, later) gives its place at t=4 and is recomputed at t=6
    # (prompt and its 4 tokens in one step, which samples token 5), then 5 more steps.
    np.testing.assert_array_equal(table.first_scheduled_s, [0.0, 0.0, 4.0])
    np.testing.assert_array_equal(table.num_preemptions, [0, 1, 0])
    np.testing.assert_array_equal(table.finish_s, [10.0, 12.0, 6.0])
    fcfs = run(requests, "orca", cap=2)  # the cap-bound engine: the urgent request waits
    assert fcfs.first_scheduled_s[2] == 10.0 and fcfs.num_preemptions.sum() == 0


def test_an_urgent_arrival_preempts_when_kv_is_full_below_the_cap():
    # 8 pages of 4 tokens. At t=4 requests 0 and 1 hold 3 pages each (11 tokens); the
    # urgent 12-token prompt needs 3 of the 2 free pages: request 1 is preempted for it.
    requests = [Request(id=0, arrival_s=0.0, prompt_len=8, output_len=16, priority=5),
                Request(id=1, arrival_s=0.0, prompt_len=8, output_len=16, priority=5),
                Request(id=2, arrival_s=3.5, prompt_len=12, output_len=2, priority=0)]
    table = run(requests, "priority", cap=4, num_kv_pages=8)
    assert table.first_scheduled_s[2] == 4.0 and table.finish_s[2] == 6.0
    assert table.num_preemptions[0] == 0 and table.num_preemptions[1] >= 1
    assert table.finish_s[0] == 16.0  # the more urgent of the two never lost a step
