"""The per-operation roofline: a step's time as the sum of its kernels' times.

The `per_op` mode of `orca_jax.sim.cost_model` (formulas in its docstring).
Each kind of kernel of a decoder step has its per-GPU shape here (`op_shapes`:
bytes and FLOPs as a function of the tokens, rows or KV it works on; the rotary
kernel's bytes over the thread lanes it holds, idle ones at half) and its
efficiencies in the hardware preset (`HardwareSpec.kernels`; a GEMM's FLOPs in
whole waves of output tiles over the SMs). `PerOpRoofline`
precomputes both for one (model, hardware, tp) as arrays of one entry per kind
of kernel, and keeps what depends only on a step's token count: the simulator
prices every step of 10^5-request runs, and must stay about as fast as the
whole-step roofline was.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence, Union

import numpy as np
from numpy.typing import NDArray

from orca_jax.specs.hardware import HardwareSpec
from orca_jax.specs.model_config import ModelConfig

# The kinds of kernel of one step, in the order of the arrays below.
OPERATIONS = ("embedding", "norm", "qkv_proj", "rope", "attention_prefill", "attention_decode",
              "attn_out_proj", "mlp_up_proj", "mlp_act", "mlp_down_proj", "residual_add",
              "lm_head")
_PREFILL = OPERATIONS.index("attention_prefill")
_DECODE = OPERATIONS.index("attention_decode")
_LM_HEAD = OPERATIONS.index("lm_head")
# The ufuncs' reductions called directly: `ndarray.sum` and `.max` add a Python layer.
_sum = np.add.reduce
_ONE = np.array(1, dtype=np.int64)  # a 0-d operand: numpy converts a Python int each call
# `_step_work` adds the prefills of a step in Python ints up to this many (a numpy call on
# a few elements costs more than a short loop), in whole-array sums beyond.
_FEW_PREFILLS = 16
# Spans of at most this many decode steps are priced in Python floats, longer ones in
# numpy arrays (`PerOpRoofline.decode_span_seconds`): about where their costs cross (on
# 200 sequences, 16 steps 16 against 46 us, 48 steps 44 against 64, 64 steps 52 against
# 45, on a loaded 2-core machine).
SHORT_SPAN = 48
# The rotary kernel measured (vLLM's `rotary_embedding_kernel`, what Vidur profiled)
# runs one thread block per token of min(query pairs, 512) threads, each thread
# rotating one (x, y) pair of a head per iteration: first the queries', then the
# keys'. With fewer KV heads than query heads (GQA) the key loop leaves lanes idle.
ROPE_BLOCK_THREADS = 512
# What an idle lane of a partly filled iteration costs, as a fraction of a busy
# one's bytes: it holds its block's slot through the iteration's memory round trip
# (the kernel is latency-bound: ~45% of HBM peak with every lane busy) but moves
# nothing, while the other blocks on the SM keep some of the bandwidth busy. Set
# from the measured GQA shapes: Llama-3-8B at TP 4 (8 query and 2 KV heads per GPU:
# the key iteration is 3/4 idle) streams 0.74x the bytes/s of Llama-2-7B at TP 4
# (no idle lanes); 0.5 prices 0.77x, 1 (idle = busy) 0.63x, 0 (bytes only) 1x.
# Refitting it per file gives 0.25-0.5; 0.5 also reproduces the held-out miss the
# issue-26 reviewer saw on 70B at TP 8 (8 query heads, 1 KV head: -30% at 8,192).
ROPE_IDLE_LANE_WEIGHT = 0.5


@dataclasses.dataclass(frozen=True)
class Stage:
    """The part of the model one pipeline stage holds: `num_layers` consecutive layers,
    with the input embedding on the first stage and the final norm and the LM head on
    the last (one stage holding the whole model is both)."""

    num_layers: int
    first: bool = True
    last: bool = True


@dataclasses.dataclass(frozen=True)
class OpShape:
    """One kind of kernel's work on one GPU, for `units` of what it works on.

    `bytes = fixed_bytes + unit_bytes * units`, `flops = unit_flops * flop_units`;
    the units are tokens for most kernels, sampled rows for the LM head, KV
    tokens read (bytes) and query-key pairs (FLOPs) for attention.
    """

    fixed_bytes: float  # weights, read once per launch
    unit_bytes: float  # HBM bytes per unit: activations in and out, or KV read
    unit_flops: float  # FLOPs per flop unit
    launches: int  # launches per step (per-layer kernels: num_layers)
    out_features: float = 0.0  # a GEMM's output columns (its tile grid's other side)


def op_shapes(model: ModelConfig, tp: int, dtype_bytes: int,
              stage: Optional[Stage] = None) -> dict[str, OpShape]:
    """Every kind of kernel's per-GPU shape for `model` split over `tp` GPUs (and, given a
    pipeline `stage`, of that stage's layers alone: a kernel it does not run has 0 launches).

    Tensor parallelism splits query heads, the MLP width and the vocabulary
    evenly, and keeps `ceil(kv_heads / tp)` KV heads per GPU (replicated when
    `tp > kv_heads`); norms, adds and the embedding gather run whole on every
    GPU. Elementwise kernels count no FLOPs: a few per byte, far below every
    GPU's ridge point.
    """
    b, d_model, head_dim = dtype_bytes, model.d_model, model.head_dim
    stage = stage if stage is not None else Stage(model.num_layers)
    layers = stage.num_layers
    q_heads = model.num_q_heads / tp
    kv_heads = math.ceil(model.num_kv_heads / tp)
    ffn = model.ffn_dim / tp
    up = (2 if model.gated_mlp else 1) * ffn  # gate and up, fused

    rope_pairs = (q_heads + kv_heads) * head_dim / 2
    rope_bytes = 4 * b * (rope_pairs + ROPE_IDLE_LANE_WEIGHT * (
        _rope_lane_slots(q_heads, kv_heads, head_dim) - rope_pairs))

    def gemm(k: float, m: float, launches: int) -> OpShape:
        # [units, k] @ [k, m]: the weight once, each unit's input row and output row.
        return OpShape(k * m * b, (k + m) * b, 2.0 * k * m, launches, out_features=m)

    # Attention reads each KV token once per KV head, and spends 2 FLOPs per head
    # dim on QK^T and 2 on PV for every query-key pair of every query head.
    attention = OpShape(0.0, 2 * kv_heads * head_dim * b, 4.0 * q_heads * head_dim, layers)
    return {
        # Gather a row, write it.
        "embedding": OpShape(0.0, 2 * d_model * b, 0.0, int(stage.first)),
        # Two per layer and the final one; each reads and writes the residual stream.
        "norm": OpShape(d_model * b, 2 * d_model * b, 0.0, 2 * layers + int(stage.last)),
        "qkv_proj": gemm(d_model, (q_heads + 2 * kv_heads) * head_dim, layers),
        # Queries and keys, read and written (4 b bytes a rotated pair), counted over
        # the lane slots the kernel holds (`_rope_lane_slots`). Models with learned
        # positions (GPT-3, OPT) add a position embedding instead: an elementwise
        # pass of about this size.
        "rope": OpShape(0.0, rope_bytes, 0.0, layers),
        "attention_prefill": attention,
        "attention_decode": attention,
        "attn_out_proj": gemm(q_heads * head_dim, d_model, layers),
        "mlp_up_proj": gemm(d_model, up, layers),
        "mlp_act": OpShape(0.0, (up + ffn) * b, 0.0, layers),  # read up (and gate), write ffn
        "mlp_down_proj": gemm(ffn, d_model, layers),
        "residual_add": OpShape(0.0, 3 * d_model * b, 0.0, 2 * layers),  # two reads, one write
        "lm_head": gemm(d_model, model.vocab_size / tp, int(stage.last)),
    }


def _rope_lane_slots(q_heads: float, kv_heads: float, head_dim: int) -> float:
    """Thread-lane iterations the rotary kernel's block spends on one token.

    `T = min(q_pairs, ROPE_BLOCK_THREADS)` threads walk the `q_pairs = q_heads * d / 2`
    query pairs, then the `kv_heads * d / 2` key pairs, `T` at a time: every
    iteration holds all `T` lanes, busy or not. Llama-3-8B at TP 4: 512 lanes, one
    query iteration and one key iteration of 128 busy lanes, 1,024 slots for 640 pairs.
    """
    half = head_dim / 2
    threads = min(q_heads * half, ROPE_BLOCK_THREADS)
    return threads * (math.ceil(q_heads * half / threads) + math.ceil(kv_heads * half / threads))


class PerOpRoofline:
    """Prices steps of one model on `tp` GPUs of one kind, kernel by kernel.

    Args:
      model: the model's shapes.
      hardware: one GPU of the replica (its `kernels` hold the efficiencies).
      tp: GPUs per replica (> 1 needs an all-reduce cost for that many GPUs).
      dtype_bytes: bytes of one weight, activation and KV element.
      stage: the pipeline stage priced (None: the whole model, one stage).

    Raises:
      ValueError: the hardware has no all-reduce cost for `tp` GPUs.
    """

    def __init__(self, model: ModelConfig, hardware: HardwareSpec, tp: int,
                 dtype_bytes: int, stage: Optional[Stage] = None) -> None:
        shapes = [op_shapes(model, tp, dtype_bytes, stage)[name] for name in OPERATIONS]
        efficiencies = [getattr(hardware.kernels, name) for name in OPERATIONS]
        self._latency_s = np.array([e.latency_s for e in efficiencies])  # [ops]
        self._fixed_bytes = np.array([s.fixed_bytes for s in shapes])  # [ops]
        self._unit_bytes = np.array([s.unit_bytes for s in shapes])  # [ops]
        self._unit_flops = np.array([s.unit_flops for s in shapes])  # [ops]
        self._launches = np.array([s.launches for s in shapes], np.float64)  # [ops]
        self._hbm_s_per_byte = np.array(  # [ops]
            [1.0 / (hardware.hbm_bytes_per_s * e.hbm_efficiency) for e in efficiencies])
        self._l2_s_per_byte = np.array(  # [ops]
            [1.0 / (hardware.hbm_bytes_per_s * (e.l2_efficiency or e.hbm_efficiency))
             for e in efficiencies])
        self._s_per_flop = np.array(  # [ops]
            [1.0 / (hardware.peak_flops * e.flops_efficiency) for e in efficiencies])
        # A GEMM with a tile runs whole waves of (rows x cols) output tiles over the
        # SMs (`KernelEfficiency.tile`): per launch it computes
        # `ceil(ceil(units / rows) * col_tiles / sms) * sms * rows * cols / out_features`
        # rows' worth of FLOPs. Attention's FLOP units are query-key pairs, not rows:
        # it takes no tile here, whatever its preset says.
        tiles = [None if i in (_PREFILL, _DECODE) or s.out_features <= 0 else e.tile
                 for i, (s, e) in enumerate(zip(shapes, efficiencies))]
        self._tiled = np.array([t is not None for t in tiles])  # [ops]
        self._tile_rows = np.array([t[0] if t else 1.0 for t in tiles])  # [ops]
        self._col_tiles = np.array(  # [ops] output tiles across a GEMM's features
            [math.ceil(s.out_features / t[1]) if t else 1.0 for s, t in zip(shapes, tiles)])
        self._rows_per_wave = np.array(  # [ops] FLOP units one full wave computes
            [hardware.num_sms * t[0] * t[1] / s.out_features if t else 1.0
             for s, t in zip(shapes, tiles)])
        self._num_sms = float(hardware.num_sms)
        self._l2_bytes = float(hardware.l2_bytes)
        # Megatron-style tensor parallelism all-reduces the [N, d_model] activations
        # after attention and after the MLP of every layer, and once after the
        # vocabulary-parallel embedding (on the first stage).
        stage = stage if stage is not None else Stage(model.num_layers)
        self._num_allreduces = 2 * stage.num_layers + int(stage.first) if tp > 1 else 0
        self._allreduce = hardware.kernels.allreduce_cost(tp) if tp > 1 else None
        self._message_bytes_per_token = float(model.d_model * dtype_bytes)
        # Python-float copies for `_attention_seconds`, and the kept times of
        # `kernels_seconds`: {num_tokens: seconds}, {num_seqs: seconds}.
        self._unit_bytes_list = self._unit_bytes.tolist()
        self._unit_flops_list = self._unit_flops.tolist()
        self._launches_list = self._launches.tolist()
        self._latency_s_list = self._latency_s.tolist()
        self._hbm_s_per_byte_list = self._hbm_s_per_byte.tolist()
        self._l2_s_per_byte_list = self._l2_s_per_byte.tolist()
        self._s_per_flop_list = self._s_per_flop.tolist()
        self._per_token_s: dict[int, float] = {}
        self._per_row_s: dict[int, float] = {}

    def launch_seconds(self, units: NDArray[np.float64],
                       flop_units: NDArray[np.float64]) -> NDArray[np.float64]:
        """Seconds of one launch of each kind of kernel (0 where it has nothing to do).

        Args:
          units: `[..., ops]` what each kernel works on (see `OpShape`), in
            `OPERATIONS` order.
          flop_units: `[..., ops]` the units each kernel's FLOPs count (a tiled
            GEMM's are rounded up to whole waves of tiles).
        """
        if self._tiled.any():
            waves = np.ceil(np.ceil(flop_units / self._tile_rows) * self._col_tiles
                            / self._num_sms)
            flop_units = np.where(self._tiled, waves * self._rows_per_wave, flop_units)
        num_bytes = self._fixed_bytes + self._unit_bytes * units
        s_per_byte = np.where(num_bytes <= self._l2_bytes, self._l2_s_per_byte,
                              self._hbm_s_per_byte)
        launch_s = self._latency_s + np.hypot(num_bytes * s_per_byte,
                                              flop_units * self._unit_flops * self._s_per_flop)
        return np.where(units > 0.0, launch_s, 0.0)

    def kernel_seconds(self, q_lens: NDArray[np.int64], kv_lens: NDArray[np.int64],
                       padded_to: Optional[tuple[int, int]] = None) -> NDArray[np.float64]:
        """`[ops]` seconds of each kind of kernel over the step (all its launches).

        Args:
          q_lens: `[num_seqs]` new tokens of each real sequence.
          kv_lens: `[num_seqs]` tokens each attends to (cache after the writes).
          padded_to: `(tokens, sequences)` of the bucket, as in `kernels_seconds`.
        """
        num_tokens, num_seqs, kv_decode, kv_prefill, pairs_prefill = _step_work(q_lens, kv_lens)
        if padded_to is not None:
            num_tokens, num_seqs = max(num_tokens, padded_to[0]), max(num_seqs, padded_to[1])
        units = np.full(len(OPERATIONS), float(num_tokens))
        units[_LM_HEAD] = num_seqs
        units[_DECODE] = kv_decode
        units[_PREFILL] = kv_prefill
        flop_units = units.copy()
        flop_units[_PREFILL] = pairs_prefill
        return self.launch_seconds(units, flop_units) * self._launches

    def allreduce_seconds(self, num_tokens: float) -> float:
        """Seconds of the step's all-reduces over `num_tokens` tokens (0 on one GPU)."""
        if self._allreduce is None:
            return 0.0
        one = (self._allreduce.latency_s
               + num_tokens * self._message_bytes_per_token / self._allreduce.bytes_per_s)
        return self._num_allreduces * one

    def breakdown(self, q_lens: NDArray[np.int64], kv_lens: NDArray[np.int64],
                  padded_to: Optional[tuple[int, int]] = None) -> dict[str, float]:
        """Seconds per kind of kernel, and `allreduce`, over one step (no step overhead).

        Args:
          q_lens: `[num_seqs]` new tokens of each real sequence.
          kv_lens: `[num_seqs]` tokens each attends to.
          padded_to: `(tokens, sequences)` of the bucket, as in `kernels_seconds`.
        """
        seconds = dict(zip(OPERATIONS,
                           self.kernel_seconds(q_lens, kv_lens, padded_to).tolist()))
        num_tokens = float(np.sum(q_lens))
        if padded_to is not None:
            num_tokens = max(num_tokens, float(padded_to[0]))
        seconds["allreduce"] = self.allreduce_seconds(num_tokens)
        return seconds

    def kernels_seconds(self, q_lens: NDArray[np.int64], kv_lens: NDArray[np.int64],
                        padded_to: Optional[tuple[int, int]] = None) -> float:
        """Seconds of every kernel and all-reduce of one step (no step overhead).

        The sum of `breakdown`, fast: every kernel but attention depends only on
        the step's token count (the LM head on its sequence count), so their
        times are kept once computed (one per count a run's steps hold), and the
        two attention kernels are priced in Python floats (`launch_seconds`'s
        formula; a numpy call costs about a microsecond).

        Args:
          q_lens: `[num_seqs]` new tokens of each real sequence.
          kv_lens: `[num_seqs]` tokens each attends to.
          padded_to: `(tokens, sequences)` of the compiled step the sequences are
            padded to (its bucket): the token-wise kernels and all-reduces then run
            on that many token rows and the LM head on that many sampled rows, as a
            compiled step does; attention still reads each sequence's real lengths
            (the ragged kernel skips padding). None: an ideal ragged engine, real
            tokens and sequences only.
        """
        num_tokens, num_seqs, kv_decode, kv_prefill, pairs_prefill = _step_work(q_lens, kv_lens)
        if padded_to is not None:  # `max` of each, without the builtin's call
            padded_tokens, padded_seqs = padded_to
            if padded_tokens > num_tokens:
                num_tokens = padded_tokens
            if padded_seqs > num_seqs:
                num_seqs = padded_seqs
        seconds = (self._rows_seconds(num_tokens, num_seqs)
                   + self._attention_seconds(_DECODE, kv_decode, kv_decode))
        # No prefill (a decode-only step): its kernel's 0.0, added as it was, uncalled.
        return seconds + (self._attention_seconds(_PREFILL, kv_prefill, pairs_prefill)
                          if kv_prefill > 0.0 else 0.0)

    def decode_span_seconds(self, num_seqs: int,
                            kv_tokens: Union[NDArray[np.int64], Sequence[int]],  # [k]
                            padded_to: Optional[tuple[int, int]] = None
                            ) -> NDArray[np.float64]:  # [k]
        """`kernels_seconds` of `k` decode-only steps of `num_seqs` sequences at once, step
        j's sequences attending to `kv_tokens[j]` tokens in all, bit for bit the floats
        `kernels_seconds` gives each step (a leap over steady decodes,
        `orca_jax.core.loop.leap`).

        The same operations in the same order, elementwise over the steps: numpy's
        elementwise float64 products and sums round as Python's, and the one function
        whose rounding numpy and Python may not share, the hypotenuse, is `math.hypot`'s.
        """
        num_tokens = num_seqs  # one new token each
        if padded_to is not None:
            num_tokens, num_seqs = max(num_tokens, padded_to[0]), max(num_seqs, padded_to[1])
        rows_s = self._rows_seconds(num_tokens, num_seqs)
        if len(kv_tokens) <= SHORT_SPAN:  # most leaps: a few steps, in Python floats
            return np.array(self.decode_steps_seconds(rows_s, kv_tokens), np.float64)
        kv = np.asarray(kv_tokens, np.int64).astype(np.float64)  # [k] float(sum k_i), exact
        op = _DECODE
        num_bytes = self._unit_bytes_list[op] * kv  # [k]
        s_per_byte = np.where(num_bytes <= self._l2_bytes, self._l2_s_per_byte_list[op],
                              self._hbm_s_per_byte_list[op])  # [k]
        compute_s = kv * self._unit_flops_list[op] * self._s_per_flop_list[op]  # [k]
        hypot = np.fromiter(map(math.hypot, (num_bytes * s_per_byte).tolist(),
                                compute_s.tolist()), np.float64, count=kv.size)  # [k]
        attention_s = self._launches_list[op] * (self._latency_s_list[op] + hypot)  # [k]
        # `_attention_seconds` is 0.0 for no KV (and prefill's is 0.0: no prefill here).
        attention_s = np.where(kv > 0.0, attention_s, 0.0)
        return rows_s + attention_s + 0.0

    def decode_rows_seconds(self, num_seqs: int,
                            padded_to: Optional[tuple[int, int]] = None) -> float:
        """The part of a decode-only step of `num_seqs` sequences that is not attention
        (`kernels_seconds`'s `_rows_seconds`, padded as it pads): the first argument of
        `decode_steps_seconds`."""
        num_tokens = num_seqs  # one new token each
        if padded_to is not None:
            num_tokens, num_seqs = max(num_tokens, padded_to[0]), max(num_seqs, padded_to[1])
        return self._rows_seconds(num_tokens, num_seqs)

    def decode_steps_seconds(self, rows_s: float,
                             kv_tokens: Sequence[int],  # [k]
                             overhead_s: float = 0.0) -> list[float]:  # [k]
        """`decode_span_seconds` of a few steps, in Python floats: each step's
        `kernels_seconds` as it adds them (`rows_s`, from `decode_rows_seconds`, then the
        decode attention over `kv_tokens[j]` tokens, then no prefill's 0.0), with no
        array: a short leap's few steps cost less so than numpy's fixed cost per call.
        `overhead_s` is added last, as a step's price adds its overhead to its kernels
        (the sum already ends in `+ 0.0`, so adding the default 0.0 moves no bit)."""
        attention = self._attention_seconds
        return [rows_s + attention(_DECODE, kv, kv) + 0.0 + overhead_s
                for kv in map(float, kv_tokens)]

    def _rows_seconds(self, num_tokens: int, num_seqs: int) -> float:
        """Seconds of every kernel but attention (and the all-reduces) over `num_tokens`
        token rows and `num_seqs` sampled rows: kept once computed, per count."""
        per_token = self._per_token_s.get(num_tokens)
        if per_token is None:
            units = np.full(len(OPERATIONS), float(num_tokens))
            units[[_DECODE, _PREFILL, _LM_HEAD]] = 0.0
            per_token = (_exact_dot(self.launch_seconds(units, units), self._launches)
                         + self.allreduce_seconds(num_tokens))
            self._per_token_s[num_tokens] = per_token
        per_row = self._per_row_s.get(num_seqs)
        if per_row is None:
            units = np.zeros(len(OPERATIONS))
            units[_LM_HEAD] = num_seqs
            per_row = _exact_dot(self.launch_seconds(units, units), self._launches)
            self._per_row_s[num_seqs] = per_row
        return per_token + per_row

    def _attention_seconds(self, op: int, kv_tokens: float, pairs: float) -> float:
        """`launch_seconds * launches` of attention kernel `op`, in Python floats."""
        if kv_tokens <= 0.0:
            return 0.0
        num_bytes = self._unit_bytes_list[op] * kv_tokens
        s_per_byte = (self._l2_s_per_byte_list[op] if num_bytes <= self._l2_bytes
                      else self._hbm_s_per_byte_list[op])
        compute_s = pairs * self._unit_flops_list[op] * self._s_per_flop_list[op]
        return self._launches_list[op] * (self._latency_s_list[op]
                                          + math.hypot(num_bytes * s_per_byte, compute_s))


def _exact_dot(a: NDArray[np.float64],  # [ops]
               b: NDArray[np.float64]) -> float:  # [ops]
    """`a . b` rounded once (`math.fsum`): the same bits on every CPU. `np.dot` calls
    BLAS, whose kernels (AVX2, AVX-512) add in different orders, so a step's price, and
    every timestamp after it, moved in the last bits from one machine to another."""
    return math.fsum((a * b).tolist())


def _step_work(q_lens: NDArray[np.int64], kv_lens: NDArray[np.int64]
               ) -> tuple[int, int, float, float, float]:
    """What a step of real sequences (`[num_seqs]` each) asks of its kernels.

    Returns:
      `(num_tokens, num_seqs, decode KV tokens, prefill KV tokens, prefill query-key
      pairs)`: sequences of one new token take the decode kernel, longer ones the
      prefill kernel.
    """
    q = np.asarray(q_lens, np.int64)
    k = np.asarray(kv_lens, np.int64)
    num_seqs = len(q)
    # The sequences of other than one new token, first: none is a decode-only step (then
    # the tokens are the sequences), and the token count is the decodes' plus theirs, so
    # no sum and no max over the whole batch is asked (two reductions a step).
    others = (q != _ONE).nonzero()[0]  # [o] prefills (and any q < 1, in neither sum)
    if others.size == 0:  # decode only
        return num_seqs, num_seqs, float(_sum(k)), 0.0, 0.0
    # A chunk of q tokens on k - q cached ones: query j sees k - q + j + 1 keys, q(2k-q+1)/2
    # in all, an integer: summed in integers, exactly, on any CPU (np.dot would call BLAS).
    # The decode KV is the whole KV less that of the other sequences (integers: exact).
    if others.size > _FEW_PREFILLS:  # a batch of prompts: whole-array sums
        q_other, k_other = q[others], k[others]
        prefill = q_other > 1
        q_prefill, k_prefill = q_other[prefill], k_other[prefill]
        kv_prefill = int(_sum(k_prefill))
        pairs = int(_sum(q_prefill * (2 * k_prefill - q_prefill + 1))) // 2
        kv_other = int(_sum(k_other))
        q_sum = int(_sum(q_other))
    else:  # most mixed steps: a few prefills beside the decodes, in Python ints
        kv_prefill = pairs = kv_other = q_sum = 0
        for chunk, kv in zip(q[others].tolist(), k[others].tolist()):
            kv_other += kv
            q_sum += chunk
            if chunk > 1:
                kv_prefill += kv
                pairs += chunk * (2 * kv - chunk + 1)
        pairs //= 2
    num_tokens = num_seqs - int(others.size) + q_sum  # the decodes' one each, and theirs
    kv_decode = int(_sum(k)) - kv_other
    return num_tokens, num_seqs, float(kv_decode), float(kv_prefill), float(pairs)
