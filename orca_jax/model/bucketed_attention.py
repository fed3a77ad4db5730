"""Ragged paged attention for CPUs: vectorized, sized by the step's longest real context.

The jnp reference (`pallas_kernels.ragged_paged_attention_reference`) loops over
sequences and KV blocks with traced counts, so a decode step pays one `lax` loop
iteration per sequence per block per layer: on a CPU its cost is loop overhead,
not arithmetic. Here every query attends at once. The step's rows are cut into
query blocks (one row per block in a decode bucket, 16 rows of one sequence
otherwise), each block gathers its sequence's pages up to a *context bucket* (a
power-of-two number of pages covering the step's longest `kv_len`), masked
causally per row, one softmax in fp32. The widths are a short static list
(`kv_bucket_pages`); the op picks one with `lax.switch` off the traced `kv_lens`,
so one compiled program per step bucket holds every width (a bounded number of
variants, none compiled at run time) and only the chosen width runs.

The reference stays the Pallas kernel's oracle; this op is tested against it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["MIN_KV_BUCKET_TOKENS", "bucketed_attention", "kv_bucket_pages", "query_block"]

MIN_KV_BUCKET_TOKENS = 64  # the narrowest context bucket: below it the step is not attention-bound
# Finite, so a fully masked row gives exp(0) instead of NaN; masked weights are zeroed too.
_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def kv_bucket_pages(page_size: int, pages_per_seq: int) -> tuple[int, ...]:
    """Page counts of the context buckets: powers of two from `MIN_KV_BUCKET_TOKENS`
    worth of pages, doubling, the last one the full page-table width.

    Args:
      page_size: tokens per page.
      pages_per_seq: the page-table width (the longest context's pages).

    Returns:
      Increasing page counts; at most `log2(pages_per_seq) + 1` of them.
    """
    if page_size < 1 or pages_per_seq < 1:
        raise ValueError(f"kv_bucket_pages: page_size={page_size} and pages_per_seq="
                         f"{pages_per_seq} must be >= 1")
    width = 1
    while width * page_size < MIN_KV_BUCKET_TOKENS:
        width *= 2
    widths = []
    while width < pages_per_seq:
        widths.append(width)
        width *= 2
    return (*widths, pages_per_seq)


def query_block(num_tokens: int, num_slots: int) -> int:
    """Query rows per block: 1 in a decode bucket (a token per sequence), else 16."""
    return 1 if num_tokens <= num_slots else 16


def _attend_width(width: int, sm_scale: float,
                  q: jax.Array,  # [B, block_q, num_kv_heads, group, head_dim] fp32
                  k_pages: jax.Array,  # [num_pages, page_size, num_kv_heads, head_dim]
                  v_pages: jax.Array,  # [num_pages, page_size, num_kv_heads, head_dim]
                  block_pages: jax.Array,  # [B, pages_per_seq] int32 each block's page row
                  q_pos: jax.Array,  # [B, block_q] int32 absolute position of each query
                  valid: jax.Array,  # [B, block_q] bool, False on padding rows
                  ) -> jax.Array:  # [B, block_q, num_kv_heads, group, head_dim] fp32
    """Each query block against the first `width` pages of its sequence, causally masked."""
    num_blocks, _, num_kv_heads, _, head_dim = q.shape
    length = width * k_pages.shape[1]
    hi = lax.Precision.HIGHEST
    rows = block_pages[:, :width]
    # One gather per block (not per token): a prefill chunk's 16 rows share their K/V.
    k = k_pages[rows].reshape(num_blocks, length, num_kv_heads, head_dim).astype(jnp.float32)
    v = v_pages[rows].reshape(num_blocks, length, num_kv_heads, head_dim).astype(jnp.float32)
    scores = jnp.einsum("bqkgd,blkd->bqkgl", q, k, precision=hi) * sm_scale
    kv_pos = jnp.arange(length, dtype=jnp.int32)
    mask = ((kv_pos <= q_pos[..., None]) & valid[..., None])[:, :, None, None, :]
    scores = jnp.where(mask, scores, _MASK_VALUE)
    weights = jnp.where(mask, jnp.exp(scores - scores.max(axis=-1, keepdims=True)), 0.0)
    denom = weights.sum(axis=-1)[..., None]  # [B, block_q, Hkv, G, 1]; 0 on padding rows
    out = jnp.einsum("bqkgl,blkd->bqkgd", weights, v, precision=hi)
    return jnp.where(denom > 0, out / jnp.where(denom > 0, denom, 1.0), 0.0)


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
    """Ragged paged attention with `ragged_paged_attention_reference`'s contract.

    Args:
      q: flat queries of all sequences, `[T, num_q_heads, head_dim]`.
      k_pages: key cache, `[num_pages, page_size, num_kv_heads, head_dim]`.
      v_pages: value cache, same shape as `k_pages`.
      kv_lens: `[S]` cached tokens of each sequence, this step's included.
      page_indices: `[S, pages_per_seq]` pages of each sequence, in order.
      cu_q_lens: `[S+1]` query offsets; padded sequences repeat the last one.
      num_seqs: `[1]` number of real sequences.
      sm_scale: softmax scale (usually `head_dim ** -0.5`).

    Returns:
      `[T, num_q_heads, head_dim]` in q's dtype; padding rows are zeros.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_pages.shape
    num_slots, pages_per_seq = page_indices.shape
    widths = kv_bucket_pages(page_size, pages_per_seq)
    real_seq = jnp.arange(num_slots) < num_seqs[0]
    longest = jnp.max(jnp.where(real_seq, kv_lens, 0))
    needed_pages = (longest + page_size - 1) // page_size
    branch = jnp.sum(jnp.asarray(widths, jnp.int32) < needed_pages)  # first width that covers it
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
    branches = [functools.partial(_attend_width, w, float(sm_scale)) for w in widths]
    out = lax.switch(jnp.minimum(branch, len(widths) - 1), branches,
                     q_rows[row], k_pages, v_pages, page_indices[seq], q_pos, valid)
    # Each real row sits in exactly one block; padding slots scatter to the dropped row T.
    flat = jnp.zeros((num_tokens + 1, num_kv_heads, group, head_dim), jnp.float32)
    flat = flat.at[row.reshape(-1)].set(out.reshape(-1, num_kv_heads, group, head_dim))
    return flat[:num_tokens].reshape(q.shape).astype(q.dtype)
