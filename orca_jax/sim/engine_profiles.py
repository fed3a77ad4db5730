"""Engine profiles: which serving engine the simulator prices, as a small named record.

The per-operation roofline (`orca_jax.sim.roofline`) prices a step's kernels from a
GPU's datasheet and the efficiencies measured kernels reach on it
(`HardwareSpec.kernels`). What runs those kernels differs between engines, and a
simulated run should say which one it means (`--engine_profile=NAME`):

* which attention kernels it runs on each GPU generation (FlashAttention-2 on Ampere,
  FlashAttention-3 on Hopper reaches more of the datasheet);
* which all-reduce it calls under tensor parallelism (NCCL, eagerly; or a custom
  one-shot/two-shot all-reduce inside CUDA graphs, several times faster on small
  messages);
* how it pads a step: to its own compiled buckets, or to the sizes it captured CUDA
  graphs at (`graph_sizes`; larger steps run without a graph, at their real size);
* the host time per step the GPU waits for (`step_overhead_s`);
* the serving front end in front of the engine (`core.step.engine_api.FrontEnd`): the
  HTTP server, tokenizer and process hops a request crosses, and whether the engine
  plans a step while the previous one runs (async scheduling).

Profiles:

* `orca_jax` (the default): this project's compiled steps as the simulator has always
  priced them — the run's bucket ladder, the hardware preset's measured kernels, 300 us
  a step, no front end. Every figure made before profiles existed is this profile's.
* `vllm`: vLLM's v1 engine (0.11-0.15) serving over its OpenAI server: FlashAttention-3
  on Hopper, its custom all-reduce inside CUDA graphs, graphs captured up to 512 tokens,
  async scheduling and the front end's per-request path. Its constants are physics where
  a datasheet or a kernel paper gives them, and fitted where nothing does (the front end,
  the step overhead, the all-reduce's latency) to public end-to-end runs of vLLM 0.15.1
  on H100s (`benchmarks/sim_vs_real.py`, `docs/fidelity.md`): a few shared constants,
  never a per-run table.

Adding an engine: a new `EngineProfile` in `PROFILES`, with its own kernel choices per
generation and its host and front-end costs, checked with `benchmarks/sim_vs_real.py`
against that engine's public runs. Adding a GPU: a `HardwareSpec` preset with its
`generation` (a profile without entries for it prices it with the preset's own kernels).
"""

from __future__ import annotations

import dataclasses
import types
from typing import Mapping, Optional

from orca_jax.core.step.engine_api import NO_FRONT_END, FrontEnd
from orca_jax.specs.hardware import AllReduceCost, HardwareSpec, KernelEfficiency

DEFAULT_PROFILE = "orca_jax"


@dataclasses.dataclass(frozen=True, kw_only=True)
class AttentionKernels:
    """The attention kernels an engine runs on one GPU generation.

    Attributes:
      prefill: sequences of more than one new token (a chunk or a whole prompt).
      decode: sequences of one new token (paged KV reads).
      source: which kernels these are, and where their efficiencies come from.
    """

    prefill: KernelEfficiency
    decode: KernelEfficiency
    source: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineProfile:
    """What one serving engine runs, beside the GPU's datasheet (the module docstring).

    Attributes:
      name: the profile's name (`--engine_profile`).
      summary: one line saying what it prices (a simulated `run` prints it).
      step_overhead_s: seconds per step outside the kernels that the GPU waits for
        (launch gaps, sampling, the host's share the engine does not hide).
      front_end: the serving path in front of the engine (`FrontEnd`).
      graph_sizes: token counts the engine captured CUDA graphs at: a step runs padded
        to the smallest at or above its tokens, larger steps at their real size. None:
        the run's own buckets (this project's compiled steps).
      attention: per GPU generation (`HardwareSpec.generation`), the attention kernels
        that replace the preset's; a generation not named keeps the preset's.
      allreduce: per GPU generation, the all-reduce costs that replace the preset's
        (each GPU count the preset has must be covered).
    """

    name: str
    summary: str
    step_overhead_s: float
    front_end: FrontEnd = NO_FRONT_END
    graph_sizes: Optional[tuple[int, ...]] = None
    attention: Mapping[str, AttentionKernels] = dataclasses.field(
        default_factory=lambda: types.MappingProxyType({}))
    allreduce: Mapping[str, tuple[AllReduceCost, ...]] = dataclasses.field(
        default_factory=lambda: types.MappingProxyType({}))

    def hardware(self, preset: HardwareSpec) -> HardwareSpec:
        """`preset` with this engine's kernels on its generation (itself if none)."""
        attention = self.attention.get(preset.generation)
        allreduce = self.allreduce.get(preset.generation)
        if attention is None and allreduce is None:
            return preset
        kernels = preset.kernels
        changes: dict[str, object] = {}
        sources = [kernels.source]
        if attention is not None:
            changes.update(attention_prefill=attention.prefill, attention_decode=attention.decode)
            sources.append(attention.source)
        if allreduce is not None:
            known = {cost.num_gpus for cost in allreduce}
            missing = sorted({cost.num_gpus for cost in kernels.allreduce} - known)
            # GPU counts the profile's all-reduce does not reach keep the preset's (NCCL
            # across nodes): a custom all-reduce spans one node's NVLink only.
            changes["allreduce"] = tuple(sorted(
                [*allreduce, *(c for c in kernels.allreduce if c.num_gpus in missing)],
                key=lambda cost: cost.num_gpus))
            sources.append(f"{self.name} all-reduce")
        kernels = dataclasses.replace(kernels, source="; ".join(sources), **changes)
        return dataclasses.replace(preset, kernels=kernels)


def _kernel(latency_us: float, hbm: float, flops: float) -> KernelEfficiency:
    return KernelEfficiency(latency_s=latency_us * 1e-6, hbm_efficiency=hbm,
                            flops_efficiency=flops)


def _allreduce(num_gpus: int, latency_us: float, gb_per_s: float) -> AllReduceCost:
    return AllReduceCost(num_gpus=num_gpus, latency_s=latency_us * 1e-6,
                         bytes_per_s=gb_per_s * 1e9)


# vLLM's default CUDA graph sizes (`CompilationConfig`, 0.11+): 1, 2, 4, multiples of 8 to
# 256, then of 16 to 512, the largest (`max_cudagraph_capture_size`) at most 512. A step
# of more tokens runs piecewise-compiled but ungraphed, at its real size.
VLLM_GRAPH_SIZES = (1, 2, 4, *range(8, 256, 8), *range(256, 513, 16))

# FlashAttention-3 on H100 (its paper: 75% of bf16 peak on long non-causal forward
# passes, ~55-60% on causal ones of a few thousand tokens, less on short chunks); its
# paged decode streams KV at close to the bandwidth of a plain copy. FlashAttention-2 on
# A100 (50-73% of peak forward; decode at ~80% of HBM).
_VLLM_ATTENTION = {
    "hopper": AttentionKernels(
        prefill=_kernel(5.0, 0.85, 0.55), decode=_kernel(5.0, 0.92, 0.55),
        source="vLLM FlashAttention-3 on Hopper (FA3 paper's causal forward; paged decode "
               "fitted to the slope of decode steps in batch, benchmarks/sim_vs_real.py)"),
    "ampere": AttentionKernels(
        prefill=_kernel(5.0, 0.80, 0.50), decode=_kernel(5.0, 0.80, 0.50),
        source="vLLM FlashAttention-2 on Ampere (FA2 paper's causal forward; decode "
               "assumed as Hopper's less its newer memory pipeline)"),
}

# vLLM's custom all-reduce (one-shot below ~512 KB, two-shot above, through NVLink
# peer memory, captured in the decode graphs) on one node: a few microseconds of
# latency where eager NCCL takes ~50 (the preset's, fitted to NCCL profiles).
# Bandwidths: NVLink4 (H100) 900 GB/s both ways per GPU, NVLink3 (A100) 600.
_VLLM_ALLREDUCE = {
    "hopper": (_allreduce(2, 5.0, 200.0), _allreduce(4, 5.0, 150.0), _allreduce(8, 6.0, 120.0)),
    "ampere": (_allreduce(2, 6.0, 130.0), _allreduce(4, 6.0, 100.0), _allreduce(8, 7.0, 80.0)),
}

PROFILES: Mapping[str, EngineProfile] = types.MappingProxyType({
    "orca_jax": EngineProfile(
        name="orca_jax",
        summary="this project's compiled steps: the run's bucket ladder, the preset's "
                "measured kernels, 300 us a step, no front end",
        step_overhead_s=300e-6),
    "vllm": EngineProfile(
        name="vllm",
        summary="vLLM v1 (0.11-0.15) behind its OpenAI server: FA3 on Hopper, custom "
                "all-reduce in CUDA graphs (to 512 tokens), async scheduling, its front end",
        step_overhead_s=300e-6,
        front_end=FrontEnd(delay_s=6e-3, plans_ahead=True),
        graph_sizes=VLLM_GRAPH_SIZES,
        attention=types.MappingProxyType(_VLLM_ATTENTION),
        allreduce=types.MappingProxyType(_VLLM_ALLREDUCE)),
})


def get_engine_profile(name: str) -> EngineProfile:
    """Looks up an engine profile by name.

    Raises:
      ValueError: naming the profile and the known ones.
    """
    if name not in PROFILES:
        raise ValueError(f"unknown engine profile {name!r}; valid names: "
                         f"{', '.join(sorted(PROFILES))}")
    return PROFILES[name]
