"""MLFQ (FastServe): demotion after the quantum, skip-join of long prompts, promotion."""

import numpy as np

import policies  # noqa: F401  (registers the built-in policies)
from orca_jax import KVConfig, Request, Scheduler, SchedulerConfig, StepLimits, make_policy
from orca_jax.sim.cost_model import CostModelConfig
from orca_jax.sim.engine import SimEngine

# Quanta 4, 8, 16, 32, ... work units; a prompt token costs 0.5, a decode step 1.
KNOBS = {"base_quantum": "4", "prompt_token_weight": "0.5"}


def make_scheduler(requests, **options):
    """Batch cap 1, 1 s per step, ample KV: the order of service is the policy's alone."""
    return Scheduler(requests, make_policy("mlfq", {**KNOBS, **options}),
                     SimEngine(CostModelConfig(mode="fixed", step_time_s=1.0)),
                     SchedulerConfig(limits=StepLimits(max_num_seqs=1, max_num_tokens=64,
                                                       max_model_len=128),
                                     kv=KVConfig(num_kv_pages=256, page_size=4)))


def run(requests, **options):
    scheduler = make_scheduler(requests, **options)
    scheduler.run()
    assert (scheduler.table.num_generated == scheduler.table.output_len).all()
    return scheduler.table


def test_a_request_is_demoted_exactly_when_it_uses_up_its_quantum():
    # A (prefill 2 units, then 1 per decode) uses quantum 4 in the steps at t=0,1,2 and
    # drops to queue 1; B, in queue 0 since t=1.5, waits behind A (first come first
    # served in queue 0) until then, and runs at t=3 while A is paused.
    requests = [Request(id=0, arrival_s=0.0, prompt_len=4, output_len=12),
                Request(id=1, arrival_s=1.5, prompt_len=4, output_len=2)]
    table = run(requests)
    np.testing.assert_array_equal(table.first_scheduled_s, [0.0, 3.0])
    np.testing.assert_array_equal(table.finish_s, [14.0, 5.0])
    assert table.num_preemptions.sum() == 0  # A was paused, not recomputed
    longer = run(requests, base_quantum="5")  # one more step in queue 0 for A
    np.testing.assert_array_equal(longer.first_scheduled_s, [0.0, 4.0])
    never = run(requests, num_queues="1")  # a single queue is FCFS: B waits for A
    np.testing.assert_array_equal(never.first_scheduled_s, [0.0, 12.0])


def test_skip_join_places_a_long_prompt_in_a_lower_queue():
    # M (short prompt) is demoted to queue 1 at t=3, queue 2 at t=11, queue 3 at t=27.
    # L's prefill is 40 * 0.5 = 20 units: it skip-joins queue 3 (quantum 32 >= 20 > 16),
    # so it waits until M reaches queue 3 (behind L, which joined it first).
    requests = [Request(id=0, arrival_s=0.0, prompt_len=4, output_len=30),
                Request(id=1, arrival_s=5.5, prompt_len=40, output_len=2)]
    scheduler = make_scheduler(requests)
    for _ in range(7):
        scheduler.step()
    np.testing.assert_array_equal(scheduler.policy.levels(np.array([0, 1])), [1, 3])
    scheduler.run()
    np.testing.assert_array_equal(scheduler.table.first_scheduled_s, [0.0, 27.0])
    np.testing.assert_array_equal(scheduler.table.finish_s, [32.0, 29.0])
    # Without skip-join L enters queue 0 and runs on arrival, ahead of the demoted M.
    plain = run(requests, skip_join="false")
    np.testing.assert_array_equal(plain.first_scheduled_s, [0.0, 6.0])


def test_starvation_promotes_a_paused_request_to_the_top_queue():
    # A stream of short jobs keeps queue 0 busy; the demoted long job L would wait for all.
    requests = [Request(id=0, arrival_s=0.0, prompt_len=4, output_len=12)] + [
        Request(id=1 + i, arrival_s=3.0 + 2.0 * i, prompt_len=4, output_len=2)
        for i in range(8)]

    def long_token_times(**options):
        scheduler = make_scheduler(requests, **options)
        scheduler.run()
        owners, times = scheduler.record.token_log()
        return times[owners == 0]

    # L: 3 steps in queue 0 (t=0..2), demoted, then nothing until the stream is over.
    np.testing.assert_array_equal(long_token_times(), [1, 2, 3] + list(range(20, 29)))
    # Idle for 6 s at t=8: promoted to the tail of queue 0, behind the short job that
    # arrived at t=7; runs a full quantum (4 decodes, t=9..12), is demoted, waits again.
    np.testing.assert_array_equal(long_token_times(starvation_s="6"),
                                  [1, 2, 3, 10, 11, 12, 13, 24, 25, 26, 27, 28])
