"""Tile sizes of the jnp reference attention, without jax.

`ragged_paged_attention_reference` walks each sequence in query blocks and KV
blocks of these sizes, so its cost counts (query tile, KV tile) pairs. The
simulator's cost fit counts the same tiles and must not import jax, so the
sizes and the rule that picks them live here, in the standard library alone.
"""

from __future__ import annotations

REFERENCE_BLOCK_Q = 16  # most query tokens the reference handles per inner step
REFERENCE_BLOCK_KV = 128  # KV tokens the reference gathers per inner step, before page rounding


def reference_blocks(num_tokens: int, num_seqs: int, page_size: int) -> tuple[int, int]:
    """`(block_q, block_kv)` of the reference op in a step of `num_tokens` x `num_seqs`.

    A decode-heavy step (few tokens per sequence) gets small query blocks, the
    next power of two of its mean tokens per sequence, so a one-token sequence
    does not pay for 15 padded rows. A KV block is whole pages: 128 tokens
    rounded down to a multiple of `page_size`, and at least one page.

    Raises:
      ValueError: a count or the page size is below 1.
    """
    if num_tokens < 1 or num_seqs < 1 or page_size < 1:
        raise ValueError(f"reference_blocks: num_tokens, num_seqs and page_size must be >= 1, "
                         f"got {num_tokens}, {num_seqs}, {page_size}")
    per_seq = -(-num_tokens // num_seqs)
    block_q = min(REFERENCE_BLOCK_Q, 1 << (per_seq - 1).bit_length())
    block_kv = max(1, REFERENCE_BLOCK_KV // page_size) * page_size
    return block_q, block_kv
