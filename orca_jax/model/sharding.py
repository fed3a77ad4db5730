"""Tensor parallelism on one host: a 1-D device mesh and a Megatron-style layout.

The model's weights are split over the mesh's `tp` axis as in Megatron-LM, so
each device holds 1/tp of every large matrix:

* column-parallel (output features split): `q_proj`, `k_proj`, `v_proj`,
  `gate_proj`, `up_proj`, and the LM head when the vocabulary divides evenly;
* row-parallel (input features split): `o_proj`, `down_proj`, whose partial sums
  XLA reduces across the mesh;
* replicated: the embedding table and the norms.

The paged KV cache is split by KV head, `[num_pages, page_size, num_kv_heads/tp,
head_dim]` per device, and so is attention: `shard_attention` runs the ragged
paged attention op under `shard_map`, each device over its own query heads and
the KV heads they read (q head h reads KV head h // group, and a contiguous
block of q heads maps onto a contiguous block of KV heads). Every other op of
the step is partitioned by XLA's SPMD partitioner from these shardings. The
step descriptor's arrays are small and replicated.

On a CPU, several devices come from
`XLA_FLAGS=--xla_force_host_platform_device_count=N` set before JAX starts.
"""

from __future__ import annotations

import functools
from typing import Any, Optional, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from orca_jax.core.step.engine_api import EngineConfigError
from orca_jax.specs.model_config import ModelConfig

TP_AXIS = "tp"
# nnx.Linear kernels are [in, out].
_COLUMN_PARALLEL = frozenset({"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"})
_ROW_PARALLEL = frozenset({"o_proj", "down_proj"})


def make_mesh(tp: int, config: ModelConfig,
              devices: Optional[Sequence[jax.Device]] = None) -> Mesh:
    """A 1-D mesh named `tp` over the first `tp` devices.

    Args:
      tp: tensor-parallel degree.
      config: the model; `tp` must divide its query heads, KV heads and MLP width.
      devices: the devices to use (default: `jax.devices()`).

    Raises:
      EngineConfigError: too few devices, or `tp` does not divide one of the model's
        dimensions.
    """
    devices = list(jax.devices() if devices is None else devices)
    if tp < 1:
        raise EngineConfigError(f"tp={tp}: the tensor-parallel degree must be >= 1")
    if tp > len(devices):
        hint = (f"; on a CPU, start with XLA_FLAGS=--xla_force_host_platform_device_count={tp}"
                if devices and devices[0].platform == "cpu" else "")
        raise EngineConfigError(f"tp={tp} needs {tp} devices, JAX sees {len(devices)} "
                         f"({devices[0].platform if devices else 'none'}){hint}")
    for field in ("num_q_heads", "num_kv_heads", "ffn_dim"):
        value = getattr(config, field)
        if value % tp:
            raise EngineConfigError(f"tp={tp} must divide model {config.name!r}'s {field}={value}")
    return Mesh(np.asarray(devices[:tp]), (TP_AXIS,))


def stage_meshes(pp: int, tp: int, config: ModelConfig,
                 devices: Optional[Sequence[jax.Device]] = None) -> list[Mesh]:
    """`pp` pipeline stages' `tp` meshes: stage `s` on devices `[s tp, (s + 1) tp)`.

    Raises:
      EngineConfigError: `pp x tp` devices are more than JAX sees (one line, with the
        flag that forces more CPU devices), or `tp` does not divide the model (as
        `make_mesh`).
    """
    devices = list(jax.devices() if devices is None else devices)
    if pp * tp > len(devices):
        platform = devices[0].platform if devices else "none"
        hint = (f"; on a CPU, start with XLA_FLAGS=--xla_force_host_platform_device_count="
                f"{pp * tp}" if platform == "cpu" else "")
        raise EngineConfigError(f"pp {pp} x tp {tp} = {pp * tp} devices, JAX sees "
                                f"{len(devices)} ({platform}){hint}")
    return [make_mesh(tp, config, devices[s * tp:(s + 1) * tp]) for s in range(pp)]


def _spec_for(path: tuple[Any, ...], leaf: Any, tp: int) -> P:
    names = [str(getattr(key, "key", getattr(key, "name", key))) for key in path]
    module = names[-3] if len(names) >= 3 else ""  # [..., module, 'kernel', 'value']
    if module in _COLUMN_PARALLEL:
        return P(None, TP_AXIS)
    if module in _ROW_PARALLEL:
        return P(TP_AXIS, None)
    if module == "lm_head" and leaf.shape[-1] % tp == 0:
        return P(None, TP_AXIS)
    return P()


def param_specs(params: Any, tp: int) -> Any:
    """The partition spec of every parameter (a pytree shaped like `params`).

    Args:
      params: the model's parameter state (`nnx.State`), arrays or shapes.
      tp: the mesh size (decides whether the LM head's vocabulary splits evenly).
    """
    return jax.tree_util.tree_map_with_path(lambda path, leaf: _spec_for(path, leaf, tp),
                                            params)


def param_shardings(params: Any, mesh: Mesh) -> Any:
    """`param_specs` as `NamedSharding`s on `mesh`."""
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec),
                        param_specs(params, mesh.size),
                        is_leaf=lambda x: isinstance(x, P))


def kv_cache_sharding(mesh: Mesh) -> NamedSharding:
    """Each cache buffer `[num_pages, page_size, num_kv_heads, head_dim]`, split by KV head."""
    return NamedSharding(mesh, P(None, None, TP_AXIS, None))


def replicated(mesh: Mesh) -> NamedSharding:
    """A full copy on every device (the step descriptor's arrays)."""
    return NamedSharding(mesh, P())


def shard_attention(attend: Any, mesh: Mesh) -> Any:
    """Wraps a ragged paged attention op so each device attends over its own heads.

    Args:
      attend: an op with `ragged_paged_attention_reference`'s signature.
      mesh: the `tp` mesh; q's heads and the pages' KV heads are split over it.

    Returns:
      An op with the same signature, for `model.step(..., attention=...)`.
    """
    heads = P(None, TP_AXIS, None)  # q and the output: [T, num_q_heads, head_dim]
    pages = P(None, None, TP_AXIS, None)  # [num_pages, page_size, num_kv_heads, head_dim]
    descriptor = P()  # kv_lens, page_indices, cu_q_lens, num_seqs: whole on every device

    def sharded(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale):
        local = jax.shard_map(
            functools.partial(attend, sm_scale=sm_scale), mesh=mesh,
            in_specs=(heads, pages, pages, descriptor, descriptor, descriptor, descriptor),
            out_specs=heads, check_vma=False)
        return local(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs)

    return sharded
