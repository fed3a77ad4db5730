"""Pipeline stages on the simulator: the schedule of micro-batches through P stages.

Hand-priced: Llama-3-8B's 32 layers split over 2 stages under a fixed 0.25 s step,
so a stage of 16 layers takes 0.125 s and a split of 24 + 8 takes 0.1875 + 0.0625 s
(binary fractions: every sum below is exact). vLLM with a batch cap of 1 puts one
request in each micro-batch, so the schedule can be written out by hand.
"""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from orca_jax import KVConfig, Request, Scheduler, SchedulerConfig, StepLimits
from orca_jax.core.api.policy import make_policy
from orca_jax.core.loop.config import LoopFeatures
from orca_jax.core.step.engine_api import Bucket, PackedStep
from orca_jax.runner.spec import SimEngineSpec
from orca_jax.sim.cost_model import CostModelConfig
from orca_jax.sim.engine import SimEngine
from orca_jax.sim.pipeline_stages import stage_layers, stage_link
from orca_jax.specs.hardware import get_hardware

STEP_S = 0.25


def _run(pp_layers, outputs, max_num_seqs=1, policy="vllm", balance=False, arrivals=None,
         max_num_tokens=16):
    requests = [Request(id=i, arrival_s=0.0 if arrivals is None else arrivals[i],
                        prompt_len=8, output_len=o) for i, o in enumerate(outputs)]
    config = SchedulerConfig(limits=StepLimits(max_num_seqs=max_num_seqs,
                                               max_num_tokens=max_num_tokens,
                                               max_model_len=64),
                             kv=KVConfig(num_kv_pages=64, page_size=16),
                             features=LoopFeatures(balance_micro_batches=balance))
    engine = SimEngine(CostModelConfig(mode="fixed", step_time_s=STEP_S, pp_layers=pp_layers))
    scheduler = Scheduler(requests, make_policy(policy), engine, config)
    return scheduler.run()


def _token_times(result, request):
    return result.token_time_s[result.token_req == request].tolist()


def test_two_equal_stages_overlap_two_micro_batches():
    # A enters stage 0 at 0 and leaves stage 1 at 0.25; B enters stage 0 at 0.125, as soon
    # as A left it; A's next iteration waits for A to leave the last stage (0.25).
    result = _run((16, 16), [3, 3])
    assert _token_times(result, 0) == [0.25, 0.5, 0.75]
    assert _token_times(result, 1) == [0.375, 0.625, 0.875]
    assert result.virtual_end_s == 0.875
    assert result.step_array("start_s").tolist() == [0, 0.125, 0.25, 0.375, 0.5, 0.625]
    stats = result.pipeline
    assert (stats["stages"], stats["micro_batches"], stats["busy_s"]) == (2, 6, 0.875)
    # Only filling (stage 1 waits for the first micro-batch) and draining (stage 0 idles
    # while the last one finishes on stage 1).
    assert stats["stage0"]["bubble_s"] == stats["stage1"]["bubble_s"] == 0.125
    assert stats["stage0"]["busy_s"] == stats["stage1"]["busy_s"] == 0.75


def test_unequal_stages_run_at_the_pace_of_the_slower_one():
    # Stage 0 (24 layers, 0.1875 s) is the bottleneck: a micro-batch enters every 0.1875 s
    # and stage 1 (0.0625 s) idles the rest of each period.
    result = _run((24, 8), [3, 3])
    assert _token_times(result, 0) == [0.25, 0.625, 1.0]
    assert _token_times(result, 1) == [0.4375, 0.8125, 1.1875]
    stats = result.pipeline
    assert stats["busy_s"] == 1.1875
    assert stats["stage0"]["busy_s"] == 1.125 and stats["stage0"]["bubble_s"] == 0.0625
    assert stats["stage1"]["busy_s"] == 0.375 and stats["stage1"]["bubble_s"] == 0.8125


def test_a_request_finishing_mid_pipeline_leaves_and_a_small_batch_leaves_bubbles():
    # A (one token) leaves after its first pass, at 0.25, while B is still on stage 1:
    # from then on B alone is runnable only every other stage slot, and each stage idles
    # half the time.
    result = _run((16, 16), [1, 3])
    assert _token_times(result, 0) == [0.25]
    assert result.finish_s[0] == 0.25
    assert _token_times(result, 1) == [0.375, 0.625, 0.875]
    stats = result.pipeline
    assert stats["busy_s"] == 0.875
    assert stats["stage0"]["bubble_s"] == stats["stage1"]["bubble_s"] == 0.375
    assert stats["bubble_fraction"] == 0.375 / 0.875


def test_an_empty_pipeline_between_arrivals_is_no_bubble():
    # The second request arrives long after the first left: the gap is idle, not bubble.
    result = _run((16, 16), [1, 1], arrivals=[0.0, 10.0])
    assert _token_times(result, 1) == [10.25]
    stats = result.pipeline
    assert stats["busy_s"] == 0.5
    assert stats["stage0"]["bubble_s"] == stats["stage1"]["bubble_s"] == 0.25


def test_balancing_splits_the_running_requests_over_the_micro_batches():
    # Four requests, cap 4, all prompts in the first step. Unbalanced, the four ride in one
    # micro-batch and the pipeline holds one at a time (each stage idles half the time).
    # Balanced, after that first step each micro-batch takes ceil(4 / 2) = 2 of them and
    # two are in flight. A fixed-time stage costs the same for 2 requests as for 4, so
    # here the split only adds micro-batches: it pays where a stage's time follows its
    # batch (the roofline: docs/pipeline.md).
    plain = _run((16, 16), [4, 4, 4, 4], max_num_seqs=4, max_num_tokens=64)
    balanced = _run((16, 16), [4, 4, 4, 4], max_num_seqs=4, max_num_tokens=64, balance=True)
    assert plain.step_array("num_seqs").tolist() == [4, 4, 4, 4]
    assert plain.virtual_end_s == 4 * STEP_S
    assert plain.pipeline["bubble_fraction"] == 0.5
    # The last two run one each: once the first pair is done, R = 2 and a share is 1.
    assert balanced.step_array("num_seqs").tolist() == [4, 2, 2, 2, 2, 2, 1, 1]
    assert balanced.step_array("start_s").tolist() == [0, 0.25, 0.375, 0.5, 0.625, 0.75,
                                                       0.875, 1.0]
    assert balanced.virtual_end_s == 1.25
    assert balanced.pipeline["bubble_fraction"] == 0.25 / 1.25
    assert balanced.num_generated.tolist() == [4, 4, 4, 4]


def test_every_policy_plans_only_requests_not_in_flight():
    # The view hides the requests of micro-batches in flight: no plan breaks busy_request,
    # and a request is in one micro-batch at a time (its tokens one stage pass apart).
    for policy in ("orca", "sarathi", "static", "sjf"):
        result = _run((8, 8, 8, 8), [5, 3, 7, 2, 6], max_num_seqs=2, policy=policy)
        for request in range(5):
            times = np.asarray(_token_times(result, request))
            assert (np.diff(times) >= 4 * 0.0625).all(), policy


def test_stage_layers_and_links():
    assert stage_layers(32, 3) == (11, 11, 10)
    assert stage_layers(96, 2, "60,36") == (60, 36)
    a100 = get_hardware("a100-40gb")
    assert stage_link(a100, 8, 0).name == "ib200"  # TP8 x PP2: the stages are two nodes
    assert stage_link(a100, 2, 0).name == "nvlink3"  # TP2 x PP4 in one node
    assert stage_link(get_hardware("h100"), 8, 0).name == "ib400"


def test_a_per_op_stage_is_its_layers_and_a_send_to_the_next():
    whole = CostModelConfig(model="gpt3-175b", hardware="a100-40gb", tp=8,
                            step_padding="ragged")
    staged = CostModelConfig(model="gpt3-175b", hardware="a100-40gb", tp=8,
                             step_padding="ragged", pp_layers=(48, 48))
    engine, one = SimEngine(staged), SimEngine(whole)
    kv_lens = np.full(16, 300, np.int64)
    packed = PackedStep(Bucket(num_tokens=16, num_seqs=16), np.ones(16, np.int64), kv_lens,
                        lambda: None)
    output, stages = engine.step_stages(packed)
    whole_s = one.step_packed(packed).step_s
    send_s = 20e-6 + 16 * 12288 * 2 / 25e9  # 16 rows of d_model over HDR InfiniBand
    # Two halves of the layers, each with its own step overhead; the send on stage 0.
    assert sum(stages) == pytest.approx(whole_s + 300e-6 + send_s, rel=1e-9)
    assert stages[0] == pytest.approx(stages[1], rel=0.05)  # the embedding vs the LM head
    assert output.step_s == pytest.approx(sum(stages))


@pytest.mark.parametrize("fields, message", [
    (dict(pp=40), "engine.pp 40 is more stages than the model's 32 layers"),
    (dict(pp=4, tp=8), "engine.pp 4 x tp 8 = 32 GPUs, more than the 16 hardware a100"),
    (dict(pp=2, pp_layers="20,10"), "engine.pp_layers '20,10' must be 2 integers >= 1 "
                                    "summing to the model's 32 layers (they sum to 30)"),
    (dict(pp=3, pp_layers="20,12"), "engine.pp_layers '20,12' gives 2 stages, engine.pp is 3"),
])
def test_bad_pipeline_settings_are_one_line_each(fields, message):
    with pytest.raises(ValueError) as raised:
        SimEngineSpec(**fields)
    assert str(raised.value).startswith(message) and "\n" not in str(raised.value)


def test_the_command_documents_pp_and_refuses_bad_values_in_one_line(tmp_path):
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    shown = subprocess.run([sys.executable, "-m", "experiments.run", "--helpfull"], cwd=root,
                           env=env, capture_output=True, text=True, timeout=300)
    assert "--pp: jax: Pipeline parallelism" in shown.stdout
    bad = subprocess.run([sys.executable, "-m", "experiments.run", "--engine=sim",
                          "--policy=orca", "--pp=2", "--pp_layers=20,10",
                          f"--out_dir={tmp_path}"], cwd=root, env=env, capture_output=True,
                         text=True, timeout=300)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    lines = [line for line in bad.stderr.splitlines() if "pp_layers" in line]
    assert len(lines) == 1 and "--pp_layers: engine.pp_layers '20,10' must be" in lines[0]
