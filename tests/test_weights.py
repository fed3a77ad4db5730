"""Weights: orbax round trip; LLaMA-format folders against an HF-convention numpy forward."""

from __future__ import annotations

import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

from orca_jax.model import llama as model_lib
from orca_jax.model import weights
from orca_jax.specs.model_config import RopeScaling, get_model_config

# tiny, with rope scaling whose bands fall inside head_dim 32 at theta 1e4.
CONFIG = dataclasses.replace(get_model_config("tiny"), rope_scaling=RopeScaling(
    factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position=64))
HF_CONFIG = {"architectures": ["LlamaForCausalLM"], "vocab_size": 512, "hidden_size": 128,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "intermediate_size": 256, "rope_theta": 10000.0, "rms_norm_eps": 1e-5,
             "max_position_embeddings": 1024, "tie_word_embeddings": False,
             "rope_scaling": {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}


def random_hf_tensors(tied: bool = False) -> dict[str, np.ndarray]:
    """HF-named tensors in HF's [out, in] layout, written without the library's name table."""
    rng = np.random.default_rng(0)
    normal = lambda *shape: (rng.standard_normal(shape) / math.sqrt(shape[-1])).astype(np.float32)
    t = {"model.embed_tokens.weight": normal(512, 128),
         "model.norm.weight": (1 + 0.1 * rng.standard_normal(128)).astype(np.float32)}
    for n in range(2):
        p = f"model.layers.{n}."
        t[p + "self_attn.q_proj.weight"] = normal(128, 128)
        t[p + "self_attn.k_proj.weight"] = normal(64, 128)
        t[p + "self_attn.v_proj.weight"] = normal(64, 128)
        t[p + "self_attn.o_proj.weight"] = normal(128, 128)
        t[p + "mlp.gate_proj.weight"] = normal(256, 128)
        t[p + "mlp.up_proj.weight"] = normal(256, 128)
        t[p + "mlp.down_proj.weight"] = normal(128, 256)
        t[p + "input_layernorm.weight"] = (1 + 0.1 * rng.standard_normal(128)).astype(np.float32)
        t[p + "post_attention_layernorm.weight"] = (
            1 + 0.1 * rng.standard_normal(128)).astype(np.float32)
    if not tied:
        t["lm_head.weight"] = normal(512, 128)
    return t


def hf_forward(t: dict[str, np.ndarray], tokens: np.ndarray) -> np.ndarray:
    """LLaMA forward as the HF reference writes it (rotate_half, repeat_kv), float64."""
    w = {k: v.astype(np.float64) for k, v in t.items()}
    length, heads, kv_heads, hd, eps = len(tokens), 4, 2, 32, 1e-5
    inv_freq = []
    for freq in 1.0 / 10000.0 ** (np.arange(0, hd, 2) / hd):
        wavelen = 2 * math.pi / freq
        if wavelen < 64 / 4.0:
            inv_freq.append(freq)
        elif wavelen > 64 / 1.0:
            inv_freq.append(freq / 4.0)
        else:
            smooth = (64 / wavelen - 1.0) / (4.0 - 1.0)
            inv_freq.append((1 - smooth) * freq / 4.0 + smooth * freq)
    angles = np.outer(np.arange(length), inv_freq)
    emb = np.concatenate([angles, angles], axis=-1)
    cos, sin = np.cos(emb), np.sin(emb)  # [L, hd]
    rotate_half = lambda x: np.concatenate([-x[..., hd // 2:], x[..., :hd // 2]], axis=-1)
    rms = lambda x, g: g * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    x = w["model.embed_tokens.weight"][tokens]
    mask = np.triu(np.full((length, length), -np.inf), 1)
    for n in range(2):
        p = f"model.layers.{n}."
        h = rms(x, w[p + "input_layernorm.weight"])
        proj = lambda name, nh: (h @ w[p + name].T).reshape(length, nh, hd).transpose(1, 0, 2)
        q, k, v = proj("self_attn.q_proj.weight", heads), proj("self_attn.k_proj.weight",
                                                               kv_heads), proj(
            "self_attn.v_proj.weight", kv_heads)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k, v = np.repeat(k, heads // kv_heads, axis=0), np.repeat(v, heads // kv_heads, axis=0)
        s = q @ k.transpose(0, 2, 1) / math.sqrt(hd) + mask
        p_attn = np.exp(s - s.max(-1, keepdims=True))
        p_attn /= p_attn.sum(-1, keepdims=True)
        o = (p_attn @ v).transpose(1, 0, 2).reshape(length, heads * hd)
        x = x + o @ w[p + "self_attn.o_proj.weight"].T
        h = rms(x, w[p + "post_attention_layernorm.weight"])
        gate = h @ w[p + "mlp.gate_proj.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * (h @ w[p + "mlp.up_proj.weight"].T)
                 ) @ w[p + "mlp.down_proj.weight"].T
    x = rms(x, w["model.norm.weight"])
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    return x @ head.T


def write_folder(path, tensors, hf_config, *, sharded: bool) -> None:
    path.mkdir()
    (path / "config.json").write_text(json.dumps(hf_config))
    if not sharded:
        save_file(tensors, str(path / "model.safetensors"))
        return
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}
    for file, shard_names in shards.items():
        save_file({n: tensors[n] for n in shard_names}, str(path / file))
    index = {"metadata": {}, "weight_map": {n: f for f, ns in shards.items() for n in ns}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))


def logits_of(config, params, tokens) -> np.ndarray:
    graphdef, _ = model_lib.abstract_model(config)
    return np.asarray(model_lib.dense_forward(nnx.merge(graphdef, params),
                                              jnp.asarray(tokens, jnp.int32)))


TOKENS = np.array([5, 300, 17, 17, 42, 511, 0, 128, 9, 77, 3, 260], np.int32)


@pytest.mark.slow
@pytest.mark.parametrize("sharded,tied", [(False, False), (True, False), (True, True)])
def test_llama_folder_matches_hf_reference_forward(tmp_path, sharded, tied):
    tensors = random_hf_tensors(tied)
    write_folder(tmp_path / "llama", tensors, {**HF_CONFIG, "tie_word_embeddings": tied},
                 sharded=sharded)
    config, params = weights.load_llama_folder(str(tmp_path / "llama"))
    assert config == dataclasses.replace(CONFIG, name="llama", tie_embeddings=tied)
    np.testing.assert_allclose(logits_of(config, params, TOKENS), hf_forward(tensors, TOKENS),
                               atol=2e-4, rtol=2e-4)
    # And back out under HF names: the same arrays.
    exported = weights.hf_state_dict(config, params)
    assert sorted(exported) == sorted(tensors)
    np.testing.assert_array_equal(exported["model.layers.1.self_attn.k_proj.weight"],
                                  tensors["model.layers.1.self_attn.k_proj.weight"])


def test_missing_and_misshaped_tensors_are_named(tmp_path):
    tensors = random_hf_tensors()
    del tensors["model.layers.1.mlp.up_proj.weight"]
    write_folder(tmp_path / "missing", tensors, HF_CONFIG, sharded=False)
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight "
                                         r"\(expected shape \(256, 128\)\)"):
        weights.load_llama_folder(str(tmp_path / "missing"))
    tensors = random_hf_tensors()
    tensors["model.layers.0.self_attn.k_proj.weight"] = np.zeros((128, 64), np.float32)
    write_folder(tmp_path / "transposed", tensors, HF_CONFIG, sharded=True)
    with pytest.raises(ValueError, match=r"k_proj\.weight has shape \(128, 64\), "
                                         r"expected \(64, 128\)"):
        weights.load_llama_folder(str(tmp_path / "transposed"))
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text(json.dumps(HF_CONFIG))
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        weights.load_llama_folder(str(tmp_path / "empty"))


def test_orbax_round_trip(tmp_path):
    params = weights.init_params(CONFIG, seed=7)
    weights.save_params(str(tmp_path / "ckpt"), params)
    config, restored = weights.load_params(str(tmp_path / "ckpt"), CONFIG)
    assert config == CONFIG
    original = jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(params))
    back = dict(jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(restored)))
    assert len(original) == len(back) == 2 + 2 * 9 + 1
    for path, leaf in original:
        np.testing.assert_array_equal(np.asarray(back[path]), np.asarray(leaf))
    assert not np.array_equal(np.asarray(original[0][1]),
                              np.asarray(nnx.to_pure_dict(weights.init_params(CONFIG, seed=8))
                                         ["embed_tokens"]["embedding"]))
    with pytest.raises(FileNotFoundError, match="nowhere"):
        weights.restore_params(str(tmp_path / "nowhere"), CONFIG)
