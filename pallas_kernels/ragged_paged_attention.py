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
that share one KV head into its rows, so even a decode tile feeds the dot with
at least 16 rows.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

try:  # The Triton backend's helpers; a jax without them still has the jnp reference.
    from jax.experimental.pallas import triton as plgpu
except ImportError as _triton_import_error:  # pragma: no cover - depends on the jax build
    plgpu = None
    _PLGPU_ERROR = _triton_import_error

from pallas_kernels.reference_tiling import reference_blocks

# Finite, so a fully masked tile gives exp(0) instead of NaN; the masked
# probabilities are zeroed explicitly as well.
_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def _is_power_of_two(n: int) -> bool:
    return n >= 1 and (n & (n - 1)) == 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class RaggedAttentionConfig:
    """Static tuning knobs of the Pallas kernel (each value compiles its own kernel)."""

    block_q: int = 16  # query tokens per tile; the tile has block_q * G rows
    block_kv: int = 32  # KV tokens per inner loop step (gathered through the pages)
    num_kv_splits: int = 1  # > 1: split-KV variant, partial (o, m, l) combined after
    num_warps: int = 4  # Triton warps per program
    num_stages: int = 2  # Triton software-pipelining stages

    def __post_init__(self) -> None:
        for name in ("block_q", "block_kv", "num_kv_splits"):
            value = getattr(self, name)
            if not isinstance(value, int) or not _is_power_of_two(value):
                raise ValueError(
                    f"RaggedAttentionConfig.{name} must be a power of two, got {value!r}")
        if self.block_kv < 16:
            raise ValueError(
                f"RaggedAttentionConfig.block_kv must be >= 16 (a dot dimension), "
                f"got {self.block_kv}")
        for name in ("num_warps", "num_stages"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"RaggedAttentionConfig.{name} must be a positive int, got {value!r}")


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


def _work_list(cu_q_lens: jax.Array, num_seqs: jax.Array, block_q: int, max_work: int):
    """Which (sequence, query block) each program takes: `[W]`, `[W]` and the count `[1]`.

    Padded sequences get no blocks. Idle programs point at sequence 0, block 0,
    so every address they form stays in bounds; the kernel masks them out.
    """
    num_slots = cu_q_lens.shape[0] - 1
    q_lens = jnp.where(jnp.arange(num_slots) < num_seqs[0], cu_q_lens[1:] - cu_q_lens[:-1], 0)
    blocks = pl.cdiv(q_lens, block_q)
    cu_blocks = jnp.cumsum(blocks)
    work = jnp.arange(max_work, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(cu_blocks, work, side="right"), num_slots - 1)
    block = work - (cu_blocks[seq] - blocks[seq])
    active = work < cu_blocks[-1]
    return (jnp.where(active, seq, 0).astype(jnp.int32),
            jnp.where(active, block, 0).astype(jnp.int32),
            cu_blocks[-1:].astype(jnp.int32))


def _kernel(work_seq_ref, work_block_ref, num_work_ref, cu_q_lens_ref, kv_lens_ref, pages_ref,
            q_ref, k_ref, v_ref, *out_refs, sm_scale: float, block_q: int, block_kv: int,
            group: int, num_q_heads: int, page_size: int, pages_per_row: int,
            num_kv_splits: int):
    # work_seq_ref, work_block_ref: [W]; num_work_ref: [1]; cu_q_lens_ref: [S+1];
    # kv_lens_ref: [S]; pages_ref: [S * pages_per_row]; q_ref: [(T + block_q) * num_q_heads, D];
    # k_ref, v_ref: [num_pages * page_size, D] (this program's KV head).
    # out_refs: o [(T + block_q) * num_q_heads, D], or with splits this split's
    # unnormalized o [..., D] and its m, l [(T + block_q) * num_q_heads].
    # Program ids are read here, never inside a loop body (interpret mode breaks there).
    kv_head, work, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    num_rows = block_q * group
    seq, q_block = work_seq_ref[work], work_block_ref[work]
    q_start = cu_q_lens_ref[seq]
    q_len = cu_q_lens_ref[seq + 1] - q_start
    kv_len = kv_lens_ref[seq]
    active = work < num_work_ref[0]

    r = lax.broadcasted_iota(jnp.int32, (num_rows,), 0)
    tok_local = q_block * block_q + r // group  # [R] token index within the sequence
    row_valid = active & (tok_local < q_len)
    rows = (q_start + tok_local) * num_q_heads + kv_head * group + r % group  # [R]
    q_pos = kv_len - q_len + tok_local  # [R] absolute position of each row's token
    kv_hi = jnp.where(active, jnp.minimum(kv_len, kv_len - q_len + (q_block + 1) * block_q), 0)
    num_tiles = pl.cdiv(kv_hi, block_kv)
    tiles_per_split = pl.cdiv(num_tiles, num_kv_splits)
    tile_lo = jnp.minimum(split * tiles_per_split, num_tiles)
    tile_hi = jnp.minimum(tile_lo + tiles_per_split, num_tiles)

    # Rows of other sequences or padding are read (in bounds) and masked out later.
    q = q_ref[rows, :]  # [R, D]
    page_row = seq * pages_per_row

    def body(tile, carry):
        acc, m, l = carry
        kv_pos = tile * block_kv + lax.broadcasted_iota(jnp.int32, (block_kv,), 0)
        page = pages_ref[page_row + kv_pos // page_size]  # [block_kv]
        slots = page * page_size + kv_pos % page_size
        k = k_ref[slots, :]  # [block_kv, D]
        # Slots past kv_len hold stale or NaN data; zero V there since 0 * NaN = NaN.
        v = jnp.where((kv_pos < kv_len)[:, None], v_ref[slots, :], jnp.zeros((), v_ref.dtype))
        s = lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                            preferred_element_type=jnp.float32) * sm_scale  # [R, block_kv]
        mask = row_valid[:, None] & (kv_pos[None, :] <= q_pos[:, None])
        s = jnp.where(mask, s, _MASK_VALUE)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        correction = jnp.exp(m - m_new)
        p = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)
        pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                             preferred_element_type=jnp.float32)
        return acc * correction[:, None] + pv, m_new, l * correction + jnp.sum(p, axis=1)

    head_dim = q_ref.shape[-1]
    init = (jnp.zeros((num_rows, head_dim), jnp.float32),
            jnp.full((num_rows,), _MASK_VALUE, jnp.float32),
            jnp.zeros((num_rows,), jnp.float32))
    acc, m, l = lax.fori_loop(tile_lo, tile_hi, body, init)
    # Masked stores index with integer arrays only: interpret mode cannot mix an
    # array index with a slice there. The rows of one tile are distinct, so the
    # interpreter's read-select-scatter keeps the masked rows as they were.
    shape = (num_rows, head_dim)
    store_mask = jnp.broadcast_to(row_valid[:, None], shape)
    at_rows = (jnp.broadcast_to(rows[:, None], shape),
               lax.broadcasted_iota(jnp.int32, shape, 1))
    if num_kv_splits == 1:
        (o_ref,) = out_refs
        out = acc / jnp.where(l > 0, l, 1.0)[:, None]
        plgpu.store(o_ref.at[at_rows], out.astype(o_ref.dtype), mask=store_mask)
    else:
        o_ref, m_ref, l_ref = out_refs
        plgpu.store(o_ref.at[at_rows], acc, mask=store_mask)
        plgpu.store(m_ref.at[rows], m, mask=row_valid)
        plgpu.store(l_ref.at[rows], l, mask=row_valid)


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
) -> jax.Array:
    """Ragged paged attention as a Pallas (Triton-portable) kernel.

    Same arguments and result as `ragged_paged_attention_reference`. The grid is
    (KV head, work item, KV split); a work item is one query block of one real
    sequence, listed in jnp before the call, so padded sequences launch nothing
    but idle programs. With `config.num_kv_splits > 1` each program covers one
    slice of the KV range and the partial (o, m, l) are combined afterwards,
    which keeps an SM busy on long-context decode with few sequences.

    Args:
      q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs: as in
        `ragged_paged_attention_reference`.
      sm_scale: softmax scale.
      config: tuning knobs; None means `RaggedAttentionConfig()`.
      interpret: run the kernel in the Pallas interpreter (CPU tests).

    Returns:
      `[T, num_q_heads, head_dim]` in q's dtype; padding rows are zeros.

    Raises:
      ValueError: a tensor has the wrong shape or dtype, or the head layout
        cannot be tiled (group size or head_dim not a power of two, fewer than
        16 rows per tile).
    """
    _check_inputs(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs)
    if plgpu is None:
        raise ImportError("ragged_paged_attention needs jax.experimental.pallas.triton, which "
                          f"this jax ({jax.__version__}) lacks: {_PLGPU_ERROR}; use "
                          "ragged_paged_attention_reference (--attention=reference)")
    config = config or RaggedAttentionConfig()
    num_q_heads, head_dim = q.shape[1:]
    group = num_q_heads // k_pages.shape[2]
    if not _is_power_of_two(group):
        raise ValueError(f"the Pallas kernel needs num_q_heads // num_kv_heads to be a power "
                         f"of two, got {num_q_heads} // {k_pages.shape[2]} = {group}")
    if head_dim < 16 or not _is_power_of_two(head_dim):
        raise ValueError(f"the Pallas kernel needs head_dim (q.shape[2]) to be a power of two "
                         f">= 16, got {head_dim}")
    if config.block_q * group < 16:
        raise ValueError(f"config.block_q ({config.block_q}) * group ({group}) must be >= 16 "
                         "rows, the smallest dot the GPU backend takes")
    return _pallas_impl(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
                        sm_scale=float(sm_scale), config=config, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("sm_scale", "config", "interpret"))
def _pallas_impl(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *,
                 sm_scale, config, interpret):
    num_tokens, num_q_heads, head_dim = q.shape
    num_pages, page_size, num_kv_heads, _ = k_pages.shape
    num_slots = page_indices.shape[0]
    block_q, splits = config.block_q, config.num_kv_splits
    # Each block holds >= 1 real token and each sequence wastes < 1 block.
    max_work = min(num_tokens, (num_tokens + num_slots * (block_q - 1)) // block_q)
    work_seq, work_block, num_work = _work_list(cu_q_lens, num_seqs, block_q, max_work)
    pages = _pad_page_columns(page_indices, page_size, config.block_kv)
    pages_per_row = pages.shape[1]
    # Spare rows: a block starting near the end still addresses rows in bounds.
    padded_rows = (num_tokens + block_q) * num_q_heads
    q_flat = jnp.pad(q, ((0, block_q), (0, 0), (0, 0))).reshape(padded_rows, head_dim)
    k_flat = k_pages.reshape(num_pages * page_size, num_kv_heads, head_dim)
    v_flat = v_pages.reshape(num_pages * page_size, num_kv_heads, head_dim)

    def whole(shape):
        return pl.BlockSpec(shape, lambda h, w, s: (0,) * len(shape))

    kv_spec = pl.BlockSpec((num_pages * page_size, None, head_dim), lambda h, w, s: (0, h, 0))
    in_specs = [whole((max_work,)), whole((max_work,)), whole((1,)), whole((num_slots + 1,)),
                whole((num_slots,)), whole((num_slots * pages_per_row,)),
                whole((padded_rows, head_dim)), kv_spec, kv_spec]
    if splits == 1:
        out_shape = [jax.ShapeDtypeStruct((padded_rows, head_dim), q.dtype)]
        out_specs = [whole((padded_rows, head_dim))]
    else:
        out_shape = [jax.ShapeDtypeStruct((splits, padded_rows, head_dim), jnp.float32),
                     jax.ShapeDtypeStruct((splits, padded_rows), jnp.float32),
                     jax.ShapeDtypeStruct((splits, padded_rows), jnp.float32)]
        out_specs = [pl.BlockSpec((None, padded_rows, head_dim), lambda h, w, s: (s, 0, 0)),
                     pl.BlockSpec((None, padded_rows), lambda h, w, s: (s, 0)),
                     pl.BlockSpec((None, padded_rows), lambda h, w, s: (s, 0))]
    kernel = functools.partial(
        _kernel, sm_scale=sm_scale, block_q=block_q, block_kv=config.block_kv,
        group=num_q_heads // num_kv_heads, num_q_heads=num_q_heads, page_size=page_size,
        pages_per_row=pages_per_row, num_kv_splits=splits)
    outs = pl.pallas_call(
        kernel,
        grid=(num_kv_heads, max_work, splits),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps,
                                             num_stages=config.num_stages),
        interpret=interpret,
        name="ragged_paged_attention",
    )(work_seq, work_block, num_work, cu_q_lens, kv_lens, pages.reshape(-1), q_flat, k_flat,
      v_flat)
    if splits == 1:
        out = outs[0]
    else:
        o_parts, m_parts, l_parts = outs
        m_max = jnp.max(m_parts, axis=0)
        weights = jnp.exp(m_parts - m_max)  # [splits, rows]; empty splits have l = 0
        denom = jnp.sum(weights * l_parts, axis=0)
        out = jnp.sum(o_parts * weights[..., None], axis=0) / denom[:, None]
    out = out[:num_tokens * num_q_heads].reshape(num_tokens, num_q_heads, head_dim)
    real = jnp.arange(num_tokens) < cu_q_lens[num_seqs[0]]
    # Unwritten rows are NaN in interpret mode and garbage on a GPU: pin them to zero.
    return jnp.where(real[:, None, None], out, 0).astype(q.dtype)
