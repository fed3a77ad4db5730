"""Ragged paged attention: the jnp reference against a dense numpy oracle, the Pallas
kernel (interpret mode) against the reference."""

from __future__ import annotations

import dataclasses

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.ragged_paged_attention import (
    RaggedAttentionConfig,
    ragged_paged_attention,
    ragged_paged_attention_reference,
)
from pallas_kernels.tiling import plan_passes


@dataclasses.dataclass(frozen=True)
class Batch:
    """One step's attention inputs (numpy) plus what the oracle needs."""

    q: np.ndarray  # [T, num_q_heads, head_dim]
    k_pages: np.ndarray  # [num_pages, page_size, num_kv_heads, head_dim]
    v_pages: np.ndarray  # [num_pages, page_size, num_kv_heads, head_dim]
    kv_lens: np.ndarray  # [S]
    page_indices: np.ndarray  # [S, pages_per_seq]
    cu_q_lens: np.ndarray  # [S+1]
    num_seqs: np.ndarray  # [1]

    def args(self) -> tuple[jax.Array, ...]:
        return tuple(jnp.asarray(a) for a in (self.q, self.k_pages, self.v_pages, self.kv_lens,
                                              self.page_indices, self.cu_q_lens, self.num_seqs))

    @property
    def num_real_tokens(self) -> int:
        return int(self.cu_q_lens[int(self.num_seqs[0])])


def make_batch(seqs: list[tuple[int, int]], *, num_slots: int, num_tokens: int,
               num_q_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 32,
               page_size: int = 16, pages_per_seq: int = 4, dtype=np.float32,
               seed: int = 0, num_pages: int | None = None) -> Batch:
    """Builds a batch of real sequences `(q_len, kv_len)` padded to `num_slots` x `num_tokens`.

    Real pages come from a scrambled pool; every cache slot that no sequence owns
    (page 0, the tail of a last page, unowned pages) holds NaN, so any read past a
    sequence's `kv_len` poisons the output.
    """
    rng = np.random.default_rng(seed)
    pages_needed = [-(-kv // page_size) for _, kv in seqs]
    num_pages = num_pages or 1 + sum(pages_needed) + 2
    assert num_pages > sum(pages_needed)
    pool = rng.permutation(np.arange(1, num_pages))
    k_pages = np.full((num_pages, page_size, num_kv_heads, head_dim), np.nan, np.float32)
    v_pages = np.full_like(k_pages, np.nan)
    page_indices = np.zeros((num_slots, pages_per_seq), np.int32)
    kv_lens = np.zeros(num_slots, np.int32)
    cu_q_lens = np.zeros(num_slots + 1, np.int32)
    next_page = 0
    for i, (q_len, kv_len) in enumerate(seqs):
        assert pages_needed[i] <= pages_per_seq and q_len <= kv_len or q_len == 0
        own = pool[next_page:next_page + pages_needed[i]]
        next_page += pages_needed[i]
        page_indices[i, :len(own)] = own
        for p in range(kv_len):
            k_pages[own[p // page_size], p % page_size] = rng.normal(size=(num_kv_heads, head_dim))
            v_pages[own[p // page_size], p % page_size] = rng.normal(size=(num_kv_heads, head_dim))
        kv_lens[i] = kv_len
        cu_q_lens[i + 1] = cu_q_lens[i] + q_len
    cu_q_lens[len(seqs) + 1:] = cu_q_lens[len(seqs)]
    assert cu_q_lens[-1] <= num_tokens
    q = rng.normal(size=(num_tokens, num_q_heads, head_dim)).astype(np.float32)
    cast = lambda a: np.asarray(jnp.asarray(a, dtype))  # noqa: E731 (bf16 via jnp)
    return Batch(cast(q), cast(k_pages), cast(v_pages), kv_lens, page_indices, cu_q_lens,
                 np.array([len(seqs)], np.int32))


def dense_oracle(batch: Batch, sm_scale: float) -> np.ndarray:
    """Per-sequence dense causal attention in float64, gathering each history whole."""
    q = np.asarray(batch.q, np.float64)
    k_pages = np.asarray(batch.k_pages, np.float64)
    v_pages = np.asarray(batch.v_pages, np.float64)
    num_q_heads, page_size, num_kv_heads = q.shape[1], k_pages.shape[1], k_pages.shape[2]
    group = num_q_heads // num_kv_heads
    out = np.zeros_like(q)
    for i in range(int(batch.num_seqs[0])):
        start, end, kv_len = batch.cu_q_lens[i], batch.cu_q_lens[i + 1], batch.kv_lens[i]
        if end == start:
            continue
        pos = np.arange(kv_len)
        pages = batch.page_indices[i, pos // page_size]
        k = k_pages[pages, pos % page_size]  # [kv_len, num_kv_heads, head_dim]
        v = v_pages[pages, pos % page_size]
        q_pos = kv_len - (end - start) + np.arange(end - start)
        for h in range(num_q_heads):
            s = q[start:end, h] @ k[:, h // group].T * sm_scale
            s = np.where(pos[None, :] <= q_pos[:, None], s, -np.inf)
            p = np.exp(s - s.max(axis=-1, keepdims=True))
            out[start:end, h] = (p / p.sum(axis=-1, keepdims=True)) @ v[:, h // group]
    return out


# name: (real sequences as (q_len, kv_len), bucket (S, T)). Most cases share one bucket,
# so a configuration compiles twice, not once per case.
BUCKET = (8, 64)
CASES = {
    "decode_only_exact_bucket": ([(1, 5), (1, 33), (1, 17), (1, 64)], (4, 4)),
    "decode_only": ([(1, 1), (1, 16), (1, 17), (1, 64), (1, 9)], BUCKET),
    "prefill_only": ([(20, 20), (9, 9), (33, 33)], BUCKET),
    "mixed": ([(1, 40), (13, 13), (1, 7), (6, 6), (1, 63)], BUCKET),
    "chunk_of_half_done_prefill": ([(10, 30), (1, 50), (16, 48)], BUCKET),
    "num_seqs_below_padded_s_and_padded_t": ([(3, 3), (1, 20)], BUCKET),
    "empty_sequences": ([(0, 0), (4, 4), (0, 12), (1, 12), (0, 3)], BUCKET),
    "full_bucket": ([(8, 8)] * 4 + [(8, 24)] * 2 + [(15, 15), (1, 2)], BUCKET),
}
# GQA groups 1, 4 and 8 (query heads per KV head).
HEADS = {"mha": (4, 4), "gqa": (4, 2), "mqa": (4, 1), "g4": (8, 2), "g8": (8, 1)}
NUM_PAGES = 48  # one pool size for every case, so shapes repeat


def _tolerance(dtype) -> float:
    return 1e-5 if dtype == np.float32 else 2e-2


def _assert_valid_rows_close(actual: jax.Array, expected: np.ndarray, batch: Batch, dtype,
                             msg: str = ""):
    n = batch.num_real_tokens
    np.testing.assert_allclose(np.asarray(actual, np.float64)[:n], expected[:n],
                               atol=_tolerance(dtype), rtol=_tolerance(dtype), err_msg=msg)


def _case_batches(heads: str, page_size: int, dtype, seed: int = 0):
    num_q_heads, num_kv_heads = HEADS[heads]
    for name, (seqs, (num_slots, num_tokens)) in CASES.items():
        yield name, make_batch(seqs, num_slots=num_slots, num_tokens=num_tokens,
                               num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                               page_size=page_size, pages_per_seq=64 // page_size,
                               dtype=dtype, seed=seed, num_pages=NUM_PAGES)


# Every pair of a head layout, a page size and a dtype once (6 cases, not the 12 of the
# full product): the layout picks the KV heads a query head reads, the page size the
# gather, the dtype the tolerance; no code path depends on all three together.
@pytest.mark.parametrize("heads, page_size, dtype", [
    ("mha", 8, np.float32), ("mha", 16, jnp.bfloat16), ("gqa", 8, jnp.bfloat16),
    ("gqa", 16, np.float32), ("mqa", 8, np.float32), ("mqa", 16, jnp.bfloat16),
], ids=["mha-8-f32", "mha-16-bf16", "gqa-8-bf16", "gqa-16-f32", "mqa-8-f32", "mqa-16-bf16"])
def test_reference_matches_dense_oracle(heads, page_size, dtype):
    for name, batch in _case_batches(heads, page_size, dtype):
        out = ragged_paged_attention_reference(*batch.args(), sm_scale=0.3)
        assert out.shape == batch.q.shape and out.dtype == batch.q.dtype
        _assert_valid_rows_close(out, dense_oracle(batch, 0.3), batch, dtype, name)
        # Padding rows are documented as zeros, whatever the cache holds.
        assert np.all(np.asarray(out, np.float32)[batch.num_real_tokens:] == 0.0), name


def test_reference_head_dim_64_and_scrambled_pages_across_seeds():
    for seed in range(3):
        batch = make_batch([(7, 19), (1, 30), (12, 12)], num_slots=4, num_tokens=32,
                           num_q_heads=8, num_kv_heads=2, head_dim=64, seed=seed)
        out = ragged_paged_attention_reference(*batch.args(), sm_scale=64 ** -0.5)
        _assert_valid_rows_close(out, dense_oracle(batch, 64 ** -0.5), batch, np.float32)


def test_reference_does_not_recompile_for_new_counts():
    batches = [make_batch([(3, 10), (1, 20)], num_slots=4, num_tokens=16, num_pages=12, seed=1),
               make_batch([(9, 9), (1, 5), (2, 30)], num_slots=4, num_tokens=16, num_pages=12,
                          seed=2)]
    traced = jax.jit(lambda *a: ragged_paged_attention_reference(*a, sm_scale=0.5))
    for batch in batches:
        _assert_valid_rows_close(traced(*batch.args()), dense_oracle(batch, 0.5), batch,
                                 np.float32)
    assert traced._cache_size() == 1


def test_reference_rejects_bad_shapes_by_name():
    batch = make_batch([(2, 2)], num_slots=2, num_tokens=4)
    args = list(batch.args())
    args[4] = args[4][:, :, None]  # page_indices
    with pytest.raises(ValueError, match="page_indices"):
        ragged_paged_attention_reference(*args, sm_scale=1.0)
    args = list(batch.args())
    args[5] = args[5][:-1]  # cu_q_lens
    with pytest.raises(ValueError, match=r"cu_q_lens must have shape \(3,\)"):
        ragged_paged_attention_reference(*args, sm_scale=1.0)
    args = list(batch.args())
    args[3] = args[3].astype(jnp.float32)  # kv_lens
    with pytest.raises(ValueError, match="kv_lens must be int32"):
        ragged_paged_attention_reference(*args, sm_scale=1.0)


# --- the Pallas kernel, in interpret mode, against the reference -------------------------


def _assert_kernel_matches_reference(batch: Batch, dtype, config=None, msg: str = ""):
    args = batch.args()
    expected = ragged_paged_attention_reference(*args, sm_scale=0.3)
    out = ragged_paged_attention(*args, sm_scale=0.3, config=config, interpret=True)
    assert out.shape == batch.q.shape and out.dtype == batch.q.dtype
    _assert_valid_rows_close(out, np.asarray(expected, np.float64), batch, dtype, msg)
    assert np.all(np.asarray(out, np.float32)[batch.num_real_tokens:] == 0.0), msg


# Kernel compiles dominate the run time (two passes per bucket), so each GQA group meets
# each page size, dtype and tile choice across the list rather than in a full product.
# head_dim 32 takes the tables' 128-token (bf16) or 64-token (f32) KV tile, one tile for
# these 64-token contexts; block_kv=16 walks 4 tiles of 1 or 2 pages.
KERNEL_GRID = {
    "g1-p8-f32-tables": ("mha", 8, np.float32, None),
    "g4-p16-bf16-tables": ("g4", 16, jnp.bfloat16, None),
    "g8-p32-f32-tables": ("g8", 32, np.float32, None),
    "g1-p16-bf16-kv16": ("mha", 16, jnp.bfloat16, RaggedAttentionConfig(block_kv=16)),
    "g4-p8-f32-kv16": ("g4", 8, np.float32, RaggedAttentionConfig(block_kv=16)),
    "g8-p8-bf16-kv32-bq2": ("g8", 8, jnp.bfloat16, RaggedAttentionConfig(block_kv=32, block_q=2)),
    "g4-p32-bf16-one-pass": ("g4", 32, jnp.bfloat16, RaggedAttentionConfig(decode_pass=False)),
}


@pytest.mark.parametrize("heads, page_size, dtype, config", list(KERNEL_GRID.values()),
                         ids=list(KERNEL_GRID))
def test_kernel_matches_reference(heads, page_size, dtype, config):
    for name, batch in _case_batches(heads, page_size, dtype, seed=3):
        _assert_kernel_matches_reference(batch, dtype, config, msg=name)


@pytest.mark.parametrize("heads, page_size, dtype, config", [
    ("g4", 8, np.float32, RaggedAttentionConfig(num_kv_splits=4, block_kv=16)),
    ("g8", 16, jnp.bfloat16, RaggedAttentionConfig(num_kv_splits=2, block_kv=16)),
], ids=["g4-p8-f32-split4", "g8-p16-bf16-split2"])
def test_split_kv_kernel_matches_reference(heads, page_size, dtype, config):
    # Forced splits divide every context evenly: 4 tiles of 16 over 4 splits, so the
    # merge of partial (o, m, l) is exercised, empty splits included.
    for name, batch in _case_batches(heads, page_size, dtype, seed=4):
        if name in ("decode_only", "mixed", "chunk_of_half_done_prefill", "empty_sequences"):
            _assert_kernel_matches_reference(batch, dtype, config, name)


@hypothesis.settings(max_examples=6, deadline=None, derandomize=True)
@hypothesis.given(
    seqs=st.lists(st.integers(0, 40).flatmap(
        lambda kv: st.tuples(st.integers(0 if kv == 0 else 1, min(kv, 12)), st.just(kv))),
        min_size=1, max_size=6),
    splits=st.sampled_from([1, 2]),
    seed=st.integers(0, 2 ** 16))
def test_kernel_matches_reference_on_random_ragged_batches(seqs, splits, seed):
    # One bucket for every example (S=6, T=72, 48 pages), so only the counts vary.
    batch = make_batch(seqs, num_slots=6, num_tokens=72, num_q_heads=8, num_kv_heads=2,
                       page_size=8, pages_per_seq=8, seed=seed, num_pages=NUM_PAGES)
    _assert_kernel_matches_reference(batch, np.float32,
                                     RaggedAttentionConfig(num_kv_splits=splits, block_kv=16))


def test_kernel_does_not_recompile_for_new_counts():
    batches = [make_batch([(3, 10), (1, 20)], num_slots=4, num_tokens=16, num_pages=12, seed=1),
               make_batch([(9, 9), (1, 5), (2, 30)], num_slots=4, num_tokens=16, num_pages=12,
                          seed=2)]
    traced = jax.jit(lambda *a: ragged_paged_attention(*a, sm_scale=0.5, interpret=True))
    for batch in batches:
        _assert_valid_rows_close(traced(*batch.args()), dense_oracle(batch, 0.5), batch,
                                 np.float32)
    assert traced._cache_size() == 1


def test_kernel_output_ignores_nan_in_the_cache_past_each_sequence():
    # make_batch fills every unowned slot with NaN; a long tile (128 tokens over 32-token
    # contexts) reads mostly NaN slots, which the masked loads must replace by zeros.
    batch = make_batch([(1, 3), (2, 17), (5, 5)], num_slots=4, num_tokens=8, page_size=8,
                       pages_per_seq=4, num_pages=12, seed=5)
    out = ragged_paged_attention(*batch.args(), sm_scale=0.5, interpret=True,
                                 config=RaggedAttentionConfig(block_kv=128))
    assert np.isfinite(np.asarray(out)).all()
    _assert_valid_rows_close(out, dense_oracle(batch, 0.5), batch, np.float32)


@pytest.mark.parametrize("field, value", [("block_q", 3), ("block_kv", 8), ("block_kv", 24),
                                          ("num_kv_splits", 0), ("num_warps", 0),
                                          ("num_stages", -1)])
def test_config_rejects_bad_knobs_by_name(field, value):
    with pytest.raises(ValueError, match=f"RaggedAttentionConfig.{field}"):
        RaggedAttentionConfig(**{field: value})


def test_kernel_rejects_untileable_head_layouts():
    batch = make_batch([(2, 2)], num_slots=2, num_tokens=4, num_q_heads=6, num_kv_heads=2)
    with pytest.raises(ValueError, match="power of two, got 6 // 2 = 3"):
        ragged_paged_attention(*batch.args(), sm_scale=1.0, interpret=True)
    batch = make_batch([(2, 2)], num_slots=2, num_tokens=4, num_q_heads=2, num_kv_heads=2)
    with pytest.raises(ValueError, match=r"RaggedAttentionConfig.block_q: block_q \(4\) \* "
                                         r"group \(1\) = 4 rows"):
        ragged_paged_attention(*batch.args(), sm_scale=1.0, interpret=True,
                               config=RaggedAttentionConfig(block_q=4))
    with pytest.raises(ValueError, match=r"block_q \(256\) \* group \(1\) = 256 rows"):
        ragged_paged_attention(*batch.args(), sm_scale=1.0, interpret=True,
                               config=RaggedAttentionConfig(block_q=256))
    # The reference has no tiling constraints: the same layout works there.
    batch = make_batch([(2, 3)], num_slots=2, num_tokens=4, num_q_heads=6, num_kv_heads=2)
    _assert_valid_rows_close(ragged_paged_attention_reference(*batch.args(), sm_scale=1.0),
                             dense_oracle(batch, 1.0), batch, np.float32)


def test_kernel_rejects_a_non_power_of_two_page_size():
    batch = make_batch([(2, 2)], num_slots=2, num_tokens=4, page_size=12, pages_per_seq=2)
    with pytest.raises(ValueError, match=r"power-of-two page size \(k_pages.shape\[1\]\), "
                                         "got 12"):
        ragged_paged_attention(*batch.args(), sm_scale=1.0, interpret=True)


def test_plan_passes_is_what_the_kernel_launches():
    # The plan for the test bucket: decode tiles of 16 // 4 = 4 tokens; a prefill sequence
    # has >= 5 tokens, so at most 64 // 5 = 12 of them, in 64 // 4 = 16-token tiles.
    plan = plan_passes(num_tokens=64, num_slots=8, num_q_heads=8, num_kv_heads=2, head_dim=32,
                       page_size=8, pages_per_seq=8, itemsize=4)
    assert (plan.decode.block_q, plan.decode.rows, plan.decode.max_work) == (4, 16, 8)
    assert (plan.prefill.block_q, plan.prefill.rows) == (16, 64)
    assert plan.prefill.max_work == min(64, (64 + 8 * 15) // 16)
