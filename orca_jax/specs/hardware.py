"""Accelerator datasheets and their presets.

`HardwareSpec` (HBM capacity and bandwidth, FLOPs, interconnect) feeds
`orca_jax.sim.cost_model`'s roofline and `orca_jax.specs.memory`'s KV pool
sizing; model shapes are `orca_jax.specs.model_config`'s. Nothing here imports jax.
"""

from __future__ import annotations

import dataclasses

GIB = 1 << 30


@dataclasses.dataclass(frozen=True, kw_only=True)
class HardwareSpec:
    """One accelerator, as its datasheet gives it."""

    name: str
    hbm_bytes: int  # HBM capacity
    hbm_bytes_per_s: float  # peak HBM bandwidth
    peak_flops: float  # dense bf16 tensor-core FLOP/s (no sparsity)
    link_bytes_per_s: float  # NVLink bandwidth per GPU, one direction (a ring sends one way)


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


def get_hardware(name: str) -> HardwareSpec:
    """Looks up a hardware preset by name or alias (`a100` is the 80 GB part)."""
    key = HARDWARE_ALIASES.get(name, name)
    if key not in HARDWARE_PRESETS:
        valid = sorted([*HARDWARE_PRESETS, *HARDWARE_ALIASES])
        raise ValueError(f"unknown hardware preset {name!r}; valid names: {', '.join(valid)}")
    return HARDWARE_PRESETS[key]
