"""The engine part of a run's spec: the real jax engine's or the simulator's settings.

A setting that only one engine reads lives only on that engine's part; the pipeline
knobs both take are written once (`_pp_layers_knob`, `_pp_balance_knob`).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional, Union

from orca_jax.core.step.verification import DRAFTERS
from orca_jax.runner.spec_fields import (
    check_at_least,
    check_choice,
    check_positive,
    knob,
    sampling_params,
)
from orca_jax.sim.cost_model import STEP_PADDINGS
from orca_jax.sim.engine_profiles import DEFAULT_PROFILE, PROFILES
from orca_jax.sim.pipeline_stages import check_gpus, stage_layers
from orca_jax.specs.hardware import HARDWARE_ALIASES, HARDWARE_PRESETS, get_hardware
from orca_jax.specs.model_config import PRESETS, draft_vocabulary_error, get_model_config

ENGINES = ("sim", "jax")
DTYPES = ("float32", "bfloat16")
ATTENTIONS = ("auto", "reference", "bucketed", "pallas", "pallas_interpret")
CLOCKS = ("profiled", "wall")
FRESH_TABLE = "fresh"  # profile_table: time the grid again, replacing the stored table
JAX_DRAFTERS = ("none", *DRAFTERS)  # the real engine's speculative drafters (none: off)
MODEL_PRESETS = tuple(PRESETS)
HARDWARE_NAMES = (*HARDWARE_PRESETS, *HARDWARE_ALIASES)
ENGINE_PROFILES = tuple(PROFILES)


def _pp_layers_knob() -> Optional[str]:
    """`pp_layers`, the same knob on both engines."""
    return knob(None, "Layers of each pipeline stage, e.g. 20,12 (summing to the model's "
                "layers; None: an even split).")


def _pp_balance_knob() -> bool:
    """`pp_balance`, the same knob on both engines."""
    return knob(False, "Pipeline stages: each micro-batch takes at most ceil(R / pp) of the R "
                "running requests (the rest wait for the next one), so the micro-batches in "
                "flight, and the stage times, stay even.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class JaxEngineSpec:
    """The real engine: the Flax model on this machine's devices."""

    kind: str = dataclasses.field(default="jax", init=False)  # names the engine in config.json
    model: str = knob("llama3-8b", "Model preset (or the name of --checkpoint's model).",
                      presets=MODEL_PRESETS)
    checkpoint: Optional[str] = knob(None, "An orbax checkpoint directory or a LLaMA-format "
                                     "folder (config.json + *.safetensors); None: seeded "
                                     "random weights.")
    dtype: str = knob("float32", "Parameter, activation and KV cache dtype.", choices=DTYPES)
    attention: str = knob("auto", "Attention op. auto: the Pallas kernel on a GPU, bucketed "
                          "(all queries at once, KV chunks up to the step's longest context) "
                          "elsewhere; reference: the ragged jnp loop, the kernel's oracle; "
                          "pallas off a GPU runs the kernel in interpret mode.",
                          choices=ATTENTIONS)
    sampling: str = knob("greedy", "greedy, or temperature:T[:TOP_K[:TOP_P]].")
    clock: str = knob("profiled", "What advances the virtual clock. profiled: each step is "
                      "priced from its real query and KV lengths by its bucket's linear fit "
                      "(base + per sequence + per KV tile) to a grid of step compositions "
                      "timed at warm-up (or read from profile_table): repeatable; wall: each "
                      "step's measured wall time.", choices=CLOCKS)
    tp: int = knob(1, "Tensor parallelism: the local devices the engine splits weights, KV "
                   "cache and attention over.")
    pp: int = knob(1, "Pipeline parallelism: the model's layers split into this many stages, "
                   "each on its own tp local devices (pp x tp in all; on a CPU force them with "
                   "XLA_FLAGS=--xla_force_host_platform_device_count=N), activations copied "
                   "between them, up to pp micro-batches in flight through JAX's asynchronous "
                   "dispatch; a request runs in one at a time. Stage seconds: the profiled "
                   "clock's step price split by layers, or (clock wall) each stage timed "
                   "alone. docs/pipeline.md.")
    pp_layers: Optional[str] = _pp_layers_knob()
    pp_balance: bool = _pp_balance_knob()
    profile_table: Optional[str] = knob(
        None, "clock profiled: the per-bucket table of the profiled clock. None: the table "
        "stored for this machine and setup (--profile_store) if there is one, so every "
        "command on this machine prices steps alike, loaded or idle; else it is timed and "
        "stored. fresh: timed again, replacing the stored one. A file: read if it exists "
        "(it must be of the same model, buckets, dtype, attention and page geometry), so a "
        "run in another process or on another host repeats this one's timings bit for bit; "
        "if not, the table is timed and written there (./fresh names a file called fresh). "
        "Each run writes the table it used to profile.json beside its results; config.json "
        "names it, its sha256 and the stored table's key, time and machine.")
    overlap: bool = knob(True, "Plan and pack step N+1 while step N runs on the device (its "
                         "decodes read N's sampled tokens there; N's tokens come back one "
                         "step late). Plans, steps and tokens are the same with it off; not "
                         "active with prefix caching.")
    drafter: str = knob("none", "Speculative decoding's drafter, for plans that give "
                        "requests draft tokens (spec_tokens): ngram (prompt lookup over the "
                        "request's tokens, no model) or model (--draft_model, run by the "
                        "same engine machinery on its own KV cache); the target verifies "
                        "every draft, so outputs are those without speculation (greedy, "
                        "or sampled: seed for seed). none: no speculation. Clock wall "
                        "only.",
                        choices=JAX_DRAFTERS)
    draft_model: Optional[str] = knob(None, "The draft model preset, of the target's "
                                      "vocabulary (drafter model).",
                                      presets=MODEL_PRESETS)

    def __post_init__(self) -> None:
        check_choice("engine", "dtype", self.dtype, DTYPES)
        check_choice("engine", "drafter", self.drafter, JAX_DRAFTERS)
        self._check_drafter()
        check_choice("engine", "attention", self.attention, ATTENTIONS)
        check_choice("engine", "clock", self.clock, CLOCKS)
        sampling_params(self.sampling)  # fails early, naming the value
        check_at_least("engine", "tp", self.tp, 1)
        check_at_least("engine", "pp", self.pp, 1)
        if self.profile_table is not None and self.clock != "profiled":
            raise ValueError(f"engine.profile_table ({self.profile_table!r}) is the profiled "
                             f"clock's table; engine.clock is {self.clock!r}")
        if not (self.checkpoint and os.path.isfile(os.path.join(self.checkpoint, "config.json"))):
            # A preset gives the shapes: fails early, naming them (a folder's: at build).
            model = get_model_config(self.model)
            stage_layers(model.num_layers, self.pp, self.pp_layers, where="engine.pp")

    def _check_drafter(self) -> None:
        """The drafter's settings agree (each disagreement one line naming the knobs)."""
        if (self.drafter == "model") != (self.draft_model is not None):
            raise ValueError("engine.drafter model needs engine.draft_model (a preset)"
                             if self.draft_model is None else
                             f"engine.draft_model {self.draft_model!r} is the model drafter's; "
                             f"engine.drafter is {self.drafter!r} (use --drafter=model)")
        if self.drafter == "none":
            return
        if self.draft_model is not None:
            draft = get_model_config(self.draft_model)  # fails early, naming the preset
            target = get_model_config(self.model)
            if not self.checkpoint and draft.vocab_size != target.vocab_size:
                raise ValueError(draft_vocabulary_error(draft, target, "engine."))
        if self.clock != "wall":
            raise ValueError(f"engine.drafter {self.drafter}: the profiled clock prices the "
                             "target's step alone, not the drafting; use engine.clock wall")
        if self.tp != 1:
            raise ValueError(f"engine.drafter {self.drafter}: speculation on a tp mesh is not "
                             f"built (engine.tp {self.tp}); use tp 1")
        if self.pp != 1:
            raise ValueError(f"engine.drafter {self.drafter}: speculation through pipeline "
                             f"stages is not built (engine.pp {self.pp}); use pp 1")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SimEngineSpec:
    """The simulator: a cost model of the model on a hardware preset."""

    kind: str = dataclasses.field(default="sim", init=False)  # names the engine in config.json
    model: str = knob("llama3-8b", "Model preset.", presets=MODEL_PRESETS)
    hardware: str = knob("a100", "Hardware preset of the simulated replica.",
                         presets=HARDWARE_NAMES)
    tp: int = knob(1, "Tensor parallelism: the simulated replica's degree.")
    pp: int = knob(1, "Pipeline parallelism: the model's layers split into this many stages, "
                   "each on its own tp GPUs (pp x tp GPUs in all, at most those the hardware "
                   "preset describes), with up to pp micro-batches in flight; a request "
                   "runs in one at a time. docs/pipeline.md.")
    pp_layers: Optional[str] = _pp_layers_knob()
    pp_balance: bool = _pp_balance_knob()
    step_time_ms: Optional[float] = knob(None, "A fixed step time in ms (instead of the "
                                         "roofline cost model).")
    cost_fit: Optional[str] = knob(None, "Step times from a cost fit JSON written by "
                                   "experiments.calibrate (instead of the roofline); use the "
                                   "fitted model's model and the same buckets.")
    step_padding: str = knob("bucket", "How the roofline prices a step's padding: bucket "
                             "(as compiled: token-wise layers on the bucket's padded tokens, "
                             "attention on the real lengths, as the real engine runs it) or "
                             "ragged (an ideal engine that computes real tokens only).",
                             choices=STEP_PADDINGS)
    engine_profile: str = knob(
        DEFAULT_PROFILE, "Which serving engine the roofline prices (orca_jax.sim.engine_profiles, "
        "docs/fidelity.md): orca_jax (this project's compiled steps on the run's buckets) or "
        "vllm (vLLM v1 behind its OpenAI server: its attention kernels and all-reduce per GPU "
        "generation, CUDA graph sizes, async scheduling and front end; calibrated on public "
        "H100 runs, benchmarks/sim_vs_real.py).", choices=ENGINE_PROFILES)
    leap: bool = knob(True, "Run stretches of steady decode steps at once where the policy "
                      "promises its plan repeats (Policy.stable_steps): the same results bit "
                      "for bit, less host time. --noleap runs every step one by one. Not "
                      "for clusters or with count_host_time.")
    spec_acceptance: Optional[float] = knob(
        None, "Speculative decoding: the probability that the target accepts a draft token, "
        "i.i.d. per position and seeded by --seed. Setting it, --draft_model or --spec_k "
        "makes the simulator speculate (None then: 0.7). docs/speculative.md.")
    draft_model: Optional[str] = knob(
        None, "Speculative decoding: the draft model preset (the target's vocabulary, e.g. "
        "llama3.2-1b for llama3-8b or llama3-70b, tinyllama-1.1b for llama2-70b) whose "
        "decode steps, k per speculating step, are priced on the clock on the target's "
        "hardware and tp; None: drafting costs nothing (a model-free drafter).",
        presets=MODEL_PRESETS)

    def __post_init__(self) -> None:
        model = get_model_config(self.model)  # fails early, naming the presets
        hardware = get_hardware(self.hardware)
        check_at_least("engine", "tp", self.tp, 1)
        stage_layers(model.num_layers, self.pp, self.pp_layers, where="engine.pp")
        if self.pp > 1:
            check_gpus(hardware, self.tp, self.pp, where="engine.pp")
            if self.cost_fit is not None:
                raise ValueError(f"engine.pp {self.pp}: a cost fit ({self.cost_fit}) prices "
                                 "whole steps, not pipeline stages; use the roofline or "
                                 "step_time_ms")
        check_positive("engine", "step_time_ms", self.step_time_ms)
        check_choice("engine", "step_padding", self.step_padding, STEP_PADDINGS)
        check_choice("engine", "engine_profile", self.engine_profile, ENGINE_PROFILES)
        if self.engine_profile != DEFAULT_PROFILE and (self.cost_fit or self.step_time_ms):
            raise ValueError(f"engine.engine_profile {self.engine_profile!r} prices the "
                             "roofline; engine.cost_fit and engine.step_time_ms give step "
                             "times of their own (use the default profile with them)")
        if self.cost_fit is not None and self.step_time_ms is not None:
            raise ValueError(f"engine.cost_fit ({self.cost_fit!r}) and engine.step_time_ms "
                             f"({self.step_time_ms}) both set; choose one step-time model")
        if self.spec_acceptance is not None and not 0.0 <= self.spec_acceptance <= 1.0:
            raise ValueError(f"engine.spec_acceptance must be in [0, 1] (a probability), got "
                             f"{self.spec_acceptance}")
        if self.draft_model is not None:
            try:
                draft = get_model_config(self.draft_model)
            except ValueError as e:  # naming the presets, and the flag
                raise ValueError(f"engine.draft_model: {e}") from None
            if draft.vocab_size != model.vocab_size:
                raise ValueError(draft_vocabulary_error(draft, model, "engine."))
            if self.pp > 1:
                raise ValueError(f"engine.draft_model with engine.pp {self.pp}: speculative "
                                 "decoding is simulated on one pipeline stage for now")


EngineSpec = Union[JaxEngineSpec, SimEngineSpec]
