"""Step-time cost model of the simulated engine (presets in `orca_jax.specs`).

Four modes (`CostModelConfig.mode`). The two rooflines price a step as it is
compiled (`step_padding="bucket"`, the default): attention by what the step
descriptor really holds — the real sequences `i < num_seqs`, with query length
`q_i = cu_q_lens[i+1] - cu_q_lens[i]` and attended length `k_i = kv_lens[i]` —
and every token-wise kernel on the bucket's `N = T` token rows, padding
included, and the LM head on its `S` sequence rows. A compiled step's shapes are
its bucket's: the real JAX engine runs embedding, projections, MLP and norms on
all T rows, real or not, and samples S rows; its ragged attention kernel skips
the padding (`benchmarks/results/sim_padding.txt` measures both on the `tiny` and
`small` engines). `step_padding="ragged"` asks what an ideal ragged engine would
take instead, `N = sum q_i` tokens and `S = num_seqs` real sequences, the
simulator's pricing before 0.2. Below, `b = dtype_bytes`, `L` layers, `H` query
heads, `d` head_dim, `D` d_model, `V` vocab. Query j of a chunk of q_i tokens attends to
`k_i - q_i + j + 1` tokens (causal inside the chunk), whose mean over the chunk
is `k_i - (q_i - 1) / 2`; each attended key costs 2 FLOPs per head dim for
QK^T and 2 for PV.

* `per_op` (default). Kernels run one after another, so their times add: a
  step is the sum of its kernels, each priced by its own roofline with the
  efficiencies of its kind (`HardwareSpec.kernels`, fitted to measured kernel
  times: `orca_jax.specs.hardware`), plus tensor parallelism's all-reduces and
  a per-step overhead (`orca_jax.sim.roofline` holds the code):

      step_s = sum_op launches_op * t_op + allreduce + step_overhead_s
      t_op   = latency_op + sqrt(memory_op^2 + compute_op^2)
      memory_op  = bytes_op / (hbm_bytes_per_s * eff_op)
      compute_op = flops_op / (peak_flops * flops_efficiency_op)
      eff_op = l2_efficiency_op if bytes_op <= l2_bytes else hbm_efficiency_op
      allreduce = (2 L + 1) * (latency[tp] + N * D * b / bytes_per_s[tp])   (0 if tp == 1)

  (`t_op` is 0 for a kernel with nothing to do: no prefill or no decode
  sequence.) The root of the sum of squares is a smooth `max(memory, compute)`:
  away from the ridge point it is the larger one, near it a real GEMM overlaps
  its loads and its math imperfectly. On Vidur's measured projections at 96-256
  tokens (the ridge on an A100, where batched decode lives) a hard max, refitted,
  is off by a median 6-21%, this by 3-11% (before the GEMM waves below; with
  them 2.5-25%, where cuBLAS switches kernels); elsewhere the two agree. Per-GPU work, with
  `h = H / tp` query heads, `g = ceil(kv_heads / tp)` KV heads, `f = ffn / tp`,
  `u = 2 f` (gated MLP) or `f`, `v = V / tp`:

      kernel             launches  bytes                      flops
      embedding          1         2 N D b                    0
      norm               2 L + 1   (D + 2 N D) b              0
      qkv_proj           L         (D e + N (D + e)) b        2 N D e,  e = (h + 2 g) d
      rope               L         4 N r b                    0
      attention_prefill  L         2 g d b sum_P k_i          4 h d sum_P q_i (k_i - (q_i - 1) / 2)
      attention_decode   L         2 g d b sum_1 k_i          4 h d sum_1 k_i
      attn_out_proj      L         (h d D + N (h d + D)) b    2 N h d D
      mlp_up_proj        L         (D u + N (D + u)) b        2 N D u
      mlp_act            L         N (u + f) b                0
      mlp_down_proj      L         (f D + N (f + D)) b        2 N f D
      residual_add       2 L       3 N D b                    0
      lm_head            1         (D v + S (D + v)) b        2 S D v

  (`sum_P` over the sequences with `q_i > 1`, `sum_1` over those with `q_i = 1`.)

  Two corrections to these counts (issue 26, checked by leaving one measured model
  out of the fit: `benchmarks/cost_model_vs_measured.py`):

  * GEMM waves. A projection `[N, K] @ [K, M]` runs `ceil(N / 64) * ceil(M / 64)`
    output tiles (`KernelEfficiency.tile`) in waves over the GPU's SMs, and a
    partial wave costs a whole one: its FLOPs are `ceil(tiles / sms) * sms * 2 *
    64 * 64 * K`, not `2 N M K`. Counting FLOPs by tokens priced decode-sized steps
    (1-512 tokens) 4-7% fast on held-out files, up to 24% just past a tile (136,
    264 tokens); with the waves the held-out medians are -3.4..+4.7%.
  * Rope's idle lanes. The measured rotary kernel (vLLM's) runs a block of `T =
    min(h d / 2, 512)` threads per token over the query pairs, then the key pairs;
    with few KV heads the key iteration leaves lanes idle, and each costs half a
    busy lane's bytes: `r = p + (T * (ceil(h d / 2T) + ceil(g d / 2T)) - p) / 2`
    with `p = (h + g) d / 2` real pairs. Bytes alone priced 70B at TP 8 (8 query
    heads, 1 KV head) 15-18% fast, -30% at 8,192 tokens.

  A projection of few tokens is bound by its weight bytes, of many by its
  FLOPs; the LM head runs on the S sampled rows only. The all-reduces are of the
  `[N, D]` activations after attention and after the MLP, and once after the
  vocabulary-parallel embedding. Elementwise kernels count no FLOPs (a few per
  byte, far below the ridge point); attention reads each KV token once.
* `roofline_max`: the whole step under one roofline, as before `per_op`
  (it hides the KV reads under the weight GEMMs and runs 0.7-0.8x fast on
  mixed prefill+decode steps; kept for the numbers that were made with it):

      bytes   = weight_bytes + sum_i k_i * kv_bytes_per_token
      flops   = 2 * non_embedding_params * N            (projections, MLP, norms)
              + 2 * D * V * S                           (LM head, sampled token only)
              + 4 * L * H * d * sum_i q_i * (k_i - (q_i - 1) / 2)   (QK^T and PV)
      allreduce = 2 * L * (2 * (tp - 1) / tp * N * D * b / link_bytes_per_s
                           + allreduce_latency_s)       (0 when tp == 1)
      step_s  = max(bytes / (hbm_bytes_per_s * hbm_efficiency * tp),
                    flops / (peak_flops * flops_efficiency * tp))
              + allreduce + step_overhead_s

  `weight_bytes` is every weight matrix read once per step: the layers, the
  final norm and the LM head (`V x D`); the input embedding is a row gather of
  N rows, which is noise next to the matrices, so it is not counted (with tied
  embeddings the LM head is the embedding table, read once). `kv_bytes_per_token`
  is `2 (K and V) * L * kv_heads * d * b`. Tensor parallelism splits weights,
  KV and FLOPs evenly over `tp` GPUs and adds two ring all-reduces of the
  `[N, D]` activations per layer. The efficiency factors absorb everything else.
* `fixed`: `step_time_s` per step, whatever the step holds (didactic examples).
* `fitted`: `fitted_step_s[bucket.num_tokens]`, fitted to a real engine. Each
  bucket's entry is either a constant (seconds measured per bucket) or a
  `LinearStepTime`, which follows what the step holds (written by
  `orca_jax.sim.calibration`):

      step_s = base_s + per_seq_s * S + per_tile_s * tiles
      tiles  = sum_i sum_{j < ceil(q_i / Qt)} ceil(min(k_i, k_i - q_i + (j + 1) * Qt) / Kt)

  `tiles` counts the (query tile, KV tile) pairs a tiled attention kernel
  visits: sequence i's `q_i` queries in tiles of `Qt = q_tile` rows, each tile
  reading the KV tiles of `Kt = kv_tile` tokens up to its last query's
  position (causal). A decode step of S sequences has `sum_i ceil(k_i / Kt)`
  tiles. The per-bucket `base_s` holds everything sized by the padded bucket
  (projections, MLP, LM head), `per_seq_s` the per-sequence loop and sampling
  work, `per_tile_s` one tile's attention (its cost depends on `Qt`, hence
  per bucket). On a CPU attention dominates long-context steps, so a
  bucket-only constant is not enough.

Nothing here imports jax: the simulator runs paper-scale workloads on a laptop.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import math
import types
from typing import Callable, Mapping, Optional, Union

import numpy as np
from numpy.typing import NDArray

from orca_jax.core.step.engine_api import Bucket, StepInputs
from orca_jax.sim.pipeline_stages import STAGE_MODES, StagePricer, check_gpus, stage_layers
from orca_jax.sim.roofline import SHORT_SPAN, PerOpRoofline
from orca_jax.specs.hardware import HardwareSpec, get_hardware
from orca_jax.specs.memory import DTYPE_BYTES, kv_bytes_per_token
from orca_jax.specs.model_config import ModelConfig, get_model_config

COST_MODES = ("per_op", "roofline_max", "fixed", "fitted")
# How the rooflines count padding: `bucket` prices a step as compiled (token-wise kernels
# on the bucket's token rows, the LM head on its sequence rows), `ragged` an ideal engine
# with no padding (real tokens and sequences only). See the module docstring.
STEP_PADDINGS = ("bucket", "ragged")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LinearStepTime:
    """One bucket's fitted step time: `base_s + per_seq_s * S + per_tile_s * tiles`.

    Attributes:
      base_s: seconds of the bucket's fixed work (everything sized by its padded shape).
      per_seq_s: seconds per real sequence.
      per_tile_s: seconds per (query tile, KV tile) pair of attention.
      q_tile: query rows per attention tile in this bucket.
      kv_tile: KV tokens per attention tile.
    """

    base_s: float
    per_seq_s: float
    per_tile_s: float
    q_tile: int
    kv_tile: int

    def __post_init__(self) -> None:
        for field in ("base_s", "per_seq_s", "per_tile_s"):
            value = getattr(self, field)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0.0):
                raise ValueError(f"LinearStepTime.{field} must be finite and >= 0, got {value!r}")
        for field in ("q_tile", "kv_tile"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"LinearStepTime.{field} must be an integer >= 1, got {value!r}")
        if self.base_s + self.per_seq_s + self.per_tile_s <= 0.0:
            raise ValueError("LinearStepTime: base_s, per_seq_s and per_tile_s are all 0")

    def seconds(self, q_lens: NDArray[np.int64], kv_lens: NDArray[np.int64]) -> float:
        """Step seconds for real sequences `q_lens` `[num_seqs]`, `kv_lens` `[num_seqs]`."""
        tiles = attention_tiles(q_lens, kv_lens, q_tile=self.q_tile, kv_tile=self.kv_tile)
        return self.base_s + self.per_seq_s * len(q_lens) + self.per_tile_s * tiles


def attention_tiles(q_lens: NDArray[np.int64], kv_lens: NDArray[np.int64], *, q_tile: int,
                    kv_tile: int) -> int:
    """(query tile, KV tile) pairs a causal tiled attention visits (the module docstring's sum).

    Args:
      q_lens: `[num_seqs]` new tokens of each sequence.
      kv_lens: `[num_seqs]` tokens each sequence attends to (this step's included).
      q_tile: query rows per tile.
      kv_tile: KV tokens per tile.
    """
    q_lens = np.asarray(q_lens, np.int64)
    kv_lens = np.asarray(kv_lens, np.int64)
    # One row per query tile of every sequence (none for a sequence with no new token), in
    # integers: the same count a loop over the sequences makes, without a numpy call each.
    num_tiles = np.where(q_lens > 0, -(-q_lens // q_tile), 0)  # [num_seqs]
    tile_kv = np.repeat(kv_lens, num_tiles)  # [num_tiles]
    tile_start = np.repeat(kv_lens - q_lens, num_tiles)  # [num_tiles] keys before the queries
    first = np.repeat(np.cumsum(num_tiles) - num_tiles, num_tiles)  # [num_tiles]
    tile_index = np.arange(1, len(tile_kv) + 1) - first  # [num_tiles] 1-based per sequence
    ends = np.minimum(tile_kv, tile_start + q_tile * tile_index)  # last key + 1
    return int(np.sum(-(-ends // kv_tile)))


@dataclasses.dataclass(frozen=True, kw_only=True)
class CostModelConfig:
    """How the simulated engine prices a step. `model`/`hardware` may be preset names.

    Attributes:
      mode: `per_op`, `roofline_max`, `fixed` or `fitted` (see the module docstring).
      model: the model (its vocab also sizes the placeholder tokens in every mode).
      hardware: one GPU of the replica (in `per_op` mode, its `kernels` hold the
        efficiencies and the all-reduce costs).
      tp: tensor-parallel degree (GPUs per replica).
      dtype_bytes: bytes of one weight, activation and KV element (2: bf16).
      hbm_efficiency: (`roofline_max` only) achievable fraction of peak HBM
        bandwidth. Streaming reads (decode GEMV, paged KV) reach 80-90% of peak
        in microbenchmarks; 0.8 leaves room for the small kernels of a real step.
      flops_efficiency: (`roofline_max` only) achievable fraction of dense peak
        FLOPs. Large bf16 GEMMs reach 70-80% of peak, a whole prefill step with
        attention and elementwise kernels about 50-60% (reported MFU of serving
        prefill); 0.6.
      allreduce_latency_s: (`roofline_max` only) fixed cost of one NVLink
        all-reduce of small messages (~10 us on 8 GPUs).
      step_overhead_s: (both rooflines) per-step cost outside the kernels: launch
        gaps, sampling, the device-to-host copy of the sampled tokens. The
        measured kernel times the `per_op` efficiencies are fitted to hold none
        of it; a few hundred microseconds is what a CUDA-graph decode step of
        vLLM spends between and around its kernels.
      step_time_s: seconds per step in `fixed` mode (only there).
      fitted_step_s: `{bucket num_tokens: seconds or LinearStepTime}` in `fitted`
        mode (only there).
      step_padding: (both rooflines) `bucket`: a step is priced as compiled, the
        token-wise kernels and all-reduces on its bucket's `T` token rows and the
        LM head on its `S` sequence rows, padding included; `ragged`: an ideal
        ragged engine that computes the real tokens only. Attention reads the
        real lengths either way.
      pp_layers: (`per_op` and `fixed` only) the layers of each pipeline stage, in
        order, summing to the model's (`pipeline_stages.stage_layers` makes an even
        split); each stage runs on its own `tp` GPUs and is priced by
        `pipeline_stages.StagePricer`. None: one stage, the whole model.
    """

    mode: str = "per_op"
    model: Union[ModelConfig, str] = "llama3-8b"
    hardware: Union[HardwareSpec, str] = "a100"
    tp: int = 1
    dtype_bytes: int = DTYPE_BYTES
    hbm_efficiency: float = 0.8
    flops_efficiency: float = 0.6
    allreduce_latency_s: float = 10e-6
    step_overhead_s: float = 300e-6
    step_time_s: Optional[float] = None
    fitted_step_s: Optional[Mapping[int, Union[float, LinearStepTime]]] = None
    step_padding: str = "bucket"
    pp_layers: Optional[tuple[int, ...]] = None
    graph_sizes: Optional[tuple[int, ...]] = None

    def __post_init__(self) -> None:
        if self.mode not in COST_MODES:
            raise ValueError(f"CostModelConfig.mode must be one of {COST_MODES}, got {self.mode!r}")
        if self.step_padding not in STEP_PADDINGS:
            raise ValueError(f"CostModelConfig.step_padding must be one of {STEP_PADDINGS}, "
                             f"got {self.step_padding!r}")
        if isinstance(self.model, str):
            object.__setattr__(self, "model", get_model_config(self.model))
        if isinstance(self.hardware, str):
            object.__setattr__(self, "hardware", get_hardware(self.hardware))
        if not isinstance(self.tp, int) or self.tp < 1:
            raise ValueError(f"CostModelConfig.tp must be an integer >= 1, got {self.tp!r}")
        if not isinstance(self.dtype_bytes, int) or self.dtype_bytes < 1:
            raise ValueError(f"CostModelConfig.dtype_bytes must be an integer >= 1, "
                             f"got {self.dtype_bytes!r}")
        for field in ("hbm_efficiency", "flops_efficiency"):
            value = getattr(self, field)
            if not 0.0 < value <= 1.0:
                raise ValueError(f"CostModelConfig.{field} must be in (0, 1], got {value!r}")
        for field in ("allreduce_latency_s", "step_overhead_s"):
            value = getattr(self, field)
            if not (math.isfinite(value) and value >= 0.0):
                raise ValueError(f"CostModelConfig.{field} must be finite and >= 0, got {value!r}")
        if (self.step_time_s is not None) != (self.mode == "fixed"):
            raise ValueError(f"CostModelConfig.step_time_s is required in fixed mode and only "
                             f"there; mode={self.mode!r}, step_time_s={self.step_time_s!r}")
        if self.step_time_s is not None and not (math.isfinite(self.step_time_s)
                                                 and self.step_time_s > 0):
            raise ValueError(f"CostModelConfig.step_time_s must be finite and > 0, "
                             f"got {self.step_time_s!r}")
        if (self.fitted_step_s is not None) != (self.mode == "fitted"):
            raise ValueError(f"CostModelConfig.fitted_step_s is required in fitted mode and "
                             f"only there; mode={self.mode!r}")
        if self.fitted_step_s is not None:
            object.__setattr__(self, "fitted_step_s", _checked_table(self.fitted_step_s))
        if self.mode == "per_op" and self.tp > 1:
            self.hardware_spec.kernels.allreduce_cost(self.tp)  # names a GPU count it lacks
        if self.pp_layers is not None:
            self._check_stages(self.pp_layers)
        if self.graph_sizes is not None:
            sizes = self.graph_sizes
            if not (sizes and all(isinstance(n, int) and n >= 1 for n in sizes)
                    and list(sizes) == sorted(set(sizes))):
                raise ValueError(f"CostModelConfig.graph_sizes must be increasing integers "
                                 f">= 1, got {sizes!r}")
            if self.step_padding != "bucket" or self.mode not in ("per_op", "roofline_max"):
                raise ValueError("CostModelConfig.graph_sizes pads the rooflines' steps "
                                 "(step_padding bucket, mode per_op or roofline_max)")

    def padded_shape(self, bucket: Bucket, num_tokens: int,
                     num_seqs: int) -> Optional[tuple[int, int]]:
        """`(tokens, sequences)` the rooflines price a step of `num_tokens` real tokens of
        `num_seqs` sequences in `bucket` at: the bucket's (`step_padding` bucket), the
        engine's captured graph sizes (`graph_sizes`: the smallest at or above the real
        tokens, the real ones above the largest; sampled rows are the real sequences), or
        None for the real ones (`ragged`)."""
        if self.step_padding != "bucket":
            return None
        if self.graph_sizes is None:
            return (bucket.num_tokens, bucket.num_seqs)
        return (graph_padded(num_tokens, self.graph_sizes), num_seqs)

    def _check_stages(self, layers: tuple[int, ...]) -> None:
        """`pp_layers` is a split of the model's layers onto GPUs the hardware has."""
        num_stages = len(layers)
        if self.mode not in STAGE_MODES:
            raise ValueError(f"CostModelConfig.pp_layers: mode {self.mode!r} prices whole "
                             f"steps; pipeline stages take one of {STAGE_MODES}")
        stage_layers(self.model_config.num_layers, num_stages,
                     ",".join(str(n) for n in layers), where="CostModelConfig.pp")
        check_gpus(self.hardware_spec, self.tp, num_stages, where="CostModelConfig.pp")

    @property
    def num_stages(self) -> int:
        """Pipeline stages (1: no pipeline)."""
        return 1 if self.pp_layers is None else len(self.pp_layers)

    @functools.cached_property
    def stage_pricer(self) -> StagePricer:
        """Prices a step on each pipeline stage (needs `pp_layers`)."""
        return StagePricer(self)

    @property
    def model_config(self) -> ModelConfig:
        """The resolved model (typed accessor: `model` holds a ModelConfig after init)."""
        assert isinstance(self.model, ModelConfig)
        return self.model

    @property
    def hardware_spec(self) -> HardwareSpec:
        """The resolved hardware."""
        assert isinstance(self.hardware, HardwareSpec)
        return self.hardware

    @functools.cached_property
    def per_op_roofline(self) -> PerOpRoofline:
        """The `per_op` mode's pricer, built once per config (any mode may ask for it)."""
        return PerOpRoofline(self.model_config, self.hardware_spec, self.tp, self.dtype_bytes)


def graph_padded(num_tokens: int, sizes: tuple[int, ...]) -> int:
    """The token count an engine with CUDA graphs captured at `sizes` (increasing) runs a
    step of `num_tokens` at: the smallest size at or above it, or itself above them all
    (run without a graph, as vLLM runs a step larger than its largest capture)."""
    index = bisect.bisect_left(sizes, num_tokens)
    return sizes[index] if index < len(sizes) else num_tokens


def _checked_table(table: Mapping[int, Union[float, LinearStepTime]]
                   ) -> Mapping[int, Union[float, LinearStepTime]]:
    if not table:
        raise ValueError("CostModelConfig.fitted_step_s is empty")
    checked: dict[int, Union[float, LinearStepTime]] = {}
    for num_tokens, seconds in table.items():
        if int(num_tokens) != num_tokens or num_tokens < 1:
            raise ValueError(f"CostModelConfig.fitted_step_s: bucket num_tokens must be an "
                             f"integer >= 1, got {num_tokens!r}")
        if isinstance(seconds, LinearStepTime):
            checked[int(num_tokens)] = seconds
            continue
        if not (isinstance(seconds, (int, float)) and math.isfinite(seconds) and seconds > 0):
            raise ValueError(f"CostModelConfig.fitted_step_s[{num_tokens}] must be finite and "
                             f"> 0, got {seconds!r}")
        checked[int(num_tokens)] = float(seconds)
    return types.MappingProxyType(checked)


@dataclasses.dataclass(frozen=True)
class StepCost:
    """The `roofline_max` parts of one step (seconds include the efficiency factors)."""

    num_bytes: float  # HBM bytes read, whole replica
    num_flops: float  # FLOPs, whole replica
    memory_s: float
    compute_s: float
    allreduce_s: float
    overhead_s: float

    @property
    def step_s(self) -> float:
        return max(self.memory_s, self.compute_s) + self.allreduce_s + self.overhead_s

    @property
    def is_memory_bound(self) -> bool:
        return self.memory_s >= self.compute_s


def roofline_max_cost(config: CostModelConfig, q_lens: NDArray[np.int64],
                      kv_lens: NDArray[np.int64],
                      padded_to: Optional[tuple[int, int]] = None) -> StepCost:
    """Prices a step of real sequences with the `roofline_max` formulas of the module docstring.

    Args:
      config: a config (any mode; its model, hardware and factors are used).
      q_lens: `[num_seqs]` new tokens of each real sequence.
      kv_lens: `[num_seqs]` tokens each sequence attends to (cache after the writes).
      padded_to: `(T, S)` of the bucket the step is padded to: N and S count its rows
        (None: the real tokens and sequences).
    """
    model, hw, tp, dtype_bytes = (config.model_config, config.hardware_spec, config.tp,
                                  config.dtype_bytes)
    q = np.asarray(q_lens, dtype=np.float64)
    k = np.asarray(kv_lens, dtype=np.float64)
    num_tokens, num_rows = float(q.sum()), q.shape[0]
    if padded_to is not None:
        num_tokens, num_rows = max(num_tokens, padded_to[0]), max(num_rows, padded_to[1])
    num_bytes = (model.step_weight_bytes(dtype_bytes)
                 + float(k.sum()) * kv_bytes_per_token(model, dtype_bytes))
    linear_flops = (2.0 * model.non_embedding_params * num_tokens
                    + 2.0 * model.d_model * model.vocab_size * num_rows)
    # Query j of a chunk of q sees k - q + j + 1 keys: q(2k-q+1)/2 pairs, an integer, summed
    # exactly in int64 (np.dot would call BLAS, whose kernels differ by CPU).
    q_int, k_int = np.asarray(q_lens, np.int64), np.asarray(kv_lens, np.int64)
    attended = float(int((q_int * (2 * k_int - q_int + 1)).sum()) // 2)
    attention_flops = 4.0 * model.num_layers * model.num_q_heads * model.head_dim * attended
    num_flops = linear_flops + attention_flops
    allreduce_s = 0.0
    if tp > 1:
        message_bytes = num_tokens * model.d_model * dtype_bytes
        one = 2.0 * (tp - 1) / tp * message_bytes / hw.link_bytes_per_s + config.allreduce_latency_s
        allreduce_s = 2 * model.num_layers * one
    return StepCost(
        num_bytes=num_bytes, num_flops=num_flops,
        memory_s=num_bytes / (hw.hbm_bytes_per_s * config.hbm_efficiency * tp),
        compute_s=num_flops / (hw.peak_flops * config.flops_efficiency * tp),
        allreduce_s=allreduce_s, overhead_s=config.step_overhead_s)


def real_lengths(inputs: StepInputs) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    """The `(q_lens, kv_lens)` of the real sequences of a descriptor, each `[num_seqs]`."""
    num_seqs = inputs.num_real_seqs
    cu = inputs.cu_q_lens[:num_seqs + 1].astype(np.int64)
    return cu[1:] - cu[:-1], inputs.kv_lens[:num_seqs].astype(np.int64)


def step_seconds(config: CostModelConfig, inputs: StepInputs,
                 lengths: Optional[tuple[NDArray[np.int64], NDArray[np.int64]]] = None
                 ) -> float:
    """Seconds one step takes under `config` (dispatches on the mode).

    Args:
      config: the cost model.
      inputs: the step's descriptor.
      lengths: its `real_lengths`, if the caller has them already (they are priced as is).
    """
    return bucket_step_seconds(config, inputs.bucket,
                               lambda: lengths or real_lengths(inputs))


def bucket_step_seconds(config: CostModelConfig, bucket: Bucket,
                        lengths: Callable[[], tuple[NDArray[np.int64], NDArray[np.int64]]]
                        ) -> float:
    """Seconds one step in `bucket` takes under `config`.

    Args:
      config: the cost model.
      bucket: the step's compiled shape (its T is a `fitted` model's key; the rooflines
        price its padding unless `config.step_padding` is `ragged`).
      lengths: gives the step's `(q_lens, kv_lens)` (`[num_seqs]` each), asked only
        by the modes that price them.

    Raises:
      ValueError: a `fitted` model has no time for the bucket.
    """
    bucket_tokens = bucket.num_tokens
    if config.mode == "fixed":
        assert config.step_time_s is not None
        return config.step_time_s
    if config.mode == "fitted":
        assert config.fitted_step_s is not None
        if bucket_tokens not in config.fitted_step_s:
            raise ValueError(f"fitted cost model has no time for bucket "
                             f"num_tokens={bucket_tokens}; "
                             f"fitted buckets: {sorted(config.fitted_step_s)}")
        entry = config.fitted_step_s[bucket_tokens]
        if isinstance(entry, LinearStepTime):
            return entry.seconds(*lengths())
        return entry
    q_lens, kv_lens = lengths()
    padded_to = config.padded_shape(bucket, int(np.sum(q_lens)), len(q_lens))
    return roofline_seconds(config, q_lens, kv_lens, padded_to)


StepPricer = Callable[[Bucket, NDArray[np.int64], NDArray[np.int64]], float]


def step_pricer(config: CostModelConfig) -> StepPricer:
    """`bucket_step_seconds(config, bucket, lambda: (q_lens, kv_lens))` as one function of
    `(bucket, q_lens, kv_lens)` (`[num_seqs]` each), chosen once per config: the
    simulator prices every step, and in `per_op` mode (the default) this is its
    roofline's `kernels_seconds` plus the step overhead, without the mode's dispatch
    and two Python frames a step (the same operations, so the same floats)."""
    if config.mode != "per_op":
        return lambda bucket, q_lens, kv_lens: bucket_step_seconds(
            config, bucket, lambda: (q_lens, kv_lens))
    kernels, overhead_s = config.per_op_roofline.kernels_seconds, config.step_overhead_s
    if config.graph_sizes is not None:  # the engine's own padding: of the real tokens
        return lambda bucket, q_lens, kv_lens: (
            kernels(q_lens, kv_lens, config.padded_shape(bucket, int(np.sum(q_lens)),
                                                         len(q_lens))) + overhead_s)
    if config.step_padding == "bucket":
        return lambda bucket, q_lens, kv_lens: (
            kernels(q_lens, kv_lens, (bucket.num_tokens, bucket.num_seqs)) + overhead_s)
    return lambda bucket, q_lens, kv_lens: kernels(q_lens, kv_lens, None) + overhead_s


def decode_span_seconds(config: CostModelConfig, bucket: Bucket,
                        kv_lens: NDArray[np.int64],  # [n]
                        num_steps: int) -> NDArray[np.float64]:  # [num_steps]
    """Seconds of each of `num_steps` decode-only steps in `bucket` of the same `n`
    sequences, step j (from 0) attending to `kv_lens + j` tokens: bit for bit what
    `bucket_step_seconds` gives each step one by one (a leap over steady decodes).

    `per_op` and `fixed` price the steps at once (`PerOpRoofline.decode_span_seconds`);
    the others step by step, through the very function a step is priced with.

    Raises:
      ValueError: a `fitted` model has no time for the bucket.
    """
    kv_lens = np.asarray(kv_lens, np.int64)
    if config.mode == "fixed":
        assert config.step_time_s is not None
        return np.full(num_steps, config.step_time_s)
    if config.mode == "per_op":
        padded_to = config.padded_shape(bucket, kv_lens.size, kv_lens.size)  # decodes: n, n
        n, first = kv_lens.size, int(np.add.reduce(kv_lens))  # step j attends to first + n j
        roofline = config.per_op_roofline
        if num_steps <= SHORT_SPAN:  # most leaps: a few steps, in Python numbers
            rows_s = roofline.decode_rows_seconds(n, padded_to)
            return np.array(roofline.decode_steps_seconds(
                rows_s, range(first, first + n * num_steps, n) if n else [0] * num_steps,
                config.step_overhead_s), np.float64)
        kv_tokens = first + n * np.arange(num_steps, dtype=np.int64)  # [k]
        return (roofline.decode_span_seconds(n, kv_tokens, padded_to)
                + config.step_overhead_s)
    q_lens = np.ones(kv_lens.size, np.int64)
    return np.array([bucket_step_seconds(config, bucket, lambda j=j: (q_lens, kv_lens + j))
                     for j in range(num_steps)], np.float64)


def roofline_seconds(config: CostModelConfig, q_lens: NDArray[np.int64],
                     kv_lens: NDArray[np.int64],
                     padded_to: Optional[tuple[int, int]] = None) -> float:
    """Seconds of a step of real sequences under `config`'s roofline (`roofline_max` if that
    is its mode, else `per_op`).

    Args:
      config: a config (any mode; `fixed` and `fitted` ones are priced `per_op`).
      q_lens: `[num_seqs]` new tokens of each real sequence.
      kv_lens: `[num_seqs]` tokens each sequence attends to (cache after the writes).
      padded_to: `(T, S)` of the bucket the step runs padded to (None: no padding, an
        ideal ragged engine).
    """
    if config.mode == "roofline_max":
        return roofline_max_cost(config, q_lens, kv_lens, padded_to).step_s
    return (config.per_op_roofline.kernels_seconds(q_lens, kv_lens, padded_to)
            + config.step_overhead_s)


def generation_seconds(config: CostModelConfig, batch_size: int, input_len: int,
                       output_len: int) -> float:
    """Seconds to generate `output_len` tokens for each of `batch_size` prompts of `input_len`.

    One step prefills every prompt; `output_len` decode steps follow, the j-th
    (from 0) attending to `input_len + j` tokens. This is how FasterTransformer
    v4.0 counts them, the code its GPT-3 175B latency table was published with
    (`gpt.h`, commit 0280a66): the context decoder fills the KV cache of the
    prompt without sampling, and the generation loop runs `for step = input_len;
    step < input_len + output_len`, its first step feeding the prompt's last
    token again to sample the first output. (From v5.0 on, the context
    decoder's last row gives the first token and the loop runs `output_len - 1`
    times.) The prefill step is priced with one sampled row per prompt, as the
    simulator's steps are; v4.0 samples none there, a difference of one LM-head
    GEMM of `batch_size` rows.

    Raises:
      ValueError: a length or the batch is < 1.
    """
    if min(batch_size, input_len, output_len) < 1:
        raise ValueError(f"generation_seconds: batch_size, input_len and output_len must be "
                         f">= 1, got {batch_size}, {input_len}, {output_len}")
    ones = np.ones(batch_size, np.int64)
    total = roofline_seconds(config, input_len * ones, input_len * ones)
    for j in range(output_len):
        total += roofline_seconds(config, ones, (input_len + j) * ones)
    return total
