"""The Pallas kernel lowers for CUDA on a CPU-only machine, at engine-like bucket shapes.

Lowering runs the Pallas-to-Triton translation, which rejects what the GPU backend
cannot take (non-power-of-two tiles, unsupported indexing, scalar prefetch), so such a
change fails here rather than on a user's GPU. The Triton IR each pass prints
(`debug=True`) is read for the shapes that decide speed: a 16-row decode accumulator,
page ids loaded once per page, no integer division in the KV loop, 64-bit offsets for
a cache over 4 GiB. Compiling the IR to GPU code happens later, on a GPU, and is not
covered. jax >= 0.11 needs an abstract GPU device to lower Triton calls without one.
"""

from __future__ import annotations

import contextlib
import functools
import io
import re
import warnings

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

from pallas_kernels.ragged_paged_attention import (
    RaggedAttentionConfig,
    ragged_paged_attention,
)

TRITON_CALL = "stablehlo.custom_call @__gpu$xla.gpu.triton"
H200 = AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
# 8k-token page rows (512 pages of 16).
LLAMA3_8B = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=16, pages_per_seq=512,
                 num_pages=1025, dtype=jnp.bfloat16)


@contextlib.contextmanager
def cuda_target():
    """Lowers as if for an H200: jax >= 0.11 reads the target from an abstract mesh."""
    with use_abstract_mesh(AbstractMesh((1,), ("gpu",), abstract_device=H200)), \
            warnings.catch_warnings():
        # jax >= 0.11 deprecates the Pallas Triton backend (still the GPU machine's path).
        warnings.filterwarnings("ignore", message=".*Pallas Triton backend is deprecated")
        yield


def _lower_for_cuda(num_tokens: int, num_slots: int, *, num_q_heads: int, num_kv_heads: int,
                    head_dim: int, page_size: int, pages_per_seq: int, num_pages: int, dtype,
                    config: RaggedAttentionConfig | None = None) -> tuple[str, dict[str, str]]:
    """Returns the lowered StableHLO text and each pass's Triton IR, by kernel name."""
    kv_shape = (num_pages, page_size, num_kv_heads, head_dim)
    args = (jax.ShapeDtypeStruct((num_tokens, num_q_heads, head_dim), dtype),
            jax.ShapeDtypeStruct(kv_shape, dtype), jax.ShapeDtypeStruct(kv_shape, dtype),
            jax.ShapeDtypeStruct((num_slots,), jnp.int32),
            jax.ShapeDtypeStruct((num_slots, pages_per_seq), jnp.int32),
            jax.ShapeDtypeStruct((num_slots + 1,), jnp.int32),
            jax.ShapeDtypeStruct((1,), jnp.int32))
    fn = functools.partial(ragged_paged_attention, sm_scale=head_dim ** -0.5, config=config,
                           debug=True)
    printed = io.StringIO()
    with cuda_target(), contextlib.redirect_stdout(printed):
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    modules = {}
    for chunk in printed.getvalue().split("The Triton module for pallas_call")[1:]:
        name = re.search(r"tt\.func public @(\w+)", chunk)
        assert name is not None
        modules[name.group(1)] = chunk.split("The kernel jaxpr for pallas_call")[0]
    return text, modules


def _grids(text: str) -> dict[str, tuple[int, int, int]]:
    found = re.findall(r"grid_x = (\d+) : i32, grid_y = (\d+) : i32, grid_z = (\d+) : i32, "
                       r"ir = \".*?\", name = \"(\w+)\"", text)
    return {name: (int(x), int(y), int(z)) for x, y, z, name in found}


def _kv_loop(module: str) -> str:
    """The body of the module's one `scf.for` (the KV loop), up to its `scf.yield`."""
    lines = [line for line in module.splitlines() if not line.lstrip().startswith("#loc")]
    start = next(i for i, line in enumerate(lines) if "scf.for" in line)
    end = next(i for i in range(start, len(lines)) if "scf.yield" in lines[i])
    assert sum("scf.for" in line for line in lines) == 1
    return "\n".join(lines[start:end + 1])


# (T, S) buckets of a serving engine: decode-only, mixed, prefill-heavy.
@pytest.mark.parametrize("num_tokens, num_slots", [(64, 64), (576, 64), (512, 8)])
def test_llama3_8b_buckets_lower_to_a_decode_and_a_prefill_pass(num_tokens, num_slots):
    text, modules = _lower_for_cuda(num_tokens, num_slots, **LLAMA3_8B)
    assert text.count(TRITON_CALL) == 2
    assert set(modules) == {"ragged_paged_attention_decode", "ragged_paged_attention_prefill"}
    # The work lists are built without loops: no while in the wrapper.
    assert "stablehlo.while" not in text
    grids = _grids(text)
    # Decode: one program per (KV head, sequence slot, split); 64 x 8 programs cover the
    # H200's 132 SMs twice, 8 x 8 need 5 splits (8 * 8 * 5 >= 264).
    splits = 1 if num_slots * 8 >= 264 else 5
    assert grids["ragged_paged_attention_decode"] == (8, num_slots, splits)
    # Prefill: 16-token tiles (64 rows / group 4) of sequences with >= 5 tokens.
    num_prefill = min(num_slots, num_tokens // 5)
    assert grids["ragged_paged_attention_prefill"] == (
        8, min(num_tokens, (num_tokens + num_prefill * 15) // 16), 1)


def test_decode_pass_has_16_row_tiles_per_page_loads_and_no_division_in_its_loop():
    _, modules = _lower_for_cuda(64, 64, **LLAMA3_8B)
    loop = _kv_loop(modules["ragged_paged_attention_decode"])
    # The accumulator (and the m, l rows) the loop carries: 16 rows of head_dim 128.
    assert re.search(r"iter_args\(.*\) -> \(tensor<16x128xf32>, tensor<16xf32>, "
                     r"tensor<16xf32>\)", loop)
    assert "tensor<16x128xbf16> * tensor<128x128xbf16> -> tensor<16x128xf32>" in loop
    # One 8-element page-id load per 128-token tile (pages of 16), never one per token.
    assert re.findall(r"tt\.load %\w+ : tensor<(\d+)x!tt\.ptr<i32>>", loop) == ["8"]
    # K and V: [128 tokens, 128] tiles, masked and zero-filled, straight into the dots; the
    # ids are widened per token in registers (the loop's one reshape is of int32 ids).
    masked = re.findall(r"tt\.load %\w+, %\w+, %\w+ : tensor<128x128x!tt\.ptr<bf16>>", loop)
    assert len(masked) == 2
    assert re.findall(r"tt\.reshape %\w+ : (tensor<[\dx]+\w+>)", loop) == ["tensor<8x16xi32>"]
    assert not re.search(r"arith\.(div|rem|floordiv|ceildiv)[su]i", loop)
    assert "__nv_exp2f" in loop and "__nv_expf" not in loop


def test_prefill_pass_has_64_row_tiles():
    _, modules = _lower_for_cuda(576, 64, **LLAMA3_8B)
    loop = _kv_loop(modules["ragged_paged_attention_prefill"])
    assert re.search(r"-> \(tensor<64x128xf32>, tensor<64xf32>, tensor<64xf32>\)", loop)
    assert not re.search(r"arith\.(div|rem)[su]i", loop)


def test_decode_pass_off_lowers_one_pass():
    text, modules = _lower_for_cuda(64, 64, **LLAMA3_8B,
                                    config=RaggedAttentionConfig(decode_pass=False))
    assert text.count(TRITON_CALL) == 1 and list(modules) == ["ragged_paged_attention_prefill"]


def test_cache_over_4_gib_gets_64_bit_offsets():
    # 140,000 pages of 16 x 8 x 128 bf16: 2.3e9 elements, 4.6 GB, past int32 offsets.
    big = dict(LLAMA3_8B, num_pages=140_000)
    _, modules = _lower_for_cuda(64, 64, **big)
    loop = _kv_loop(modules["ragged_paged_attention_decode"])
    assert re.search(r"tt\.addptr %\w+, %\w+ : tensor<128x128x!tt\.ptr<bf16>>, "
                     r"tensor<128x128xi64>", loop)
    _, modules = _lower_for_cuda(64, 64, **LLAMA3_8B)
    loop = _kv_loop(modules["ragged_paged_attention_decode"])
    assert "tensor<128x128xi64>" not in loop


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_split_kv_variant_lowers_with_a_split_grid_axis(dtype):
    config = RaggedAttentionConfig(block_kv=32, num_kv_splits=8)
    text, _ = _lower_for_cuda(32, 32, num_q_heads=16, num_kv_heads=4, head_dim=64, page_size=8,
                              pages_per_seq=32, num_pages=300, dtype=dtype, config=config)
    assert text.count(TRITON_CALL) == 2
    assert _grids(text)["ragged_paged_attention_decode"] == (4, 32, 8)


def test_untileable_head_dim_is_rejected_by_name_before_lowering():
    # A 48-wide head would make every load non-power-of-two; the wrapper says so by name
    # before the Triton lowering would fail with a less helpful message.
    with pytest.raises(ValueError, match=r"head_dim \(q.shape\[2\]\) to be a power of two"):
        _lower_for_cuda(16, 4, num_q_heads=4, num_kv_heads=4, head_dim=48, page_size=16,
                        pages_per_seq=4, num_pages=17, dtype=jnp.float32)
