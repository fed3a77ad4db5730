"""Hardware and model specs of the simulator, their presets, and KV pool sizing.

`HardwareSpec` (HBM, FLOPs, interconnect, efficiencies) and `ModelSpec`
(shapes, parameter and weight bytes) feed `orca_jax.sim.cost_model`'s roofline;
`num_kv_pages_for_memory` sizes a replica's KV pool from what its GPUs hold
after the weights. Nothing here imports jax.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

GIB = 1 << 30


@dataclasses.dataclass(frozen=True, kw_only=True)
class HardwareSpec:
    """One accelerator, as its datasheet gives it."""

    name: str
    hbm_bytes: int  # HBM capacity
    hbm_bytes_per_s: float  # peak HBM bandwidth
    peak_flops: float  # dense bf16 tensor-core FLOP/s (no sparsity)
    link_bytes_per_s: float  # NVLink bandwidth per GPU, one direction (a ring sends one way)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A decoder-only transformer's shape, as its published config gives it."""

    name: str
    num_layers: int
    d_model: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_dim: int
    vocab_size: int
    gated_mlp: bool  # SwiGLU (3 matrices) or a plain 2-matrix MLP
    max_context: int
    tied_embeddings: bool = False  # LM head shares the input embedding table
    dtype_bytes: int = 2

    def __post_init__(self) -> None:
        for field in ("num_layers", "d_model", "num_heads", "num_kv_heads", "head_dim",
                      "ffn_dim", "vocab_size", "max_context", "dtype_bytes"):
            value = getattr(self, field)
            if not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"ModelSpec {self.name!r}: {field} must be an integer >= 1, "
                                 f"got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"ModelSpec {self.name!r}: num_heads={self.num_heads} is not a "
                             f"multiple of num_kv_heads={self.num_kv_heads}")

    @property
    def params_per_layer(self) -> int:
        """Weights of one decoder layer: attention, MLP and its two norms (biases ignored)."""
        q_out = self.num_heads * self.head_dim
        kv_out = self.num_kv_heads * self.head_dim
        attention = self.d_model * (2 * q_out + 2 * kv_out)  # Wq, Wo, Wk, Wv
        mlp = (3 if self.gated_mlp else 2) * self.d_model * self.ffn_dim
        return attention + mlp + 2 * self.d_model

    @property
    def non_embedding_params(self) -> int:
        """Weights every token goes through: all layers and the final norm."""
        return self.num_layers * self.params_per_layer + self.d_model

    @property
    def num_params(self) -> int:
        """All weights: layers, final norm, input embedding, and an untied LM head."""
        num_tables = 1 if self.tied_embeddings else 2
        return self.non_embedding_params + num_tables * self.vocab_size * self.d_model

    @property
    def weight_bytes(self) -> int:
        """Bytes of all weights (what must fit in HBM)."""
        return self.num_params * self.dtype_bytes

    @property
    def step_weight_bytes(self) -> int:
        """Bytes one step reads: the layers, final norm and LM head (not the embedding gather)."""
        return (self.non_embedding_params + self.vocab_size * self.d_model) * self.dtype_bytes


# Datasheet numbers (SXM parts). HBM capacity as the driver reports it for the
# 40/80 GB parts (GiB); H200 is sold as 141 GB.
HARDWARE_PRESETS: dict[str, HardwareSpec] = {
    "a100-40gb": HardwareSpec(name="a100-40gb", hbm_bytes=40 * GIB, hbm_bytes_per_s=1.555e12,
                              peak_flops=312e12, link_bytes_per_s=300e9),  # NVLink3 600 GB/s bidir
    "a100-80gb": HardwareSpec(name="a100-80gb", hbm_bytes=80 * GIB, hbm_bytes_per_s=2.039e12,
                              peak_flops=312e12, link_bytes_per_s=300e9),
    "h100-sxm": HardwareSpec(name="h100-sxm", hbm_bytes=80 * GIB, hbm_bytes_per_s=3.35e12,
                             peak_flops=989e12, link_bytes_per_s=450e9),  # NVLink4 900 GB/s bidir
    "h200": HardwareSpec(name="h200", hbm_bytes=141 * 10**9, hbm_bytes_per_s=4.8e12,
                         peak_flops=989e12, link_bytes_per_s=450e9),
}
HARDWARE_ALIASES: dict[str, str] = {"a100": "a100-80gb", "h100": "h100-sxm"}

MODEL_PRESETS: dict[str, ModelSpec] = {
    "tiny": ModelSpec(name="tiny", num_layers=2, d_model=128, num_heads=4, num_kv_heads=2,
                      head_dim=32, ffn_dim=256, vocab_size=512, gated_mlp=True, max_context=1024),
    "small": ModelSpec(name="small", num_layers=4, d_model=256, num_heads=8, num_kv_heads=4,
                       head_dim=32, ffn_dim=688, vocab_size=2048, gated_mlp=True,
                       max_context=2048),
    "llama3-8b": ModelSpec(name="llama3-8b", num_layers=32, d_model=4096, num_heads=32,
                           num_kv_heads=8, head_dim=128, ffn_dim=14336, vocab_size=128256,
                           gated_mlp=True, max_context=8192),
    "llama2-7b": ModelSpec(name="llama2-7b", num_layers=32, d_model=4096, num_heads=32,
                           num_kv_heads=32, head_dim=128, ffn_dim=11008, vocab_size=32000,
                           gated_mlp=True, max_context=4096),
    "mistral-7b": ModelSpec(name="mistral-7b", num_layers=32, d_model=4096, num_heads=32,
                            num_kv_heads=8, head_dim=128, ffn_dim=14336, vocab_size=32000,
                            gated_mlp=True, max_context=32768),
    "opt-13b": ModelSpec(name="opt-13b", num_layers=40, d_model=5120, num_heads=40,
                         num_kv_heads=40, head_dim=128, ffn_dim=20480, vocab_size=50272,
                         gated_mlp=False, max_context=2048, tied_embeddings=True),
    "gpt3-175b": ModelSpec(name="gpt3-175b", num_layers=96, d_model=12288, num_heads=96,
                           num_kv_heads=96, head_dim=128, ffn_dim=49152, vocab_size=50257,
                           gated_mlp=False, max_context=2048, tied_embeddings=True),
}


def get_hardware(name: str) -> HardwareSpec:
    """Looks up a hardware preset by name or alias (`a100` is the 80 GB part)."""
    key = HARDWARE_ALIASES.get(name, name)
    if key not in HARDWARE_PRESETS:
        valid = sorted([*HARDWARE_PRESETS, *HARDWARE_ALIASES])
        raise ValueError(f"unknown hardware preset {name!r}; valid names: {', '.join(valid)}")
    return HARDWARE_PRESETS[key]


def get_model(name: str) -> ModelSpec:
    """Looks up a model preset by name."""
    if name not in MODEL_PRESETS:
        raise ValueError(f"unknown model preset {name!r}; valid names: "
                         f"{', '.join(sorted(MODEL_PRESETS))}")
    return MODEL_PRESETS[name]


def kv_bytes_per_token(model: ModelSpec) -> int:
    """KV-cache bytes one token holds over the whole model: K and V, every layer."""
    return 2 * model.num_layers * model.num_kv_heads * model.head_dim * model.dtype_bytes


def num_kv_pages_for_memory(model: ModelSpec, hardware: HardwareSpec, tp: int, page_size: int,
                            kv_memory_gb: Optional[float] = None,
                            gpu_memory_utilization: float = 0.9) -> int:
    """Number of KV pages the pool of a `tp`-GPU replica holds.

    Each GPU keeps `ceil(kv_heads / tp)` KV heads (heads are replicated when
    `tp > kv_heads`) and `1/tp` of the weights. The pool is `kv_memory_gb`
    (decimal GB over the whole replica) when given, else what is left of
    `gpu_memory_utilization x HBM` on each GPU once its weight shard is loaded.

    Raises:
      ValueError: bad arguments, the weights do not fit, or not even one page fits.
    """
    if tp < 1 or page_size < 1:
        raise ValueError(f"tp and page_size must be >= 1, got tp={tp}, page_size={page_size}")
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    heads_per_gpu = -(-model.num_kv_heads // tp)
    page_bytes_per_gpu = (page_size * 2 * model.num_layers * heads_per_gpu * model.head_dim
                          * model.dtype_bytes)
    if kv_memory_gb is not None:
        if not kv_memory_gb > 0:
            raise ValueError(f"kv_memory_gb must be > 0, got {kv_memory_gb}")
        kv_bytes_per_gpu = kv_memory_gb * 1e9 / tp
    else:
        usable = gpu_memory_utilization * hardware.hbm_bytes
        weights_per_gpu = model.weight_bytes / tp
        if weights_per_gpu >= usable:
            raise ValueError(
                f"model {model.name} ({model.weight_bytes / 1e9:.1f} GB of weights) does not fit "
                f"on {tp} x {hardware.name} at gpu_memory_utilization={gpu_memory_utilization}: "
                f"{weights_per_gpu / 1e9:.1f} GB per GPU > {usable / 1e9:.1f} GB usable")
        kv_bytes_per_gpu = usable - weights_per_gpu
    num_pages = int(kv_bytes_per_gpu // page_bytes_per_gpu)
    if num_pages < 1:
        raise ValueError(f"model {model.name} on {tp} x {hardware.name}: KV memory of "
                         f"{kv_bytes_per_gpu:.3g} B per GPU holds no page of {page_size} tokens")
    return num_pages
