"""Pipeline stages of the simulated replica: how the layers split, and each stage's seconds.

With pipeline parallelism `P` the model's layers split into `P` consecutive stages
(`stage_layers`: an even split by default, the first stages taking one more layer
when `P` does not divide the layers, or a given uneven split), each on its own `tp`
GPUs: stage `s` on GPUs `[s tp, (s + 1) tp)`, `gpus_per_node` to a node. A step
passes through the stages in order; stage `s`'s seconds are

    stage_s = kernels of its layers (the `per_op` roofline of `Stage(layers_s)`: the
              embedding on the first stage, the final norm and the LM head on the last)
            + its tensor-parallel all-reduces (2 per layer, + 1 after the embedding)
            + step_overhead_s (each stage launches, and waits for, its own step)
            + send_s (s < P - 1): latency + N D b / bytes_per_s

where `N` is the step's token rows (the bucket's, as the kernels), `D` d_model and
`b` dtype bytes: the `[N, D]` activations cross to the next stage over one link,
the hardware's `nvlink` preset when both stages' first GPUs share a node, else its
`node_link` (`orca_jax.specs.hardware.KV_LINK_PRESETS`). One link carries the whole
tensor (no scatter over the `tp` GPU pairs): an upper bound, and small beside a
stage (GPT-3 175B: 64 decode rows are 1.6 MB, 63 us on HDR InfiniBand).
In `fixed` mode stage `s` takes `step_time_s * layers_s / L`, and nothing crosses.

The executor (`orca_jax.core.loop.pipeline`) turns these into the run's clock.
Nothing here imports jax.
"""

from __future__ import annotations

from typing import Callable, Optional, Protocol

import numpy as np
from numpy.typing import NDArray

from orca_jax.core.step.engine_api import Bucket
from orca_jax.sim.roofline import PerOpRoofline, Stage
from orca_jax.specs.hardware import HardwareSpec, KVLinkSpec, get_kv_link
from orca_jax.specs.model_config import ModelConfig

# The cost modes that price stages (a fit prices whole steps; so does roofline_max).
STAGE_MODES = ("per_op", "fixed")


def stage_layers(num_layers: int, pp: int, split: Optional[str] = None,
                 where: str = "pp") -> tuple[int, ...]:
    """The layers of each of `pp` stages: `split` ("20,12") if given, else an even split
    (the first `num_layers % pp` stages one layer more).

    Raises:
      ValueError: one line naming `where`: `pp` < 1 or above the layers, or `split`
        is not `pp` integers >= 1 summing to `num_layers`.
    """
    if not isinstance(pp, int) or pp < 1:
        raise ValueError(f"{where} must be an integer >= 1, got {pp!r}")
    if pp > num_layers:
        raise ValueError(f"{where} {pp} is more stages than the model's {num_layers} layers")
    if split is None:
        base, extra = divmod(num_layers, pp)
        return tuple(base + (1 if s < extra else 0) for s in range(pp))
    try:
        layers = tuple(int(part) for part in split.split(","))
    except ValueError:
        raise ValueError(f"{where}_layers {split!r} is not a comma-separated list of "
                         "integers") from None
    if len(layers) != pp:
        raise ValueError(f"{where}_layers {split!r} gives {len(layers)} stages, {where} is {pp}")
    if min(layers) < 1 or sum(layers) != num_layers:
        raise ValueError(f"{where}_layers {split!r} must be {pp} integers >= 1 summing to the "
                         f"model's {num_layers} layers (they sum to {sum(layers)})")
    return layers


def check_gpus(hardware: HardwareSpec, tp: int, pp: int, where: str = "pp") -> None:
    """Raises ValueError (one line) when `pp` stages of `tp` GPUs exceed the GPUs the
    hardware preset describes (`HardwareSpec.max_gpus`)."""
    if pp * tp > hardware.max_gpus:
        raise ValueError(f"{where} {pp} x tp {tp} = {pp * tp} GPUs, more than the "
                         f"{hardware.max_gpus} hardware {hardware.name} describes "
                         f"({hardware.gpus_per_node} to a node)")


def stage_link(hardware: HardwareSpec, tp: int, stage: int) -> KVLinkSpec:
    """The link stage `stage` sends its activations to stage `stage + 1` over: NVLink
    when their first GPUs share a node, else the node link."""
    per_node = hardware.gpus_per_node
    same_node = (stage * tp) // per_node == ((stage + 1) * tp) // per_node
    return get_kv_link(hardware.nvlink if same_node else hardware.node_link)


class StageCostConfig(Protocol):
    """What `StagePricer` reads of a `cost_model.CostModelConfig`."""

    mode: str
    tp: int
    dtype_bytes: int
    step_overhead_s: float
    step_time_s: Optional[float]
    step_padding: str
    pp_layers: Optional[tuple[int, ...]]

    @property
    def model_config(self) -> ModelConfig: ...

    @property
    def hardware_spec(self) -> HardwareSpec: ...


class StagePricer:
    """Prices a step on each pipeline stage of `config` (`config.pp_layers`).

    Args:
      config: a `per_op` or `fixed` cost model with `pp_layers` set.
    """

    def __init__(self, config: StageCostConfig) -> None:
        assert config.pp_layers is not None
        self.config = config
        self.layers = config.pp_layers
        num_stages = len(self.layers)
        model, hardware = config.model_config, config.hardware_spec
        self.rooflines: Optional[list[PerOpRoofline]] = None
        if config.mode == "per_op":
            self.rooflines = [
                PerOpRoofline(model, hardware, config.tp, config.dtype_bytes,
                              Stage(layers, first=s == 0, last=s == num_stages - 1))
                for s, layers in enumerate(self.layers)]
        self.links = [stage_link(hardware, config.tp, s) for s in range(num_stages - 1)]
        self._row_bytes = float(model.d_model * config.dtype_bytes)

    @property
    def num_stages(self) -> int:
        return len(self.layers)

    def send_seconds(self, stage: int, num_rows: int) -> float:
        """Seconds stage `stage` takes to send `num_rows` activation rows to the next."""
        link = self.links[stage]
        return link.latency_s + num_rows * self._row_bytes / link.bytes_per_s

    def seconds(self, bucket: Bucket,
                lengths: Callable[[], tuple[NDArray[np.int64], NDArray[np.int64]]]
                ) -> list[float]:
        """Each stage's seconds for one step in `bucket` (see the module docstring).

        Args:
          bucket: the step's compiled shape.
          lengths: gives the step's `(q_lens, kv_lens)` (`[num_seqs]` each).
        """
        config = self.config
        total_layers = sum(self.layers)
        if self.rooflines is None:  # fixed: the step's time by layer share
            assert config.step_time_s is not None
            return [config.step_time_s * layers / total_layers for layers in self.layers]
        q_lens, kv_lens = lengths()
        real_tokens = int(np.sum(q_lens))
        padded_to = config.padded_shape(bucket, real_tokens, len(q_lens))
        rows = padded_to[0] if padded_to is not None else real_tokens
        out = []
        for s, roofline in enumerate(self.rooflines):
            stage_s = roofline.kernels_seconds(q_lens, kv_lens, padded_to) + config.step_overhead_s
            if s < len(self.links):
                stage_s += self.send_seconds(s, rows)
            out.append(stage_s)
        return out

