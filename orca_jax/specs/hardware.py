"""Accelerator datasheets, how close real kernels come to them, and their presets.

`HardwareSpec` (HBM capacity and bandwidth, FLOPs, L2, interconnect) feeds
`orca_jax.sim`'s rooflines and `orca_jax.specs.memory`'s KV pool sizing; model
shapes are `orca_jax.specs.model_config`'s. Its `kernels` are the per-operation
roofline's constants (`orca_jax.sim.roofline`): for each kind of kernel, the
fraction of the datasheet it reaches, its fixed time and, for GEMMs, the output
tile its thread blocks compute (a partial wave of tiles over the SMs costs a whole
one), and the all-reduce's latency and bandwidth per number of GPUs. Nothing here
imports jax.

Checked by leaving one measured model out of the fit (issue 26,
`benchmarks/cost_model_vs_measured.py`, A100: Llama-2-7B and Llama-3-8B refitted on
each other): before the GEMM tiles and rope's idle lanes, 79 of 80 (operation, TP)
cells within 15% (rope at TP 8 16.2%) and a layer's kernels at 1-512 tokens 4-7%
fast at TP 2 and 4 (worst points -24%); after, 80 of 80 (rope at TP 8 at most
10.7%) and signed medians -3.4..+4.7% per TP (worst points -21%/+18%).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

GIB = 1 << 30
MIB = 1 << 20


def _check_fraction(owner: str, field: str, value: float, upper: float = 1.0) -> None:
    if not (isinstance(value, (int, float)) and 0.0 < value <= upper):
        raise ValueError(f"{owner}.{field} must be in (0, {upper:g}], got {value!r}")


def _check_seconds(owner: str, field: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0.0):
        raise ValueError(f"{owner}.{field} must be finite and >= 0, got {value!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class KernelEfficiency:
    """How close one kind of kernel comes to its GPU's datasheet.

    One launch takes `latency_s + hypot(memory_s, compute_s)` with `memory_s =
    bytes / (hbm_bytes_per_s * eff)` and `compute_s = flops / (peak_flops *
    flops_efficiency)` (`orca_jax.sim.roofline`), where `eff` is `l2_efficiency`
    when all its bytes fit in L2 (set for elementwise kernels, whose input the
    kernel just before wrote), else `hbm_efficiency`. A GEMM with a `tile` computes
    whole waves of output tiles: its FLOPs are those of `ceil(tiles / num_sms)`
    waves of `num_sms` tiles, the last wave's idle SMs and each tile's padding
    included.

    Attributes:
      latency_s: fixed time of one launch (ramp-up, the last partial wave).
      hbm_efficiency: fraction of peak HBM bandwidth the memory-bound regime reaches.
      flops_efficiency: fraction of peak FLOP/s the compute-bound regime reaches.
      l2_efficiency: the same fraction of *HBM* peak when the bytes fit in L2 (it may
        pass 1), or None for "as from HBM".
      tile: `(token rows, output features)` of the output tile one thread block of
        a GEMM computes, or None (elementwise kernels, attention: FLOPs as counted).
        A `[N, K] @ [K, M]` GEMM runs `ceil(N / rows) * ceil(M / features)` tiles in
        waves over the SMs: a step whose tiles just spill into another wave pays the
        whole wave (Vidur's measured projections jump by up to 1.5x from 128 to 136
        tokens). It matters at decode sizes, where a GEMM is a few waves; over many
        waves it is the FLOP count.
    """

    latency_s: float
    hbm_efficiency: float
    flops_efficiency: float = 1.0  # elementwise kernels count no FLOPs: any value will do
    l2_efficiency: Optional[float] = None
    tile: Optional[tuple[int, int]] = None

    def __post_init__(self) -> None:
        _check_seconds("KernelEfficiency", "latency_s", self.latency_s)
        _check_fraction("KernelEfficiency", "hbm_efficiency", self.hbm_efficiency)
        _check_fraction("KernelEfficiency", "flops_efficiency", self.flops_efficiency)
        if self.l2_efficiency is not None:
            # L2 bandwidth is a few times HBM's on these parts; 4x bounds a typo, not physics.
            _check_fraction("KernelEfficiency", "l2_efficiency", self.l2_efficiency, upper=4.0)
        if self.tile is not None and not (
                len(self.tile) == 2 and all(isinstance(n, int) and n >= 1 for n in self.tile)):
            raise ValueError(f"KernelEfficiency.tile must be None or two integers >= 1 "
                             f"(token rows, output features), got {self.tile!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class AllReduceCost:
    """An all-reduce over `num_gpus` GPUs: `latency_s + message_bytes / bytes_per_s`.

    `bytes_per_s` is message bytes over time (what nccl-tests calls algbw), not
    link bandwidth: it already holds the ring's `2 (n - 1) / n` traffic.
    """

    num_gpus: int
    latency_s: float
    bytes_per_s: float

    def __post_init__(self) -> None:
        if not isinstance(self.num_gpus, int) or self.num_gpus < 2:
            raise ValueError(f"AllReduceCost.num_gpus must be an integer >= 2, "
                             f"got {self.num_gpus!r}")
        _check_seconds("AllReduceCost", "latency_s", self.latency_s)
        if not (math.isfinite(self.bytes_per_s) and self.bytes_per_s > 0):
            raise ValueError(f"AllReduceCost.bytes_per_s must be finite and > 0, "
                             f"got {self.bytes_per_s!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class KernelCosts:
    """The per-operation roofline's constants on one kind of GPU.

    One `KernelEfficiency` per kind of kernel of a decoder step (per-GPU shapes:
    tensor parallelism splits the projections, MLP and attention heads), and the
    all-reduces of tensor parallelism.

    Attributes:
      source: where the numbers come from (written beside results).
      qkv_proj: the fused Q, K, V projection.
      attn_out_proj: attention's output projection.
      mlp_up_proj: the MLP's up (and gate) projection.
      mlp_down_proj: the MLP's down projection.
      lm_head: the vocabulary projection of the sampled rows.
      attention_prefill: attention of sequences with more than one new token.
      attention_decode: attention of sequences with one new token.
      norm: an RMSNorm/LayerNorm over the tokens.
      rope: rotary embedding of the queries and keys.
      mlp_act: the MLP's activation (SiLU-and-multiply, or GELU).
      residual_add: one residual add.
      embedding: the input embedding's row gather.
      allreduce: one entry per number of GPUs a replica may span.
    """

    source: str
    qkv_proj: KernelEfficiency
    attn_out_proj: KernelEfficiency
    mlp_up_proj: KernelEfficiency
    mlp_down_proj: KernelEfficiency
    lm_head: KernelEfficiency
    attention_prefill: KernelEfficiency
    attention_decode: KernelEfficiency
    norm: KernelEfficiency
    rope: KernelEfficiency
    mlp_act: KernelEfficiency
    residual_add: KernelEfficiency
    embedding: KernelEfficiency
    allreduce: tuple[AllReduceCost, ...]

    def __post_init__(self) -> None:
        counts = [cost.num_gpus for cost in self.allreduce]
        if len(set(counts)) != len(counts):
            raise ValueError(f"KernelCosts.allreduce: GPU counts repeat: {counts}")

    def allreduce_cost(self, num_gpus: int) -> AllReduceCost:
        """The all-reduce over `num_gpus` GPUs.

        Raises:
          ValueError: naming the GPU count and the counts there are costs for.
        """
        for cost in self.allreduce:
            if cost.num_gpus == num_gpus:
                return cost
        known = ", ".join(str(cost.num_gpus) for cost in self.allreduce)
        raise ValueError(f"no all-reduce cost for {num_gpus} GPUs ({self.source}); "
                         f"known GPU counts: {known}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class HardwareSpec:
    """One accelerator: its datasheet, and how close measured kernels come to it."""

    name: str
    hbm_bytes: int  # HBM capacity
    hbm_bytes_per_s: float  # peak HBM bandwidth
    peak_flops: float  # dense bf16 tensor-core FLOP/s (no sparsity)
    link_bytes_per_s: float  # NVLink bandwidth per GPU, one direction (a ring sends one way)
    l2_bytes: int  # L2 cache: an elementwise kernel whose bytes fit reads what was just written
    num_sms: int  # streaming multiprocessors: a GEMM's tiles run in waves of this many
    kernels: KernelCosts
    # Where the GPUs sit: `gpus_per_node` to a node (a DGX), joined inside it by the
    # `nvlink` preset and across nodes by `node_link` (`KV_LINK_PRESETS`): what a
    # pipeline stage's activations cross to the next stage (`orca_jax.sim.cost_model`).
    gpus_per_node: int = 8
    nvlink: str = "nvlink3"
    node_link: str = "ib200"
    # The GPU generation (`ampere`, `hopper`): what an engine profile's kernel choices
    # key on (`orca_jax.sim.engine_profiles`: FlashAttention-2 or -3, its all-reduce).
    generation: str = "ampere"

    @property
    def max_gpus(self) -> int:
        """The most GPUs a replica of this preset may span: the largest group its
        all-reduce costs describe (two 8-GPU nodes for the measured presets)."""
        return max([self.gpus_per_node, *(cost.num_gpus for cost in self.kernels.allreduce)])


def _gemm(latency_us: float, hbm: float, flops: float,
          tile: Optional[tuple[int, int]] = None) -> KernelEfficiency:
    return KernelEfficiency(latency_s=latency_us * 1e-6, hbm_efficiency=hbm,
                            flops_efficiency=flops, tile=tile)


def _elementwise(latency_us: float, hbm: float, l2: float) -> KernelEfficiency:
    return KernelEfficiency(latency_s=latency_us * 1e-6, hbm_efficiency=hbm, l2_efficiency=l2)


def _allreduce(num_gpus: int, latency_us: float, gb_per_s: float) -> AllReduceCost:
    return AllReduceCost(num_gpus=num_gpus, latency_s=latency_us * 1e-6,
                         bytes_per_s=gb_per_s * 1e9)


# Attention is not in Vidur's files (its tables are too large to ship), so its
# constants are assumptions, not fits: decode attention (paged, memory-bound)
# at 70% of HBM bandwidth, as in the audit that compared the simulator with
# Vidur's measured layers; prefill attention at 50% of peak FLOPs on A100
# (FlashAttention-2 reaches 50-73% there, the low end for short causal
# prefills); a launch as long as the measured projections' shortest. The
# decode kernel's FLOPs (1-4 per KV byte) and the prefill kernel's bytes barely count.
_A100_ATTENTION = _gemm(5.0, 0.70, 0.50)
# FlashAttention-2 reaches only ~35% of H100's peak (FlashAttention-3's paper).
_H100_ATTENTION = _gemm(5.0, 0.70, 0.35)

# The output tile of one thread block of the measured GEMMs, (token rows, output
# features), for the waves of `KernelEfficiency.tile`. cuBLAS picks its tile per
# shape (64-256 a side on these parts; smaller ones at few tokens, where a large
# tile would leave most SMs idle), so this is the one size that fits decode-sized
# steps best: leaving one model out of the fit, the layer's summed kernels at
# 1-512 tokens come within -3.4..+4.7% (signed median per TP) with 64 x 64 tiles,
# against -6.6..+0.5% with none; 128-row or 128 x 128 tiles over-price them by
# 6-40%, 32-row tiles leave them 3-5% fast (benchmarks/results/cost_model_vs_measured.txt).
GEMM_TILE = (64, 64)

# Fitted by `python benchmarks/cost_model_vs_measured.py --fit` to Vidur's
# per-operation CUDA kernel times (../shared/profiles/vidur_a100_h100/:
# Meta-Llama-3-8B and Llama-2-7B on A100-80GB, TP 1/2/4/8, 1-8,192 tokens).
# The LM head was not measured: it takes the MLP up projection's constants
# (the widest GEMM that was).
_A100_MLP_UP = _gemm(2.2, 0.91, 0.73, GEMM_TILE)
A100_KERNELS = KernelCosts(
    source="fitted to Vidur's A100-80GB kernel times (../shared/profiles/vidur_a100_h100)",
    qkv_proj=_gemm(1.8, 0.87, 0.72, GEMM_TILE), attn_out_proj=_gemm(3.9, 0.92, 0.71, GEMM_TILE),
    mlp_up_proj=_A100_MLP_UP, mlp_down_proj=_gemm(3.5, 0.92, 0.77, GEMM_TILE), lm_head=_A100_MLP_UP,
    attention_prefill=_A100_ATTENTION, attention_decode=_A100_ATTENTION,
    norm=_elementwise(3.1, 0.34, 0.46), rope=_elementwise(2.2, 0.45, 0.52),
    mlp_act=_elementwise(2.1, 0.49, 0.50), residual_add=_elementwise(1.7, 0.91, 1.22),
    embedding=_elementwise(2.8, 0.15, 0.16),
    # Fitted to Vidur's a100_dgx_all_reduce.csv: NCCL on one 8xA100 DGX
    # (NVLink3); 16 GPUs span two DGXs (InfiniBand), an order of magnitude slower.
    allreduce=(_allreduce(2, 45.0, 172.0), _allreduce(4, 51.0, 117.0),
               _allreduce(8, 51.0, 89.0), _allreduce(16, 444.0, 9.5)))

# Fitted the same way to Vidur's Llama-2-7B times on an H100 (TP 1/2/4/8).
_H100_MLP_UP = _gemm(6.3, 0.92, 0.73, GEMM_TILE)
H100_KERNELS = KernelCosts(
    source="fitted to Vidur's H100 kernel times (../shared/profiles/vidur_a100_h100)",
    qkv_proj=_gemm(5.2, 0.92, 0.73, GEMM_TILE), attn_out_proj=_gemm(5.7, 0.92, 0.74, GEMM_TILE),
    mlp_up_proj=_H100_MLP_UP, mlp_down_proj=_gemm(6.4, 0.92, 0.80, GEMM_TILE), lm_head=_H100_MLP_UP,
    attention_prefill=_H100_ATTENTION, attention_decode=_H100_ATTENTION,
    norm=_elementwise(2.8, 0.33, 0.46), rope=_elementwise(1.8, 0.50, 0.53),
    mlp_act=_elementwise(1.6, 0.57, 0.55), residual_add=_elementwise(1.0, 0.92, 1.21),
    embedding=_elementwise(2.5, 0.18, 0.19),
    # Not measured: A100's latencies, and its bandwidths x1.5 inside a node
    # (NVLink4 900 GB/s against NVLink3's 600) and x2 across nodes (NDR 400 Gb/s
    # InfiniBand against HDR 200).
    allreduce=(_allreduce(2, 45.0, 258.0), _allreduce(4, 51.0, 176.0),
               _allreduce(8, 51.0, 134.0), _allreduce(16, 444.0, 19.0)))

# Datasheet numbers (SXM parts). HBM capacity as the driver reports it for the
# 40/80 GB parts (GiB); H200 is sold as 141 GB. The 40 GB A100 and the H200 have
# no measured kernels: each takes the efficiencies of its sibling (same SMs and
# L2), as fractions of its own datasheet bandwidth.
HARDWARE_PRESETS: dict[str, HardwareSpec] = {
    "a100-40gb": HardwareSpec(name="a100-40gb", hbm_bytes=40 * GIB, hbm_bytes_per_s=1.555e12,
                              peak_flops=312e12, link_bytes_per_s=300e9,  # NVLink3 600 GB/s bidir
                              l2_bytes=40 * MIB, num_sms=108, kernels=A100_KERNELS),
    "a100-80gb": HardwareSpec(name="a100-80gb", hbm_bytes=80 * GIB, hbm_bytes_per_s=2.039e12,
                              peak_flops=312e12, link_bytes_per_s=300e9, l2_bytes=40 * MIB,
                              num_sms=108, kernels=A100_KERNELS),
    "h100-sxm": HardwareSpec(name="h100-sxm", hbm_bytes=80 * GIB, hbm_bytes_per_s=3.35e12,
                             peak_flops=989e12, link_bytes_per_s=450e9,  # NVLink4 900 GB/s bidir
                             l2_bytes=50 * MIB, num_sms=132, kernels=H100_KERNELS,
                             nvlink="nvlink4", node_link="ib400", generation="hopper"),
    "h200": HardwareSpec(name="h200", hbm_bytes=141 * 10**9, hbm_bytes_per_s=4.8e12,
                         peak_flops=989e12, link_bytes_per_s=450e9, l2_bytes=50 * MIB,
                         num_sms=132, kernels=H100_KERNELS, nvlink="nvlink4",
                         node_link="ib400", generation="hopper"),
}
HARDWARE_ALIASES: dict[str, str] = {"a100": "a100-80gb", "h100": "h100-sxm"}


def get_hardware(name: str) -> HardwareSpec:
    """Looks up a hardware preset by name or alias (`a100` is the 80 GB part)."""
    key = HARDWARE_ALIASES.get(name, name)
    if key not in HARDWARE_PRESETS:
        valid = sorted([*HARDWARE_PRESETS, *HARDWARE_ALIASES])
        raise ValueError(f"unknown hardware preset {name!r}; valid names: {', '.join(valid)}")
    return HARDWARE_PRESETS[key]


@dataclasses.dataclass(frozen=True, kw_only=True)
class KVLinkSpec:
    """A path that carries a request's KV cache from a prefill GPU to a decode GPU.

    A transfer of `b` bytes takes `latency_s + b / bytes_per_s`; at most
    `max_concurrent` transfers share the path at once (each at the full rate, so
    1 is the honest default: a burst queues behind the link), the rest wait.

    Attributes:
      name: the preset's name.
      latency_s: fixed time of one transfer (setup, the first byte, completion).
      bytes_per_s: one direction's bandwidth.
      max_concurrent: transfers in flight on one link at once.
      source: where the numbers come from.
    """

    name: str
    latency_s: float
    bytes_per_s: float
    max_concurrent: int = 1
    source: str = ""

    def __post_init__(self) -> None:
        _check_seconds("KVLinkSpec", "latency_s", self.latency_s)
        if not (math.isfinite(self.bytes_per_s) and self.bytes_per_s > 0):
            raise ValueError(f"KVLinkSpec.bytes_per_s must be finite and > 0, "
                             f"got {self.bytes_per_s!r}")
        if not isinstance(self.max_concurrent, int) or self.max_concurrent < 1:
            raise ValueError(f"KVLinkSpec.max_concurrent must be an integer >= 1, "
                             f"got {self.max_concurrent!r}")


# Bandwidths are datasheet line rates, one direction; latencies are assumptions (a
# GPU-to-GPU copy or an RDMA write with its completion is 5-20 us), small beside the
# milliseconds a prompt's KV takes at these rates.
KV_LINK_PRESETS: dict[str, KVLinkSpec] = {
    # A100 datasheet: third-generation NVLink, 600 GB/s bidirectional per GPU.
    "nvlink3": KVLinkSpec(name="nvlink3", latency_s=10e-6, bytes_per_s=300e9,
                          source="NVIDIA A100 datasheet: NVLink 600 GB/s (both directions)"),
    # H100 SXM datasheet: fourth-generation NVLink, 900 GB/s bidirectional per GPU.
    "nvlink4": KVLinkSpec(name="nvlink4", latency_s=10e-6, bytes_per_s=450e9,
                          source="NVIDIA H100 datasheet: NVLink 900 GB/s (both directions)"),
    # ConnectX-6 HDR InfiniBand, 200 Gb/s per port (one per GPU in a DGX A100; Splitwise's
    # A100 cluster).
    "ib200": KVLinkSpec(name="ib200", latency_s=20e-6, bytes_per_s=200e9 / 8,
                        source="NVIDIA ConnectX-6 HDR InfiniBand: 200 Gb/s per port"),
    # ConnectX-7 NDR InfiniBand, 400 Gb/s per port (one per GPU in a DGX H100).
    "ib400": KVLinkSpec(name="ib400", latency_s=20e-6, bytes_per_s=400e9 / 8,
                        source="NVIDIA ConnectX-7 NDR InfiniBand: 400 Gb/s per port"),
    # PCIe 4.0 x16: 16 GT/s per lane, 128b/130b coding: 31.5 GB/s per direction.
    "pcie4": KVLinkSpec(name="pcie4", latency_s=10e-6, bytes_per_s=16e9 * 16 * 128 / 130 / 8,
                        source="PCI-SIG PCIe 4.0: 16 GT/s x16, 128b/130b"),
    # PCIe 5.0 x16: 32 GT/s per lane: 63 GB/s per direction.
    "pcie5": KVLinkSpec(name="pcie5", latency_s=10e-6, bytes_per_s=32e9 * 16 * 128 / 130 / 8,
                        source="PCI-SIG PCIe 5.0: 32 GT/s x16, 128b/130b"),
    # Links to slower KV tiers (issue 27): the host's DRAM and a disk or remote store.
    # GH200's NVLink-C2C joins the Grace CPU's memory to the Hopper GPU: 900 GB/s both
    # directions, 450 GB/s each way.
    "nvlink-c2c": KVLinkSpec(name="nvlink-c2c", latency_s=5e-6, bytes_per_s=450e9,
                             source="NVIDIA GH200 datasheet: NVLink-C2C 900 GB/s (both "
                                    "directions)"),
    # One PCIe 4.0 x4 NVMe SSD: ~7 GB/s sequential read, ~100 us per request (an
    # assumption from datacenter drives' datasheets, e.g. Samsung PM9A3: 6.9 GB/s read).
    "nvme": KVLinkSpec(name="nvme", latency_s=100e-6, bytes_per_s=7e9,
                       source="PCIe 4.0 x4 NVMe SSD datasheets (Samsung PM9A3: 6.9 GB/s read)"),
    # A remote KV store over RDMA (Mooncake's store): one 200 Gb/s NIC per GPU, a few
    # microseconds of verbs latency plus the store's lookup (an assumption: 50 us).
    "rdma": KVLinkSpec(name="rdma", latency_s=50e-6, bytes_per_s=200e9 / 8,
                       source="one 200 Gb/s RDMA NIC per GPU (Mooncake's transfer engine); "
                              "latency assumed"),
}
KV_LINK_ALIASES: dict[str, str] = {"nvlink": "nvlink3", "pcie-gen4-x16": "pcie4",
                                   "pcie-gen5-x16": "pcie5"}


def get_kv_link(name: str, max_concurrent: Optional[int] = None) -> KVLinkSpec:
    """Looks up a KV link preset by name or alias (`nvlink` is A100's NVLink3), with
    `max_concurrent` transfers per link if given."""
    key = KV_LINK_ALIASES.get(name, name)
    if key not in KV_LINK_PRESETS:
        valid = sorted([*KV_LINK_PRESETS, *KV_LINK_ALIASES])
        raise ValueError(f"unknown KV link preset {name!r}; valid names: {', '.join(valid)}")
    link = KV_LINK_PRESETS[key]
    return link if max_concurrent is None else dataclasses.replace(
        link, max_concurrent=max_concurrent)
