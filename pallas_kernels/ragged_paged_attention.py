"""Ragged paged attention for mixed prefill + decode steps: Pallas kernel and jnp reference.

One step's queries are a flat stack of many sequences' tokens. Sequence i owns
rows `cu_q_lens[i]:cu_q_lens[i+1]`; its query j sits at absolute position
`kv_lens[i] - q_len_i + j` and attends causally to cached positions
`0..that position`, read through its pages: token p lives in page
`page_indices[i, p // page_size]` at offset `p % page_size`. Query head h reads
KV head `h // (num_q_heads // num_kv_heads)` (MHA, GQA and MQA alike).

Rows at or past `cu_q_lens[num_seqs]` are padding. Both implementations return
zeros there, and padded sequences (`kv_lens` 0, repeated `cu_q_lens`) cost no
KV reads. All counts are arrays, so new values never trigger a compile.

The kernel keeps to the Pallas subset that lowers through the GPU (Triton)
backend and also runs with `interpret=True` on a CPU: a grid with BlockSpecs,
the ragged mapping read from int32 arrays inside the kernel (no scalar
prefetch), loops bounded by values read from refs, masked loads and stores,
power-of-two tiles. A tile packs `block_q` query tokens times the G query heads
that share one KV head into its rows: 16 rows for decode, 64 for prefill
(tiling.py holds the tables and the split-KV rule, ragged_attention_kernel.py
the kernel and its two passes).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import ragged_attention_kernel as kernel
from pallas_kernels.reference_tiling import reference_blocks
from pallas_kernels.tiling import RaggedAttentionConfig, plan_passes

__all__ = ["RaggedAttentionConfig", "ragged_paged_attention", "ragged_paged_attention_reference"]

# Finite, so a fully masked tile gives exp(0) instead of NaN; the masked
# probabilities are zeroed explicitly as well.
_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def _check_inputs(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                  kv_lens: jax.Array, page_indices: jax.Array, cu_q_lens: jax.Array,
                  num_seqs: jax.Array) -> None:
    """Raises ValueError naming the first tensor whose shape or dtype is wrong."""
    if q.ndim != 3:
        raise ValueError(f"q must be [T, num_q_heads, head_dim], got shape {q.shape}")
    _, num_q_heads, head_dim = q.shape
    if k_pages.ndim != 4 or k_pages.shape[-1] != head_dim:
        raise ValueError("k_pages must be [num_pages, page_size, num_kv_heads, "
                         f"{head_dim}], got shape {k_pages.shape}")
    if v_pages.shape != k_pages.shape:
        raise ValueError(f"v_pages must have k_pages' shape {k_pages.shape}, "
                         f"got {v_pages.shape}")
    num_kv_heads = k_pages.shape[2]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads ({num_q_heads}, q.shape[1]) must be a multiple "
                         f"of num_kv_heads ({num_kv_heads}, k_pages.shape[2])")
    if page_indices.ndim != 2:
        raise ValueError(f"page_indices must be [S, pages_per_seq], got {page_indices.shape}")
    num_slots = page_indices.shape[0]
    expected = {"kv_lens": (kv_lens, (num_slots,)), "cu_q_lens": (cu_q_lens, (num_slots + 1,)),
                "num_seqs": (num_seqs, (1,)), "page_indices": (page_indices, page_indices.shape)}
    for name, (array, shape) in expected.items():
        if array.shape != shape:
            raise ValueError(f"{name} must have shape {shape}, got {array.shape}")
        if array.dtype != jnp.int32:
            raise ValueError(f"{name} must be int32, got {array.dtype}")
    for name, array in (("k_pages", k_pages), ("v_pages", v_pages)):
        if array.dtype != q.dtype:
            raise ValueError(f"{name} dtype {array.dtype} differs from q dtype {q.dtype}")


def _pad_page_columns(page_indices: jax.Array, page_size: int, block_kv: int) -> jax.Array:
    """Pads each row with the null page so a whole KV block never reads past the row."""
    pages_per_seq = page_indices.shape[1]
    padded_tokens = pl.cdiv(pages_per_seq * page_size, block_kv) * block_kv
    extra = pl.cdiv(padded_tokens, page_size) - pages_per_seq
    return jnp.pad(page_indices, ((0, 0), (0, extra)))


def ragged_paged_attention_reference(
    q: jax.Array,  # [T, num_q_heads, head_dim]
    k_pages: jax.Array,  # [num_pages, page_size, num_kv_heads, head_dim]
    v_pages: jax.Array,  # [num_pages, page_size, num_kv_heads, head_dim]
    kv_lens: jax.Array,  # [S] int32
    page_indices: jax.Array,  # [S, pages_per_seq] int32
    cu_q_lens: jax.Array,  # [S+1] int32
    num_seqs: jax.Array,  # [1] int32
    *,
    sm_scale: float,
) -> jax.Array:
    """Pure-jnp ragged paged attention (the CPU path and the kernel's oracle).

    Loops over real sequences, their query blocks (up to 16 tokens, fewer in
    decode-heavy buckets) and the 128-token KV blocks those queries can see,
    with an online softmax in fp32, so the work follows the real tokens rather
    than a padded dense batch. Jit-able; the counts are traced values.

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
    _check_inputs(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs)
    return _reference_impl(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens,
                           num_seqs, sm_scale=float(sm_scale))


@functools.partial(jax.jit, static_argnames=("sm_scale",))
def _reference_impl(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *,
                    sm_scale):
    num_tokens, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_pages.shape
    group = num_q_heads // num_kv_heads
    # The simulator's cost fit counts these same tiles (reference_tiling, jax-free).
    block_q, block_kv = reference_blocks(num_tokens, page_indices.shape[0], page_size)
    pages_per_block = block_kv // page_size
    pages = _pad_page_columns(page_indices, page_size, block_kv)
    # Spare rows let the last block of the last sequence be sliced whole.
    q_rows = jnp.pad(q.astype(jnp.float32).reshape(num_tokens, num_kv_heads, group, head_dim),
                     ((0, block_q), (0, 0), (0, 0), (0, 0)))
    hi = lax.Precision.HIGHEST

    def kv_block(seq, kv_block_idx):
        page_ids = lax.dynamic_slice_in_dim(pages[seq], kv_block_idx * pages_per_block,
                                            pages_per_block)
        k = k_pages[page_ids].reshape(block_kv, num_kv_heads, head_dim)
        v = v_pages[page_ids].reshape(block_kv, num_kv_heads, head_dim)
        return k.astype(jnp.float32), v.astype(jnp.float32)

    def q_block_body(seq, q_block_idx, out):
        q_start, q_len, kv_len = cu_q_lens[seq], cu_q_lens[seq + 1] - cu_q_lens[seq], kv_lens[seq]
        local = q_block_idx * block_q + jnp.arange(block_q)
        row_valid = local < q_len
        q_pos = kv_len - q_len + local  # [block_q] absolute positions
        q_blk = lax.dynamic_slice_in_dim(q_rows, q_start + q_block_idx * block_q, block_q)
        kv_needed = jnp.minimum(kv_len, kv_len - q_len + (q_block_idx + 1) * block_q)

        def kv_body(kv_block_idx, carry):
            acc, m, l = carry  # [H, G, Q, D], [H, G, Q], [H, G, Q]
            k, v = kv_block(seq, kv_block_idx)
            kv_pos = kv_block_idx * block_kv + jnp.arange(block_kv)
            # A stale or NaN value past kv_len must not leak in through 0 * NaN.
            v = jnp.where((kv_pos < kv_len)[:, None, None], v, 0.0)
            mask = row_valid[:, None] & (kv_pos[None, :] <= q_pos[:, None])  # [Q, K]
            s = jnp.einsum("qhgd,khd->hgqk", q_blk, k, precision=hi) * sm_scale
            s = jnp.where(mask, s, _MASK_VALUE)
            m_new = jnp.maximum(m, s.max(axis=-1))
            p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
            correction = jnp.exp(m - m_new)
            acc = acc * correction[..., None] + jnp.einsum("hgqk,khd->hgqd", p, v, precision=hi)
            return acc, m_new, l * correction + p.sum(axis=-1)

        init = (jnp.zeros((num_kv_heads, group, block_q, head_dim), jnp.float32),
                jnp.full((num_kv_heads, group, block_q), _MASK_VALUE, jnp.float32),
                jnp.zeros((num_kv_heads, group, block_q), jnp.float32))
        acc, _, l = lax.fori_loop(0, pl.cdiv(kv_needed, block_kv), kv_body, init)
        result = acc / jnp.where(l > 0, l, 1.0)[..., None]
        result = jnp.transpose(result, (2, 0, 1, 3))  # [Q, H, G, D]
        row0 = q_start + q_block_idx * block_q
        old = lax.dynamic_slice_in_dim(out, row0, block_q)
        new = jnp.where(row_valid[:, None, None, None], result, old)
        return lax.dynamic_update_slice_in_dim(out, new, row0, axis=0)

    def seq_body(seq, out):
        q_len = cu_q_lens[seq + 1] - cu_q_lens[seq]
        return lax.fori_loop(0, pl.cdiv(q_len, block_q),
                             functools.partial(q_block_body, seq), out)

    out = jnp.zeros_like(q_rows)
    out = lax.fori_loop(0, num_seqs[0], seq_body, out)
    return out[:num_tokens].reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)




def ragged_paged_attention(
    q: jax.Array,  # [T, num_q_heads, head_dim]
    k_pages: jax.Array,  # [num_pages, page_size, num_kv_heads, head_dim]
    v_pages: jax.Array,  # [num_pages, page_size, num_kv_heads, head_dim]
    kv_lens: jax.Array,  # [S] int32
    page_indices: jax.Array,  # [S, pages_per_seq] int32
    cu_q_lens: jax.Array,  # [S+1] int32
    num_seqs: jax.Array,  # [1] int32
    *,
    sm_scale: float,
    config: RaggedAttentionConfig | None = None,
    interpret: bool = False,
    debug: bool = False,
) -> jax.Array:
    """Ragged paged attention as a Pallas (Triton-portable) kernel.

    Same arguments and result as `ragged_paged_attention_reference`. Up to two
    launches of one kernel body: a decode pass (16-row tiles, KV split by
    occupancy) for sequences with few new tokens and a prefill/mixed pass
    (64-row tiles) for the rest; both work lists are built in XLA without
    loops, longest first, so padded sequences launch nothing but idle programs.

    Args:
      q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs: as in
        `ragged_paged_attention_reference`.
      sm_scale: softmax scale.
      config: overrides of the tile tables; None means the tables' choice.
      interpret: run the kernel in the Pallas interpreter (CPU tests).
      debug: print each pass's kernel jaxpr and Triton IR while lowering
        (`pallas_call(debug=True)`; the lowering tests read it).

    Returns:
      `[T, num_q_heads, head_dim]` in q's dtype; padding rows are zeros.

    Raises:
      ValueError: a tensor has the wrong shape or dtype, the head layout cannot
        be tiled (group size, page size or head_dim not a power of two, a tile
        outside 16..128 rows), or the cache is too large for the kernel's offsets.
    """
    _check_inputs(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs)
    if kernel.plgpu is None:
        raise ImportError("ragged_paged_attention needs jax.experimental.pallas.triton, which "
                          f"this jax ({jax.__version__}) lacks: {kernel.PLGPU_ERROR}; use "
                          "ragged_paged_attention_reference (--attention=reference)")
    num_tokens, num_q_heads, head_dim = q.shape
    num_pages, page_size, num_kv_heads, _ = k_pages.shape
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"the Pallas kernel needs head_dim (q.shape[2]) to be a power of two "
                         f">= 16, got {head_dim}")
    # Pallas switches pointer offsets to 64 bits above 4 GiB; below that, a 1-byte cache of
    # 2**31 or more elements would overflow the 32-bit offsets it keeps.
    if k_pages.dtype.itemsize < 2 and k_pages.size >= 2 ** 31:
        raise ValueError(f"k_pages {k_pages.shape} {k_pages.dtype} has {k_pages.size} elements; "
                         "a 1-byte cache must stay under 2**31 per layer")
    plan = plan_passes(num_tokens=num_tokens, num_slots=page_indices.shape[0],
                       num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                       page_size=page_size, pages_per_seq=page_indices.shape[1],
                       itemsize=k_pages.dtype.itemsize, config=config)
    return kernel.attention_passes(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens,
                                   num_seqs, plan=plan, sm_scale=float(sm_scale),
                                   interpret=interpret, debug=debug)
