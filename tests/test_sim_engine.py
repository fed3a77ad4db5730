"""SimEngine and its cost model: presets, the roofline_max numbers, modes, and the Engine contract.

The roofline tests here pin the whole-step `roofline_max` mode (their numbers are its
formulas); the default `per_op` roofline has its own, tests/test_cost_model.py.
"""

import subprocess
import sys

import numpy as np
import pytest

from orca_jax.core.step.engine_api import Bucket, StepInputs
from orca_jax.sim import cost_model as cm
from orca_jax.sim.engine import SimEngine
from orca_jax.specs.hardware import get_hardware
from orca_jax.specs.memory import kv_bytes_per_token, num_kv_pages_for_memory
from orca_jax.specs.model_config import get_model_config


def make_inputs(q_lens, kv_lens, num_tokens, num_seqs, pages_per_seq=4, pad_kv_lens=0):
    """A StepInputs of real sequences (q_lens, kv_lens) padded by hand to (num_tokens, num_seqs)."""
    n = len(q_lens)
    cu = np.zeros(num_seqs + 1, np.int32)
    cu[1:n + 1] = np.cumsum(q_lens)
    cu[n + 1:] = cu[n]
    kv = np.full(num_seqs, pad_kv_lens, np.int32)
    kv[:n] = kv_lens
    positions = np.zeros(num_tokens, np.int32)
    for i, (q, k) in enumerate(zip(q_lens, kv_lens)):
        positions[cu[i]:cu[i + 1]] = np.arange(k - q, k)
    sample = np.zeros(num_seqs, np.int32)
    sample[:n] = cu[1:n + 1] - 1
    return StepInputs(
        bucket=Bucket(num_tokens, num_seqs), token_ids=np.zeros(num_tokens, np.int32),
        positions=positions, cu_q_lens=cu, kv_lens=kv,
        page_indices=np.zeros((num_seqs, pages_per_seq), np.int32),
        slot_mapping=np.zeros(num_tokens, np.int32), sample_indices=sample,
        num_seqs=np.array([n], np.int32), temperature=np.zeros(num_seqs, np.float32),
        top_k=np.zeros(num_seqs, np.int32), top_p=np.ones(num_seqs, np.float32),
        rng_seeds=np.zeros(num_seqs, np.uint32))


@pytest.mark.parametrize("name, params", [
    ("llama3-8b", 8_030_261_248),  # the published parameter counts
    ("llama2-7b", 6_738_415_616),
    ("mistral-7b", 7_241_732_096),
])
def test_param_counts_match_published_llama_family(name, params):
    assert get_model_config(name).num_params == params


def test_param_counts_of_untied_and_tied_large_models():
    assert get_model_config("gpt3-175b").num_params == pytest.approx(1.75e11, rel=0.01)
    assert get_model_config("opt-13b").num_params == pytest.approx(1.285e10, rel=0.01)


def test_kv_bytes_per_token_counts_kv_heads_layers_and_both_tensors():
    assert kv_bytes_per_token(get_model_config("llama3-8b")) == 2 * 32 * 8 * 128 * 2  # GQA: 8 heads
    assert kv_bytes_per_token(get_model_config("llama2-7b")) == 2 * 32 * 32 * 128 * 2


def test_single_decode_of_llama3_8b_on_a100_is_memory_bound_near_weights_over_bandwidth():
    config = cm.CostModelConfig(mode="roofline_max", model="llama3-8b", hardware="a100")
    cost = cm.roofline_max_cost(config, np.array([1]), np.array([100]))
    assert cost.is_memory_bound
    assert 8e-3 < cost.step_s < 10e-3
    weights_s = get_model_config("llama3-8b").step_weight_bytes(2) / (2.039e12 * 0.8)
    assert cost.memory_s == pytest.approx(weights_s, rel=0.01)


def test_2048_token_prefill_is_compute_bound():
    config = cm.CostModelConfig(mode="roofline_max", model="llama3-8b", hardware="a100")
    cost = cm.roofline_max_cost(config, np.array([2048]), np.array([2048]))
    assert not cost.is_memory_bound
    # ~16 GFLOP per token at 60% of 312 TFLOP/s: about 0.16 s.
    assert 0.14 < cost.step_s < 0.18


def test_attention_flops_are_causal_within_the_chunk():
    config = cm.CostModelConfig(mode="roofline_max", model="tiny")
    model = config.model_config
    # A 3-token chunk on 2 cached tokens: its queries attend to 3, 4 and 5 keys.
    cost = cm.roofline_max_cost(config, np.array([3]), np.array([5]))
    linear = 2 * model.non_embedding_params * 3 + 2 * 128 * 512 * 1
    attention = 4 * 2 * 4 * 32 * (3 + 4 + 5)
    assert cost.num_flops == linear + attention


def test_tensor_parallel_gpt3_decode_is_faster_and_pays_allreduces():
    tp1 = cm.roofline_max_cost(cm.CostModelConfig(mode="roofline_max", model="gpt3-175b", tp=1),
                               np.array([1]), np.array([512]))
    tp8 = cm.roofline_max_cost(cm.CostModelConfig(mode="roofline_max", model="gpt3-175b", tp=8),
                               np.array([1]), np.array([512]))
    assert tp1.allreduce_s == 0.0
    one_allreduce = 2 * 7 / 8 * 12288 * 2 / 300e9 + 10e-6
    assert tp8.allreduce_s == pytest.approx(2 * 96 * one_allreduce)
    assert tp8.memory_s == pytest.approx(tp1.memory_s / 8)
    assert tp8.step_s < tp1.step_s / 5


def test_a_ragged_engine_pays_nothing_for_padding():
    engine = SimEngine(cm.CostModelConfig(model="llama3-8b", step_padding="ragged"))
    q_lens, kv_lens = [5, 1, 1], [5, 300, 40]
    tight = engine.step(make_inputs(q_lens, kv_lens, num_tokens=7, num_seqs=3))
    # Garbage in the padded sequences' kv_lens must be ignored too.
    padded = engine.step(make_inputs(q_lens, kv_lens, num_tokens=512, num_seqs=64,
                                     pad_kv_lens=999))
    assert padded.step_s == tight.step_s


def test_a_compiled_step_pays_its_buckets_rows_but_attends_to_real_lengths():
    config = cm.CostModelConfig(model="llama3-8b")  # step_padding="bucket", the default
    q_lens, kv_lens = np.array([5, 1, 1]), np.array([5, 300, 40])
    engine = SimEngine(config)
    padded = engine.step(make_inputs(q_lens, kv_lens, num_tokens=512, num_seqs=64,
                                     pad_kv_lens=999))
    zeroed = engine.step(make_inputs(q_lens, kv_lens, num_tokens=512, num_seqs=64))
    assert padded.step_s == zeroed.step_s  # padded sequences' kv_lens never read
    roofline = config.per_op_roofline
    parts = roofline.breakdown(q_lens, kv_lens, padded_to=(512, 64))
    real = roofline.breakdown(q_lens, kv_lens)
    # A full bucket of 512 one-token sequences has the token-wise kernels of 512 rows.
    full = roofline.breakdown(np.ones(512, np.int64), np.full(512, 8))
    for op in ("qkv_proj", "mlp_up_proj", "mlp_down_proj", "norm", "embedding"):
        assert parts[op] == full[op] > real[op]
    for op in ("attention_prefill", "attention_decode"):
        assert parts[op] == real[op] > 0
    assert parts["lm_head"] == roofline.breakdown(np.ones(64, np.int64),
                                                  np.full(64, 8))["lm_head"]
    assert padded.step_s == pytest.approx(sum(parts.values()) + config.step_overhead_s,
                                          rel=1e-12)
    assert engine.step(make_inputs(q_lens, kv_lens, num_tokens=7, num_seqs=3)).step_s == \
        SimEngine(cm.CostModelConfig(model="llama3-8b", step_padding="ragged")).step(
            make_inputs(q_lens, kv_lens, num_tokens=7, num_seqs=3)).step_s  # nothing padded


def test_roofline_max_counts_the_buckets_rows_in_its_linear_flops():
    config = cm.CostModelConfig(mode="roofline_max", model="llama3-8b")
    model = config.model_config
    q_lens, kv_lens = np.array([5, 1, 1]), np.array([5, 300, 40])
    real = cm.roofline_max_cost(config, q_lens, kv_lens)
    padded = cm.roofline_max_cost(config, q_lens, kv_lens, padded_to=(512, 64))
    assert padded.num_bytes == real.num_bytes  # the weights and KV are read once either way
    assert padded.num_flops == pytest.approx(
        real.num_flops + 2.0 * model.non_embedding_params * (512 - 7)
        + 2.0 * model.d_model * model.vocab_size * (64 - 3), rel=1e-12)


def test_decode_with_longer_contexts_costs_more_by_the_kv_bytes():
    config = cm.CostModelConfig(mode="roofline_max", model="llama3-8b")
    ones = np.ones(256, np.int64)
    short = cm.roofline_max_cost(config, ones, np.full(256, 100))
    long = cm.roofline_max_cost(config, ones, np.full(256, 1000))
    extra_s = 256 * 900 * 131072 / (2.039e12 * 0.8)
    assert long.memory_s - short.memory_s == pytest.approx(extra_s, rel=1e-9)
    # 256 decodes of an 8B model sit near the ridge: the short step is compute
    # bound, the long one memory bound, so the step time grows by less than extra_s.
    assert not short.is_memory_bound and long.is_memory_bound
    assert long.step_s == pytest.approx(long.memory_s + 300e-6)
    assert long.step_s > short.step_s + 0.005


def test_fixed_mode_ignores_the_step_contents():
    engine = SimEngine(cm.CostModelConfig(mode="fixed", step_time_s=0.05))
    assert engine.step(make_inputs([1], [10], 16, 4)).step_s == 0.05
    assert engine.step(make_inputs([16], [16], 16, 4)).step_s == 0.05


def test_fitted_mode_picks_the_bucket_entry_and_names_a_missing_bucket():
    engine = SimEngine(cm.CostModelConfig(mode="fitted", fitted_step_s={16: 0.01, 64: 0.03}))
    assert engine.step(make_inputs([1, 1], [10, 20], 16, 4)).step_s == 0.01
    assert engine.step(make_inputs([1, 1], [10, 20], 64, 8)).step_s == 0.03
    with pytest.raises(ValueError, match="num_tokens=32"):
        engine.step(make_inputs([1], [10], 32, 4))
    with pytest.raises(ValueError, match="num_tokens=32"):
        engine.warmup([Bucket(16, 4), Bucket(32, 4)])


def test_sampled_tokens_are_kv_len_mod_vocab():
    engine = SimEngine(cm.CostModelConfig(model="tiny", hardware="h100"))
    out = engine.step(make_inputs([3, 1], [3, 700], 8, 4))
    np.testing.assert_array_equal(out.sampled_tokens, [3, 700 % 512, 0, 0])
    assert out.sampled_tokens.dtype == np.int32
    assert engine.name == "sim" and engine.needs_token_ids is False


def test_warmup_restricts_steps_to_the_warm_buckets():
    engine = SimEngine(cm.CostModelConfig(mode="fixed", step_time_s=0.01))
    engine.warmup([Bucket(16, 4), Bucket(32, 8)])
    engine.step(make_inputs([2], [2], 16, 4))
    with pytest.raises(ValueError, match="not warmed up"):
        engine.step(make_inputs([2], [2], 64, 8))
    with pytest.raises(ValueError, match=r"buckets\[0\]"):
        engine.warmup([Bucket(0, 4)])


def test_step_rejects_inconsistent_descriptors():
    engine = SimEngine()
    inputs = make_inputs([4], [4], 16, 4)
    with pytest.raises(ValueError, match="shapes"):
        engine.step(StepInputs(**{**inputs.__dict__, "kv_lens": np.zeros(3, np.int32)}))
    with pytest.raises(ValueError, match=r"kv_lens\[0\]=2"):
        engine.step(make_inputs([4], [2], 16, 4))


def test_presets_lookup_aliases_and_errors():
    assert get_hardware("a100") == get_hardware("a100-80gb")
    assert get_hardware("a100").hbm_bytes == 80 * 2**30
    assert get_hardware("h100") is get_hardware("h100-sxm")
    with pytest.raises(ValueError, match="valid names: .*a100-40gb.*h200"):
        get_hardware("v100")
    with pytest.raises(ValueError, match="'llama9'.*gpt3-175b"):
        cm.CostModelConfig(model="llama9")


@pytest.mark.parametrize("kwargs, message", [
    ({"mode": "magic"}, "mode"),
    ({"mode": "fixed"}, "step_time_s"),
    ({"step_time_s": 0.1}, "step_time_s"),
    ({"mode": "fixed", "step_time_s": -1.0}, "step_time_s"),
    ({"mode": "fitted", "fitted_step_s": {16: 0.0}}, r"fitted_step_s\[16\]"),
    ({"tp": 0}, "tp"),
    ({"hbm_efficiency": 1.5}, "hbm_efficiency"),
])
def test_config_validation_names_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        cm.CostModelConfig(**kwargs)


def test_kv_pages_for_memory():
    llama, a100 = get_model_config("llama3-8b"), get_hardware("a100")
    page_bytes = 16 * 131072
    expected = int((0.9 * 80 * 2**30 - 8_030_261_248 * 2) // page_bytes)
    assert num_kv_pages_for_memory(llama, a100, tp=1, page_size=16) == expected
    assert num_kv_pages_for_memory(llama, a100, 1, 16, kv_memory_gb=10) == 10**10 // page_bytes
    # 8 KV heads on tp=16: each GPU keeps one head, so a page costs 2x its share.
    assert (num_kv_pages_for_memory(llama, a100, 16, 16, kv_memory_gb=10)
            == int(10e9 / 16 // (page_bytes / 8)))
    with pytest.raises(ValueError, match="gpt3-175b.*1 x a100-80gb"):
        num_kv_pages_for_memory(get_model_config("gpt3-175b"), a100, tp=1, page_size=16)
    assert num_kv_pages_for_memory(get_model_config("gpt3-175b"), a100, tp=8, page_size=16) > 0


def test_host_modules_do_not_import_jax():
    code = ("import sys, orca_jax.sim.engine, orca_jax.results.metrics; "
            "assert 'jax' not in sys.modules, 'jax imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
