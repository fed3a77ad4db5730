"""The paged ragged step against a plain dense forward, rotary scaling, configs, sampling."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from orca_jax.core.step.engine_api import Bucket, StepInputs
from orca_jax.model import llama as model_lib
from orca_jax.model import sampling
from orca_jax.specs.model_config import (
    PRESETS,
    RopeScaling,
    from_hf_config,
    get_model_config,
    to_hf_config,
)

PAGE_SIZE = 4
PAGES_PER_SEQ = 8
BUCKET = Bucket(num_tokens=32, num_seqs=4)


def make_inputs(chunks: list[tuple[list[int], int, list[int]]], bucket: Bucket,
                *, page_size: int = PAGE_SIZE, pages_per_seq: int = PAGES_PER_SEQ,
                temperature: float = 0.0) -> StepInputs:
    """StepInputs for sequences given as (new token ids, position of the first, pages)."""
    t, s = bucket.num_tokens, bucket.num_seqs
    token_ids, positions, slots = (np.zeros(t, np.int32) for _ in range(3))
    cu = np.zeros(s + 1, np.int32)
    kv_lens = np.zeros(s, np.int32)
    page_indices = np.zeros((s, pages_per_seq), np.int32)
    sample_indices = np.zeros(s, np.int32)
    for i, (tokens, start, pages) in enumerate(chunks):
        lo = cu[i]
        n = len(tokens)
        pos = np.arange(start, start + n)
        token_ids[lo:lo + n] = tokens
        positions[lo:lo + n] = pos
        slots[lo:lo + n] = np.asarray(pages)[pos // page_size] * page_size + pos % page_size
        cu[i + 1] = lo + n
        kv_lens[i] = start + n
        page_indices[i, :len(pages)] = pages
        sample_indices[i] = lo + n - 1
    cu[len(chunks) + 1:] = cu[len(chunks)]
    return StepInputs(
        bucket=bucket, token_ids=token_ids, positions=positions, cu_q_lens=cu, kv_lens=kv_lens,
        page_indices=page_indices, slot_mapping=slots, sample_indices=sample_indices,
        num_seqs=np.array([len(chunks)], np.int32), temperature=np.full(s, temperature, np.float32),
        top_k=np.zeros(s, np.int32), top_p=np.ones(s, np.float32),
        rng_seeds=np.arange(s, dtype=np.uint32))


def attention_oracle(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *,
                     sm_scale):
    """Per-token dense attention over the token's own pages: independent of the kernel file."""
    t = q.shape[0]
    num_kv = k_pages.shape[2]
    group = q.shape[1] // num_kv
    rows = jnp.arange(t)
    seq = jnp.clip(jnp.searchsorted(cu_q_lens, rows, side="right") - 1, 0, kv_lens.shape[0] - 1)
    q_len = cu_q_lens[seq + 1] - cu_q_lens[seq]
    q_pos = kv_lens[seq] - q_len + rows - cu_q_lens[seq]  # [T]
    k = k_pages[page_indices[seq]].reshape(t, -1, num_kv, q.shape[-1])  # [T, P*page, kv, d]
    v = v_pages[page_indices[seq]].reshape(t, -1, num_kv, q.shape[-1])
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    scores = jnp.einsum("thd,tkhd->thk", q, k) * sm_scale
    visible = jnp.arange(k.shape[1])[None, :] <= q_pos[:, None]  # [T, keys]
    scores = jnp.where(visible[:, None, :], scores, -jnp.inf)
    out = jnp.einsum("thk,tkhd->thd", jax.nn.softmax(scores, axis=-1), v)
    real = rows < cu_q_lens[num_seqs[0]]
    return jnp.where(real[:, None, None], out, 0.0)


@pytest.fixture(scope="module")
def tiny():
    config = get_model_config("tiny")
    graphdef, params = nnx.split(model_lib.init_model(config, seed=0))
    return config, graphdef, params


@pytest.mark.parametrize("attention",
                         [attention_oracle, "reference", "bucketed", "pallas_interpret"],
                         ids=["oracle", "reference", "bucketed", "pallas_interpret"])
def test_paged_step_matches_dense_forward(tiny, attention):
    config, graphdef, params = tiny
    step = jax.jit(functools.partial(model_lib.step, graphdef, attention=attention),
                   donate_argnums=1)
    num_pages = 1 + 3 * PAGES_PER_SEQ + 5
    scrambled = np.random.default_rng(0).permutation(np.arange(1, num_pages))
    pages = [list(scrambled[i * PAGES_PER_SEQ:(i + 1) * PAGES_PER_SEQ]) for i in range(3)]
    rng = np.random.default_rng(1)
    prompts = [list(rng.integers(0, config.vocab_size, n)) for n in (13, 7, 21)]
    # Sequence 0 prefills in one step, 1 in chunks of 4+3, 2 in chunks of 10+11.
    schedule = [[(0, 13), (1, 4), (2, 10)], [(1, 3), (2, 11)]] + [[(0, 1), (1, 1), (2, 1)]] * 4
    known, done = [list(p) for p in prompts], [0, 0, 0]
    cache = model_lib.init_kv_cache(config, num_pages=num_pages, page_size=PAGE_SIZE)
    recorded = []  # (seq, position, step logits row, step token)
    for plan in schedule:
        chunks = [(known[i][done[i]:done[i] + n], done[i], pages[i]) for i, n in plan]
        inputs = make_inputs(chunks, BUCKET)
        cache, result = step(params, cache, inputs)
        for slot, (i, n) in enumerate(plan):
            done[i] += n
            recorded.append((i, done[i] - 1, np.asarray(result.logits[slot]),
                             int(result.tokens[slot])))
            if done[i] == len(known[i]):
                known[i].append(int(result.tokens[slot]))
    dense = nnx.jit(lambda m, t: model_lib.dense_forward(m, t))
    model = nnx.merge(graphdef, params)
    oracle = {i: np.asarray(dense(model, jnp.asarray(known[i][:32] + [0] * (32 - len(known[i])),
                                                     jnp.int32)))
              for i in range(3)}
    assert len(recorded) == 3 + 2 + 12
    for i, pos, logits, token in recorded:
        np.testing.assert_allclose(logits, oracle[i][pos], atol=1e-4, rtol=1e-4)
        assert token == int(np.argmax(oracle[i][pos]))
    # The decode tokens come from the dense model too (causal: padding cannot leak back).
    for i in range(3):
        positions = range(len(prompts[i]) - 1, len(known[i]) - 1)
        assert known[i][len(prompts[i]):] == [int(np.argmax(oracle[i][p])) for p in positions]


def test_padding_writes_only_the_null_page(tiny):
    config, graphdef, params = tiny
    num_pages = 12
    cache = model_lib.init_kv_cache(config, num_pages=num_pages, page_size=PAGE_SIZE)
    inputs = make_inputs([([5, 6, 7, 8, 9], 0, [3, 7])], BUCKET)
    step = jax.jit(functools.partial(model_lib.step, graphdef, attention=attention_oracle))
    cache, _ = step(params, cache, inputs)
    for layer_k in cache.k:
        written = np.flatnonzero(np.abs(np.asarray(layer_k)).sum(axis=(1, 2, 3)))
        assert set(written) == {0, 3, 7}  # 27 padding rows land in page 0
        assert np.count_nonzero(np.abs(np.asarray(layer_k[7])).sum(axis=(1, 2))) == 1


def test_llama3_rope_scaling_bands():
    config = get_model_config("llama3.1-8b")
    plain = model_lib.rope_inv_freq(dataclasses.replace(config, rope_scaling=None))
    scaled = model_lib.rope_inv_freq(config)
    wavelen = 2 * np.pi / plain
    assert scaled[0] == plain[0]  # short wavelength: unchanged
    np.testing.assert_allclose(scaled[-1], plain[-1] / 8.0)  # longer than 8192: divided by 8
    middle = (wavelen > 8192 / 4) & (wavelen < 8192 / 1)
    assert middle.any()
    assert np.all(scaled[middle] < plain[middle]) and np.all(scaled[middle] > plain[middle] / 8)


def test_rope_is_rotate_half_and_relative():
    x = jax.random.normal(jax.random.key(0), (1, 1, 8))
    inv = 1.0 / 10000 ** (np.arange(0, 8, 2) / 8)
    out = np.asarray(model_lib.apply_rope(x, jnp.array([3]), inv))[0, 0]
    xn = np.asarray(x)[0, 0]
    cos, sin = np.cos(3 * inv), np.sin(3 * inv)
    np.testing.assert_allclose(out, np.concatenate([xn[:4] * cos - xn[4:] * sin,
                                                    xn[4:] * cos + xn[:4] * sin]), rtol=1e-5)
    # Dot products of rotated q, k depend only on the position difference.
    q, k = jax.random.normal(jax.random.key(1), (2, 1, 1, 8))
    dot = lambda a, b: float(jnp.sum(model_lib.apply_rope(q, jnp.array([a]), inv)
                                     * model_lib.apply_rope(k, jnp.array([b]), inv)))
    assert dot(5, 2) == pytest.approx(dot(13, 10), rel=1e-4)


def test_configs_validate_and_round_trip_hf():
    with pytest.raises(ValueError, match="llama2-7b"):
        get_model_config("gpt5")
    with pytest.raises(ValueError, match="num_kv_heads=3"):
        dataclasses.replace(PRESETS["tiny"], num_kv_heads=3)
    with pytest.raises(ValueError, match="head_dim"):
        dataclasses.replace(PRESETS["tiny"], head_dim=31)
    for name in ("tiny", "llama3.1-8b", "llama2-7b"):
        config = PRESETS[name]
        assert from_hf_config(to_hf_config(config), name=name) == config
    assert PRESETS["llama3-8b"].num_params == pytest.approx(8.03e9, rel=0.01)
    assert PRESETS["llama2-7b"].num_params == pytest.approx(6.74e9, rel=0.01)
    with pytest.raises(ValueError, match="intermediate_size"):
        from_hf_config({"hidden_size": 8, "num_attention_heads": 2, "vocab_size": 4,
                        "num_hidden_layers": 1})
    with pytest.raises(ValueError, match="factor"):
        RopeScaling(factor=0.5, low_freq_factor=1, high_freq_factor=4, original_max_position=8)


# Jitted, as the engine's step calls it: called eagerly, its `lax.cond` over a fresh
# closure compiled again on every call (4-5 s each); jitted, once per shape.
_SAMPLE_TOKENS = jax.jit(sampling.sample_tokens)


def _step_sample(logits, temperature=0.0, top_k=0, top_p=1.0, seeds=None, positions=None):
    s = logits.shape[0]
    return np.asarray(_SAMPLE_TOKENS(
        jnp.asarray(logits, jnp.float32),
        jnp.asarray(positions if positions is not None else np.zeros(s), jnp.int32),
        jnp.full(s, temperature, jnp.float32), jnp.full(s, top_k, jnp.int32),
        jnp.full(s, top_p, jnp.float32),
        jnp.asarray(seeds if seeds is not None else np.arange(s), jnp.uint32)))


def test_sampling_greedy_and_top_k_one():
    logits = np.random.default_rng(0).normal(size=(6, 50)).astype(np.float32)
    np.testing.assert_array_equal(_step_sample(logits), logits.argmax(-1))
    np.testing.assert_array_equal(_step_sample(logits, temperature=2.0, top_k=1),
                                  logits.argmax(-1))
    # A tiny nucleus keeps only the most likely token, too.
    np.testing.assert_array_equal(_step_sample(logits, temperature=1.0, top_p=1e-6),
                                  logits.argmax(-1))


def test_greedy_tokens_are_argmax_on_ties_infinities_and_nans():
    rng = np.random.default_rng(5)
    logits = rng.normal(size=(8, 300)).astype(np.float32)
    logits[0, [17, 4, 250]] = 9.0  # a tie: the first index wins
    logits[1, :] = 0.5  # all tied
    logits[2, 299] = np.inf
    logits[3, :] = -np.inf
    logits[4, [40, 12]] = np.nan  # argmax returns the first NaN
    logits[5, [3, 200]] = [np.inf, np.nan]
    logits[6, -1] = 1e30
    logits[7] = np.round(logits[7])  # many ties among small integers
    got = np.asarray(jax.jit(sampling.greedy_tokens)(jnp.asarray(logits)))
    np.testing.assert_array_equal(got, np.asarray(jnp.argmax(jnp.asarray(logits), axis=-1)))
    np.testing.assert_array_equal(got[:6], [4, 0, 299, 0, 12, 200])
    assert got.dtype == np.int32


def test_sampling_depends_on_seed_and_position_not_slot():
    row = np.random.default_rng(1).normal(size=50).astype(np.float32)
    other = np.random.default_rng(2).normal(size=(7, 50)).astype(np.float32)
    draws = []
    for slot in (0, 3, 7):
        logits = np.insert(other, slot, row, axis=0)
        seeds = np.insert(np.arange(100, 107), slot, 42)
        positions = np.insert(np.arange(7) * 3, slot, 17)
        draws.append(_step_sample(logits, temperature=1.0, seeds=seeds, positions=positions)[slot])
    assert draws[0] == draws[1] == draws[2]
    # Over many positions the same seed gives varied tokens: the position is mixed in.
    many = _step_sample(np.tile(row, (64, 1)), temperature=1.0, seeds=np.full(64, 42),
                        positions=np.arange(64))
    assert len(set(many.tolist())) > 5


def test_sampling_distribution_follows_temperature_and_cuts():
    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05]], np.float32))
    n = 4000
    tiled = np.tile(logits, (n, 1))
    tokens = _step_sample(tiled, temperature=1.0, seeds=np.arange(n))
    freq = np.bincount(tokens, minlength=4) / n
    np.testing.assert_allclose(freq, [0.5, 0.3, 0.15, 0.05], atol=0.03)
    top2 = np.bincount(_step_sample(tiled, temperature=1.0, top_k=2, seeds=np.arange(n)),
                       minlength=4) / n
    np.testing.assert_allclose(top2, [0.625, 0.375, 0, 0], atol=0.03)
    nucleus = np.bincount(_step_sample(tiled, temperature=1.0, top_p=0.85, seeds=np.arange(n)),
                          minlength=4) / n
    np.testing.assert_allclose(nucleus, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0], atol=0.03)
    cold = np.bincount(_step_sample(tiled, temperature=0.25, seeds=np.arange(n)), minlength=4) / n
    assert cold[0] > 0.75  # p^4 renormalised: 0.5^4 / sum = 0.87
