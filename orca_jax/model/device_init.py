"""A model at scale on one accelerator: random weights made on the device, KV sized to fit.

`weights.init_params` builds the Flax module eagerly, a few hundred small ops and,
where it runs on the host, a host copy of every weight. For an 8B model (16 GB in
bf16) `init_params_on_device` instead draws each weight with `jax.random` inside a
jitted function whose output lives on the device (or is split over a mesh with
`out_shardings`), so no byte of a weight exists on the host and one compiled
program serves every leaf of a shape. The draw is seeded but is not
`init_params`' draw: these weights are for timing and for comparisons within one
run, not for matching another init.

`kv_pages_for_free_memory` sizes the paged KV cache from what the device has free
after the weights (`device.memory_stats()`: `bytes_limit - bytes_in_use`), a
documented fraction of it, so that activations and compiler scratch keep the
rest. A backend without memory stats (the CPU) gets the caller's fallback.
"""

from __future__ import annotations

import functools
from typing import Any, Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from orca_jax.model import llama as model_lib
from orca_jax.model import sharding
from orca_jax.specs.model_config import ModelConfig

# Of the device's free bytes after the weights, the share the KV cache takes. The rest
# holds a step's activations (a 2,048-token llama3-8b step: ~0.5 GB), the logits, XLA's
# scratch and cuBLAS workspaces; vLLM's default gpu_memory_utilization leaves ~10% too.
KV_FREE_FRACTION = 0.8


def _leaf_std(names: list[str], shape: tuple[int, ...]) -> Optional[float]:
    """The draw's standard deviation for a leaf (None: ones, a norm's weight).

    LeCun normal over the input features, as nnx.Linear's default: a kernel [in, out]
    gets 1/sqrt(in); the embedding [vocab, d] gets 1/sqrt(d), so that an embedded
    token has unit RMS like a norm's output.
    """
    if "layernorm" in " ".join(names) or names[:1] == ["norm"]:
        return None
    if names[-1] == "embedding":
        return shape[-1] ** -0.5
    return shape[0] ** -0.5


def _draw_all(abstract: nnx.State, seed: int) -> nnx.State:
    """Every leaf of `abstract` drawn (traced under jit: the seed is a constant of the
    program, so nothing crosses from the host)."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract)
    root = jax.random.key(seed)
    out = []
    for index, (path, leaf) in enumerate(leaves):
        names = [str(getattr(key, "key", getattr(key, "name", key))) for key in path]
        names = [n for n in names if n != "value"]
        shape, dtype = tuple(leaf.shape), jnp.dtype(leaf.dtype)
        std = _leaf_std(names, shape)
        if std is None:
            out.append(jnp.ones(shape, dtype))
        else:  # drawn in the target dtype: no fp32 copy of the leaf, even transiently
            out.append(jax.random.normal(jax.random.fold_in(root, index), shape, dtype)
                       * jnp.asarray(std, dtype))
    return jax.tree_util.tree_unflatten(treedef, out)


def init_params_on_device(config: ModelConfig, *, seed: int = 0,
                          dtype: jnp.dtype = jnp.bfloat16,
                          mesh: Optional[jax.sharding.Mesh] = None) -> nnx.State:
    """Random parameters drawn on the device by one jitted program.

    Args:
      config: the model's shapes.
      seed: the draw's seed (leaf i takes `fold_in(key(seed), i)`).
      dtype: the parameters' dtype.
      mesh: a `tp` mesh (`sharding.make_mesh`): each leaf is drawn already split as
        `sharding.param_shardings` lays it out (`out_shardings`), so no device ever
        holds a whole split leaf; None: the default device.

    Returns:
      A parameter state shaped like `llama.abstract_model(config, dtype)`'s.
    """
    _, abstract = model_lib.abstract_model(config, dtype)
    shardings = None if mesh is None else sharding.param_shardings(abstract, mesh)
    draw = jax.jit(functools.partial(_draw_all, abstract, seed), out_shardings=shardings)
    return draw()


def free_device_bytes(device: Optional[jax.Device] = None) -> Optional[int]:
    """`bytes_limit - bytes_in_use` of `device` (default: the first), or None where the
    backend keeps no memory stats (the CPU)."""
    device = device or jax.devices()[0]
    try:
        stats = device.memory_stats()
    except (AttributeError, NotImplementedError, RuntimeError):
        return None
    return free_bytes_of(stats)


def free_bytes_of(stats: Optional[Mapping[str, Any]]) -> Optional[int]:
    """Free bytes in a `memory_stats()` dict (None when it lacks the two counters)."""
    if not stats or "bytes_limit" not in stats or "bytes_in_use" not in stats:
        return None
    return max(0, int(stats["bytes_limit"]) - int(stats["bytes_in_use"]))


def kv_page_bytes(config: ModelConfig, page_size: int, dtype: jnp.dtype, tp: int = 1) -> int:
    """Bytes of one KV page on one device: K and V of every layer (1/tp of the heads)."""
    heads = -(-config.num_kv_heads // tp)
    return 2 * config.num_layers * page_size * heads * config.head_dim * jnp.dtype(dtype).itemsize


def kv_pages_for_free_memory(config: ModelConfig, *, page_size: int, dtype: jnp.dtype,
                             free_bytes: Optional[int], fallback_bytes: int,
                             fraction: float = KV_FREE_FRACTION,
                             max_pages: Optional[int] = None, tp: int = 1) -> int:
    """Pages of the KV cache (the null page included) that fit in `fraction` of the
    device's free bytes, or in `fallback_bytes` where the device reports none.

    Args:
      config: the model's shapes.
      page_size: tokens per page.
      dtype: the cache's dtype.
      free_bytes: `free_device_bytes()` after the weights are on the device, or None.
      fallback_bytes: the cache's bytes where `free_bytes` is None (a CPU test).
      fraction: the share of the free bytes the cache takes, in (0, 1].
      max_pages: at most this many pages (a benchmark that needs fewer).
      tp: devices the cache's heads are split over.

    Raises:
      ValueError: a fraction outside (0, 1], or not even two pages (null + one) fit.
    """
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"kv_pages_for_free_memory: fraction={fraction} must be in (0, 1]")
    budget = fallback_bytes if free_bytes is None else int(free_bytes * fraction)
    pages = budget // kv_page_bytes(config, page_size, dtype, tp)
    if max_pages is not None:
        pages = min(pages, max_pages)
    if pages < 2:
        raise ValueError(f"kv_pages_for_free_memory: {budget / 1e9:.3g} GB holds {pages} KV "
                         f"page(s) of model {config.name!r}; at least 2 (null + one) needed")
    return int(pages)


def param_bytes(params: nnx.State) -> int:
    """Bytes of every parameter leaf (as laid out, all devices together)."""
    return int(sum(np.prod(leaf.shape) * jnp.dtype(leaf.dtype).itemsize
                   for leaf in jax.tree_util.tree_leaves(params)))
