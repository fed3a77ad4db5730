"""The `vllm` policy: vLLM v1's scheduling rules, as exact plans on hand-made workloads."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from policy_recorder import Recorder, Step

import policies
from orca_jax import KVConfig, Request, RequestState, Scheduler, SchedulerConfig, StepLimits
from orca_jax.sim.cost_model import CostModelConfig
from orca_jax.sim.engine import SimEngine

REPO = Path(__file__).resolve().parents[1]


def run(requests, policy="vllm", *, page_size=4, num_kv_pages=64, scheduler_max_num_tokens=16,
        scheduler_max_num_seqs=8, max_model_len=64, **options):
    recorder = Recorder(policies.make_policy(policy, {k: str(v) for k, v in options.items()}))
    config = SchedulerConfig(limits=StepLimits(max_num_seqs=scheduler_max_num_seqs,
                                               max_num_tokens=scheduler_max_num_tokens,
                                               max_model_len=max_model_len),
                             kv=KVConfig(num_kv_pages=num_kv_pages, page_size=page_size))
    engine = SimEngine(CostModelConfig(mode="fixed", model="tiny", step_time_s=1.0))
    scheduler = Scheduler(requests, recorder, engine, config)
    scheduler.run()
    table = scheduler.view.requests
    assert (table.state == RequestState.FINISHED).all()
    np.testing.assert_array_equal(table.num_generated, table.output_len)  # nothing lost
    return recorder.steps, scheduler


def burst(*lengths, priorities=None, arrivals=None):
    return [Request(id=i, arrival_s=0.0 if arrivals is None else arrivals[i], prompt_len=p,
                    output_len=o, priority=0 if priorities is None else priorities[i])
            for i, (p, o) in enumerate(lengths)]


def test_chunked_prefill_splits_a_long_prompt_by_the_budget_left():
    steps, _ = run(burst((20, 3), (5, 2)), max_num_tokens=8)
    # A long prompt takes the whole budget twice, then its rest leaves room for a
    # chunk of the next prompt; its first decode comes only on the step after.
    assert [s.tokens for s in steps] == [
        {0: 8}, {0: 8}, {0: 4, 1: 4}, {0: 1, 1: 1}, {0: 1, 1: 1}]


def test_knob_budget_is_capped_by_the_scheduler_budget():
    steps, _ = run(burst((20, 1)), max_num_tokens=100, scheduler_max_num_tokens=16)
    assert [s.tokens for s in steps] == [{0: 16}, {0: 4}]


def test_admission_stops_at_max_num_seqs():
    steps, _ = run(burst(*[(3, 4)] * 4), max_num_seqs=2)
    assert [s.tokens for s in steps] == (
        [{0: 3, 1: 3}] + [{0: 1, 1: 1}] * 3 + [{2: 3, 3: 3}] + [{2: 1, 3: 1}] * 3)


def test_kv_pressure_preempts_the_newest_running_request_and_admits_nobody_that_step():
    # Pages of 4 tokens, 4 pages: three 4-token prompts fill 3; every decode past
    # 4 tokens needs a second page.
    steps, scheduler = run(burst((4, 6), (4, 6), (4, 6)), num_kv_pages=4)
    assert steps[0].tokens == {0: 4, 1: 4, 2: 4}
    # Request 0 takes the last free page; request 1 gets one only by preempting 2,
    # the most recently admitted; 2 (waiting, 5 tokens = 2 pages) is not readmitted.
    assert (steps[1].tokens, steps[1].preempt) == ({0: 1, 1: 1}, [2])
    assert all(s.tokens == {0: 1, 1: 1} and not s.preempt for s in steps[2:5])
    # Request 0's ninth token needs a third page: 1 is preempted, 0 finishes.
    assert (steps[5].tokens, steps[5].preempt) == ({0: 1}, [1])
    # 0's 3 pages come back. Request 1 recomputes its prompt and 5 outputs at once (3
    # pages) and samples its last token; 2 (5 tokens) is admitted only if all its 2
    # pages fit, and 1 is left, so it waits a step more.
    assert steps[6].tokens == {1: 9}
    assert steps[7].tokens == {2: 5}
    assert len(steps) == 12
    assert scheduler.record.num_preemptions == 2
    assert scheduler.view.requests.num_preemptions.tolist() == [0, 1, 1]


def test_admission_needs_the_pages_of_the_whole_prompt_not_just_its_first_chunk():
    # 6 pages of 4. Request 1's first chunk (7 tokens, 2 pages) would fit beside
    # request 0, but its whole prompt (5 pages) never does until 0 is gone.
    steps, _ = run(burst((4, 10), (20, 1), arrivals=[0.0, 0.5]), num_kv_pages=6,
                   max_num_tokens=8)
    assert [s.tokens for s in steps] == [{0: 4}] + [{0: 1}] * 9 + [{1: 8}, {1: 8}, {1: 4}]


def test_a_request_that_must_preempt_itself_stops_the_running_pass():
    # Request 0 is older and decoding; request 1 has no page and is the newest.
    steps, _ = run(burst((4, 6), (4, 6), arrivals=[0.0, 0.5]), num_kv_pages=3)
    assert steps[:3] == [Step({0: 4}, []), Step({0: 1, 1: 4}, []), Step({0: 1}, [1])]


def test_priority_preempts_the_lowest_priority_even_if_it_is_older_and_scheduled():
    # Request 0 (priority 1) is older and already scheduled this step when request 1
    # (priority 0) needs its page: vLLM's priority scheduler un-schedules and
    # preempts 0; FCFS would have preempted 1, the newest.
    requests = burst((4, 6), (4, 6), priorities=[1, 0], arrivals=[0.0, 0.5])
    steps, _ = run(requests, "vllm-priority", num_kv_pages=3)
    assert steps[2] == Step({1: 1}, [0])


def test_priority_orders_waiting_by_priority_then_arrival():
    requests = burst((3, 1), (3, 1), (3, 1), (3, 1), priorities=[2, 0, 1, 0])
    steps, _ = run(requests, "vllm", priority=True, max_num_seqs=1)
    assert [list(s.tokens) for s in steps] == [[1], [3], [2], [0]]


def test_chunked_prefill_off_admits_a_prompt_only_whole_and_skips_nobody():
    lengths = ((6, 2), (6, 2), (3, 1))
    off, _ = run(burst(*lengths), max_num_tokens=10, enable_chunked_prefill=False,
                 max_model_len=10)
    # Request 1 does not fit the 4 tokens left whole, so it waits, and 2 behind it.
    assert [s.tokens for s in off] == [{0: 6}, {0: 1, 1: 6, 2: 3}, {1: 1}]
    on, _ = run(burst(*lengths), max_num_tokens=10)
    assert [s.tokens for s in on] == [{0: 6, 1: 4}, {0: 1, 1: 2, 2: 3}, {1: 1}]


def test_chunked_prefill_off_refuses_a_budget_below_the_context_up_front():
    # vLLM refuses max_num_batched_tokens < max_model_len without chunked prefill; this
    # policy once died mid-run instead, at the first prompt over the budget (issue 25).
    with pytest.raises(ValueError, match=r"policy 'vllm': enable_chunked_prefill=false .* "
                                         r"\(--max_num_tokens=10\) is below --max_model_len=64"):
        run(burst((4, 1)), scheduler_max_num_tokens=10, enable_chunked_prefill=False)
    with pytest.raises(ValueError, match=r"\(option max_num_tokens=10\) is below "
                                         r"--max_model_len=12"):
        run(burst((4, 1)), max_num_tokens=10, max_model_len=12, enable_chunked_prefill=False)
    # A budget of the context serves its longest prompt whole.
    steps, _ = run(burst((4, 1), (11, 1)), max_num_tokens=12, max_model_len=12,
                   enable_chunked_prefill=False)
    assert [s.tokens for s in steps] == [{0: 4}, {1: 11}]


def test_the_issue_s_command_is_refused_in_one_line_naming_the_option_and_flags(tmp_path):
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "-m", "experiments.run", "--engine=sim", "--policy=vllm",
         "--policy_opts=enable_chunked_prefill=false", "--max_num_tokens=64",
         "--bucket_ladder=pow2", "--num_requests=10", f"--out_dir={out}"],
        cwd=REPO, env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True,
        timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [
        "error: policy 'vllm': enable_chunked_prefill=false computes each prompt whole in one "
        "step, but the step budget (--max_num_tokens=64) is below --max_model_len=8192 (vLLM "
        "refuses the same); raise the budget to 8192, lower --max_model_len, or turn chunked "
        "prefill on"]
    assert not out.exists()


def test_long_prefill_threshold_caps_chunks_unless_the_request_is_alone():
    steps, _ = run(burst((10, 1), (6, 1)), long_prefill_token_threshold=4)
    assert [s.tokens for s in steps] == [{0: 4, 1: 4}, {0: 4, 1: 2}, {0: 2}]
    alone, _ = run(burst((10, 1)), long_prefill_token_threshold=4)
    assert [s.tokens for s in alone] == [{0: 10}]


def test_random_workload_under_kv_pressure_keeps_every_limit_and_loses_nothing():
    rng = np.random.default_rng(3)
    requests = [Request(id=i, arrival_s=float(rng.uniform(0, 20)),
                        prompt_len=int(rng.integers(4, 40)), output_len=int(rng.integers(1, 20)),
                        priority=int(rng.integers(0, 3))) for i in range(60)]
    for name in ("vllm", "vllm-priority"):
        steps, scheduler = run(requests, name, num_kv_pages=24, scheduler_max_num_tokens=32,
                               max_num_tokens=24, max_num_seqs=6)
        assert scheduler.record.num_preemptions > 0
        assert max(sum(s.tokens.values()) for s in steps) == 24
        assert max(len(s.tokens) for s in steps) <= 6
        preempting = [s for s in steps if s.preempt]
        assert preempting and all(set(s.tokens) <= set(s.running) for s in preempting)
        # FCFS preempts from the newest end of the running list.
        if name == "vllm":
            assert all(s.preempt == s.running[len(s.running) - len(s.preempt):][::-1]
                       for s in preempting)


def test_bad_knob_is_rejected_with_its_name():
    with pytest.raises(policies.PolicyLoadError, match="max_num_seqs must be >= 1"):
        policies.make_policy("vllm", {"max_num_seqs": "0"})
