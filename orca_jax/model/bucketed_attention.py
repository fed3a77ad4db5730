"""Ragged paged attention for CPUs: vectorized, sized by the step's longest real context.

The jnp reference (`pallas_kernels.ragged_paged_attention_reference`) loops over
sequences and KV blocks with traced counts, so a decode step pays one `lax` loop
iteration per sequence per block per layer: on a CPU its cost is loop overhead,
not arithmetic. Here every query token attends at once: each token gathers its
own sequence's pages up to a *context bucket* (a power-of-two number of pages
that covers the step's longest `kv_len`), masked causally per token, one softmax
in fp32. The widths are a short static list (`kv_bucket_pages`); the step picks
one with `lax.switch` off the traced `kv_lens`, so one compiled program per
step bucket holds every width (a bounded number of variants, none compiled at
run time) and only the chosen width runs.

The reference stays the Pallas kernel's oracle; this op is tested against it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["MIN_KV_BUCKET_TOKENS", "bucketed_attention", "kv_bucket_pages"]

MIN_KV_BUCKET_TOKENS = 64  # the narrowest context bucket: below it the step is not attention-bound
# Bytes of gathered K (or V) per query chunk: a prefill bucket's tokens x a long context
# would otherwise materialise T x L x heads x head_dim at once.
_CHUNK_BYTES = 4 << 20
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


def _query_chunk(num_tokens: int, row_bytes: int) -> int:
    """Largest power-of-two divisor of `num_tokens` whose gathered K fits `_CHUNK_BYTES`."""
    chunk = 1
    while (num_tokens % (chunk * 2) == 0 and chunk * 2 <= num_tokens
           and chunk * 2 * row_bytes <= _CHUNK_BYTES):
        chunk *= 2
    return chunk


def _attend_width(width: int, sm_scale: float,
                  q: jax.Array,  # [T, num_kv_heads, group, head_dim] fp32
                  k_pages: jax.Array,  # [num_pages, page_size, num_kv_heads, head_dim]
                  v_pages: jax.Array,  # [num_pages, page_size, num_kv_heads, head_dim]
                  token_pages: jax.Array,  # [T, pages_per_seq] int32 each token's page row
                  q_pos: jax.Array,  # [T] int32 absolute position of each query
                  valid: jax.Array,  # [T] bool, False on padding rows
                  ) -> jax.Array:  # [T, num_kv_heads, group, head_dim] fp32
    """Every token against the first `width` pages of its own sequence, causally masked."""
    num_tokens, num_kv_heads, group, head_dim = q.shape
    page_size = k_pages.shape[1]
    length = width * page_size
    chunk = _query_chunk(num_tokens, length * num_kv_heads * head_dim * 4)
    hi = lax.Precision.HIGHEST
    kv_pos = jnp.arange(length, dtype=jnp.int32)

    def attend_chunk(args):
        qc, rows, pos, ok = args  # [C, Hkv, G, D], [C, width], [C], [C]
        k = k_pages[rows].reshape(chunk, length, num_kv_heads, head_dim).astype(jnp.float32)
        v = v_pages[rows].reshape(chunk, length, num_kv_heads, head_dim).astype(jnp.float32)
        scores = jnp.einsum("ckgd,clkd->ckgl", qc, k, precision=hi) * sm_scale
        mask = ((kv_pos[None, :] <= pos[:, None]) & ok[:, None])[:, None, None, :]  # [C,1,1,L]
        scores = jnp.where(mask, scores, _MASK_VALUE)
        weights = jnp.where(mask, jnp.exp(scores - scores.max(axis=-1, keepdims=True)), 0.0)
        denom = weights.sum(axis=-1)[..., None]  # [C, Hkv, G, 1]; 0 on padding rows
        out = jnp.einsum("ckgl,clkd->ckgd", weights, v, precision=hi)
        return jnp.where(denom > 0, out / jnp.where(denom > 0, denom, 1.0), 0.0)

    rows = token_pages[:, :width]
    if chunk == num_tokens:
        return attend_chunk((q, rows, q_pos, valid))
    n = num_tokens // chunk
    split = lambda a: a.reshape(n, chunk, *a.shape[1:])  # noqa: E731
    out = lax.map(attend_chunk, (split(q), split(rows), split(q_pos), split(valid)))
    return out.reshape(q.shape)


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
    # Token t belongs to sequence i when cu_q_lens[i] <= t < cu_q_lens[i + 1].
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(cu_q_lens[1:], t, side="right"), num_slots - 1)
    q_start = cu_q_lens[seq]
    q_pos = kv_lens[seq] - (cu_q_lens[seq + 1] - q_start) + (t - q_start)
    valid = t < cu_q_lens[num_seqs[0]]
    q4 = q.astype(jnp.float32).reshape(num_tokens, num_kv_heads,
                                       num_q_heads // num_kv_heads, head_dim)
    branches = [functools.partial(_attend_width, w, float(sm_scale)) for w in widths]
    out = lax.switch(jnp.minimum(branch, len(widths) - 1), branches,
                     q4, k_pages, v_pages, page_indices[seq], q_pos, valid)
    return out.reshape(q.shape).astype(q.dtype)
