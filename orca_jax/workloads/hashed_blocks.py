"""Prompts given as hashed blocks (the Mooncake trace's `hash_ids`): their token ids, and the
prefix-cache ceiling they imply.

A trace that ships no text can still say which prompts share a prefix: it lists each
prompt's `block_size`-token blocks as ids, equal ids standing for the same block *and*
everything before it (the ids are chained hashes). Turning each id into a fixed run of
token ids, derived from the id alone, gives requests whose prompts share exactly the
prefixes the trace says they share, so a prefix cache sees the hits the trace saw.

Blocks of any size meet KV pages of any size this way (Mooncake's are 512 tokens, others'
16; the loader takes the size from the file or the caller): the cache names each full page
from the derived token ids, chained over its parent, so a `B`-token block spans
`ceil(B / page_size)` pages (one more where it starts mid-page) and a page is shared
exactly when every token up to its end is, a page that straddles a shared and a differing
block is not, and a prompt's last partial page never is (docs/traces.md).
`cached_prefix_lens` counts the same pages from the ids alone.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
from numpy.typing import NDArray

HASH_BLOCK_SIZE = 512  # tokens per block of the Mooncake trace's hash_ids

_U64 = np.uint64


def _mix64(x: NDArray[np.uint64]) -> NDArray[np.uint64]:  # [...] -> [...]
    # splitmix64's finalizer: a bijection of uint64 that scatters neighbouring inputs, so
    # distinct (block id, position) pairs give unrelated words. uint64 arrays wrap silently.
    x = x + _U64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> _U64(27))) * _U64(0x94D049BB133111EB)
    return x ^ (x >> _U64(31))


def block_tokens(block_ids: Sequence[int], num_tokens: int, vocab_size: int,
                 block_size: int = HASH_BLOCK_SIZE) -> NDArray[np.int32]:
    """Token ids of a prompt given as hashed blocks.

    Each block id becomes a fixed run of `block_size` ids in [1, vocab_size) that depends
    on the id alone (no seed): the same id gives the same run in every request and every
    run, different ids give different runs with overwhelming probability.

    Args:
      block_ids: the prompt's block ids in order (integers >= 0).
      num_tokens: the prompt's length; the last block is cut to fit, so it must lie in
        `((len(block_ids) - 1) * block_size, len(block_ids) * block_size]`.
      vocab_size: ids are in [1, vocab_size) (0 is the packed step's padding).
      block_size: tokens per block.

    Returns:
      `[num_tokens]` int32 token ids.
    """
    # (The trace loader imports this module, so it cannot use synthetic's check.)
    if isinstance(vocab_size, bool) or int(vocab_size) != vocab_size or vocab_size < 2:
        raise ValueError(f"vocab_size must be an integer >= 2, got {vocab_size!r}")
    ids = np.asarray(block_ids, dtype=np.int64)  # [num_blocks]
    if ids.ndim != 1 or ids.size == 0 or int(ids.min()) < 0:
        raise ValueError(f"block_ids must be a non-empty list of integers >= 0, got "
                         f"{list(block_ids)!r}")
    if not (ids.size - 1) * block_size < num_tokens <= ids.size * block_size:
        raise ValueError(f"num_tokens {num_tokens} does not fit {ids.size} blocks of "
                         f"{block_size} tokens (expected more than {(ids.size - 1) * block_size} "
                         f"and at most {ids.size * block_size})")
    keys = _mix64(ids.astype(np.uint64))  # [num_blocks]
    positions = np.arange(block_size, dtype=np.uint64)  # [block_size]
    words = _mix64(keys[:, None] + positions[None, :]).reshape(-1)[:num_tokens]  # [num_tokens]
    return (words % _U64(vocab_size - 1) + _U64(1)).astype(np.int32)


def cached_prefix_lens(block_ids: Sequence[Sequence[int]], prompt_lens: Sequence[int],
                       page_size: int, block_size: int = HASH_BLOCK_SIZE) -> NDArray[np.int64]:
    """Prompt tokens an unbounded prefix cache holds for each request when it arrives.

    The cache has seen every block of every earlier request and evicts nothing. A
    request's hit is its leading run of blocks seen before (a prefix cache can only
    reuse a prefix; with chained hashes a seen block's predecessors were seen too, so
    this is every seen block), each only as far as an earlier prompt held it (a block
    that was some prompt's last, partial block is cached only that far, and ends the
    run there), cut to whole pages of `page_size` tokens and never reaching the
    prompt's last token, which must be computed to sample the first output token
    (vLLM's rule).

    Args:
      block_ids: each request's block ids, in arrival order.
      prompt_lens: `[num_requests]` each request's prompt length.
      page_size: tokens per KV page (>= 1).
      block_size: tokens per block.

    Returns:
      `[num_requests]` int64 cached prompt tokens.
    """
    if len(block_ids) != len(prompt_lens):
        raise ValueError(f"block_ids has {len(block_ids)} requests, prompt_lens "
                         f"{len(prompt_lens)}; expected one entry per request in both")
    if isinstance(page_size, bool) or int(page_size) != page_size or page_size < 1:
        raise ValueError(f"page_size must be an integer >= 1, got {page_size!r}")
    seen: dict[int, int] = {}  # block id -> most of its tokens an earlier prompt held
    cached = np.zeros(len(block_ids), dtype=np.int64)  # [num_requests]
    for i, (blocks, prompt_len) in enumerate(zip(block_ids, prompt_lens)):
        hit = 0
        for block in blocks:
            held = seen.get(block, 0)
            hit += held
            if held < block_size:
                break
        cached[i] = min(hit, int(prompt_len) - 1) // page_size * page_size
        for k, block in enumerate(blocks):
            held = min(block_size, int(prompt_len) - k * block_size)
            seen[block] = max(seen.get(block, 0), held)
    return cached
