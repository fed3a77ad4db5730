"""The one model-shape type, `ModelConfig`, and its one preset table, `PRESETS`.

The real (LLaMA-style) model is built from a `ModelConfig`, and the simulator's
roofline and KV sizing read the same type: its shapes, parameter counts and
weight bytes. `gated_mlp=False` (a plain 2-matrix MLP, as in OPT and GPT-3)
describes models only the simulator prices. Host-only (no jax import) so the
simulator, the cost model and the CLI can read model shapes without a device.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """LLaMA-3 frequency-dependent rotary scaling (HF `rope_type: "llama3"`).

    Wavelengths shorter than `original_max_position / high_freq_factor` keep their
    frequency, longer than `original_max_position / low_freq_factor` are divided by
    `factor`, and the band between is interpolated smoothly.
    """

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position: int

    def __post_init__(self) -> None:
        if self.factor < 1.0:
            raise ValueError(f"RopeScaling.factor must be >= 1, got {self.factor}")
        if not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ValueError(
                "RopeScaling needs 0 < low_freq_factor < high_freq_factor, got "
                f"low_freq_factor={self.low_freq_factor}, high_freq_factor={self.high_freq_factor}")
        if self.original_max_position <= 0:
            raise ValueError("RopeScaling.original_max_position must be positive, got "
                             f"{self.original_max_position}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """A LLaMA-style decoder's shapes.

    Attributes:
      name: preset name or a label (written to results).
      vocab_size: number of token ids.
      d_model: residual stream width.
      num_layers: decoder blocks.
      num_q_heads: query heads.
      num_kv_heads: key/value heads (grouped-query attention; divides num_q_heads).
      head_dim: width of one head.
      ffn_dim: MLP hidden width.
      rope_theta: rotary base.
      rope_scaling: LLaMA-3 rotary scaling, or None.
      rms_norm_eps: RMSNorm epsilon.
      tie_embeddings: whether the LM head reuses the embedding matrix.
      max_context: longest sequence (prompt + output) the model accepts.
      gated_mlp: SwiGLU MLP (3 matrices), or a plain 2-matrix MLP (OPT, GPT-3),
        which only the simulator prices: the JAX model is LLaMA-style.
    """

    name: str = "custom"
    vocab_size: int
    d_model: int
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_dim: int
    rope_theta: float = 10000.0
    rope_scaling: Optional[RopeScaling] = None
    rms_norm_eps: float = 1e-5
    tie_embeddings: bool = False
    max_context: int = 2048
    gated_mlp: bool = True

    def __post_init__(self) -> None:
        for field in ("vocab_size", "d_model", "num_layers", "num_q_heads", "num_kv_heads",
                      "head_dim", "ffn_dim", "max_context"):
            value = getattr(self, field)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelConfig {self.name!r}: {field} must be a positive int, "
                                 f"got {value!r}")
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(f"ModelConfig {self.name!r}: num_kv_heads={self.num_kv_heads} must "
                             f"divide num_q_heads={self.num_q_heads}")
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig {self.name!r}: head_dim must be even for rotary "
                             f"embeddings, got {self.head_dim}")
        if self.rope_theta <= 0 or self.rms_norm_eps <= 0:
            raise ValueError(f"ModelConfig {self.name!r}: rope_theta and rms_norm_eps must be "
                             f"positive, got {self.rope_theta}, {self.rms_norm_eps}")

    @property
    def params_per_layer(self) -> int:
        """Weights of one decoder layer: attention, MLP and its two norms (no biases)."""
        attention = self.d_model * self.head_dim * (2 * self.num_q_heads + 2 * self.num_kv_heads)
        mlp = (3 if self.gated_mlp else 2) * self.d_model * self.ffn_dim
        return attention + mlp + 2 * self.d_model

    @property
    def non_embedding_params(self) -> int:
        """Weights every token goes through: all layers and the final norm."""
        return self.num_layers * self.params_per_layer + self.d_model

    @property
    def num_params(self) -> int:
        """All weights: layers, final norm, input embedding, and an untied LM head."""
        num_tables = 1 if self.tie_embeddings else 2
        return self.non_embedding_params + num_tables * self.vocab_size * self.d_model

    def weight_bytes(self, dtype_bytes: int) -> int:
        """Bytes of all weights at `dtype_bytes` per weight (what must fit in memory)."""
        return self.num_params * dtype_bytes

    def step_weight_bytes(self, dtype_bytes: int) -> int:
        """Bytes one step reads at `dtype_bytes` per weight: the layers, final norm and LM
        head (not the embedding rows a step gathers)."""
        return (self.non_embedding_params + self.vocab_size * self.d_model) * dtype_bytes


_LLAMA3_SCALING = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                              original_max_position=8192)

PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(name="tiny", vocab_size=512, d_model=128, num_layers=2, num_q_heads=4,
                        num_kv_heads=2, head_dim=32, ffn_dim=256, max_context=1024),
    "small": ModelConfig(name="small", vocab_size=2048, d_model=256, num_layers=4,
                         num_q_heads=8, num_kv_heads=4, head_dim=32, ffn_dim=688,
                         max_context=2048),
    # Meta-Llama-3-8B as published (no rope scaling, 8k context).
    "llama3-8b": ModelConfig(name="llama3-8b", vocab_size=128256, d_model=4096, num_layers=32,
                             num_q_heads=32, num_kv_heads=8, head_dim=128, ffn_dim=14336,
                             rope_theta=500000.0, max_context=8192),
    # Llama-3.1-8B: the same shapes with LLaMA-3 rope scaling to 128k.
    "llama3.1-8b": ModelConfig(name="llama3.1-8b", vocab_size=128256, d_model=4096,
                               num_layers=32, num_q_heads=32, num_kv_heads=8, head_dim=128,
                               ffn_dim=14336, rope_theta=500000.0, rope_scaling=_LLAMA3_SCALING,
                               max_context=131072),
    "llama2-7b": ModelConfig(name="llama2-7b", vocab_size=32000, d_model=4096, num_layers=32,
                             num_q_heads=32, num_kv_heads=32, head_dim=128, ffn_dim=11008,
                             max_context=4096),
    # Meta-Llama-3-70B and Llama-2-70b as published (GQA: 8 KV heads).
    "llama3-70b": ModelConfig(name="llama3-70b", vocab_size=128256, d_model=8192, num_layers=80,
                              num_q_heads=64, num_kv_heads=8, head_dim=128, ffn_dim=28672,
                              rope_theta=500000.0, max_context=8192),
    "llama2-70b": ModelConfig(name="llama2-70b", vocab_size=32000, d_model=8192, num_layers=80,
                              num_q_heads=64, num_kv_heads=8, head_dim=128, ffn_dim=28672,
                              max_context=4096),
    # Code Llama 34B (codellama/CodeLlama-34b-hf's config.json): Llama-2's tokenizer and
    # 32,000-token vocabulary, GQA with 8 KV heads, rope theta 10^6 for 16k contexts.
    "codellama-34b": ModelConfig(name="codellama-34b", vocab_size=32000, d_model=8192,
                                 num_layers=48, num_q_heads=64, num_kv_heads=8, head_dim=128,
                                 ffn_dim=22016, rope_theta=1000000.0, max_context=16384),
    # Small models of the 8B and 70B families' vocabularies, as drafts (and targets):
    # Llama-3.2-1B shares Llama-3's 128,256-token vocabulary (16 layers, tied embeddings,
    # LLaMA-3 rope scaling x32 to 128k); TinyLlama-1.1B shares Llama-2's 32,000 (22
    # layers, GQA with 4 KV heads, 2k context), as their published config.json say.
    "llama3.2-1b": ModelConfig(name="llama3.2-1b", vocab_size=128256, d_model=2048,
                               num_layers=16, num_q_heads=32, num_kv_heads=8, head_dim=64,
                               ffn_dim=8192, rope_theta=500000.0,
                               rope_scaling=dataclasses.replace(_LLAMA3_SCALING, factor=32.0),
                               tie_embeddings=True, max_context=131072),
    "tinyllama-1.1b": ModelConfig(name="tinyllama-1.1b", vocab_size=32000, d_model=2048,
                                  num_layers=22, num_q_heads=32, num_kv_heads=4, head_dim=64,
                                  ffn_dim=5632, max_context=2048),
    # Mistral-7B-v0.1 (its 4k sliding window is not modelled: attention sees the whole context).
    "mistral-7b": ModelConfig(name="mistral-7b", vocab_size=32000, d_model=4096, num_layers=32,
                              num_q_heads=32, num_kv_heads=8, head_dim=128, ffn_dim=14336,
                              max_context=32768),
    # Simulator-only shapes (plain MLP, learned positions rather than rotary): the rope
    # and norm fields keep their defaults and nothing reads them.
    "opt-13b": ModelConfig(name="opt-13b", vocab_size=50272, d_model=5120, num_layers=40,
                           num_q_heads=40, num_kv_heads=40, head_dim=128, ffn_dim=20480,
                           tie_embeddings=True, max_context=2048, gated_mlp=False),
    "gpt3-175b": ModelConfig(name="gpt3-175b", vocab_size=50257, d_model=12288, num_layers=96,
                             num_q_heads=96, num_kv_heads=96, head_dim=128, ffn_dim=49152,
                             tie_embeddings=True, max_context=2048, gated_mlp=False),
}
# Draft models for speculative decoding: their target's shapes and vocabulary, one layer
# (with random weights the real engine's draft takes the target's first layer).
PRESETS.update({f"{target}-draft": dataclasses.replace(PRESETS[target], name=f"{target}-draft",
                                                       num_layers=1)
                for target in ("tiny", "small")})


# Which presets share one tokenizer (the same token ids, not only as many): a draft must
# propose the target's tokens. A preset named in none has a vocabulary of its own.
VOCABULARIES: dict[str, tuple[str, ...]] = {
    "llama3": ("llama3.2-1b", "llama3-8b", "llama3.1-8b", "llama3-70b"),
    "llama2": ("tinyllama-1.1b", "llama2-7b", "codellama-34b", "llama2-70b"),
    "tiny": ("tiny-draft", "tiny"),
    "small": ("small-draft", "small"),
}


def draft_presets(target: str) -> list[str]:
    """The presets that may draft for the preset `target`: of its tokenizer
    (`VOCABULARIES`) and fewer weights, smallest first (none for an unknown name)."""
    if target not in PRESETS:
        return []
    family = next((names for names in VOCABULARIES.values() if target in names), ())
    size = PRESETS[target].num_params
    return sorted((name for name in family if PRESETS[name].num_params < size),
                  key=lambda name: PRESETS[name].num_params)


def draft_vocabulary_error(draft: ModelConfig, target: ModelConfig, where: str = "") -> str:
    """One line: `draft` cannot draft for `target` (another vocabulary), naming the presets
    that could (`draft_presets`). `where` leads it (a knob's name)."""
    fits = draft_presets(target.name)
    hint = (f"presets that share it: {', '.join(fits)}" if fits
            else "no preset shares it")
    return (f"{where}draft_model {draft.name!r} has a vocabulary of {draft.vocab_size} tokens, "
            f"the target {target.name!r} {target.vocab_size}: a draft must share the "
            f"target's vocabulary ({hint})")


def get_model_config(name: str) -> ModelConfig:
    """Returns the preset called `name`.

    Raises:
      ValueError: naming the unknown preset and listing the known ones.
    """
    if name not in PRESETS:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(sorted(PRESETS))}")
    return PRESETS[name]


def from_hf_config(hf: Mapping[str, Any], *, name: str = "hf") -> ModelConfig:
    """Reads a LLaMA `config.json` (as a dict) into a ModelConfig.

    Raises:
      ValueError: naming a missing key or an unsupported `rope_scaling` type.
    """
    def need(key: str) -> Any:
        if key not in hf:
            raise ValueError(f"config.json: missing required key {key!r}")
        return hf[key]

    num_q_heads = int(need("num_attention_heads"))
    d_model = int(need("hidden_size"))
    scaling = hf.get("rope_scaling")
    rope_scaling = None
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind != "llama3":
            raise ValueError(f"config.json: rope_scaling type {kind!r} is not supported "
                             "(only 'llama3')")
        rope_scaling = RopeScaling(
            factor=float(scaling["factor"]), low_freq_factor=float(scaling["low_freq_factor"]),
            high_freq_factor=float(scaling["high_freq_factor"]),
            original_max_position=int(scaling["original_max_position_embeddings"]))
    return ModelConfig(
        name=name, vocab_size=int(need("vocab_size")), d_model=d_model,
        num_layers=int(need("num_hidden_layers")), num_q_heads=num_q_heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or num_q_heads),
        head_dim=int(hf.get("head_dim") or d_model // num_q_heads),
        ffn_dim=int(need("intermediate_size")), rope_theta=float(hf.get("rope_theta", 10000.0)),
        rope_scaling=rope_scaling, rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_context=int(hf.get("max_position_embeddings", 2048)))


def to_hf_config(config: ModelConfig) -> dict[str, Any]:
    """The LLaMA `config.json` dict of `config` (the inverse of `from_hf_config`).

    Raises:
      ValueError: `config` has a plain MLP, which a LLaMA config cannot describe.
    """
    if not config.gated_mlp:
        raise ValueError(f"to_hf_config: model {config.name!r} has a plain 2-matrix MLP "
                         "(gated_mlp=False); a LLaMA config.json describes SwiGLU models only")
    hf: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": config.vocab_size, "hidden_size": config.d_model,
        "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_q_heads,
        "num_key_value_heads": config.num_kv_heads, "head_dim": config.head_dim,
        "intermediate_size": config.ffn_dim, "rope_theta": config.rope_theta,
        "rms_norm_eps": config.rms_norm_eps, "tie_word_embeddings": config.tie_embeddings,
        "max_position_embeddings": config.max_context, "rope_scaling": None,
    }
    if config.rope_scaling is not None:
        s = config.rope_scaling
        hf["rope_scaling"] = {"rope_type": "llama3", "factor": s.factor,
                              "low_freq_factor": s.low_freq_factor,
                              "high_freq_factor": s.high_freq_factor,
                              "original_max_position_embeddings": s.original_max_position}
    return hf
