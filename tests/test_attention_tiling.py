"""The attention kernel's static choices: tile tables, the split-KV occupancy rule, the
pass plan of a bucket. Pure Python (pallas_kernels.tiling imports no jax)."""

from __future__ import annotations

import hypothesis
import hypothesis.strategies as st
import pytest

from pallas_kernels.tiling import (
    DECODE_TILES,
    H200_NUM_SMS,
    MIN_TILES_PER_SPLIT,
    RaggedAttentionConfig,
    choose_kv_splits,
    decode_block_q,
    plan_passes,
    tile_config,
)

LLAMA3_8B = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=16, itemsize=2)


@pytest.mark.parametrize("num_items, max_kv_tiles, expected", [
    (64, 64, 1),  # 64 decodes x 8 KV heads = 512 programs: two waves already
    (33, 64, 1),  # 264 programs: exactly two waves
    (32, 64, 2),  # 256 programs: one split more reaches 512
    (8, 128, 5),  # 8 x 8k contexts (128 tiles of 64): 64 programs need 5 splits for 264
    (1, 16, 4),  # one 1k context: 33 splits wanted, but a split keeps >= 4 of its 16 tiles
    (1, 3, 1),  # too short to split at all
    (1, 10_000, 16),  # one very long context: capped
])
def test_kv_splits_cover_the_sms_twice_within_the_tile_floor(num_items, max_kv_tiles, expected):
    assert choose_kv_splits(num_kv_heads=8, num_items=num_items,
                            max_kv_tiles=max_kv_tiles) == expected


@hypothesis.given(heads=st.integers(1, 64), items=st.integers(1, 512),
                  tiles=st.integers(1, 4096), sms=st.integers(1, 200))
def test_kv_split_rule_properties(heads, items, tiles, sms):
    splits = choose_kv_splits(num_kv_heads=heads, num_items=items, max_kv_tiles=tiles,
                              num_sms=sms)
    assert 1 <= splits <= 16
    covered = heads * items * splits >= 2 * sms
    # Either the grid covers every SM twice, or a cap stopped it: the tile floor or 16.
    assert covered or splits in (max(1, tiles // MIN_TILES_PER_SPLIT), 16)
    if splits > 1:
        assert tiles // splits >= MIN_TILES_PER_SPLIT  # no split of tiny KV ranges
        # And no more splits than needed: one fewer would not cover the SMs twice.
        assert heads * items * (splits - 1) < 2 * sms


@pytest.mark.parametrize("group, block_q", [(1, 16), (2, 8), (4, 4), (8, 2), (16, 1), (32, 1)])
def test_decode_tiles_are_16_rows_or_one_token(group, block_q):
    assert decode_block_q(group) == block_q


def test_llama3_8b_decode_bucket_plan():
    # 64 slots x 64 tokens, 8k page rows: 16-row decode tiles (4 tokens x group 4), no split
    # (512 programs), then 64-row prefill tiles for the <= 12 sequences of >= 5 tokens.
    plan = plan_passes(num_tokens=64, num_slots=64, pages_per_seq=512, **LLAMA3_8B)
    d, p = plan.decode, plan.prefill
    assert (d.block_q, d.rows, d.block_kv, d.num_kv_splits, d.max_work) == (4, 16, 128, 1, 64)
    assert d.num_stages >= 3
    assert (p.block_q, p.rows, p.block_kv, p.num_kv_splits) == (16, 64, 64, 1)
    assert p.max_work == (64 + 12 * 15) // 16


def test_few_long_decodes_are_split():
    plan = plan_passes(num_tokens=8, num_slots=8, pages_per_seq=512, **LLAMA3_8B)
    assert plan.decode.num_kv_splits == 5 and 8 * 8 * 5 >= 2 * H200_NUM_SMS
    assert plan.prefill.max_work == 1  # 8 tokens hold one sequence of >= 5 (one tile)
    tiny = plan_passes(num_tokens=4, num_slots=4, pages_per_seq=512, **LLAMA3_8B)
    assert tiny.prefill is None  # 4 tokens: no sequence can have the 5 a prefill needs
    assert tiny.decode.num_kv_splits == 9  # 4 x 8 x 9 = 288 >= 264


def test_config_overrides_and_one_pass_mode():
    config = RaggedAttentionConfig(block_q=8, block_kv=128, num_kv_splits=2, num_warps=8,
                                   num_stages=4)
    plan = plan_passes(num_tokens=64, num_slots=64, pages_per_seq=512, config=config,
                       **LLAMA3_8B)
    assert (plan.prefill.block_q, plan.prefill.rows, plan.prefill.block_kv) == (8, 32, 128)
    assert (plan.decode.num_kv_splits, plan.decode.min_tiles_per_split) == (2, 1)
    assert {(t.num_warps, t.num_stages) for t in plan.passes()} == {(8, 4)}
    one = plan_passes(num_tokens=64, num_slots=64, pages_per_seq=512, **LLAMA3_8B,
                      config=RaggedAttentionConfig(decode_pass=False))
    assert one.decode is None and one.prefill.max_work == 64  # any sequence, even 1 token


def test_tiles_follow_dtype_and_page_size():
    assert tile_config(DECODE_TILES, 128, 2, 16).block_kv == 128
    assert tile_config(DECODE_TILES, 128, 4, 16).block_kv == 64  # f32: half the tokens
    assert tile_config(DECODE_TILES, 128, 2, 256).block_kv == 256  # whole pages
    assert tile_config(DECODE_TILES, 96, 2, 16) == tile_config(DECODE_TILES, 128, 2, 16)


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_q_heads=48, num_kv_heads=8), r"48 // 8 = 6"),
    (dict(num_q_heads=512, num_kv_heads=1), r"the decode tile: block_q \(1\) \* group \(512\)"),
    (dict(page_size=24), r"power-of-two page size \(k_pages.shape\[1\]\), got 24"),
])
def test_plan_rejects_untileable_layouts_by_name(kwargs, match):
    shapes = dict(LLAMA3_8B, **kwargs)
    with pytest.raises(ValueError, match=match):
        plan_passes(num_tokens=64, num_slots=8, pages_per_seq=8, **shapes)
