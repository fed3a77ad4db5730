"""The Pallas kernel lowers for CUDA on a CPU-only machine, at engine-like bucket shapes.

Lowering runs the Pallas-to-Triton translation, which rejects what the GPU backend
cannot take (non-power-of-two tiles, unsupported indexing, scalar prefetch), so such a
change fails here rather than on a user's GPU. Compiling the Triton IR to GPU code
happens later, on a GPU, and is not covered.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.ragged_paged_attention import (
    RaggedAttentionConfig,
    ragged_paged_attention,
)

# What jax 0.10.2 emits for a Pallas call lowered through the Triton backend.
TRITON_CALL = "stablehlo.custom_call @__gpu$xla.gpu.triton"


def _lower_for_cuda(num_tokens: int, num_slots: int, *, num_q_heads: int, num_kv_heads: int,
                    head_dim: int, page_size: int, pages_per_seq: int, num_pages: int, dtype,
                    config: RaggedAttentionConfig) -> str:
    kv_shape = (num_pages, page_size, num_kv_heads, head_dim)
    args = (jax.ShapeDtypeStruct((num_tokens, num_q_heads, head_dim), dtype),
            jax.ShapeDtypeStruct(kv_shape, dtype), jax.ShapeDtypeStruct(kv_shape, dtype),
            jax.ShapeDtypeStruct((num_slots,), jnp.int32),
            jax.ShapeDtypeStruct((num_slots, pages_per_seq), jnp.int32),
            jax.ShapeDtypeStruct((num_slots + 1,), jnp.int32),
            jax.ShapeDtypeStruct((1,), jnp.int32))
    fn = functools.partial(ragged_paged_attention, sm_scale=head_dim ** -0.5, config=config)
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


# (T, S) buckets of a serving engine: decode-only, mixed, prefill-heavy.
@pytest.mark.parametrize("num_tokens, num_slots", [(16, 16), (256, 32), (512, 8)])
def test_llama3_8b_head_shapes_lower_to_one_triton_call(num_tokens, num_slots):
    config = RaggedAttentionConfig(block_q=16, block_kv=64)
    text = _lower_for_cuda(num_tokens, num_slots, num_q_heads=32, num_kv_heads=8,
                           head_dim=128, page_size=16, pages_per_seq=64, num_pages=1025,
                           dtype=jnp.bfloat16, config=config)
    assert text.count(TRITON_CALL) == 1
    # Grid: one program per (KV head, work item, split); no program per padded slot.
    max_work = min(num_tokens, (num_tokens + num_slots * 15) // 16)
    grid = re.search(r"grid_x = (\d+) : i32, grid_y = (\d+) : i32, grid_z = (\d+) : i32", text)
    assert grid is not None and tuple(map(int, grid.groups())) == (8, max_work, 1)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_split_kv_variant_lowers_with_a_split_grid_axis(dtype):
    config = RaggedAttentionConfig(block_q=4, block_kv=32, num_kv_splits=8)
    text = _lower_for_cuda(32, 32, num_q_heads=16, num_kv_heads=4, head_dim=64, page_size=8,
                           pages_per_seq=32, num_pages=300, dtype=dtype, config=config)
    assert text.count(TRITON_CALL) == 1
    assert re.search(r"grid_x = 4 : i32, grid_y = 32 : i32, grid_z = 8 : i32", text)


def test_untileable_head_dim_is_rejected_by_name_before_lowering():
    # A 48-wide head would make every load non-power-of-two; the wrapper says so by name
    # before the Triton lowering would fail with a less helpful message.
    with pytest.raises(ValueError, match=r"head_dim \(q.shape\[2\]\) to be a power of two"):
        _lower_for_cuda(16, 4, num_q_heads=4, num_kv_heads=4, head_dim=48, page_size=16,
                        pages_per_seq=4, num_pages=17, dtype=jnp.float32,
                        config=RaggedAttentionConfig())
