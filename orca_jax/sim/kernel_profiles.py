"""Measured GPU kernel times (Vidur's profiling files) beside the per-operation roofline.

Vidur (Microsoft, MIT licence) ships per-operation CUDA times of decoder layers
by token count and tensor-parallel degree (`<gpu>_<model>_mlp.csv`), and NCCL
all-reduce times by message size and GPU count (`a100_dgx_all_reduce.csv`).
The project keeps no copy: they sit at `../shared/profiles/vidur_a100_h100/`
from the repository root (its README says what each file holds), and whatever
reads them takes the folder as an argument. This module loads them and prices
the same shapes with `orca_jax.sim.roofline`, for the fit of the hardware
presets' efficiencies and the check of those presets
(`benchmarks/cost_model_vs_measured.py`, `tests/test_cost_model.py`).
"""

from __future__ import annotations

import csv
import dataclasses
from pathlib import Path

import numpy as np
from numpy.typing import NDArray

from orca_jax.sim.roofline import OPERATIONS, PerOpRoofline
from orca_jax.specs.hardware import AllReduceCost, HardwareSpec, get_hardware
from orca_jax.specs.model_config import ModelConfig

# Vidur's operation -> the roofline's kind of kernel. Vidur times the two norms of a
# layer apart; both are the roofline's `norm`.
MEASURED_OPS = {
    "emb": "embedding", "input_layernorm": "norm", "attn_pre_proj": "qkv_proj",
    "attn_rope": "rope", "attn_post_proj": "attn_out_proj",
    "post_attention_layernorm": "norm", "mlp_up_proj": "mlp_up_proj", "mlp_act": "mlp_act",
    "mlp_down_proj": "mlp_down_proj", "add": "residual_add",
}
LAYER_FILES = ("a100_meta-llama-3-8b_mlp.csv", "a100_llama-2-7b_mlp.csv",
               "h100_llama-2-7b_mlp.csv")
ALLREDUCE_FILE = "a100_dgx_all_reduce.csv"
GPUS_PER_NODE = 8  # one DGX: a replica of up to 8 GPUs stays on NVLink
_HARDWARE = {"a100": "a100-80gb", "h100": "h100-sxm"}  # Vidur profiled the 80 GB A100
# {num_gpus: (message bytes [n], median seconds [n])}
AllReduceTimes = dict[int, tuple[NDArray[np.float64], NDArray[np.float64]]]


@dataclasses.dataclass(frozen=True)
class OpTimes:
    """One operation's measured times at one tensor-parallel degree."""

    op: str  # Vidur's name
    tp: int
    num_tokens: NDArray[np.int64]  # [n] ascending
    seconds: NDArray[np.float64]  # [n] median CUDA time of one launch


@dataclasses.dataclass(frozen=True)
class LayerProfile:
    """One `<gpu>_<model>_mlp.csv`: the model as profiled and every operation's times."""

    name: str  # the file's stem
    hardware: HardwareSpec
    model: ModelConfig  # the file's own shapes (one layer)
    ops: tuple[OpTimes, ...]


def load_layer_profile(path: Path) -> LayerProfile:
    """Reads one of Vidur's per-layer files; a repeated (tp, tokens) row keeps its first.

    Raises:
      ValueError: the file's name does not start with a known GPU, or it holds
        several model shapes.
    """
    gpu = path.name.split("_")[0]
    if gpu not in _HARDWARE:
        raise ValueError(f"{path.name}: unknown GPU {gpu!r}; known: {sorted(_HARDWARE)}")
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    shapes = {tuple(row[k] for k in ("n_head", "n_kv_head", "n_embd", "n_expanded_embd",
                                     "vocab_size", "use_gated_mlp")) for row in rows}
    if len(shapes) != 1:
        raise ValueError(f"{path.name}: expected one model shape, found {sorted(shapes)}")
    heads, kv_heads, d_model, ffn, vocab, gated = shapes.pop()
    model = ModelConfig(name=path.stem, vocab_size=int(vocab), d_model=int(d_model),
                        num_layers=1, num_q_heads=int(heads), num_kv_heads=int(kv_heads),
                        head_dim=int(d_model) // int(heads), ffn_dim=int(ffn),
                        gated_mlp=gated == "True")
    first: dict[tuple[int, int], dict[str, str]] = {}
    for row in rows:
        first.setdefault((int(row["num_tensor_parallel_workers"]), int(row["num_tokens"])), row)
    ops = []
    for tp in sorted({tp for tp, _ in first}):
        tokens = np.array(sorted(n for t, n in first if t == tp), np.int64)
        for op in MEASURED_OPS:
            ms = [float(first[tp, n][f"time_stats.{op}.median"]) for n in tokens]
            ops.append(OpTimes(op=op, tp=tp, num_tokens=tokens, seconds=np.array(ms) * 1e-3))
    return LayerProfile(name=path.stem, hardware=get_hardware(_HARDWARE[gpu]), model=model,
                        ops=tuple(ops))


def load_allreduce(path: Path) -> AllReduceTimes:
    """`{num_gpus: (message bytes [n], median seconds [n])}` from Vidur's all-reduce file.

    Keeps, per GPU count, the runs on the fewest nodes (up to 8 GPUs in one DGX,
    16 on two): where a tensor-parallel replica is placed.
    """
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    times: AllReduceTimes = {}
    for num_gpus in sorted({int(row["num_workers"]) for row in rows}):
        per_node = min(num_gpus, GPUS_PER_NODE)
        mine = sorted((int(row["size"]), float(row["time_stats.all_reduce.median"]))
                      for row in rows if int(row["num_workers"]) == num_gpus
                      and int(row["devices_per_node"]) == per_node)
        sizes, ms = zip(*mine)
        times[num_gpus] = (np.array(sizes, np.float64), np.array(ms) * 1e-3)
    return times


def predicted_seconds(model: ModelConfig, hardware: HardwareSpec, tp: int, op: str,
                      num_tokens: NDArray[np.int64], dtype_bytes: int = 2) -> NDArray[np.float64]:
    """`[n]` seconds of one launch of Vidur's operation `op` at each of `num_tokens` `[n]`.

    Vidur profiles fp16 (2 bytes), whatever `dtype_bytes` a run uses.
    """
    column = OPERATIONS.index(MEASURED_OPS[op])
    units = np.zeros((len(num_tokens), len(OPERATIONS)))  # [n, ops]: only `op` has work
    units[:, column] = num_tokens
    roofline = PerOpRoofline(model, hardware, tp, dtype_bytes)
    return roofline.launch_seconds(units, units)[:, column]


def allreduce_seconds(cost: AllReduceCost, message_bytes: NDArray[np.float64]
                      ) -> NDArray[np.float64]:
    """`[n]` seconds of an all-reduce of each of `message_bytes` `[n]`."""
    return cost.latency_s + message_bytes / cost.bytes_per_s


def median_relative_error(predicted: NDArray[np.float64],
                          measured: NDArray[np.float64]) -> float:
    """Median of `|predicted / measured - 1|` over matching `[n]` arrays."""
    return float(np.median(np.abs(predicted / measured - 1.0)))
