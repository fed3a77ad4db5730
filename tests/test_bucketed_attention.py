"""The bucketed CPU attention op against the ragged jnp reference (the kernel's oracle)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from orca_jax.model.bucketed_attention import bucketed_attention, kv_chunk_pages
from pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference

PAGE_SIZE, PAGES_PER_SEQ, NUM_PAGES = 4, 64, 300
NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = 4, 2, 16


def test_kv_chunks_are_128_tokens_of_whole_pages():
    assert kv_chunk_pages(16) == 8 and kv_chunk_pages(4) == 32
    assert kv_chunk_pages(256) == 1  # a page larger than a chunk: one page at a time
    with pytest.raises(ValueError, match="page_size=0"):
        kv_chunk_pages(0)


def _case(rng, q_lens, kv_lens, num_tokens, num_slots):
    cu = np.zeros(num_slots + 1, np.int32)
    cu[1:len(q_lens) + 1] = np.cumsum(q_lens)
    cu[len(q_lens) + 1:] = cu[len(q_lens)]
    kv = np.zeros(num_slots, np.int32)
    kv[:len(kv_lens)] = kv_lens
    table = rng.integers(1, NUM_PAGES, (num_slots, PAGES_PER_SEQ)).astype(np.int32)
    q = rng.normal(size=(num_tokens, NUM_Q_HEADS, HEAD_DIM)).astype(np.float32)
    return (jnp.asarray(q), jnp.asarray(kv), jnp.asarray(table), jnp.asarray(cu),
            jnp.asarray([len(q_lens)], jnp.int32))


@pytest.mark.parametrize("q_lens, kv_lens, num_tokens, num_slots", [
    ([1] * 16, [3, 70, 129, 256, 1, 40, 64, 65, 100, 200, 9, 17, 33, 250, 5, 128], 16, 16),
    ([3, 1, 5], [10, 100, 5], 16, 4),  # mixed, padding rows and padding sequences
    ([64, 1], [64, 200], 128, 4),  # prefill beside a long decode, query chunks
    ([128], [256], 128, 2),  # a chunk of a long prompt: the whole page table, two KV chunks
    ([2, 2], [2, 2], 8, 8),  # short contexts: one KV chunk
])
def test_matches_the_ragged_reference(q_lens, kv_lens, num_tokens, num_slots):
    rng = np.random.default_rng(sum(kv_lens))
    k_pages, v_pages = (jnp.asarray(rng.normal(size=(NUM_PAGES, PAGE_SIZE, NUM_KV_HEADS,
                                                     HEAD_DIM)).astype(np.float32))
                        for _ in range(2))
    q, kv, table, cu, num_seqs = _case(rng, q_lens, kv_lens, num_tokens, num_slots)
    args = (q, k_pages, v_pages, kv, table, cu, num_seqs)
    want = ragged_paged_attention_reference(*args, sm_scale=HEAD_DIM ** -0.5)
    got = jax.jit(bucketed_attention, static_argnames="sm_scale")(*args,
                                                                  sm_scale=HEAD_DIM ** -0.5)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)
    assert not np.asarray(got)[sum(q_lens):].any()  # padding rows are zeros
