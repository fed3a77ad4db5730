"""The KV pools (allocation, growth, free, row reuse) and `pack_step()`'s arrays and buckets."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orca_jax.core.kv import KVPool, make_pool
from orca_jax.core.step.engine_api import NULL_PAGE, Bucket, bucket_arrays_are_consistent
from orca_jax.core.step.packing import (
    BucketConfig,
    SamplingArrays,
    bucket_config_for,
    default_token_sizes,
    pack_step,
)


def manager(num_pages=10, page_size=4, max_pages_per_seq=4, num_requests=8) -> KVPool:
    return make_pool(num_kv_pages=num_pages, page_size=page_size,
                     max_pages_per_seq=max_pages_per_seq, num_requests=num_requests)


def ids(*values):
    return np.asarray(values, dtype=np.int64)


# ------------------------------------------------------------------ KV pages
def test_pages_for_tokens_and_pages_needed():
    kv = manager(page_size=4)
    np.testing.assert_array_equal(kv.pages_for_tokens(ids(0, 1, 3, 4, 5, 8, 9)),
                                  [0, 1, 1, 1, 2, 2, 3])
    kv.allocate(ids(0), ids(6))  # 2 pages
    np.testing.assert_array_equal(kv.pages_needed(ids(0, 0, 0, 0, 1), ids(3, 8, 9, 16, 5)),
                                  [0, 0, 1, 2, 2])  # never negative; request 1 holds nothing


def test_allocate_grow_and_free():
    kv = manager(num_pages=10, page_size=4, max_pages_per_seq=4)
    assert kv.num_free == 10 and kv.num_used == 0
    kv.allocate(ids(3, 5), ids(5, 1))  # 2 pages and 1 page
    first3, first5 = kv.pages_of(3), kv.pages_of(5)
    assert first3.size == 2 and first5.size == 1
    assert kv.num_free == 7 and kv.num_used == 3
    np.testing.assert_array_equal(kv.num_held[[3, 5]], [2, 1])
    kv.allocate(ids(3), ids(13))  # grows to 4 pages; the old ones stay, in order
    grown = kv.pages_of(3)
    assert grown.size == 4 and kv.num_free == 5
    np.testing.assert_array_equal(grown[:2], first3)
    kv.allocate(ids(3), ids(10))  # a smaller target never shrinks
    assert kv.pages_of(3).size == 4 and kv.num_free == 5
    everything = np.concatenate([grown, first5])
    assert len(set(everything.tolist())) == 5 and NULL_PAGE not in everything
    assert ((everything >= 1) & (everything <= 10)).all()
    kv.check_consistency()
    kv.free(ids(3))
    assert kv.num_free == 9 and kv.num_held[3] == 0 and kv.pages_of(3).size == 0
    assert kv.row_of[3] == -1
    np.testing.assert_array_equal(kv.pages_of(5), first5)
    kv.free(ids(3, 7))  # freeing what holds nothing is harmless
    assert kv.num_free == 9
    kv.check_consistency()


def test_a_batch_free_and_a_mixed_allocation_keep_the_page_order():
    # Several requests of different widths freed at once (one holding nothing): their pages
    # go back in request order, so the next grant takes them in that order; rows and the
    # page table are cleared. Then one allocation mixing a request growing one page, a new
    # one (no row yet) taking two and one taking none hands out the pages that allocating
    # them one at a time, in request order, would.
    pools = [manager(num_pages=12, page_size=2, max_pages_per_seq=6, num_requests=6)
             for _ in range(2)]
    for kv in pools:
        kv.allocate(ids(0, 1, 2), ids(2, 9, 5))  # 1, 5 and 3 pages
        held0, held1 = kv.pages_of(0), kv.pages_of(1)
        rows = kv.row_of[[0, 1]].copy()
        kv.free(ids(0, 4, 1))  # request 4 holds nothing
        assert kv.num_free == 9 and (kv.row_of[[0, 1, 4]] == -1).all()
        assert not kv.page_table[rows].any()
        kv.allocate(ids(3), ids(12))  # 6 pages: the freed ones first, in request order
        np.testing.assert_array_equal(kv.pages_of(3), np.concatenate([held0, held1]))
    batched, one_by_one = pools
    batched.allocate(ids(2, 5, 3), ids(8, 3, 12))  # 2 grows 1 page, 5 takes 2, 3 none
    one_by_one.allocate(ids(2), ids(8))
    one_by_one.allocate(ids(5), ids(3))
    for request in (2, 3, 5):
        np.testing.assert_array_equal(batched.pages_of(request), one_by_one.pages_of(request))
    assert batched.pages_of(2).size == 4 and batched.pages_of(5).size == 2
    assert batched.row_of[5] >= 0 and batched.num_free == 0
    batched.check_consistency()


def test_page_zero_is_never_handed_out():
    kv = manager(num_pages=6, page_size=2, max_pages_per_seq=6, num_requests=3)
    kv.allocate(ids(0, 1, 2), ids(4, 4, 4))
    assert kv.num_free == 0
    pages = np.concatenate([kv.pages_of(i) for i in range(3)])
    np.testing.assert_array_equal(np.sort(pages), np.arange(1, 7))


def test_overcommit_and_overlong_are_refused_without_side_effects():
    kv = manager(num_pages=5, page_size=4, max_pages_per_seq=3)
    kv.allocate(ids(0), ids(8))
    table_before, free_before = kv.page_table.copy(), kv.num_free
    with pytest.raises(RuntimeError, match="overcommitted"):
        kv.allocate(ids(1, 2), ids(8, 8))  # 4 pages, 3 free
    with pytest.raises(RuntimeError, match="max_pages_per_seq"):
        kv.allocate(ids(0), ids(13))  # 4 pages > 3 per sequence
    assert kv.num_free == free_before and (kv.num_held[1:] == 0).all()
    assert (kv.row_of[1:] == -1).all()
    np.testing.assert_array_equal(kv.page_table[:table_before.shape[0]], table_before)
    kv.check_consistency()


def test_rows_are_reused():
    kv = manager(num_pages=64, page_size=4, max_pages_per_seq=4, num_requests=200)
    live: list[int] = []
    for request in range(200):  # at most 5 alive at once
        kv.allocate(ids(request), ids(1 + request % 16))
        live.append(request)
        if len(live) == 5:
            kv.free(ids(live.pop(0)))
    assert kv.page_table.shape[0] <= 16  # never more rows than ever held at once (min 16)
    rows = kv.row_of[live]
    assert len(set(rows.tolist())) == 4 and (rows >= 0).all()
    kv.check_consistency()


def test_check_consistency_catches_a_leak():
    kv = manager()
    kv.allocate(ids(0), ids(8))
    kv.page_table[kv.row_of[0], 1] = kv.page_table[kv.row_of[0], 0]  # a page owned twice
    with pytest.raises(AssertionError, match="leaked or double-owned"):
        kv.check_consistency()


@settings(max_examples=30, deadline=None, derandomize=True)
@given(ops=st.lists(st.tuples(st.booleans(), st.lists(st.integers(0, 11), min_size=1,
                                                       max_size=4, unique=True),
                              st.integers(0, 24)), max_size=40))
def test_random_operations_keep_the_pool_consistent(ops):
    page_size, num_pages, width = 4, 16, 6
    kv = manager(num_pages=num_pages, page_size=page_size, max_pages_per_seq=width,
                 num_requests=12)
    model: dict[int, list[int]] = {}  # request -> its pages, as the manager reported them
    for is_free, requests, tokens in ops:
        request_ids = ids(*requests)
        if is_free:
            kv.free(request_ids)
            for r in requests:
                model.pop(r, None)
        else:
            targets = np.full(len(requests), tokens, dtype=np.int64)
            need = np.maximum(-(-targets // page_size)
                              - np.asarray([len(model.get(r, [])) for r in requests]), 0)
            if need.sum() > kv.num_free:
                with pytest.raises(RuntimeError):
                    kv.allocate(request_ids, targets)
            else:
                kv.allocate(request_ids, targets)
                for r in requests:
                    pages = kv.pages_of(r).tolist()
                    held_before = model.get(r, [])
                    assert pages[:len(held_before)] == held_before  # growth keeps old pages
                    if pages:
                        model[r] = pages
        kv.check_consistency()
        held = [p for pages in model.values() for p in pages]
        assert len(held) == len(set(held)) and NULL_PAGE not in held
        assert kv.num_free == num_pages - len(held) >= 0
        for r in range(12):
            assert kv.num_held[r] == len(model.get(r, []))
            assert (kv.row_of[r] >= 0) == (r in model)


# ------------------------------------------------------------- pack_step()
PAGE = 4
CONFIG = BucketConfig(token_sizes=(4, 8, 16, 32), max_num_seqs=8, pages_per_seq=4)


def sampling(n=10) -> SamplingArrays:
    return SamplingArrays(temperature=np.arange(n, dtype=np.float32) / 10,
                          top_k=np.arange(n, dtype=np.int32) + 100,
                          top_p=np.linspace(0.5, 0.95, n).astype(np.float32),
                          rng_seeds=np.arange(n, dtype=np.uint32) * 7 + 1)


def test_pack_mixed_batch_exact_arrays():
    # A decode (9 cached, 1 new), the rest of a half-done prefill (4 cached, 3 new) and a
    # whole 5-token prompt: 9 tokens of 3 sequences, padded to the (16, 8) bucket.
    page_rows = np.array([[3, 8, 6, 0], [2, 5, 0, 0], [1, 4, 0, 0]], dtype=np.int32)
    token_ids = np.arange(101, 110, dtype=np.int32)
    inputs = pack_step(bucket_config=CONFIG, request_ids=ids(7, 2, 5), num_tokens=ids(1, 3, 5),
                       num_computed=ids(9, 4, 0), page_rows=page_rows, page_size=PAGE,
                       sampling=sampling(), token_ids=token_ids).inputs
    assert inputs.bucket == Bucket(16, 8)
    assert bucket_arrays_are_consistent(inputs)
    pad = [0] * 7
    np.testing.assert_array_equal(inputs.token_ids, list(range(101, 110)) + pad)
    np.testing.assert_array_equal(inputs.positions, [9, 4, 5, 6, 0, 1, 2, 3, 4] + pad)
    np.testing.assert_array_equal(inputs.cu_q_lens, [0, 1, 4, 9, 9, 9, 9, 9, 9])
    np.testing.assert_array_equal(inputs.kv_lens, [10, 7, 5, 0, 0, 0, 0, 0])
    expected_pages = np.zeros((8, 4), np.int32)
    expected_pages[:3] = page_rows
    np.testing.assert_array_equal(inputs.page_indices, expected_pages)
    # Position 9 of [3, 8, 6] is page 6 offset 1; 4..6 of [2, 5] are page 5 offsets 0..2;
    # 0..4 of [1, 4] are page 1 offsets 0..3 and page 4 offset 0. Padding writes page 0.
    np.testing.assert_array_equal(inputs.slot_mapping,
                                  [25, 20, 21, 22, 4, 5, 6, 7, 16] + pad)
    np.testing.assert_array_equal(inputs.sample_indices, [0, 3, 8, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(inputs.num_seqs, [3])
    assert inputs.num_real_tokens == 9 and inputs.num_real_seqs == 3
    seq_pad = [0] * 5
    np.testing.assert_allclose(inputs.temperature, [0.7, 0.2, 0.5] + seq_pad)
    np.testing.assert_array_equal(inputs.top_k, [107, 102, 105] + seq_pad)
    np.testing.assert_allclose(inputs.top_p[:3], sampling().top_p[[7, 2, 5]])
    np.testing.assert_allclose(inputs.top_p[3:], 1.0)
    np.testing.assert_array_equal(inputs.rng_seeds, [50, 15, 36] + seq_pad)
    for name in ("token_ids", "positions", "cu_q_lens", "kv_lens", "page_indices",
                 "slot_mapping", "sample_indices", "num_seqs"):
        assert getattr(inputs, name).dtype == np.int32, name


def test_pack_all_decodes():
    page_rows = np.array([[2, 0, 0, 0], [5, 7, 0, 0], [1, 3, 4, 6]], dtype=np.int32)
    inputs = pack_step(bucket_config=CONFIG, request_ids=ids(0, 1, 2), num_tokens=ids(1, 1, 1),
                       num_computed=ids(0, 5, 15), page_rows=page_rows, page_size=PAGE,
                       sampling=sampling(), token_ids=None).inputs
    assert inputs.bucket == Bucket(4, 4)  # S = min(T, max_num_seqs)
    np.testing.assert_array_equal(inputs.positions, [0, 5, 15, 0])
    np.testing.assert_array_equal(inputs.slot_mapping, [8, 29, 27, 0])
    np.testing.assert_array_equal(inputs.cu_q_lens, [0, 1, 2, 3, 3])
    np.testing.assert_array_equal(inputs.kv_lens, [1, 6, 16, 0])
    np.testing.assert_array_equal(inputs.sample_indices, [0, 1, 2, 0])
    np.testing.assert_array_equal(inputs.token_ids, [0, 0, 0, 0])  # no ids: zeros
    np.testing.assert_array_equal(inputs.page_indices[3], [0, 0, 0, 0])


def test_pack_fills_a_bucket_exactly():
    page_rows = np.array([[1, 2, 0, 0]], dtype=np.int32)
    inputs = pack_step(bucket_config=CONFIG, request_ids=ids(4), num_tokens=ids(8),
                       num_computed=ids(0), page_rows=page_rows, page_size=PAGE,
                       sampling=sampling(), token_ids=np.arange(1, 9, dtype=np.int32)).inputs
    assert inputs.bucket == Bucket(8, 8)
    np.testing.assert_array_equal(inputs.slot_mapping, [4, 5, 6, 7, 8, 9, 10, 11])
    np.testing.assert_array_equal(inputs.cu_q_lens, [0, 8, 8, 8, 8, 8, 8, 8, 8])
    np.testing.assert_array_equal(inputs.sample_indices, [7, 0, 0, 0, 0, 0, 0, 0])


@pytest.mark.parametrize("num_tokens, bucket", [
    (1, Bucket(4, 4)), (4, Bucket(4, 4)), (5, Bucket(8, 8)), (8, Bucket(8, 8)),
    (9, Bucket(16, 8)), (17, Bucket(32, 8)), (32, Bucket(32, 8)),
])
def test_bucket_selection_is_the_smallest_that_fits(num_tokens, bucket):
    assert CONFIG.select(num_tokens) == bucket


def test_bucket_config():
    assert CONFIG.buckets() == [Bucket(4, 4), Bucket(8, 8), Bucket(16, 8), Bucket(32, 8)]
    assert CONFIG.max_num_tokens == 32
    with pytest.raises(ValueError, match="33 tokens exceed the largest bucket"):
        CONFIG.select(33)
    assert default_token_sizes(100) == (16, 32, 64, 100)
    assert default_token_sizes(64) == (16, 32, 64)
    assert default_token_sizes(8) == (8,)
    config = bucket_config_for(max_num_tokens=48, max_num_seqs=6, max_model_len=50, page_size=8)
    assert config.token_sizes == (16, 32, 48) and config.pages_per_seq == 7
    assert config.buckets()[0] == Bucket(16, 6)
    with pytest.raises(ValueError, match="largest bucket"):
        bucket_config_for(max_num_tokens=48, max_num_seqs=6, max_model_len=50, page_size=8,
                          token_sizes=(16, 32))
    for sizes in [(8, 4), (4, 4, 8), (0, 4), ()]:
        with pytest.raises(ValueError, match="bucket token sizes"):
            BucketConfig(token_sizes=sizes, max_num_seqs=4, pages_per_seq=2)
