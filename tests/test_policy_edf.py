"""EDF: deadline order, pausing for a tighter deadline, and infeasible requests deprioritised."""

import numpy as np

import policies  # noqa: F401  (registers the built-in policies)
from orca_jax import KVConfig, Request, Scheduler, SchedulerConfig, StepLimits, make_policy
from orca_jax.sim.cost_model import CostModelConfig
from orca_jax.sim.engine import SimEngine


def run(requests, **options):
    """Batch cap 1, 1 s per step (and the policy's per-token estimate set to match)."""
    options = {"time_per_token_s": "1.0", **options}
    scheduler = Scheduler(requests, make_policy("edf", options),
                          SimEngine(CostModelConfig(mode="fixed", step_time_s=1.0)),
                          SchedulerConfig(limits=StepLimits(max_num_seqs=1, max_num_tokens=64,
                                                            max_model_len=128),
                                          kv=KVConfig(num_kv_pages=256, page_size=4)))
    scheduler.run()
    table = scheduler.table
    assert (table.num_generated == table.output_len).all()
    return table


def _request(i, deadline, output_len=3, arrival=0.0):
    return Request(id=i, arrival_s=arrival, prompt_len=4, output_len=output_len,
                   deadline_s=deadline)


def test_edf_orders_by_deadline_and_deprioritizes_infeasible_requests():
    # Request 4 needs 5 s of output but its deadline is at 2 s: hopeless from the start.
    requests = [_request(0, 10.0), _request(1, 4.0), _request(2, 7.0), _request(3, None),
                _request(4, 2.0, output_len=5)]
    table = run(requests)
    # Feasible ones by deadline, then the one without a deadline, then the hopeless one.
    np.testing.assert_array_equal(table.first_scheduled_s, [6.0, 0.0, 3.0, 9.0, 12.0])
    np.testing.assert_array_equal(table.finish_s[:3] <= table.deadline_s[:3], True)
    plain = run(requests, infeasible="ignore")  # plain EDF spends 5 s on the lost cause
    np.testing.assert_array_equal(plain.first_scheduled_s, [11.0, 5.0, 8.0, 14.0, 0.0])
    np.testing.assert_array_equal(plain.finish_s <= plain.deadline_s, [False] * 3 + [True, False])


def test_a_tighter_deadline_pauses_the_running_request():
    requests = [_request(0, 50.0, output_len=8), _request(1, 6.0, output_len=2, arrival=2.5)]
    table = run(requests)
    np.testing.assert_array_equal(table.finish_s, [10.0, 5.0])  # 1 runs at t=3, 4
    assert table.num_preemptions.sum() == 0  # request 0 was paused, keeping its KV


def test_a_ttft_slo_gives_deadlines_to_requests_without_one():
    requests = [_request(0, None, output_len=5), _request(1, 100.0, output_len=2)]
    np.testing.assert_array_equal(run(requests).first_scheduled_s, [2.0, 0.0])
    # With a 3 s TTFT SLO request 0 is due at t=3 and goes first.
    np.testing.assert_array_equal(run(requests, ttft_slo_s="3").first_scheduled_s, [0.0, 5.0])
