"""The Pallas (Triton) body of ragged paged attention: work lists, kernel, two passes.

`ragged_paged_attention` (in ragged_paged_attention.py) checks its inputs and
calls `attention_passes`, which launches up to two `pallas_call`s over one
kernel body (tiling.py says why and with which tiles):
  * the decode pass: one program per (KV head, decode sequence, KV split), a
    16-row tile, longest context first; with splits the partial (o, m, l) are
    merged in XLA and scattered to their rows;
  * the prefill/mixed pass: one program per (KV head, query block of a longer
    sequence), longest KV range first, writing into the decode pass's output
    (aliased), so each output row is written once.
Both work lists are built in XLA without loops (cumsum, scatter, cummax, sort):
the lowered wrapper holds no `while`.

Inside the KV loop a tile is whole pages: their ids are one contiguous load of
`block_kv // page_size` int32s, widened per token in registers; K and V are
loaded as [block_kv, D] tiles with a mask and zero fill past the sequence's end;
the softmax runs in base 2 with the scale folded into one multiply. Pointer
offsets are 64-bit whenever a cache exceeds 4 GiB (Pallas's rule); the wrapper
rejects the one layout that rule misses.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

try:  # The Triton backend's helpers; a jax without them still has the jnp reference.
    from jax.experimental.pallas import triton as plgpu
except ImportError as _triton_import_error:  # pragma: no cover - depends on the jax build
    plgpu = None
    PLGPU_ERROR: Exception | None = _triton_import_error
else:
    PLGPU_ERROR = None

from pallas_kernels.tiling import PassPlan, PassTiles

# Finite, so a fully masked tile gives exp2(0) instead of NaN; masked
# probabilities are zeroed explicitly as well.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
LOG2_E = math.log2(math.e)


def _log2(n: int) -> int:
    return n.bit_length() - 1


def decode_work_list(cu_q_lens: jax.Array,  # [S+1] int32
                     kv_lens: jax.Array,  # [S] int32
                     num_seqs: jax.Array,  # [1] int32
                     max_q_len: int):
    """Decode items: real sequences with 1..max_q_len new tokens, longest context first.

    Returns `(seq [S], block [S], count [1])`; items past `count` are idle and
    point at sequence 0 so every address they form stays in bounds.
    """
    num_slots = kv_lens.shape[0]
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    is_decode = (jnp.arange(num_slots) < num_seqs[0]) & (q_lens > 0) & (q_lens <= max_q_len)
    order = jnp.argsort(-jnp.where(is_decode, kv_lens, -1), stable=True).astype(jnp.int32)
    count = jnp.sum(is_decode, dtype=jnp.int32)
    seq = jnp.where(jnp.arange(num_slots) < count, order, 0)
    return seq, jnp.zeros_like(seq), count[None]


def prefill_work_list(cu_q_lens: jax.Array,  # [S+1] int32
                      kv_lens: jax.Array,  # [S] int32
                      num_seqs: jax.Array,  # [1] int32
                      min_q_len: int, block_q: int, max_work: int):
    """(sequence, query block) items of sequences with more than `min_q_len` tokens.

    Ordered by the KV range each block reads, longest first, so the longest
    programs start in the first wave. Loop-free: a scatter of each sequence's
    id at its first item and a running max give every item its sequence.

    Returns `(seq [W], block [W], count [1])`; idle items point at sequence 0.
    """
    num_slots = kv_lens.shape[0]
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    takes = (jnp.arange(num_slots) < num_seqs[0]) & (q_lens > min_q_len)
    blocks = jnp.where(takes, (q_lens + block_q - 1) // block_q, 0)
    ends = jnp.cumsum(blocks)
    starts = ends - blocks
    first_item = jnp.full((max_work,), -1, jnp.int32).at[
        jnp.where(blocks > 0, starts, max_work)].set(
            jnp.arange(num_slots, dtype=jnp.int32), mode="drop")
    seq = jnp.maximum(lax.cummax(first_item), 0)
    work = jnp.arange(max_work, dtype=jnp.int32)
    block = work - starts[seq]
    count = ends[-1].astype(jnp.int32)
    active = work < count
    kv_len, q_len = kv_lens[seq], q_lens[seq]
    kv_hi = jnp.minimum(kv_len, kv_len - q_len + (block + 1) * block_q)
    order = jnp.argsort(-jnp.where(active, kv_hi, -1), stable=True)
    seq, block = seq[order], block[order]
    idle = jnp.arange(max_work) >= count
    return (jnp.where(idle, 0, seq).astype(jnp.int32), jnp.where(idle, 0, block).astype(jnp.int32),
            count[None])


def _kernel(work_seq_ref, work_block_ref, num_work_ref, cu_q_lens_ref, kv_lens_ref, pages_ref,
            q_ref, k_ref, v_ref, *out_refs, qk_scale: float, block_q: int, block_kv: int,
            group: int, num_q_heads: int, num_kv_heads: int, page_size: int,
            pages_per_row: int, num_kv_splits: int, min_tiles_per_split: int):
    # work_seq_ref, work_block_ref: [W]; num_work_ref: [1]; cu_q_lens_ref: [S+1];
    # kv_lens_ref: [S]; pages_ref: [S * pages_per_row]; q_ref: [(T + block_q) * num_q_heads, D];
    # k_ref, v_ref: [num_pages, page_size, D] (this program's KV head).
    # out_refs: o [(T + block_q) * num_q_heads, D] (plus the aliased input before it), or
    # with splits this split's unnormalized o [W * Hkv * R, D] and its m, l [W * Hkv * R].
    # Program ids are read here, never inside a loop body (interpret mode breaks there).
    kv_head, work, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    num_rows = block_q * group
    pages_per_tile = block_kv // page_size
    seq, q_block = work_seq_ref[work], work_block_ref[work]
    q_start = cu_q_lens_ref[seq]
    q_len = cu_q_lens_ref[seq + 1] - q_start
    kv_len = kv_lens_ref[seq]
    active = work < num_work_ref[0]

    # Shifts and masks rather than // and %: group is a power of two.
    r = lax.broadcasted_iota(jnp.int32, (num_rows,), 0)
    tok_local = q_block * block_q + lax.shift_right_logical(r, _log2(group))  # [R]
    row_valid = active & (tok_local < q_len)
    rows = (q_start + tok_local) * num_q_heads + kv_head * group + (r & (group - 1))  # [R]
    q_pos = kv_len - q_len + tok_local  # [R] absolute position of each row's token
    kv_hi = jnp.where(active, jnp.minimum(kv_len, kv_len - q_len + (q_block + 1) * block_q), 0)
    num_tiles = lax.shift_right_logical(kv_hi + block_kv - 1, _log2(block_kv))
    if num_kv_splits == 1:
        tile_lo, tile_hi = 0, num_tiles
    else:
        # Short contexts fill the first splits only; the rest exit at once.
        per_split = jnp.maximum((num_tiles + num_kv_splits - 1) // num_kv_splits,
                                min_tiles_per_split)
        tile_lo = jnp.minimum(split * per_split, num_tiles)
        tile_hi = jnp.minimum(tile_lo + per_split, num_tiles)

    # Rows of other sequences or padding are read (in bounds) and never stored.
    q = q_ref[rows, :]  # [R, D]
    head_dim = q.shape[-1]
    page_base = seq * pages_per_row
    # A tile's K or V is loaded as [block_kv, D] straight into the dot (the pattern
    # Triton's pipeliner overlaps), addressed by three index arrays (interpret mode's
    # masked loads take index arrays only, no slices): page, slot in page, dim.
    tile_shape = (block_kv, head_dim)
    kv_iota = lax.broadcasted_iota(jnp.int32, (block_kv,), 0)
    in_page = jnp.broadcast_to((kv_iota & (page_size - 1))[:, None], tile_shape)
    dims = lax.broadcasted_iota(jnp.int32, tile_shape, 1)

    def body(tile, carry):
        acc, m, l = carry  # [R, D], [R], [R]
        kv_start = tile * block_kv
        # One id per page of the tile, widened to one per token in registers.
        page_ids = pages_ref[pl.ds(page_base + tile * pages_per_tile, pages_per_tile)]
        page_of_token = jnp.broadcast_to(page_ids[:, None], (pages_per_tile, page_size))
        at = (jnp.broadcast_to(page_of_token.reshape(block_kv, 1), tile_shape), in_page, dims)
        # Slots past kv_len hold stale or NaN data: load zeros there (0 * NaN = NaN).
        in_seq = jnp.broadcast_to((kv_start + kv_iota < kv_len)[:, None], tile_shape)
        k = plgpu.load(k_ref.at[at], mask=in_seq, other=0)  # [block_kv, D]
        v = plgpu.load(v_ref.at[at], mask=in_seq, other=0)
        s = lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                            preferred_element_type=jnp.float32) * qk_scale  # [R, block_kv]
        mask = (kv_start + kv_iota)[None, :] <= q_pos[:, None]
        s = jnp.where(mask, s, MASK_VALUE)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        correction = jnp.exp2(m - m_new)
        p = jnp.where(mask, jnp.exp2(s - m_new[:, None]), 0.0)
        pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                             preferred_element_type=jnp.float32)
        return acc * correction[:, None] + pv, m_new, l * correction + jnp.sum(p, axis=1)

    init = (jnp.zeros((num_rows, head_dim), jnp.float32),
            jnp.full((num_rows,), MASK_VALUE, jnp.float32),
            jnp.zeros((num_rows,), jnp.float32))
    acc, m, l = lax.fori_loop(tile_lo, tile_hi, body, init)
    if num_kv_splits == 1:
        o_ref = out_refs[-1]
        # Masked stores index with integer arrays only: interpret mode cannot mix an
        # array index with a slice there. The rows of one tile are distinct, so the
        # interpreter's read-select-scatter keeps the masked rows as they were.
        shape = (num_rows, head_dim)
        at_rows = (jnp.broadcast_to(rows[:, None], shape),
                   lax.broadcasted_iota(jnp.int32, shape, 1))
        out = acc / jnp.where(l > 0, l, 1.0)[:, None]
        plgpu.store(o_ref.at[at_rows], out.astype(o_ref.dtype),
                    mask=jnp.broadcast_to(row_valid[:, None], shape))
    else:
        o_ref, m_ref, l_ref = out_refs
        base = (work * num_kv_heads + kv_head) * num_rows  # this item's compact rows
        o_ref[pl.ds(base, num_rows), :] = acc
        m_ref[pl.ds(base, num_rows)] = m
        l_ref[pl.ds(base, num_rows)] = l


def _launch(tiles: PassTiles, work, out_init, *, q_flat, k_pages, v_pages, kv_lens, pages,
            cu_q_lens, num_q_heads, qk_scale, interpret, debug, name):
    """One pallas_call over `work`; writes into `out_init` (aliased) unless split."""
    num_pages, page_size, num_kv_heads, head_dim = k_pages.shape
    padded_rows = q_flat.shape[0]
    work_seq, work_block, num_work = work
    max_work, splits = tiles.max_work, tiles.num_kv_splits
    num_slots = kv_lens.shape[0]

    def whole(shape):
        return pl.BlockSpec(shape, lambda h, w, s: (0,) * len(shape))

    kv_spec = pl.BlockSpec((num_pages, page_size, None, head_dim), lambda h, w, s: (0, 0, h, 0))
    in_specs = [whole((max_work,)), whole((max_work,)), whole((1,)), whole((num_slots + 1,)),
                whole((num_slots,)), whole(pages.shape), whole((padded_rows, head_dim)),
                kv_spec, kv_spec]
    operands = [work_seq, work_block, num_work, cu_q_lens, kv_lens, pages, q_flat, k_pages,
                v_pages]
    aliases = {}
    if splits == 1:
        in_specs.append(whole((padded_rows, head_dim)))
        operands.append(out_init)
        aliases = {len(operands) - 1: 0}
        out_shape = [jax.ShapeDtypeStruct((padded_rows, head_dim), out_init.dtype)]
        out_specs = [whole((padded_rows, head_dim))]
    else:
        compact = max_work * num_kv_heads * tiles.rows
        out_shape = [jax.ShapeDtypeStruct((splits, compact, head_dim), jnp.float32),
                     jax.ShapeDtypeStruct((splits, compact), jnp.float32),
                     jax.ShapeDtypeStruct((splits, compact), jnp.float32)]
        out_specs = [pl.BlockSpec((None, compact, head_dim), lambda h, w, s: (s, 0, 0)),
                     pl.BlockSpec((None, compact), lambda h, w, s: (s, 0)),
                     pl.BlockSpec((None, compact), lambda h, w, s: (s, 0))]
    kernel = functools.partial(
        _kernel, qk_scale=qk_scale, block_q=tiles.block_q, block_kv=tiles.block_kv,
        group=tiles.rows // tiles.block_q, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
        page_size=page_size, pages_per_row=pages.shape[0] // num_slots,
        num_kv_splits=splits, min_tiles_per_split=tiles.min_tiles_per_split)
    return pl.pallas_call(
        kernel,
        grid=(num_kv_heads, max_work, splits),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps,
                                             num_stages=tiles.num_stages),
        interpret=interpret,
        debug=debug,
        name=name,
    )(*operands)


def _merge_splits(parts, work, cu_q_lens, tiles: PassTiles, num_q_heads: int,
                  out: jax.Array) -> jax.Array:
    """Merges the decode splits' partial (o, m, l) and scatters each row to `out`."""
    o_parts, m_parts, l_parts = parts  # [splits, C, D], [splits, C], [splits, C]
    m_max = jnp.max(m_parts, axis=0)
    weights = jnp.exp2(m_parts - m_max)  # empty splits have l = 0
    denom = jnp.sum(weights * l_parts, axis=0)  # [C]; 0 only for idle items' rows
    denom = jnp.where(denom > 0, denom, 1.0)
    merged = jnp.sum(o_parts * weights[..., None], axis=0) / denom[:, None]  # [C, D]
    work_seq, work_block, num_work = work
    group = tiles.rows // tiles.block_q
    num_kv_heads = merged.shape[0] // (tiles.max_work * tiles.rows)
    w = jnp.arange(tiles.max_work)[:, None, None]
    h = jnp.arange(num_kv_heads)[None, :, None]
    r = jnp.arange(tiles.rows)[None, None, :]
    seq = work_seq[w]
    tok = work_block[w] * tiles.block_q + r // group
    q_start, q_len = cu_q_lens[seq], cu_q_lens[seq + 1] - cu_q_lens[seq]
    rows = (q_start + tok) * num_q_heads + h * group + r % group  # [W, Hkv, R]
    valid = (w < num_work[0]) & (tok < q_len)
    rows = jnp.where(valid, rows, out.shape[0]).reshape(-1)  # out of range: dropped
    return out.at[rows].set(merged.astype(out.dtype), mode="drop")


@functools.partial(jax.jit, static_argnames=("plan", "sm_scale", "interpret", "debug"))
def attention_passes(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *,
                     plan: PassPlan, sm_scale: float, interpret: bool, debug: bool):
    """Runs the plan's passes (see the module docstring); arguments as the public op's."""
    num_tokens, num_q_heads, head_dim = q.shape
    page_size = k_pages.shape[1]
    block_q = max(t.block_q for t in plan.passes())
    # Whole tiles never read past a page row: pad it with the null page.
    pages_per_seq = page_indices.shape[1]
    padded_tokens = pl.cdiv(pages_per_seq * page_size, plan.max_block_kv) * plan.max_block_kv
    pages = jnp.pad(page_indices, ((0, 0), (0, padded_tokens // page_size - pages_per_seq)))
    pages = pages.reshape(-1)
    # Spare rows: a block starting near the end still addresses rows in bounds.
    padded_rows = (num_tokens + block_q) * num_q_heads
    q_flat = jnp.pad(q, ((0, block_q), (0, 0), (0, 0))).reshape(padded_rows, head_dim)
    # The passes write each real row once, into this buffer (aliased); the rest stay zero.
    out = jnp.zeros((padded_rows, head_dim), q.dtype)
    launch = functools.partial(_launch, q_flat=q_flat, k_pages=k_pages, v_pages=v_pages,
                               kv_lens=kv_lens, pages=pages, cu_q_lens=cu_q_lens,
                               num_q_heads=num_q_heads, qk_scale=sm_scale * LOG2_E,
                               interpret=interpret, debug=debug)
    if plan.decode is not None:
        work = decode_work_list(cu_q_lens, kv_lens, num_seqs, plan.decode.block_q)
        outs = launch(plan.decode, work, out, name="ragged_paged_attention_decode")
        if plan.decode.num_kv_splits == 1:
            out = outs[0]
        else:
            out = _merge_splits(outs, work, cu_q_lens, plan.decode, num_q_heads, out)
    if plan.prefill is not None:
        min_q_len = plan.decode.block_q if plan.decode is not None else 0
        work = prefill_work_list(cu_q_lens, kv_lens, num_seqs, min_q_len, plan.prefill.block_q,
                                 plan.prefill.max_work)
        out = launch(plan.prefill, work, out, name="ragged_paged_attention_prefill")[0]
    return out[:num_tokens * num_q_heads].reshape(num_tokens, num_q_heads, head_dim)
