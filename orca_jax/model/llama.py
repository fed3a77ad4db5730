"""A LLaMA-style decoder in Flax NNX, and the pure paged step that serves it.

Selective batching (Orca): `step` runs the embedding, norms, projections and MLP
on the flat `[T, d_model]` stack of every token in the batch, whatever request
it belongs to; only attention looks at request boundaries, through the ragged
paged attention op, each sequence attending causally to its own KV pages.

Weights follow the HF LLaMA layout (after transposing [out, in] to [in, out]):
q/k use the `rotate_half` rotary convention, so a LLaMA-format checkpoint gives
the same outputs here as in its reference implementation.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, NamedTuple, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from orca_jax.core.step.engine_api import EngineConfigError, StepInputs
from orca_jax.model import sampling
from orca_jax.specs.model_config import ModelConfig

# q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale -> out
AttentionFn = Callable[..., jax.Array]
ATTENTION_OPS = ("reference", "bucketed", "pallas", "pallas_interpret")


def rope_inv_freq(config: ModelConfig) -> np.ndarray:  # [head_dim // 2] float64
    """Rotary inverse frequencies, with LLaMA-3 scaling when the config has it."""
    inv_freq = 1.0 / config.rope_theta ** (np.arange(0, config.head_dim, 2) / config.head_dim)
    s = config.rope_scaling
    if s is None:
        return inv_freq
    wavelen = 2 * math.pi / inv_freq
    low_wavelen = s.original_max_position / s.low_freq_factor
    high_wavelen = s.original_max_position / s.high_freq_factor
    smooth = (s.original_max_position / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor)
    interpolated = (1 - smooth) * inv_freq / s.factor + smooth * inv_freq
    return np.where(wavelen < high_wavelen, inv_freq,
                    np.where(wavelen > low_wavelen, inv_freq / s.factor, interpolated))


def apply_rope(x: jax.Array,  # [T, num_heads, head_dim]
               positions: jax.Array,  # [T] int32
               inv_freq: np.ndarray,  # [head_dim // 2]
               ) -> jax.Array:  # [T, num_heads, head_dim]
    """Rotates each head by its token's position (HF `rotate_half` convention)."""
    angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq, jnp.float32)
    cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]  # [T, 1, head_dim/2]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


class RMSNorm(nnx.Module):
    """Root-mean-square norm, computed in fp32 like the HF reference."""

    def __init__(self, dim: int, eps: float, dtype: jnp.dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:  # [N, dim] -> [N, dim]
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * xf.astype(x.dtype)


def _linear(d_in: int, d_out: int, dtype: jnp.dtype, rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(d_in, d_out, use_bias=False, dtype=dtype, param_dtype=dtype, rngs=rngs)


class DecoderLayer(nnx.Module):
    """One pre-norm block: GQA attention then SwiGLU MLP, each with a residual."""

    def __init__(self, config: ModelConfig, dtype: jnp.dtype, rngs: nnx.Rngs):
        d, hd = config.d_model, config.head_dim
        self.input_layernorm = RMSNorm(d, config.rms_norm_eps, dtype)
        self.q_proj = _linear(d, config.num_q_heads * hd, dtype, rngs)
        self.k_proj = _linear(d, config.num_kv_heads * hd, dtype, rngs)
        self.v_proj = _linear(d, config.num_kv_heads * hd, dtype, rngs)
        self.o_proj = _linear(config.num_q_heads * hd, d, dtype, rngs)
        self.post_attention_layernorm = RMSNorm(d, config.rms_norm_eps, dtype)
        self.gate_proj = _linear(d, config.ffn_dim, dtype, rngs)
        self.up_proj = _linear(d, config.ffn_dim, dtype, rngs)
        self.down_proj = _linear(config.ffn_dim, d, dtype, rngs)
        self.head_dim = hd

    def qkv(self, x: jax.Array,  # [T, d_model]
            positions: jax.Array,  # [T]
            inv_freq: np.ndarray,  # [head_dim // 2]
            ) -> tuple[jax.Array, jax.Array, jax.Array]:  # [T, H, head_dim] each
        """Projects the normed stack to rotated queries and keys, and values."""
        h = self.input_layernorm(x)
        t = x.shape[0]
        q = self.q_proj(h).reshape(t, -1, self.head_dim)
        k = self.k_proj(h).reshape(t, -1, self.head_dim)
        v = self.v_proj(h).reshape(t, -1, self.head_dim)
        return apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq), v

    def finish(self, x: jax.Array,  # [T, d_model] residual stream
               attn: jax.Array,  # [T, num_q_heads, head_dim] attention output
               ) -> jax.Array:  # [T, d_model]
        """Output projection, residual, and the MLP half of the block."""
        x = x + self.o_proj(attn.reshape(x.shape[0], -1))
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(jax.nn.silu(self.gate_proj(h)) * self.up_proj(h))


class Llama(nnx.Module):
    """The decoder: embedding, `num_layers` blocks, final norm, LM head (tied or not)."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, dtype: jnp.dtype = jnp.float32):
        if not config.gated_mlp:
            raise EngineConfigError(
                f"model {config.name!r} has a plain 2-matrix MLP (gated_mlp=False, as in OPT "
                "and GPT-3); the JAX model is LLaMA-style (SwiGLU), so only the simulator "
                "runs it (--engine=sim)")
        self.config = config
        self.embed_tokens = nnx.Embed(config.vocab_size, config.d_model, dtype=dtype,
                                      param_dtype=dtype, rngs=rngs)
        self.layers = nnx.List([DecoderLayer(config, dtype, rngs)
                                for _ in range(config.num_layers)])
        self.norm = RMSNorm(config.d_model, config.rms_norm_eps, dtype)
        self.lm_head = None if config.tie_embeddings else _linear(
            config.d_model, config.vocab_size, dtype, rngs)

    def logits(self, x: jax.Array) -> jax.Array:  # [N, d_model] -> [N, vocab] fp32
        """Final norm and LM head."""
        return lm_logits(self.norm, self.embed_tokens, self.lm_head, x)


def lm_logits(norm: RMSNorm, embed: Optional[nnx.Embed], lm_head: Optional[nnx.Linear],
              x: jax.Array,  # [N, d_model]
              ) -> jax.Array:  # [N, vocab] fp32
    """Final norm and LM head (the embedding's transpose when `lm_head` is None: tied)."""
    h = norm(x)
    if lm_head is not None:
        return lm_head(h).astype(jnp.float32)
    assert embed is not None, "lm_logits: a tied head reads the embedding"
    return embed.attend(h).astype(jnp.float32)


def init_model(config: ModelConfig, *, seed: int = 0, dtype: jnp.dtype = jnp.float32) -> Llama:
    """A randomly initialised model (deterministic in `seed`)."""
    return Llama(config, rngs=nnx.Rngs(seed), dtype=dtype)


def abstract_model(config: ModelConfig, dtype: jnp.dtype = jnp.float32
                   ) -> tuple[nnx.GraphDef, nnx.State]:
    """The model's graph definition and a shape-only parameter state (no allocation)."""
    return nnx.split(nnx.eval_shape(lambda: init_model(config, dtype=dtype)))


class KVCache(NamedTuple):
    """Paged KV cache, one buffer per layer so each layer's writes update in place."""

    k: tuple[jax.Array, ...]  # num_layers x [num_pages, page_size, num_kv_heads, head_dim]
    v: tuple[jax.Array, ...]  # num_layers x [num_pages, page_size, num_kv_heads, head_dim]


def init_kv_cache(config: ModelConfig, *, num_pages: int, page_size: int,
                  dtype: jnp.dtype = jnp.float32) -> KVCache:
    """A zeroed cache of `num_pages` pages (page 0 included: the null page)."""
    shape = (num_pages, page_size, config.num_kv_heads, config.head_dim)
    zeros = lambda: jnp.zeros(shape, dtype)  # noqa: E731  (fresh buffer per layer)
    return KVCache(k=tuple(zeros() for _ in range(config.num_layers)),
                   v=tuple(zeros() for _ in range(config.num_layers)))


# The descriptor crosses into the jitted step as it is: its arrays are the leaves,
# its bucket is static (a different bucket is a different compiled step).
jax.tree_util.register_dataclass(
    StepInputs, data_fields=[f.name for f in dataclasses.fields(StepInputs) if f.name != "bucket"],
    meta_fields=["bucket"])


class StepResult(NamedTuple):
    tokens: jax.Array  # [S] int32 sampled token per sequence
    logits: jax.Array  # [S, vocab] float32 logits at sample_indices
    # [T] int32 the token after every row, sampled as its sequence samples (a
    # verification step's; None otherwise)
    row_tokens: Optional[jax.Array] = None


def attention_op(attention: Union[str, AttentionFn]) -> AttentionFn:
    """Resolves an attention choice (`reference` | `bucketed` | `pallas` |
    `pallas_interpret`, or a function with `ragged_paged_attention_reference`'s
    signature). `bucketed` is the vectorized CPU path (`bucketed_attention`)."""
    if callable(attention):
        return attention
    if attention not in ATTENTION_OPS:
        raise ValueError(f"unknown attention op {attention!r}; choose one of {ATTENTION_OPS}")
    if attention == "bucketed":
        from orca_jax.model.bucketed_attention import bucketed_attention
        return bucketed_attention
    # Imported here so the model module loads before (and without) the kernel package.
    from pallas_kernels import ragged_paged_attention as rpa
    if attention == "reference":
        return rpa.ragged_paged_attention_reference
    return functools.partial(rpa.ragged_paged_attention,
                             interpret=attention == "pallas_interpret")


def write_kv(pages: jax.Array,  # [num_pages, page_size, num_kv_heads, head_dim]
             new: jax.Array,  # [T, num_kv_heads, head_dim]
             slot_mapping: jax.Array,  # [T] flat slot page * page_size + offset
             ) -> jax.Array:  # [num_pages, page_size, num_kv_heads, head_dim]
    """Scatters each new token's K or V to its slot (padding lands in the null page)."""
    flat = pages.reshape(-1, *pages.shape[2:])
    return flat.at[slot_mapping].set(new.astype(pages.dtype)).reshape(pages.shape)


def step(graphdef: nnx.GraphDef, params: nnx.State, kv_cache: KVCache, inputs: StepInputs, *,
         attention: Union[str, AttentionFn] = "reference",
         every_row: bool = False) -> tuple[KVCache, StepResult]:
    """One engine step: writes the new tokens' K/V, attends, samples one token per sequence.

    Pure; jit it with `graphdef` and `attention` bound and the cache donated.

    Args:
      graphdef: the model's graph definition (from `nnx.split` or `abstract_model`).
      params: the model's parameter state.
      kv_cache: the paged cache; page 0 is the null page padding writes to.
      inputs: one padded step descriptor (see `orca_jax.core.step.engine_api.StepInputs`).
      attention: the ragged paged attention op (see `attention_op`).
      every_row: also return the token after every row (`row_tokens`, sampled as its
        sequence samples: `sample_rows`), as a speculative verification step needs: the
        LM head then runs on all T rows.

    Returns:
      The updated cache, and the sampled tokens and logits at `sample_indices`.
    """
    model: Llama = nnx.merge(graphdef, params)
    config = model.config
    attend = attention_op(attention)
    x = model.embed_tokens(inputs.token_ids)  # [T, d_model]
    x, kv_cache = decoder_layers(model.layers, kv_cache, x, inputs, attend, config)
    return kv_cache, sample_rows(model.logits, x, inputs, every_row=every_row)


def decoder_layers(layers: Sequence[DecoderLayer], kv_cache: KVCache,
                   x: jax.Array,  # [T, d_model] the residual stream entering layers[0]
                   inputs: StepInputs, attend: AttentionFn, config: ModelConfig,
                   ) -> tuple[jax.Array, KVCache]:  # [T, d_model], the cache updated
    """Runs `layers` (a run of consecutive blocks: all of them, or a pipeline stage's)
    over the stack; `kv_cache` holds those layers' pages only, in the same order."""
    inv_freq = rope_inv_freq(config)
    new_k, new_v = [], []
    for layer, k_pages, v_pages in zip(layers, kv_cache.k, kv_cache.v):
        q, k, v = layer.qkv(x, inputs.positions, inv_freq)
        k_pages = write_kv(k_pages, k, inputs.slot_mapping)
        v_pages = write_kv(v_pages, v, inputs.slot_mapping)
        out = attend(q, k_pages, v_pages, inputs.kv_lens, inputs.page_indices, inputs.cu_q_lens,
                     inputs.num_seqs, sm_scale=config.head_dim ** -0.5)
        x = layer.finish(x, out.astype(x.dtype))
        new_k.append(k_pages)
        new_v.append(v_pages)
    return x, KVCache(tuple(new_k), tuple(new_v))


def sample_rows(logits_of: Callable[[jax.Array], jax.Array],
                x: jax.Array,  # [T, d_model] the last layer's output
                inputs: StepInputs, every_row: bool = False) -> StepResult:
    """The logits at `sample_indices` (`logits_of`: final norm and LM head) and one
    token sampled from each; `every_row`: also the token after every row (`row_tokens`).

    A row's token is sampled as its sequence's token would be at that position: with the
    sequence's temperature, top-k and top-p, and the key of (its seed, the row's position
    + 1), which is the key a step without speculation uses for the token there. So a
    speculative verification (`orca_jax.core.step.verification.accept_greedy`) keeps
    exactly the tokens sampling one at a time would have given: greedy rows take the
    argmax, and at temperature > 0 a draft is kept while it equals the target's draw.
    """
    # The sampled token sits one past the last computed token.
    next_positions = inputs.positions + 1  # [T]
    if every_row:
        row_logits = logits_of(x)  # [T, vocab]
        # Row t belongs to sequence i when cu_q_lens[i] <= t < cu_q_lens[i + 1]; padding
        # rows past the last real sequence take the last slot (their tokens are unread).
        num_slots = inputs.temperature.shape[0]
        rows = jnp.arange(row_logits.shape[0], dtype=jnp.int32)
        seq = jnp.minimum(jnp.searchsorted(inputs.cu_q_lens[1:], rows, side="right"),
                          num_slots - 1)  # [T]
        row_tokens = sampling.sample_tokens(
            row_logits, next_positions, inputs.temperature[seq], inputs.top_k[seq],
            inputs.top_p[seq], inputs.rng_seeds[seq])  # [T]
        # Each sequence's token is its last row's: the same logits and key as below.
        return StepResult(row_tokens[inputs.sample_indices],
                          row_logits[inputs.sample_indices], row_tokens)
    logits = logits_of(x[inputs.sample_indices])  # [S, vocab]
    tokens = sampling.sample_tokens(logits, next_positions[inputs.sample_indices],
                                    inputs.temperature, inputs.top_k, inputs.top_p,
                                    inputs.rng_seeds)
    return StepResult(tokens, logits)


def dense_forward(model: Llama, tokens: jax.Array  # [L] int32, one sequence
                  ) -> jax.Array:  # [L, vocab] float32
    """Plain full-sequence causal forward (no cache, no paging): the step's test oracle."""
    config = model.config
    length = tokens.shape[0]
    positions = jnp.arange(length, dtype=jnp.int32)
    inv_freq = rope_inv_freq(config)
    group = config.num_q_heads // config.num_kv_heads
    causal = jnp.tril(jnp.ones((length, length), bool))
    x = model.embed_tokens(tokens)
    for layer in model.layers:
        q, k, v = layer.qkv(x, positions, inv_freq)
        k, v = jnp.repeat(k, group, axis=1), jnp.repeat(v, group, axis=1)  # q head h -> kv h//group
        scores = jnp.einsum("qhd,khd->hqk", q.astype(jnp.float32), k.astype(jnp.float32))
        scores = jnp.where(causal, scores * config.head_dim ** -0.5, -jnp.inf)
        out = jnp.einsum("hqk,khd->qhd", jax.nn.softmax(scores, axis=-1), v.astype(jnp.float32))
        x = layer.finish(x, out.astype(x.dtype))
    return model.logits(x)
