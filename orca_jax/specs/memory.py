"""A model's bytes on a replica: the KV cache per token, and the KV pool that fits.

Sizes come from a `ModelConfig` (shapes) and a `HardwareSpec` (HBM). How many
bytes one weight or KV element takes is a setting of each function, not a fact
of the shape: `DTYPE_BYTES` (bf16, what serving runs) unless told otherwise.
Nothing here imports jax.
"""

from __future__ import annotations

from typing import Optional

from orca_jax.specs.hardware import HardwareSpec
from orca_jax.specs.model_config import ModelConfig

DTYPE_BYTES = 2  # bf16 weights, activations and KV cache


def _check_dtype_bytes(dtype_bytes: int) -> None:
    if not isinstance(dtype_bytes, int) or dtype_bytes < 1:
        raise ValueError(f"dtype_bytes must be an integer >= 1, got {dtype_bytes!r}")


def kv_bytes_per_token(model: ModelConfig, dtype_bytes: int = DTYPE_BYTES) -> int:
    """KV-cache bytes one token holds over the whole model: K and V, every layer."""
    _check_dtype_bytes(dtype_bytes)
    return 2 * model.num_layers * model.num_kv_heads * model.head_dim * dtype_bytes


def num_kv_pages_for_memory(model: ModelConfig, hardware: HardwareSpec, tp: int, page_size: int,
                            kv_memory_gb: Optional[float] = None,
                            gpu_memory_utilization: float = 0.9,
                            dtype_bytes: int = DTYPE_BYTES,
                            stage_layers: Optional[tuple[int, ...]] = None) -> int:
    """Number of KV pages the pool of a `tp`-GPU replica holds.

    Each GPU keeps `ceil(kv_heads / tp)` KV heads (heads are replicated when
    `tp > kv_heads`) and `1/tp` of the weights. The pool is `kv_memory_gb`
    (decimal GB over the whole replica) when given, else what is left of
    `gpu_memory_utilization x HBM` on each GPU once its weight shard is loaded.

    Args:
      model: the model's shapes.
      hardware: one GPU of the replica.
      tp: GPUs per replica.
      page_size: tokens per KV page.
      kv_memory_gb: the pool's size over the replica, or None to fill the GPUs.
      gpu_memory_utilization: the fraction of HBM weights and KV may take.
      dtype_bytes: bytes of one weight and one KV element.
      stage_layers: the layers of each pipeline stage (None: one stage). A stage's GPUs
        hold its layers' share of the weights (`weight_bytes * layers_s / L`) and of each
        page; a page spans every stage, so the pool is the least any stage holds
        (`kv_memory_gb` splits over all `tp * stages` GPUs by layers).

    Raises:
      ValueError: bad arguments, the weights do not fit, or not even one page fits.
    """
    if stage_layers is not None and len(stage_layers) > 1:
        total = sum(stage_layers)
        return min(_stage_pages(model, hardware, tp, page_size, kv_memory_gb,
                                gpu_memory_utilization, dtype_bytes, layers / total)
                   for layers in stage_layers)
    return _stage_pages(model, hardware, tp, page_size, kv_memory_gb, gpu_memory_utilization,
                        dtype_bytes, 1.0)


def _stage_pages(model: ModelConfig, hardware: HardwareSpec, tp: int, page_size: int,
                 kv_memory_gb: Optional[float], gpu_memory_utilization: float,
                 dtype_bytes: int, share: float) -> int:
    """`num_kv_pages_for_memory` of the `share` of the layers one stage holds (1.0: all)."""
    if tp < 1 or page_size < 1:
        raise ValueError(f"tp and page_size must be >= 1, got tp={tp}, page_size={page_size}")
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    _check_dtype_bytes(dtype_bytes)
    heads_per_gpu = -(-model.num_kv_heads // tp)
    page_bytes_per_gpu = (page_size * 2 * model.num_layers * heads_per_gpu * model.head_dim
                          * dtype_bytes)
    if share != 1.0:
        page_bytes_per_gpu = page_bytes_per_gpu * share
    if kv_memory_gb is not None:
        if not kv_memory_gb > 0:
            raise ValueError(f"kv_memory_gb must be > 0, got {kv_memory_gb}")
        kv_bytes_per_gpu = kv_memory_gb * 1e9 / tp * share
    else:
        usable = gpu_memory_utilization * hardware.hbm_bytes
        weight_bytes = model.weight_bytes(dtype_bytes)
        weights_per_gpu = weight_bytes / tp if share == 1.0 else weight_bytes * share / tp
        if weights_per_gpu >= usable:
            raise ValueError(
                f"model {model.name} ({weight_bytes / 1e9:.1f} GB of weights) does not fit "
                f"on {tp} x {hardware.name} at gpu_memory_utilization={gpu_memory_utilization}: "
                f"{weights_per_gpu / 1e9:.1f} GB per GPU > {usable / 1e9:.1f} GB usable")
        kv_bytes_per_gpu = usable - weights_per_gpu
    num_pages = int(kv_bytes_per_gpu // page_bytes_per_gpu)
    if num_pages < 1:
        raise ValueError(f"model {model.name} on {tp} x {hardware.name}: KV memory of "
                         f"{kv_bytes_per_gpu:.3g} B per GPU holds no page of {page_size} tokens")
    return num_pages
