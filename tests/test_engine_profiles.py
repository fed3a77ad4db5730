"""Engine profiles (`orca_jax.sim.engine_profiles`) and the front end they declare.

The `orca_jax` profile must price every step as the simulator did before profiles
existed; `vllm` swaps in its kernels and all-reduce per GPU generation, pads steps to
its CUDA graph sizes, and puts a front end before the scheduler (`FrontEnd`: a delay,
and planning one step ahead), which the scheduler honours with leaping on or off.
"""

import dataclasses

import numpy as np
import pytest

import policies  # noqa: F401  (registers the built-in policies)
from orca_jax.core.api.policy import make_policy
from orca_jax.core.loop.arrival_join import ArrivalJoin
from orca_jax.core.loop.scheduler import Scheduler
from orca_jax.core.requests.request import Request
from orca_jax.core.step.engine_api import Bucket, FrontEnd
from orca_jax.runner.build import build_engine, build_workload, scheduler_config
from orca_jax.runner.spec import LimitsSpec, RunSpec, SimEngineSpec, WorkloadSpec
from orca_jax.sim.cost_model import CostModelConfig, bucket_step_seconds, graph_padded
from orca_jax.sim.engine import SimEngine
from orca_jax.sim.engine_profiles import VLLM_GRAPH_SIZES, get_engine_profile
from orca_jax.specs.hardware import get_hardware


def _price(config: CostModelConfig, bucket: Bucket, q, k) -> float:
    q, k = np.array(q, np.int64), np.array(k, np.int64)
    return bucket_step_seconds(config, bucket, lambda: (q, k))


def test_the_default_profile_prices_as_before():
    rng = np.random.default_rng(0)
    spec = SimEngineSpec(model="llama2-70b", hardware="h100", tp=4)
    built = build_engine(RunSpec(engine=spec), scheduler_config(RunSpec(engine=spec))).config
    plain = CostModelConfig(model="llama2-70b", hardware="h100", tp=4)
    for _ in range(20):
        n = int(rng.integers(1, 64))
        q = rng.integers(1, 3, n) * rng.integers(1, 200, n) ** (rng.random(n) < 0.2)
        k = q + rng.integers(0, 2000, n)
        bucket = Bucket(int(2 ** np.ceil(np.log2(q.sum()))), 64)
        assert _price(built, bucket, q, k) == _price(plain, bucket, q, k)


def test_graph_padding_rounds_up_to_a_capture_size_and_not_past_the_largest():
    assert [graph_padded(n, VLLM_GRAPH_SIZES) for n in (1, 3, 5, 9, 255, 257, 512, 513, 2000)] \
        == [1, 4, 8, 16, 256, 272, 512, 513, 2000]


def test_vllm_on_hopper_runs_fa3_and_a_custom_allreduce_within_a_node():
    profile = get_engine_profile("vllm")
    h100 = profile.hardware(get_hardware("h100"))
    preset = get_hardware("h100")
    assert (h100.kernels.attention_decode.hbm_efficiency
            > preset.kernels.attention_decode.hbm_efficiency)
    # Inside a node the custom all-reduce; 16 GPUs span two nodes: NCCL's, kept.
    custom, nccl = h100.kernels.allreduce_cost(4), preset.kernels.allreduce_cost(4)
    assert custom.latency_s < nccl.latency_s / 3
    assert h100.kernels.allreduce_cost(16) == preset.kernels.allreduce_cost(16)
    # A100 gets FlashAttention-2's; the orca_jax profile leaves every preset as it is.
    assert profile.hardware(get_hardware("a100")).kernels.attention_prefill.flops_efficiency == 0.50
    assert get_engine_profile("orca_jax").hardware(preset) is preset


def test_a_tp4_decode_step_is_cheaper_under_vllm_and_its_padding_is_the_graphs():
    vllm = SimEngineSpec(model="llama2-70b", hardware="h100", tp=4, engine_profile="vllm")
    config = build_engine(RunSpec(engine=vllm), scheduler_config(RunSpec(engine=vllm))).config
    plain = CostModelConfig(model="llama2-70b", hardware="h100", tp=4)
    decode = ([1] * 10, [700] * 10)
    assert _price(config, Bucket(16, 16), *decode) < 0.8 * _price(plain, Bucket(16, 16), *decode)
    # vLLM pads 10 tokens to its 16-token graph whatever the run's bucket: a bucket of 512
    # costs the same, where the orca_jax profile pays the bucket's rows.
    assert _price(config, Bucket(512, 64), *decode) == _price(config, Bucket(16, 16), *decode)
    assert _price(plain, Bucket(512, 64), *decode) > _price(plain, Bucket(16, 16), *decode)


def test_a_bad_profile_is_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match="unknown engine profile 'sglang'.*orca_jax, vllm"):
        get_engine_profile("sglang")
    with pytest.raises(ValueError, match="engine_profile"):
        SimEngineSpec(engine_profile="vllm", step_time_ms=10.0)


def test_the_join_compares_what_the_clock_is_moved_to():
    # 0.1 + 0.2 rounds: the clock moved to a request's visible time must join it.
    join = ArrivalJoin(FrontEnd(delay_s=0.2), horizon=4)
    arrivals = np.array([0.1, 0.1, 0.3, 0.7], np.float64)
    due = join.visible_s(0.1)
    assert join.due_end(arrivals, 0, due) == 2
    assert join.due_end(arrivals, 0, np.nextafter(due, 0.0)) == 0
    assert join.due_end(arrivals, 2, join.visible_s(0.3)) == 3


def _run(engine: SimEngineSpec, requests: list[Request], leap: bool = True):
    spec = RunSpec(engine=dataclasses.replace(engine, leap=leap),
                   limits=LimitsSpec(max_num_seqs=16, max_num_tokens=512))
    config = scheduler_config(spec)
    scheduler = Scheduler(requests, make_policy("vllm"), build_engine(spec, config), config)
    return scheduler.run(), scheduler


def test_a_front_end_delays_the_join_and_planning_ahead_costs_a_step():
    # Steps of 10 ms, back to back from 0: step k runs [10k, 10k + 10) ms. The late
    # request arrives at 105 ms, inside step 10, while the long one decodes.
    requests = [Request(id=0, arrival_s=0.0, prompt_len=8, output_len=40),
                Request(id=1, arrival_s=0.105, prompt_len=8, output_len=2)]
    spec = RunSpec(limits=LimitsSpec(max_num_seqs=16, max_num_tokens=512))
    config = scheduler_config(spec)
    fixed = CostModelConfig(mode="fixed", step_time_s=0.01)
    # (delay, plans ahead) -> when it first runs. The first request meets an idle engine
    # and runs after the delay d, so steps start at d + 10k ms, and the late one reaches
    # the queue at 105 + d: at once, the step at 110 takes it; planning ahead, the plan
    # at 110 was made at 100, and the step at 120 takes it; d = 3 ms: 108, the step at
    # 113; d = 8 ms: 113, the step at 118, or planning ahead (made at 108), at 128.
    for delay, plans_ahead, joins in ((0.0, False, 0.110), (0.0, True, 0.120),
                                      (0.003, False, 0.113), (0.008, False, 0.118),
                                      (0.008, True, 0.128)):
        sim = SimEngine(fixed, front_end=FrontEnd(delay_s=delay, plans_ahead=plans_ahead))
        result = Scheduler(requests, make_policy("vllm"), sim, config).run()
        assert result.first_scheduled_s[1] == pytest.approx(joins), (delay, plans_ahead)
        # The first arrived at an idle engine: it waits for the front end alone.
        assert result.first_scheduled_s[0] == pytest.approx(delay), (delay, plans_ahead)


@pytest.mark.parametrize("seed", [1, 2])
def test_a_vllm_profile_run_leaps_exactly(seed):
    engine = SimEngineSpec(model="llama2-7b", hardware="h100", engine_profile="vllm")
    requests = build_workload(RunSpec(seed=seed, workload=WorkloadSpec(num_requests=60,
                                                                       rate=12)))
    leaped, scheduler = _run(engine, requests, leap=True)
    stepped, _ = _run(engine, requests, leap=False)
    assert scheduler.executor.leaper.num_leaped_steps > 0
    for field in ("first_scheduled_s", "first_token_s", "finish_s", "num_generated"):
        np.testing.assert_array_equal(getattr(leaped, field), getattr(stepped, field),
                                      err_msg=field)
    for field in ("start_s", "num_tokens", "step_s", "num_waiting"):
        np.testing.assert_array_equal(leaped.step_array(field), stepped.step_array(field),
                                      err_msg=field)
