"""Tile tables and the split-KV occupancy rule of the ragged paged attention kernel.

Standard library only, so the rules can be read, tested and printed without jax.
Everything here is a function of static shapes (the engine's bucket), so each
choice compiles once per bucket and never per step.

Two passes share one kernel body:
  * decode: sequences with at most `decode_block_q(group)` new tokens. Their tile
    is 16 rows (the smallest dot the GPU takes): `16 // group` tokens times the
    `group` query heads that read one KV head, so a llama3-8b decode (group 4)
    fills 4 of 16 rows instead of 4 of 64. Long contexts with few sequences are
    split along the KV axis (`choose_kv_splits`).
  * prefill/mixed: every longer sequence, in tiles of `PREFILL_ROWS` rows.
The tables are for an H200 (sm_90, 228 KB shared memory per SM); the head_dim-128
entries are tuned from `benchmarks/attention_gpu.py`'s figures on one, the others
are starting points.
"""

from __future__ import annotations

import dataclasses

H200_NUM_SMS = 132  # streaming multiprocessors of an H200 (and an H100 SXM)
DECODE_ROWS = 16  # rows of a decode tile: the smallest M a GPU dot takes
PREFILL_ROWS = 64  # rows of a prefill/mixed tile (block_q * group)
MAX_ROWS = 128  # more rows than this spill the accumulator out of registers
MIN_TILES_PER_SPLIT = 4  # a KV split below this many tiles costs more in merging than it saves
MAX_KV_SPLITS = 16
OCCUPANCY_WAVES = 2  # programs per SM the split rule aims for


def is_power_of_two(n: int) -> bool:
    return isinstance(n, int) and n >= 1 and (n & (n - 1)) == 0


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """One pass's static tile: KV tokens per inner step and Triton's launch knobs."""

    block_kv: int  # KV tokens per inner loop step (whole pages)
    num_warps: int
    num_stages: int  # software-pipelining depth of the KV loop


# Keyed by head_dim, for 2-byte caches (bf16/f16). A stage holds one K and one V tile,
# 2 * block_kv * head_dim * 2 bytes: 32 KB at (64, 128), so 3 stages take 96 KB and two
# programs still share an SM. 4-byte caches halve block_kv (`tile_config`).
# Tuned on an H200 (benchmarks/results/attention_h200.txt, llama3-8b heads, bf16): at
# head_dim 128 a decode tile of 128 KV tokens (3 stages, 192 KB) read 64 x {2k, 4k, 8k}
# contexts at 66/74/78% of the measured HBM read ceiling where 64 tokens read 61/68/73%;
# the prefill tile stays at 64 (128 there made the mixed step 15% slower).
DECODE_TILES: dict[int, TileConfig] = {
    64: TileConfig(block_kv=128, num_warps=4, num_stages=3),
    128: TileConfig(block_kv=128, num_warps=4, num_stages=3),
    256: TileConfig(block_kv=32, num_warps=4, num_stages=3),
}
PREFILL_TILES: dict[int, TileConfig] = {
    64: TileConfig(block_kv=128, num_warps=4, num_stages=3),
    128: TileConfig(block_kv=64, num_warps=4, num_stages=3),
    256: TileConfig(block_kv=32, num_warps=8, num_stages=2),
}


def tile_config(table: dict[int, TileConfig], head_dim: int, itemsize: int,
                page_size: int) -> TileConfig:
    """The table's tile for `head_dim`, resized to the cache dtype and page size.

    A head_dim missing from the table takes the nearest larger entry's tile (or
    the largest). A tile always covers whole pages (JAX's GPU paged attention
    loads whole pages too), so a page larger than the tile widens the tile.
    """
    keys = sorted(table)
    base = table[next((k for k in keys if k >= head_dim), keys[-1])]
    block_kv = base.block_kv if itemsize <= 2 else max(16, base.block_kv // 2)
    return dataclasses.replace(base, block_kv=max(block_kv, page_size))


def decode_block_q(group: int) -> int:
    """Query tokens per decode tile: `DECODE_ROWS // group`, at least 1."""
    return max(1, DECODE_ROWS // group)


def prefill_block_q(group: int) -> int:
    """Query tokens per prefill tile: `PREFILL_ROWS // group`, at least 1."""
    return max(1, PREFILL_ROWS // group)


def check_rows(block_q: int, group: int, what: str) -> None:
    """Raises ValueError unless `block_q * group` rows is a power of two in [16, 128]."""
    rows = block_q * group
    if not is_power_of_two(rows) or not 16 <= rows <= MAX_ROWS:
        raise ValueError(f"{what}: block_q ({block_q}) * group ({group}) = {rows} rows; a tile "
                         f"needs a power of two from 16 (the smallest GPU dot) to {MAX_ROWS} "
                         "(the accumulator must stay in registers)")


def choose_kv_splits(*, num_kv_heads: int, num_items: int, max_kv_tiles: int,
                     num_sms: int = H200_NUM_SMS, waves: int = OCCUPANCY_WAVES,
                     min_tiles_per_split: int = MIN_TILES_PER_SPLIT,
                     max_splits: int = MAX_KV_SPLITS) -> int:
    """KV splits for the decode pass, from the bucket's static shape (FlashInfer's rule).

    The decode grid has `num_kv_heads * num_items * splits` programs. Splits are
    added until that covers `waves` programs per SM, but never so many that a
    split of the longest possible context gets fewer than `min_tiles_per_split`
    KV tiles (the merge would cost more than the split saves), nor more than
    `max_splits`.

    Args:
      num_kv_heads: KV heads (grid axis 0).
      num_items: decode work items the bucket can hold (its sequence slots).
      max_kv_tiles: KV tiles of the longest context a slot's page row can hold.
      num_sms: streaming multiprocessors of the target GPU.
      waves: programs per SM to aim for.
      min_tiles_per_split: fewest KV tiles a split of the longest context gets.
      max_splits: upper bound.

    Returns:
      The number of splits, >= 1.
    """
    programs = num_kv_heads * num_items
    target = waves * num_sms
    if programs >= target:
        return 1
    wanted = -(-target // programs)
    return max(1, min(wanted, max_kv_tiles // min_tiles_per_split, max_splits))


@dataclasses.dataclass(frozen=True, kw_only=True)
class RaggedAttentionConfig:
    """Overrides of the kernel's static choices; None takes the tables' and rules' value.

    Each distinct value compiles its own kernel.
    """

    block_q: int | None = None  # prefill tile tokens; rows = block_q * group <= 128
    block_kv: int | None = None  # KV tokens per inner step (both passes), >= 16
    num_kv_splits: int | None = None  # decode-pass splits, even ones; None: `choose_kv_splits`
    num_warps: int | None = None  # Triton warps per program (both passes)
    num_stages: int | None = None  # Triton pipelining stages (both passes)
    decode_pass: bool = True  # False: every sequence takes prefill tiles (one pallas_call)

    def __post_init__(self) -> None:
        for name in ("block_q", "block_kv", "num_kv_splits"):
            value = getattr(self, name)
            if value is not None and not is_power_of_two(value):
                raise ValueError(
                    f"RaggedAttentionConfig.{name} must be a power of two, got {value!r}")
        if self.block_kv is not None and self.block_kv < 16:
            raise ValueError(
                f"RaggedAttentionConfig.block_kv must be >= 16 (a dot dimension), "
                f"got {self.block_kv}")
        for name in ("num_warps", "num_stages"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(
                    f"RaggedAttentionConfig.{name} must be a positive int, got {value!r}")


@dataclasses.dataclass(frozen=True)
class PassTiles:
    """Everything static about one pass: its tile, launch knobs and grid."""

    block_q: int  # query tokens per tile
    rows: int  # block_q * group, the tile's M
    block_kv: int  # KV tokens per inner step, whole pages
    num_warps: int
    num_stages: int
    num_kv_splits: int  # grid axis 2
    max_work: int  # grid axis 1: the most work items the bucket can produce
    min_tiles_per_split: int = MIN_TILES_PER_SPLIT


@dataclasses.dataclass(frozen=True)
class PassPlan:
    """The decode and prefill/mixed passes of one bucket (either may be absent)."""

    decode: PassTiles | None
    prefill: PassTiles | None

    def passes(self) -> tuple[PassTiles, ...]:
        return tuple(p for p in (self.decode, self.prefill) if p is not None)

    @property
    def max_block_kv(self) -> int:
        return max(p.block_kv for p in self.passes())


def plan_passes(*, num_tokens: int, num_slots: int, num_q_heads: int, num_kv_heads: int,
                head_dim: int, page_size: int, pages_per_seq: int, itemsize: int,
                config: RaggedAttentionConfig | None = None,
                num_sms: int = H200_NUM_SMS) -> PassPlan:
    """The static passes for a bucket of `num_tokens` x `num_slots`, from the shapes alone.

    Sequences of 1..`decode_block_q(group)` new tokens take the decode pass (at
    most one item each, so `min(num_slots, num_tokens)` items); the rest take
    prefill tiles. A pass the bucket cannot use is left out: a bucket of fewer
    tokens than a prefill sequence needs launches no prefill pass.

    Raises:
      ValueError: the group or page size is not a power of two, or a tile's rows
        fall outside [16, 128].
    """
    config = config or RaggedAttentionConfig()
    group = num_q_heads // num_kv_heads
    if not is_power_of_two(group):
        raise ValueError(f"the Pallas kernel needs num_q_heads // num_kv_heads to be a power "
                         f"of two, got {num_q_heads} // {num_kv_heads} = {group}")
    if not is_power_of_two(page_size):
        raise ValueError(f"the Pallas kernel needs a power-of-two page size "
                         f"(k_pages.shape[1]), got {page_size}")

    def tiles(table, block_q: int, splits: int, max_work: int) -> PassTiles:
        base = tile_config(table, head_dim, itemsize, page_size)
        block_kv = max(config.block_kv or base.block_kv, page_size)
        return PassTiles(block_q=block_q, rows=block_q * group, block_kv=block_kv,
                         num_warps=config.num_warps or base.num_warps,
                         num_stages=config.num_stages or base.num_stages,
                         num_kv_splits=splits, max_work=max_work)

    decode = None
    min_prefill_q = 1
    if config.decode_pass:
        block_q = decode_block_q(group)
        check_rows(block_q, group, "the decode tile")
        items = min(num_slots, num_tokens)
        decode = tiles(DECODE_TILES, block_q, 1, items)
        max_tiles = -(-pages_per_seq * page_size // decode.block_kv)
        if config.num_kv_splits:  # forced: every context is split evenly, however short
            decode = dataclasses.replace(decode, num_kv_splits=config.num_kv_splits,
                                         min_tiles_per_split=1 if config.num_kv_splits > 1
                                         else MIN_TILES_PER_SPLIT)
        else:
            decode = dataclasses.replace(decode, num_kv_splits=choose_kv_splits(
                num_kv_heads=num_kv_heads, num_items=items, max_kv_tiles=max_tiles,
                num_sms=num_sms))
        min_prefill_q = block_q + 1
    block_q = config.block_q or prefill_block_q(group)
    check_rows(block_q, group, "the prefill tile" if config.block_q is None
               else "RaggedAttentionConfig.block_q")
    # Each prefill sequence has >= min_prefill_q tokens and wastes < 1 block.
    num_prefill = min(num_slots, num_tokens // min_prefill_q)
    max_work = min(num_tokens, (num_tokens + num_prefill * (block_q - 1)) // block_q)
    prefill = tiles(PREFILL_TILES, block_q, 1, max_work) if num_prefill else None
    return PassPlan(decode=decode, prefill=prefill)
