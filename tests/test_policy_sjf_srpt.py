"""SJF and SRPT: size-based order from a pluggable predictor, pausing, and the starvation guard."""

import numpy as np
import pytest

import policies  # noqa: F401  (registers the built-in policies)
from orca_jax import (
    KVConfig,
    Request,
    RequestState,
    Scheduler,
    SchedulerConfig,
    StepLimits,
    make_policy,
)
from orca_jax.learned.length_predictor import get_predictor, registered_predictors
from orca_jax.sim.cost_model import CostModelConfig
from orca_jax.sim.engine import SimEngine


def make_scheduler(requests, policy, cap, **options):
    """A scheduler on a simulator whose every step takes 1 s, with ample KV."""
    return Scheduler(requests, make_policy(policy, {k: str(v) for k, v in options.items()}),
                     SimEngine(CostModelConfig(mode="fixed", step_time_s=1.0)),
                     SchedulerConfig(limits=StepLimits(max_num_seqs=cap, max_num_tokens=64,
                                                       max_model_len=128),
                                     kv=KVConfig(num_kv_pages=256, page_size=4)))


def run(requests, policy, cap, **options):
    scheduler = make_scheduler(requests, policy, cap, **options)
    scheduler.run()
    assert (scheduler.table.num_generated == scheduler.table.output_len).all()
    return scheduler.table


OUTPUTS = [7, 3, 9, 1, 5, 2, 8, 4, 6]


def test_oracle_predictor_returns_true_output_lengths():
    requests = [Request(id=i, arrival_s=0.0, prompt_len=3, output_len=o)
                for i, o in enumerate(OUTPUTS)]
    assert "oracle" in registered_predictors()
    np.testing.assert_array_equal(get_predictor("oracle").predict_output_len(requests), OUTPUTS)
    with pytest.raises(ValueError, match="unknown length predictor 'psychic'"):
        make_policy("srpt", {"predictor": "psychic"})


@pytest.mark.parametrize("cap", [1, 3])
def test_srpt_finishes_all_at_once_requests_in_output_length_order(cap):
    requests = [Request(id=i, arrival_s=0.0, prompt_len=4, output_len=o)
                for i, o in enumerate(OUTPUTS)]
    table = run(requests, "srpt", cap)
    finish_order = np.argsort(table.finish_s, kind="stable")
    np.testing.assert_array_equal(finish_order, np.argsort(OUTPUTS))
    assert (np.diff(table.finish_s[finish_order]) > 0).all()
    if cap == 1:  # one at a time, one step per token: finish times are running sums
        np.testing.assert_array_equal(table.finish_s[finish_order], np.cumsum(sorted(OUTPUTS)))
    assert table.num_preemptions.sum() == 0


def test_srpt_pauses_a_long_request_for_a_shorter_arrival_and_keeps_its_kv():
    requests = [Request(id=0, arrival_s=0.0, prompt_len=4, output_len=10),
                Request(id=1, arrival_s=2.5, prompt_len=4, output_len=2)]
    scheduler = make_scheduler(requests, "srpt", cap=1)
    for _ in range(4):  # steps at t=0,1,2 run the long one, t=3 the newcomer
        scheduler.step()
    view = scheduler.view
    assert view.requests.num_generated[0] == 3 and view.requests.num_generated[1] == 1
    # Paused, not preempted: still running and holding the pages of its 6 computed tokens.
    assert view.requests.state[0] == RequestState.RUNNING and view.pages_held([0])[0] == 2
    scheduler.run()
    table = scheduler.table
    assert table.finish_s[1] == 5.0  # t=3 prefill, t=4 decode
    assert table.finish_s[0] == 12.0  # 10 steps of its own plus 2 paused
    assert table.num_preemptions.sum() == 0


def test_sjf_admits_by_total_predicted_work_and_never_preempts():
    # (prompt, output): total order 2, 1, 0, 3 differs from prompt order and output order.
    shapes = [(30, 2), (2, 20), (10, 5), (1, 40)]
    requests = [Request(id=i, arrival_s=0.0, prompt_len=p, output_len=o)
                for i, (p, o) in enumerate(shapes)]
    requests.append(Request(id=4, arrival_s=3.5, prompt_len=1, output_len=1))  # tiny, late
    table = run(requests, "sjf", cap=1)
    # The tiny job waits for the running one (request 2, busy until t=5), then jumps the queue.
    np.testing.assert_array_equal(table.first_scheduled_s, [26.0, 6.0, 0.0, 28.0, 5.0])
    assert table.num_preemptions.sum() == 0
    weighted = run(requests, "sjf", cap=1, prompt_token_weight=0.0)  # by output only
    np.testing.assert_array_equal(np.argsort(weighted.first_scheduled_s, kind="stable"),
                                  [0, 2, 4, 1, 3])


def _long_and_a_stream_of_short(num_short=10):
    long = Request(id=0, arrival_s=0.0, prompt_len=4, output_len=20)
    # Each short job takes 2 steps and the next arrives as it finishes: the queue never empties.
    shorts = [Request(id=1 + i, arrival_s=2.0 * i, prompt_len=4, output_len=2)
              for i in range(num_short)]
    return [long] + shorts


def test_sjf_starvation_guard_promotes_a_long_waiting_request():
    requests = _long_and_a_stream_of_short()
    assert run(requests, "sjf", cap=1).first_scheduled_s[0] == 20.0  # after every short one
    # Overdue from t=5; the short job running then finishes at t=6 (SJF does not preempt).
    assert run(requests, "sjf", cap=1, starvation_s=5.0).first_scheduled_s[0] == 6.0


def test_srpt_starvation_guard_promotes_for_good_pausing_the_short_job():
    requests = _long_and_a_stream_of_short()
    assert run(requests, "srpt", cap=1).first_scheduled_s[0] == 20.0
    table = run(requests, "srpt", cap=1, starvation_s=5.0)
    assert table.first_scheduled_s[0] == 5.0  # idle for 5 s: promoted at once (preemptive)
    assert table.finish_s[0] == 25.0  # and stays in front until it is done
    assert table.finish_s[3] == 26.0  # the short job it paused at t=5 decodes its last token
    assert table.num_preemptions.sum() == 0


@pytest.mark.parametrize("policy", ["sjf", "srpt", "mlfq", "vtc", "priority", "edf"])
@pytest.mark.parametrize("watermark", [0, 2])
def test_ranking_policies_lose_nothing_under_kv_pressure(policy, watermark):
    rng = np.random.default_rng(7)
    requests = [Request(id=i, arrival_s=float(rng.uniform(0, 10)),
                        prompt_len=int(rng.integers(1, 40)), output_len=int(rng.integers(1, 30)),
                        priority=int(rng.integers(0, 3)), tenant=f"t{rng.integers(0, 3)}",
                        deadline_s=float(rng.uniform(5, 40)))
                for i in range(40)]
    # 20 pages of 4 tokens for requests of up to 68 tokens: growth must preempt.
    scheduler = Scheduler(requests, make_policy(policy),
                          SimEngine(CostModelConfig(mode="fixed", step_time_s=1.0)),
                          SchedulerConfig(limits=StepLimits(max_num_seqs=6, max_num_tokens=32,
                                                            max_model_len=128),
                                          kv=KVConfig(num_kv_pages=20, page_size=4,
                                                      watermark_pages=watermark)))
    scheduler.run()
    table = scheduler.table
    assert scheduler.record.num_preemptions > 0
    assert (table.state == RequestState.FINISHED).all()
    np.testing.assert_array_equal(table.num_generated, table.output_len)
    owners, _ = scheduler.record.token_log()
    np.testing.assert_array_equal(np.bincount(owners, minlength=40), table.output_len)
