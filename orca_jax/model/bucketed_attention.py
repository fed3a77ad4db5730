"""Ragged paged attention for CPUs: vectorized, sized by the step's longest real context.

The jnp reference (`pallas_kernels.ragged_paged_attention_reference`) loops over
sequences and KV blocks with traced counts, so a decode step pays one `lax` loop
iteration per sequence per block per layer: on a CPU its cost is loop overhead,
not arithmetic. Here every query of the step attends at once. Its rows are cut
into query blocks (one row per block in a decode bucket, up to 16 rows of one
sequence otherwise); one loop iteration reads a 128-token KV chunk of every
block's sequence (one gather per block, KV-head-major so that neither product
transposes K; masked causally per row, online softmax in fp32), and the step
runs ceil(longest kv_len / 128) iterations: sized by the step's longest real
context, never by the number of sequences. One compiled program per step bucket
(no variants); the count is a traced value, so a new context length never
compiles.

On a CPU its cost is the gathers and the many small products, not FLOPs: per
CPU-second it does about what the reference does (`benchmarks/engine_step.py`
prints both), and it is faster on the wall clock because its ops are large
enough for XLA to split over the cores, where the reference's are not.

The reference stays the Pallas kernel's oracle; this op is tested against it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["KV_CHUNK_TOKENS", "bucketed_attention", "kv_chunk_pages", "query_block"]

# Tokens of KV each loop iteration reads for every query block: a step runs
# ceil(longest context / this) iterations, whatever its number of sequences.
KV_CHUNK_TOKENS = 128
# Finite, so a fully masked row gives exp(0) instead of NaN; masked weights are zeroed too.
_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def kv_chunk_pages(page_size: int) -> int:
    """Pages per KV chunk: `KV_CHUNK_TOKENS` worth, at least one page."""
    if page_size < 1:
        raise ValueError(f"kv_chunk_pages: page_size={page_size} must be >= 1")
    return max(1, KV_CHUNK_TOKENS // page_size)


def query_block(num_tokens: int, num_slots: int) -> int:
    """Query rows per block: 1 in a decode bucket (a token per sequence), else 16."""
    return 1 if num_tokens <= num_slots else 16


def _attend_chunks(sm_scale: float, chunk_pages: int,
                   num_chunks: jax.Array,  # [] int32 KV chunks covering the longest context
                   q: jax.Array,  # [B, block_q, num_kv_heads, group, head_dim] fp32
                   k_pages: jax.Array,  # [num_pages, page_size, num_kv_heads, head_dim]
                   v_pages: jax.Array,  # [num_pages, page_size, num_kv_heads, head_dim]
                   block_pages: jax.Array,  # [B, chunks * chunk_pages] int32 page rows
                   q_pos: jax.Array,  # [B, block_q] int32 absolute position of each query
                   valid: jax.Array,  # [B, block_q] bool, False on padding rows
                   ) -> jax.Array:  # [B, block_q, num_kv_heads, group, head_dim] fp32
    """Every query block against its sequence's pages, one KV chunk of all blocks at a
    time (online softmax in fp32), for `num_chunks` chunks only."""
    num_blocks, block_q, num_kv_heads, group, head_dim = q.shape
    length = chunk_pages * k_pages.shape[1]
    hi = lax.Precision.HIGHEST
    chunk_pos = jnp.arange(length, dtype=jnp.int32)
    # Heads first, a block's rows x the KV head's query heads as one matrix (m = row * G + g):
    # each (block, KV head) is then one [m, D] x [D, L] product.
    rows_q = q.transpose(0, 2, 1, 3, 4).reshape(num_blocks, num_kv_heads, -1, head_dim)
    row_pos = jnp.repeat(q_pos, group, axis=1)[:, None, :, None]  # [B, 1, m, 1]
    row_ok = jnp.repeat(valid, group, axis=1)[:, None, :, None]  # [B, 1, m, 1]

    heads = jnp.arange(num_kv_heads, dtype=jnp.int32)[None, :, None]  # [1, Hkv, 1]

    def body(chunk, carry):
        top, total, acc = carry  # [B, Hkv, m], same, [B, Hkv, m, D]
        rows = lax.dynamic_slice_in_dim(block_pages, chunk * chunk_pages, chunk_pages, axis=1)
        # One gather per block and KV head (not per token): a prefill chunk's 16 rows share
        # their K/V. Gathered head-major, [B, Hkv, L, D], each head's tokens are the rows of
        # a matrix the dots read as they lie; a gather of whole pages, [B, L, Hkv, D], made
        # XLA transpose K into [B, Hkv, D, L] for the product: ~3x the gather's time.
        k = k_pages[rows[:, None, :], :, heads].reshape(num_blocks, num_kv_heads, length,
                                                        head_dim)
        v = v_pages[rows[:, None, :], :, heads].reshape(num_blocks, num_kv_heads, length,
                                                        head_dim)
        # K on the left ([L, D] x [D, m]): its contracted dim is minor, so no transpose.
        scores = jnp.einsum("bkld,bkmd->bkml", k.astype(jnp.float32), rows_q, precision=hi)
        mask = ((chunk * length + chunk_pos) <= row_pos) & row_ok  # [B, 1, m, L]
        scores = jnp.where(mask, scores * sm_scale, _MASK_VALUE)
        new_top = jnp.maximum(top, scores.max(axis=-1))
        weights = jnp.where(mask, jnp.exp(scores - new_top[..., None]), 0.0)
        rescale = jnp.exp(top - new_top)
        acc = acc * rescale[..., None] + jnp.einsum("bkml,bkld->bkmd", weights,
                                                    v.astype(jnp.float32), precision=hi)
        return new_top, total * rescale + weights.sum(axis=-1), acc

    init = (jnp.full(rows_q.shape[:-1], _MASK_VALUE, jnp.float32),
            jnp.zeros(rows_q.shape[:-1], jnp.float32), jnp.zeros(rows_q.shape, jnp.float32))
    _, total, acc = lax.fori_loop(0, num_chunks, body, init)
    total = total[..., None]  # 0 on padding rows
    out = jnp.where(total > 0, acc / jnp.where(total > 0, total, 1.0), 0.0)
    return out.reshape(num_blocks, num_kv_heads, block_q, group, head_dim).transpose(0, 2, 1, 3, 4)


def bucketed_attention(
    q: jax.Array,  # [T, num_q_heads, head_dim]
    k_pages: jax.Array,  # [num_pages, page_size, num_kv_heads, head_dim]
    v_pages: jax.Array,  # [num_pages, page_size, num_kv_heads, head_dim]
    kv_lens: jax.Array,  # [S] int32
    page_indices: jax.Array,  # [S, pages_per_seq] int32
    cu_q_lens: jax.Array,  # [S+1] int32
    num_seqs: jax.Array,  # [1] int32
    *,
    sm_scale: float,
) -> jax.Array:  # [T, num_q_heads, head_dim]
    """Ragged paged attention with `ragged_paged_attention_reference`'s contract: the
    same arguments and result (`[T, num_q_heads, head_dim]` in q's dtype, padding rows
    zeros), computed by query blocks against the step's KV chunks (module docstring).
    """
    num_tokens, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_pages.shape
    num_slots, pages_per_seq = page_indices.shape
    real_seq = jnp.arange(num_slots) < num_seqs[0]
    longest = jnp.max(jnp.where(real_seq, kv_lens, 0))
    needed_pages = (longest + page_size - 1) // page_size
    # Query blocks: sequence i's q_len rows split into ceil(q_len / block_q) blocks. Every
    # real sequence has a row, so sum(ceil(q_len_i / block_q)) <= S + (T - S) // block_q.
    block_q = query_block(num_tokens, num_slots)
    num_blocks = num_slots + max(num_tokens - num_slots, 0) // block_q
    q_lens = jnp.where(real_seq, cu_q_lens[1:] - cu_q_lens[:-1], 0)
    cu_blocks = jnp.cumsum((q_lens + block_q - 1) // block_q)  # [S] blocks up to seq i
    b = jnp.arange(num_blocks, dtype=jnp.int32)
    # compare_all: S is small, and the default binary search is a loop of tiny ops.
    seq = jnp.minimum(jnp.searchsorted(cu_blocks, b, side="right", method="compare_all"),
                      num_slots - 1)  # [B] sequence of each block
    first_block = cu_blocks[seq] - (q_lens[seq] + block_q - 1) // block_q
    local = (b - first_block)[:, None] * block_q + jnp.arange(block_q)  # [B, block_q]
    valid = (local < q_lens[seq][:, None]) & (b < cu_blocks[-1])[:, None]
    row = jnp.where(valid, cu_q_lens[seq][:, None] + local, num_tokens)  # padding: row T
    q_pos = (kv_lens[seq] - q_lens[seq])[:, None] + local
    group = num_q_heads // num_kv_heads
    q_rows = jnp.pad(q.astype(jnp.float32).reshape(num_tokens, num_kv_heads, group, head_dim),
                     ((0, 1), (0, 0), (0, 0), (0, 0)))  # row T: zeros for padding slots
    chunk_pages = kv_chunk_pages(page_size)
    num_chunks = (needed_pages + chunk_pages - 1) // chunk_pages
    total_chunks = -(-pages_per_seq // chunk_pages)
    table = jnp.pad(page_indices, ((0, 0), (0, total_chunks * chunk_pages - pages_per_seq)))
    out = _attend_chunks(float(sm_scale), chunk_pages, num_chunks, q_rows[row], k_pages,
                         v_pages, table[seq], q_pos, valid)
    # Each real row sits in exactly one block; padding slots scatter to the dropped row T.
    flat = jnp.zeros((num_tokens + 1, num_kv_heads, group, head_dim), jnp.float32)
    flat = flat.at[row.reshape(-1)].set(out.reshape(-1, num_kv_heads, group, head_dim))
    return flat[:num_tokens].reshape(q.shape).astype(q.dtype)
