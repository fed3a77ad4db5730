"""Weights drawn on the device (no host copy) and the KV cache sized from free memory."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from orca_jax.model import device_init, weights
from orca_jax.model import llama as model_lib
from orca_jax.specs.model_config import get_model_config

TINY = get_model_config("tiny")
LLAMA3_8B = get_model_config("llama3-8b")


@pytest.fixture(scope="module")
def drawn():
    return device_init.init_params_on_device(TINY, seed=0, dtype=jnp.bfloat16)


def test_drawn_params_have_the_models_shapes_and_dtype(drawn):
    _, abstract = model_lib.abstract_model(TINY, jnp.bfloat16)
    want = {jax.tree_util.keystr(p): (leaf.shape, leaf.dtype)
            for p, leaf in jax.tree_util.tree_leaves_with_path(abstract)}
    got = {jax.tree_util.keystr(p): (leaf.shape, leaf.dtype)
           for p, leaf in jax.tree_util.tree_leaves_with_path(drawn)}
    assert got == want


def test_norms_are_ones_and_kernels_lecun_scaled(drawn):
    leaves = {jax.tree_util.keystr(p): np.asarray(leaf, np.float32)
              for p, leaf in jax.tree_util.tree_leaves_with_path(drawn)}
    norm = leaves["['layers'][0]['input_layernorm']['weight'].value"]
    assert np.all(norm == 1.0)
    down = leaves["['layers'][0]['down_proj']['kernel'].value"]  # [ffn 256, d 128]
    assert down.std() == pytest.approx(256 ** -0.5, rel=0.1)
    embed = leaves["['embed_tokens']['embedding'].value"]  # [vocab, d 128]
    assert embed.std() == pytest.approx(128 ** -0.5, rel=0.1)


def test_the_draw_follows_the_seed(drawn):
    again = device_init.init_params_on_device(TINY, seed=0, dtype=jnp.bfloat16)
    other = device_init.init_params_on_device(TINY, seed=1, dtype=jnp.bfloat16)
    first = jax.tree_util.tree_leaves(drawn)[0]
    assert np.array_equal(first, jax.tree_util.tree_leaves(again)[0])
    assert not np.array_equal(first, jax.tree_util.tree_leaves(other)[0])


def test_no_byte_of_a_weight_crosses_from_the_host():
    # One jitted program draws every leaf; its seed is a constant of the program, so
    # not even a scalar is transferred. The eager path (nnx.Rngs) does transfer.
    with jax.transfer_guard_host_to_device("disallow_explicit"):
        device_init.init_params_on_device(TINY, seed=3, dtype=jnp.bfloat16)
        with pytest.raises(Exception, match="host-to-device"):
            weights.init_params(TINY, seed=3, dtype=jnp.bfloat16)


def test_kv_pages_from_fake_memory_stats():
    stats = {"bytes_limit": 80_000_000_000, "bytes_in_use": 16_000_000_000}
    free = device_init.free_bytes_of(stats)
    assert free == 64_000_000_000
    # llama3-8b bf16, 16-token pages: 2 (K, V) x 32 layers x 16 x 8 heads x 128 x 2 B.
    page = device_init.kv_page_bytes(LLAMA3_8B, 16, jnp.bfloat16)
    assert page == 2_097_152
    pages = device_init.kv_pages_for_free_memory(LLAMA3_8B, page_size=16, dtype=jnp.bfloat16,
                                                 free_bytes=free, fallback_bytes=1,
                                                 fraction=0.8)
    assert pages == 51_200_000_000 // 2_097_152 == 24_414
    capped = device_init.kv_pages_for_free_memory(LLAMA3_8B, page_size=16, dtype=jnp.bfloat16,
                                                  free_bytes=free, fallback_bytes=1,
                                                  max_pages=100)
    assert capped == 100
    assert device_init.kv_page_bytes(LLAMA3_8B, 16, jnp.bfloat16, tp=2) == page // 2


def test_kv_pages_fall_back_without_memory_stats():
    assert device_init.free_bytes_of(None) is None
    assert device_init.free_bytes_of({"bytes_in_use": 5}) is None
    pages = device_init.kv_pages_for_free_memory(TINY, page_size=16, dtype=jnp.float32,
                                                 free_bytes=None, fallback_bytes=1_000_000)
    # tiny fp32: 2 x 2 layers x 16 x 2 heads x 32 x 4 B = 16,384 B a page.
    assert pages == 1_000_000 // 16_384


def test_kv_sizing_rejects_a_bad_fraction_and_too_little_memory():
    with pytest.raises(ValueError, match="fraction"):
        device_init.kv_pages_for_free_memory(TINY, page_size=16, dtype=jnp.float32,
                                             free_bytes=10 ** 9, fallback_bytes=1, fraction=0)
    with pytest.raises(ValueError, match="at least 2"):
        device_init.kv_pages_for_free_memory(TINY, page_size=16, dtype=jnp.float32,
                                             free_bytes=20_000, fallback_bytes=1)
