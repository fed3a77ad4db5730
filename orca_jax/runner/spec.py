"""What defines a run, but for its policy: `RunSpec` and its parts.

A run is a workload (`WorkloadSpec`) served by an engine (`JaxEngineSpec` or
`SimEngineSpec`) under the scheduler's limits (`LimitsSpec`), on one replica or
several (`ClusterSpec`), with a seed and SLOs. Each part is a frozen,
keyword-only dataclass that checks its own fields, and a setting that only one
engine reads lives only on that engine's part. The command-line flags resolve
to a `RunSpec` (`experiments/flags.py`); config.json's "run" section is
`dataclasses.asdict` of it, grouped the same way.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Optional, Union

from orca_jax import _legacy
from orca_jax.cluster.migration import MIGRATION_MODES
from orca_jax.core.api.plugins import parse_options
from orca_jax.core.kv import KV_LAYOUTS
from orca_jax.core.kv.config import PREFIX_CACHING_MODES
from orca_jax.core.step.bucket_fit import max_fitted_sizes, parse_fit_ladder
from orca_jax.core.step.verification import DRAFTERS
from orca_jax.runner.kv_tiers import engine_kv_shape, tier_configs
from orca_jax.runner.spec_caps import check_caps
from orca_jax.sim.cost_model import STEP_PADDINGS
from orca_jax.sim.pipeline_stages import check_gpus, stage_layers
from orca_jax.specs.hardware import (
    HARDWARE_ALIASES,
    HARDWARE_PRESETS,
    KV_LINK_ALIASES,
    KV_LINK_PRESETS,
    get_hardware,
    get_kv_link,
)
from orca_jax.specs.model_config import PRESETS, get_model_config
from orca_jax.workloads.programs import COPILOT_DEFAULTS, PROGRAM_SHAPES
from orca_jax.workloads.synthetic import parse_length_spec

WORKLOADS = ("poisson", "gamma", "burst", "trace", "shared_prefix", "conversation", "programs",
             "program_trace")
ENGINES = ("sim", "jax")
DTYPES = ("float32", "bfloat16")
ATTENTIONS = ("auto", "reference", "bucketed", "pallas", "pallas_interpret")
CLOCKS = ("profiled", "wall")
JAX_DRAFTERS = ("none", *DRAFTERS)  # the real engine's speculative drafters (none: off)
# The prefix workloads' length specs -> the column an `empirical:PATH` spec of each reads.
LENGTH_COLUMNS = {"prefix_len": "prompt_len", "suffix_len": "prompt_len",
                  "num_turns": "num_turns", "think_time_ms": "think_time_ms",
                  **{f"program_{name}": "prompt_len" for name in COPILOT_DEFAULTS}}
MODEL_PRESETS = tuple(PRESETS)
HARDWARE_NAMES = (*HARDWARE_PRESETS, *HARDWARE_ALIASES)
KV_LINK_NAMES = (*KV_LINK_PRESETS, *KV_LINK_ALIASES)

# The commands' defaults (`experiments/flags.py`) of the settings whose default depends on
# the engine: a small workload the tiny real model serves in seconds on a laptop CPU, and a
# GPU-scale one for the simulator. A field's own default is the library's (`RunSpec()` in a
# script); the sim column differs from it only in num_requests (1000, not 200) and rate
# (32, not 4): a command's simulation is sized like a GPU's load, a script's for a quick
# check. A flag of one of these fields defaults to None (the engine's column) and its help
# names both columns.
COMMAND_DEFAULTS: dict[str, dict[str, object]] = {
    "jax": dict(model="tiny", num_requests=64, rate=40.0, prompt_len="uniform:16:128",
                output_len="uniform:16:64", max_num_seqs=16, max_num_tokens=256,
                prefix_len="fixed:256", suffix_len="uniform:16:64", num_turns="uniform:1:6"),
    "sim": dict(model="llama3-8b", num_requests=1000, rate=32.0, prompt_len="uniform:32:512",
                output_len="uniform:1:128", max_num_seqs=64, max_num_tokens=2048,
                prefix_len="fixed:1024", suffix_len="uniform:16:256", num_turns="uniform:1:8"),
}


def _knob(default: object, help_text: str, *, choices: tuple[str, ...] = (),
          presets: tuple[str, ...] = (), registry: Optional[str] = None) -> Any:
    """A spec field with its documentation as data: the command-line flag of the field takes
    its default and help from here (`experiments/flags.py`, checked by
    tests/test_flag_spec_consistency.py).

    Args:
      default: the field's default.
      help_text: what the field means (the flag's help).
      choices: the only values allowed (checked in `__post_init__`).
      presets: the named presets a value may be (others may be allowed: a path, a name).
      registry: the plugin registry whose names a value may be (`router`), besides a
        plugin spec; filled in where the registry is (the built-ins register on import).
    """
    return dataclasses.field(default=default, metadata={
        "help": help_text, "choices": choices, "presets": presets, "registry": registry})


def field_doc(part: type, name: str) -> dict[str, Any]:
    """A spec field's documentation (`_knob`'s metadata: help, choices, presets, registry);
    empty for a field without one."""
    return dict(next(f for f in dataclasses.fields(part) if f.name == name).metadata)


def sampling_params(text: str) -> tuple[float, int, float]:
    """Parses `greedy` or `temperature:T[:top_k[:top_p]]` into (temperature, top_k, top_p)."""
    if text == "greedy":
        return 0.0, 0, 1.0
    kind, _, rest = text.partition(":")
    parts = rest.split(":") if rest else []
    try:
        if kind != "temperature" or not 1 <= len(parts) <= 3:
            raise ValueError
        temperature = float(parts[0])
        top_k = int(parts[1]) if len(parts) > 1 else 0
        top_p = float(parts[2]) if len(parts) > 2 else 1.0
        if temperature < 0 or top_k < 0 or not 0 < top_p <= 1:
            raise ValueError
    except ValueError:
        raise ValueError(f"sampling {text!r}: expected greedy or temperature:T[:TOP_K[:TOP_P]] "
                         "with T >= 0, TOP_K >= 0, 0 < TOP_P <= 1") from None
    return temperature, top_k, top_p


def _check_choice(part: str, field: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{part}.{field} must be one of {choices}, got {value!r}")


def _check_at_least(part: str, field: str, value: Optional[float], lowest: float) -> None:
    if value is not None and not value >= lowest:
        raise ValueError(f"{part}.{field} must be >= {lowest:g}, got {value}")


def _check_positive(part: str, field: str, value: Optional[float], what: str = "") -> None:
    """A finite number > 0 (or None): nan, inf and 0 are refused here, by name, not deep
    in the run as a division by zero or an endless loop."""
    if value is not None and not (math.isfinite(value) and value > 0):
        raise ValueError(f"{part}.{field} must be a finite number > 0{what}, got {value}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class WorkloadSpec:
    """The requests: an arrival process with length distributions, a trace file, or a
    workload whose prompts share prefixes (`workloads.prefix_workloads`)."""

    arrival: str = _knob("poisson", "Arrival process, a trace file, or prompts that share "
                         "prefixes: shared_prefix (a few system prompts, Zipf popularity, and "
                         "private suffixes) or conversation (multi-turn chats whose turns hold "
                         "the conversation so far); programs (agent sessions of LLM calls "
                         "with tool pauses, --program_*) or program_trace (--trace: a "
                         "program JSONL, ours or the Copilot agent trace's; "
                         "docs/programs.md).", choices=WORKLOADS)
    trace: Optional[str] = _knob(None, "Trace file (JSONL or CSV) of arrival 'trace'; its "
                                 "columns/fields (ours, Vidur's, Mooncake's), units and what "
                                 "may be left out: docs/traces.md. Without arrival times it is "
                                 "an offline batch (all at time 0, in file order).")
    trace_block_size: Optional[int] = _knob(None, "Tokens per block of a trace's hash_ids "
                                            "where the file gives no block_size (None: "
                                            "Mooncake's 512); each block maps onto whole KV "
                                            "pages of the run's page_size (docs/traces.md).")
    trace_time_scale: float = _knob(1.0, "Multiplies the trace's arrival times (and "
                                    "deadlines): 0.5 replays it at twice its request rate.")
    trace_repeat: int = _knob(1, "Plays the trace (its first num_requests) this many times "
                              "back to back, each copy one period later (its last arrival "
                              "plus the mean gap), after trace_time_scale: a long run from a "
                              "short trace (ids 0..N*trace_repeat-1).")
    num_requests: Optional[int] = _knob(200, "Requests in the workload (the first N of a "
                                        "trace, None: the whole trace; of conversation: "
                                        "turns).")
    rate: float = _knob(4.0, "Arrival rate in requests/s (poisson, gamma, shared_prefix; "
                        "conversation: conversations/s; programs: programs/s).")
    cv: float = _knob(1.0, "Coefficient of variation of gamma inter-arrival gaps.")
    prompt_len: str = _knob("uniform:32:512", "Prompt length distribution: fixed:N, "
                            "uniform:LO:HI, lognormal:MEAN:SIGMA, zipf:A:MAX, "
                            "empirical:PATH[:COLUMN].")
    output_len: Optional[str] = _knob("uniform:1:128", "Output length distribution (as "
                                      "prompt_len); of a trace: only for a trace without "
                                      "output lengths (its own win), drawn per request (None: "
                                      "such a trace is an error).")
    num_prefixes: int = _knob(8, "shared_prefix: the number of system prompts.")
    prefix_len: str = _knob("fixed:1024", "shared_prefix: each system prompt's length (as "
                            "prompt_len).")
    prefix_zipf: float = _knob(1.1, "shared_prefix: the popularity exponent; system prompt k "
                               "(from 0) is picked with weight (k + 1)**-prefix_zipf (0: "
                               "uniform).")
    suffix_len: str = _knob("uniform:16:256", "The private part of each prompt (as "
                            "prompt_len): the suffix after the system prompt (shared_prefix), "
                            "or each turn's new message (conversation).")
    num_turns: str = _knob("uniform:1:8", "conversation: turns per conversation (as "
                           "prompt_len).")
    think_time_ms: str = _knob("lognormal:10000:1", "conversation: milliseconds from a turn's "
                               "arrival to the next turn's (as prompt_len).")
    program_shape: str = _knob("copilot", "programs: copilot (sequential sessions of turns "
                               "of calls) or parallel (a planning call fans out to "
                               "--program_fanout threads that join).", choices=PROGRAM_SHAPES)
    program_turns: str = _knob(COPILOT_DEFAULTS["turns"], "programs: turns per program "
                               "(parallel: fan-out stages); the default's mean is the Copilot "
                               "agent trace's 3.95 (as prompt_len).")
    program_calls_per_turn: str = _knob(COPILOT_DEFAULTS["calls_per_turn"], "programs, "
                                        "copilot: LLM calls per turn; the default's mean is "
                                        "the Copilot agent trace's 7.83 (as prompt_len).")
    program_first_prompt: str = _knob(COPILOT_DEFAULTS["first_prompt"], "programs: the "
                                      "first call's prompt tokens (as prompt_len).")
    program_prompt_growth: str = _knob(COPILOT_DEFAULTS["prompt_growth"], "programs: tokens "
                                       "a tool's output adds to the context before the next "
                                       "call (as prompt_len).")
    program_completion_len: str = _knob(COPILOT_DEFAULTS["completion_len"], "programs: each "
                                        "call's answer tokens (the defaults give prompts "
                                        "about 120 times the completions, as the Copilot "
                                        "trace's 128; as prompt_len).")
    program_tool_ms: str = _knob(COPILOT_DEFAULTS["tool_ms"], "programs: the tool pause in "
                                 "milliseconds before each call but a turn's first (as "
                                 "prompt_len).")
    program_turn_gap_ms: str = _knob(COPILOT_DEFAULTS["turn_gap_ms"], "programs: the user's "
                                     "pause in milliseconds before a turn's first call (as "
                                     "prompt_len).")
    program_fanout: int = _knob(4, "programs, parallel: thread calls per stage.")
    program_count: Optional[int] = _knob(None, "programs: generate exactly this many whole "
                                         "programs, all their calls (--num_requests is then "
                                         "not read), so each rate of a sweep runs the same "
                                         "programs, only started faster; None: the first "
                                         "--num_requests calls in planned order, which "
                                         "programs those are varying with the rate.")

    def __post_init__(self) -> None:
        _check_choice("workload", "arrival", self.arrival, WORKLOADS)
        for field, column in LENGTH_COLUMNS.items():
            try:
                parse_length_spec(getattr(self, field), default_column=column)
            except (ValueError, OSError) as e:
                raise ValueError(f"workload.{field}: {e}") from None
        _check_at_least("workload", "num_prefixes", self.num_prefixes, 1)
        if not (math.isfinite(self.prefix_zipf) and self.prefix_zipf >= 0):
            raise ValueError(f"workload.prefix_zipf must be a finite number >= 0, got "
                             f"{self.prefix_zipf}")
        if self.arrival in ("trace", "program_trace") and not self.trace:
            raise ValueError(f"workload.arrival {self.arrival!r} needs a trace file "
                             "(workload.trace, --trace)")
        _check_at_least("workload", "program_fanout", self.program_fanout, 1)
        _check_at_least("workload", "program_count", self.program_count, 1)
        if self.output_len is None and self.arrival != "trace":
            raise ValueError(f"workload.output_len: None is only for a trace (which then "
                             f"gives its own output lengths); workload {self.arrival!r} needs "
                             f"a distribution")
        _check_at_least("workload", "trace_block_size", self.trace_block_size, 1)
        _check_at_least("workload", "num_requests", self.num_requests, 1)
        _check_positive("workload", "rate", self.rate, " (requests per second)")
        _check_positive("workload", "cv", self.cv)
        _check_at_least("workload", "trace_repeat", self.trace_repeat, 1)
        if self.trace_repeat > 1 and self.arrival != "trace":
            raise ValueError(f"workload.trace_repeat={self.trace_repeat} repeats a trace; "
                             f"arrival is {self.arrival!r}, not 'trace'")
        if not (math.isfinite(self.trace_time_scale) and self.trace_time_scale > 0):
            raise ValueError(f"workload.trace_time_scale must be a finite number > 0, got "
                             f"{self.trace_time_scale}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class JaxEngineSpec:
    """The real engine: the Flax model on this machine's devices."""

    kind: str = dataclasses.field(default="jax", init=False)  # names the engine in config.json
    model: str = _knob("llama3-8b", "Model preset (or the name of --checkpoint's model).",
                       presets=MODEL_PRESETS)
    checkpoint: Optional[str] = _knob(None, "An orbax checkpoint directory or a LLaMA-format "
                                      "folder (config.json + *.safetensors); None: seeded "
                                      "random weights.")
    dtype: str = _knob("float32", "Parameter, activation and KV cache dtype.", choices=DTYPES)
    attention: str = _knob("auto", "Attention op. auto: the Pallas kernel on a GPU, bucketed "
                           "(all queries at once, KV chunks up to the step's longest context) "
                           "elsewhere; reference: the ragged jnp loop, the kernel's oracle; "
                           "pallas off a GPU runs the kernel in interpret mode.",
                           choices=ATTENTIONS)
    sampling: str = _knob("greedy", "greedy, or temperature:T[:TOP_K[:TOP_P]].")
    clock: str = _knob("profiled", "What advances the virtual clock. profiled: each step is "
                       "priced from its real query and KV lengths by its bucket's linear fit "
                       "(base + per sequence + per KV tile) to a grid of step compositions "
                       "timed at warm-up (or read from profile_table): repeatable; wall: each "
                       "step's measured wall time.", choices=CLOCKS)
    tp: int = _knob(1, "Tensor parallelism: the local devices the engine splits weights, KV "
                    "cache and attention over.")
    pp: int = _knob(1, "Pipeline parallelism: the model's layers split into this many stages, "
                    "each on its own tp local devices (pp x tp in all; on a CPU force them with "
                    "XLA_FLAGS=--xla_force_host_platform_device_count=N), activations copied "
                    "between them, up to pp micro-batches in flight through JAX's asynchronous "
                    "dispatch; a request runs in one at a time. Stage seconds: the profiled "
                    "clock's step price split by layers, or (clock wall) each stage timed "
                    "alone. docs/pipeline.md.")
    pp_layers: Optional[str] = _knob(None, "Layers of each pipeline stage, e.g. 20,12 "
                                     "(summing to the model's layers; None: an even split).")
    pp_balance: bool = _knob(False, "Pipeline stages: each micro-batch takes at most "
                             "ceil(R / pp) of the R running requests (the rest wait for the "
                             "next one), so the micro-batches in flight, and the stage times, "
                             "stay even.")
    profile_table: Optional[str] = _knob(
        None, "clock profiled: the per-bucket table of the profiled clock. If the file exists "
        "it is read (it must be of the same model, buckets, dtype, attention and page "
        "geometry), so a run in another process repeats this one's timings bit for bit; if "
        "not, the table is measured and written there. None: measured, and written to "
        "profile.json beside the results. config.json names the table and its sha256.")
    overlap: bool = _knob(True, "Plan and pack step N+1 while step N runs on the device (its "
                          "decodes read N's sampled tokens there; N's tokens come back one "
                          "step late). Plans, steps and tokens are the same with it off; not "
                          "active with prefix caching.")
    drafter: str = _knob("none", "Speculative decoding's drafter, for plans that give "
                         "requests draft tokens (spec_tokens): ngram (prompt lookup over the "
                         "request's tokens, no model) or model (--draft_model, run by the "
                         "same engine machinery on its own KV cache); the target verifies "
                         "every draft, so greedy outputs are unchanged. none: no "
                         "speculation. Greedy sampling and clock wall only.",
                         choices=JAX_DRAFTERS)
    draft_model: Optional[str] = _knob(None, "The draft model preset, of the target's "
                                       "vocabulary (drafter model).",
                                       presets=MODEL_PRESETS)

    def __post_init__(self) -> None:
        _check_choice("engine", "dtype", self.dtype, DTYPES)
        _check_choice("engine", "drafter", self.drafter, JAX_DRAFTERS)
        self._check_drafter()
        _check_choice("engine", "attention", self.attention, ATTENTIONS)
        _check_choice("engine", "clock", self.clock, CLOCKS)
        sampling_params(self.sampling)  # fails early, naming the value
        _check_at_least("engine", "tp", self.tp, 1)
        _check_at_least("engine", "pp", self.pp, 1)
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
            if not self.checkpoint and draft.vocab_size != get_model_config(self.model).vocab_size:
                raise ValueError(f"engine.draft_model {self.draft_model!r} has vocab_size "
                                 f"{draft.vocab_size}, engine.model {self.model!r} has "
                                 f"{get_model_config(self.model).vocab_size}: a draft model "
                                 "needs the target's vocabulary")
        if sampling_params(self.sampling)[0] > 0:
            raise ValueError(f"engine.drafter {self.drafter}: speculative sampling at "
                             f"temperature > 0 is not built on the jax engine (engine.sampling "
                             f"{self.sampling!r}); use greedy")
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
    model: str = _knob("llama3-8b", "Model preset.", presets=MODEL_PRESETS)
    hardware: str = _knob("a100", "Hardware preset of the simulated replica.",
                          presets=HARDWARE_NAMES)
    tp: int = _knob(1, "Tensor parallelism: the simulated replica's degree.")
    pp: int = _knob(1, "Pipeline parallelism: the model's layers split into this many stages, "
                    "each on its own tp GPUs (pp x tp GPUs in all, at most those the hardware "
                    "preset describes), with up to pp micro-batches in flight; a request "
                    "runs in one at a time. docs/pipeline.md.")
    pp_layers: Optional[str] = _knob(None, "Layers of each pipeline stage, e.g. 20,12 "
                                     "(summing to the model's layers; None: an even split).")
    pp_balance: bool = _knob(False, "Pipeline stages: each micro-batch takes at most "
                             "ceil(R / pp) of the R running requests (the rest wait for the "
                             "next one), so the micro-batches in flight, and the stage times, "
                             "stay even.")
    step_time_ms: Optional[float] = _knob(None, "A fixed step time in ms (instead of the "
                                          "roofline cost model).")
    cost_fit: Optional[str] = _knob(None, "Step times from a cost fit JSON written by "
                                    "experiments.calibrate (instead of the roofline); use the "
                                    "fitted model's model and the same buckets.")
    step_padding: str = _knob("bucket", "How the roofline prices a step's padding: bucket "
                              "(as compiled: token-wise layers on the bucket's padded tokens, "
                              "attention on the real lengths, as the real engine runs it) or "
                              "ragged (an ideal engine that computes real tokens only).",
                              choices=STEP_PADDINGS)
    leap: bool = _knob(True, "Run stretches of steady decode steps at once where the policy "
                       "promises its plan repeats (Policy.stable_steps): the same results bit "
                       "for bit, less host time. --noleap runs every step one by one. Not "
                       "for clusters or with count_host_time.")
    spec_acceptance: Optional[float] = _knob(
        None, "Speculative decoding: the probability that the target accepts a draft token, "
        "i.i.d. per position and seeded by --seed. Setting it, --draft_model or --spec_k "
        "makes the simulator speculate (None then: 0.7). docs/speculative.md.")
    draft_model: Optional[str] = _knob(
        None, "Speculative decoding: the draft model preset (the target's vocabulary, e.g. "
        "llama2-7b for llama2-70b) whose decode steps, k per speculating step, are priced on "
        "the clock on the target's hardware and tp; None: drafting costs nothing (a "
        "model-free drafter).", presets=MODEL_PRESETS)

    def __post_init__(self) -> None:
        model = get_model_config(self.model)  # fails early, naming the presets
        hardware = get_hardware(self.hardware)
        _check_at_least("engine", "tp", self.tp, 1)
        stage_layers(model.num_layers, self.pp, self.pp_layers, where="engine.pp")
        if self.pp > 1:
            check_gpus(hardware, self.tp, self.pp, where="engine.pp")
            if self.cost_fit is not None:
                raise ValueError(f"engine.pp {self.pp}: a cost fit ({self.cost_fit}) prices "
                                 "whole steps, not pipeline stages; use the roofline or "
                                 "step_time_ms")
        _check_positive("engine", "step_time_ms", self.step_time_ms)
        _check_choice("engine", "step_padding", self.step_padding, STEP_PADDINGS)
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
                raise ValueError(f"engine.draft_model {self.draft_model!r} has a vocabulary of "
                                 f"{draft.vocab_size} tokens, the target {self.model!r} "
                                 f"{model.vocab_size}: a draft must share the target's "
                                 "vocabulary")
            if self.pp > 1:
                raise ValueError(f"engine.draft_model with engine.pp {self.pp}: speculative "
                                 "decoding is simulated on one pipeline stage for now")


EngineSpec = Union[JaxEngineSpec, SimEngineSpec]


@dataclasses.dataclass(frozen=True, kw_only=True)
class LimitsSpec:
    """The scheduler's limits and clock setting (resolved into a `SchedulerConfig` by
    `build.scheduler_config`)."""

    max_num_seqs: int = _knob(64, "Batch cap: most sequences in one step.")
    max_num_tokens: int = _knob(2048, "Most tokens in one step (the largest bucket).")
    num_kv_pages: Optional[int] = _knob(None, "KV pool size in pages (None: from kv_memory_gb, "
                                        "else what the GPU holds beside the weights; jax: a "
                                        "full batch of full contexts).")
    kv_memory_gb: Optional[float] = _knob(None, "KV pool size in GB (decimal) over the "
                                          "replica.")
    page_size: int = _knob(16, "Tokens per KV page.")
    max_model_len: Optional[int] = _knob(None, "Context limit (None: the model's).")
    token_buckets: Optional[tuple[int, ...]] = _knob(None, "Step token sizes to pad to, "
                                                     "ending at max_num_tokens (None: powers "
                                                     "of two).")
    bucket_ladder: Optional[str] = _knob(None, "fit:K: token_buckets are fitted to a simulator "
                                         "pilot run (runner.bucket_pilot), which fills them "
                                         "in; None: token_buckets as given.")
    log_step_requests: bool = _knob(False, "Write each step's request ids and token counts to "
                                    "steps.jsonl (request_ids, request_tokens).")
    kv_layout: str = _knob("paged", "KV pages: paged, or buddy: each reservation one "
                           "power-of-two block (the vLLM paper's Orca).", choices=KV_LAYOUTS)
    prefix_caching: str = _knob("policy", "Share the KV pages of common prompt prefixes "
                                "between requests: policy (each policy's own opt-in: vllm's "
                                "enable_prefix_caching knob, lpm; the others off), on (every "
                                "policy), off (none). The switch wins over a policy's opt-in; "
                                "--describe_policy says what each does with it.",
                                choices=PREFIX_CACHING_MODES)
    kv_pin_s: float = _knob(0.0, "Agent programs: seconds a finished call's KV pages stay "
                            "pinned on the device for its program's next call (0: freed at "
                            "once; inf: until that call is admitted); each policy decides "
                            "per call (Policy.kv_pin_s, whose default this is). With prefix "
                            "caching, on one replica (docs/programs.md).")
    count_host_time: bool = _knob(False, "Add the scheduler's measured host time (planning, "
                                  "packing, bookkeeping) to the virtual clock, as a real "
                                  "server pays it; runs are then no longer repeatable bit for "
                                  "bit.")
    spec_k: int = _knob(0, "Speculative decoding at a fixed k: each decode of a plan gets up "
                        "to this many draft tokens to verify (within its output, the context, "
                        "the token budget and the KV pages), for every policy that does not "
                        "choose them itself (smartspec does); 0: none. Needs an engine that "
                        "speculates (sim: --spec_acceptance/--draft_model; jax: --drafter). "
                        "docs/speculative.md.")
    no_progress_steps: int = _knob(10_000, "Fail the run after this many iterations in a row "
                                   "in which no request gains a computed token or finishes.")
    kv_host_gb: Optional[float] = _knob(None, "Host (DRAM) KV tier under the device's pool, in "
                                        "GB (decimal) over the replica: swapped-out requests "
                                        "and prefix pages the device evicts (None: no host "
                                        "tier). On the jax engine the pages are copied to host "
                                        "memory (pinned where the device offers it).")
    kv_host_pages: Optional[int] = _knob(None, "Host KV tier in pages (instead of "
                                         "kv_host_gb).")
    kv_disk_gb: Optional[float] = _knob(None, "Disk (or remote store) KV tier under the host "
                                        "tier, in GB: prefix pages the host evicts (None: no "
                                        "disk tier). Simulator only.")
    kv_disk_pages: Optional[int] = _knob(None, "Disk KV tier in pages (instead of "
                                         "kv_disk_gb).")
    kv_host_link: str = _knob("pcie4", "The link between the device and the host KV tier.",
                              presets=KV_LINK_NAMES)
    kv_disk_link: str = _knob("nvme", "The link between the host and the disk KV tier.",
                              presets=KV_LINK_NAMES)
    kv_cache_policy: str = _knob("lru", "The slower KV tiers' cache policy (which page to "
                                 "evict, write_back/write_through/drop, what to prefetch): "
                                 "lru, lfu, arc, prefetch-on-queue, or a plugin as "
                                 "path/to/file.py:Class.")
    kv_cache_policy_opts: str = _knob("", "The cache policy's knobs: key=value,... (e.g. "
                                      "placement=write_through).")

    def __post_init__(self) -> None:
        for field in ("max_num_seqs", "max_num_tokens", "num_kv_pages", "page_size",
                      "no_progress_steps"):
            _check_at_least("limits", field, getattr(self, field), 1)
        _check_at_least("limits", "max_model_len", self.max_model_len, 2)
        _check_at_least("limits", "spec_k", self.spec_k, 0)
        _check_choice("limits", "kv_layout", self.kv_layout, KV_LAYOUTS)
        _check_choice("limits", "prefix_caching", self.prefix_caching, PREFIX_CACHING_MODES)
        if not self.kv_pin_s >= 0:
            raise ValueError(f"limits.kv_pin_s must be >= 0 (seconds; inf: until the next "
                             f"call), got {self.kv_pin_s}")
        if self.prefix_caching == "on" and self.kv_layout == "buddy":
            raise ValueError("limits.prefix_caching 'on' shares single KV pages and kv_layout "
                             "'buddy' hands out whole blocks; choose one")
        _check_positive("limits", "kv_memory_gb", self.kv_memory_gb)
        for field in ("kv_host_gb", "kv_disk_gb"):
            _check_positive("limits", field, getattr(self, field))
        for field in ("kv_host_pages", "kv_disk_pages"):
            _check_at_least("limits", field, getattr(self, field), 1)
        for field in ("kv_host_link", "kv_disk_link"):
            try:
                get_kv_link(getattr(self, field))
            except ValueError as e:
                raise ValueError(f"limits.{field}: {e}") from None
        parse_options(self.kv_cache_policy_opts)  # fails early, naming the bad option
        buckets = self.token_buckets
        if buckets is not None and not (
                buckets and buckets[0] >= 1 and list(buckets) == sorted(set(buckets))
                and buckets[-1] == self.max_num_tokens):
            raise ValueError(f"limits.token_buckets must ascend from >= 1 to max_num_tokens "
                             f"({self.max_num_tokens}), got {buckets}")
        if self.bucket_ladder is not None:
            num_sizes = parse_fit_ladder(self.bucket_ladder)
            if num_sizes is None:
                raise ValueError(f"limits.bucket_ladder {self.bucket_ladder!r}: only fit:K is "
                                 "resolved at run time (give a rule's sizes as token_buckets)")
            most = max_fitted_sizes(self.max_num_tokens)
            if num_sizes > most:
                raise ValueError(f"limits.bucket_ladder {self.bucket_ladder!r}: at most {most} "
                                 f"sizes fit under max_num_tokens={self.max_num_tokens} "
                                 "(multiples of 8, and the budget)")


# A planner's settings besides its name and knobs (set only with a planner).
PLANNER_FIELDS = ("planner_interval_s", "min_replicas", "max_replicas", "replica_startup_s",
                  "replica_load_link")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClusterSpec:
    """Replicas behind a global router (`orca_jax.cluster`); one replica by default.

    With `num_prefill_replicas` and `num_decode_replicas` (both >= 1) the cluster
    is disaggregated (`orca_jax.cluster.disaggregated`): a prefill pool and a
    decode pool, each behind its own router, with each request's KV moved between
    them over `kv_link`. Each pool runs the run's policy unless
    `prefill_policy`/`decode_policy` name another (knobs: `*_policy_opts`, or
    the run's when the policy is the run's).
    """

    num_replicas: int = _knob(1, "Replicas behind a global router, each with its own "
                              "scheduler, KV pool and engine (jax: each its own KV cache, "
                              "in this process).")
    router: str = _knob("round_robin", "How num_replicas > 1 replicas share the arrivals: a "
                        "registered router, or a plugin as package.module:Class or "
                        "path/to/file.py:Class.", registry="router")
    router_opts: str = _knob("", "Router knobs: key=value,... (with num_replicas > 1).")
    num_prefill_replicas: int = _knob(0, "Disaggregated prefill and decode: replicas of the "
                                      "prefill pool (with the decode pool's; 0: colocated).")
    num_decode_replicas: int = _knob(0, "Disaggregated: replicas of the decode pool.")
    prefill_policy: Optional[str] = _knob(None, "Disaggregated: the prefill pool's policy "
                                          "(None: the run's).")
    decode_policy: Optional[str] = _knob(None, "Disaggregated: the decode pool's policy (None: "
                                         "the run's).")
    prefill_policy_opts: Optional[str] = _knob(None, "Disaggregated: the prefill policy's knobs "
                                               "(None: the run's, when it is the run's "
                                               "policy).")
    decode_policy_opts: Optional[str] = _knob(None, "Disaggregated: the decode policy's knobs.")
    prefill_router: str = _knob("least_outstanding", "Disaggregated: which prefill replica "
                                "takes each arrival (a router, as router).", registry="router")
    decode_router: str = _knob("least_outstanding", "Disaggregated: which decode replica takes "
                               "each prefilled request (a router, as router).",
                               registry="router")
    prefill_router_opts: str = _knob("", "Disaggregated: the prefill router's knobs: "
                                     "key=value,...")
    decode_router_opts: str = _knob("", "Disaggregated: the decode router's knobs: "
                                    "key=value,...")
    rebalancer: Optional[str] = _knob(None, "Live migration (num_replicas > 1): the "
                                      "rebalancer asked every rebalance_interval_s which "
                                      "requests to move (a registered rebalancer, or a plugin "
                                      "as router; None: requests stay where routed).",
                                      registry="rebalancer")
    rebalancer_opts: str = _knob("", "Rebalancer knobs: key=value,... (with rebalancer).")
    rebalance_interval_s: float = _knob(0.5, "Virtual seconds between the rebalancer's calls.")
    migration: str = _knob("live", "How a migration moves KV over kv_link: live (copy while the "
                           "source decodes, then stop for the last pages) or stop_and_copy.",
                           choices=MIGRATION_MODES)
    kv_link: str = _knob("ib200", "Disaggregated, and migrations: the KV link preset.",
                         presets=KV_LINK_NAMES)
    kv_link_max_concurrent: int = _knob(1, "Disaggregated: KV transfers in flight on one "
                                        "(prefill, decode) link at once; the rest queue.")
    planner: Optional[str] = _knob(None, "Elastic replicas (colocated, sim): the planner asked "
                                   "every planner_interval_s how many replicas to run, "
                                   "num_replicas at the start (a registered planner, or a "
                                   "plugin as router; None: num_replicas throughout). "
                                   "docs/clusters.md.", registry="planner")
    planner_opts: str = _knob("", "Planner knobs: key=value,... (with planner).")
    planner_interval_s: Optional[float] = _knob(None, "Virtual seconds between the planner's "
                                                "calls (None: 30).")
    min_replicas: Optional[int] = _knob(None, "With planner: the fewest replicas it may ask "
                                        "for (None: 1).")
    max_replicas: Optional[int] = _knob(None, "With planner: the most replicas it may ask for "
                                        "(None: num_replicas).")
    replica_startup_s: Optional[float] = _knob(None, "With planner: seconds from a replica's "
                                               "start to its first request (None: the "
                                               "model's weights over replica_load_link).")
    replica_load_link: Optional[str] = _knob(None, "With planner: the link a starting "
                                             "replica loads its weights over, one GPU's shard "
                                             "each (None: nvme).", presets=KV_LINK_NAMES)

    def __post_init__(self) -> None:
        _check_at_least("cluster", "num_replicas", self.num_replicas, 1)
        parse_options(self.router_opts)  # fails early, naming the bad option
        _check_at_least("cluster", "num_prefill_replicas", self.num_prefill_replicas, 0)
        _check_at_least("cluster", "num_decode_replicas", self.num_decode_replicas, 0)
        _check_at_least("cluster", "kv_link_max_concurrent", self.kv_link_max_concurrent, 1)
        if (self.num_prefill_replicas == 0) != (self.num_decode_replicas == 0):
            raise ValueError(f"cluster: a disaggregated cluster needs both pools; got "
                             f"num_prefill_replicas={self.num_prefill_replicas}, "
                             f"num_decode_replicas={self.num_decode_replicas}")
        if self.disaggregated and self.num_replicas > 1:
            raise ValueError(f"cluster: num_replicas={self.num_replicas} (colocated) and "
                             f"prefill/decode pools ({self.num_prefill_replicas}+"
                             f"{self.num_decode_replicas}) both set; choose one")
        get_kv_link(self.kv_link)  # fails early, naming the presets
        parse_options(self.rebalancer_opts)
        _check_choice("cluster", "migration", self.migration, MIGRATION_MODES)
        if self.rebalancer is not None:
            if self.disaggregated or self.num_replicas < 2:
                raise ValueError(f"cluster: rebalancer {self.rebalancer!r}: migration needs "
                                 "num_replicas >= 2 (colocated), got "
                                 + ("prefill/decode pools" if self.disaggregated
                                    else f"num_replicas={self.num_replicas}"))
            if not (math.isfinite(self.rebalance_interval_s) and self.rebalance_interval_s > 0):
                raise ValueError(f"cluster: rebalance_interval_s must be > 0 seconds, got "
                                 f"{self.rebalance_interval_s!r}")
        self._check_planner()
        for field in ("prefill_policy_opts", "decode_policy_opts", "prefill_router_opts",
                      "decode_router_opts"):
            if getattr(self, field) is not None:
                parse_options(getattr(self, field))

    @property
    def disaggregated(self) -> bool:
        """Whether the cluster has a prefill and a decode pool."""
        return self.num_prefill_replicas > 0

    @property
    def colocated_cluster(self) -> bool:
        """Whether the run is a colocated cluster (more than one replica, or a planner's)."""
        return self.num_replicas > 1 or self.planner is not None

    @property
    def replica_caps(self) -> tuple[int, int]:
        """A planner's `(min_replicas, max_replicas)`, defaults resolved."""
        return (1 if self.min_replicas is None else self.min_replicas,
                self.num_replicas if self.max_replicas is None else self.max_replicas)

    def _check_planner(self) -> None:
        """The planner's settings: each only with a planner, the caps around num_replicas."""
        settings = {"planner_opts": self.planner_opts or None,
                    **{field: getattr(self, field) for field in PLANNER_FIELDS}}
        given = [f"{field}={value}" for field, value in settings.items() if value is not None]
        if self.planner is None:
            if given:
                raise ValueError(f"cluster: {', '.join(given)} set without a planner; give "
                                 "planner=NAME (threshold, sla, or a plugin) or drop them")
            return
        parse_options(self.planner_opts)
        if self.disaggregated or self.rebalancer is not None:
            raise ValueError(f"cluster: planner {self.planner!r} scales colocated replicas "
                             "without a rebalancer; got "
                             + ("prefill/decode pools" if self.disaggregated
                                else f"rebalancer {self.rebalancer!r}"))
        _check_positive("cluster", "planner_interval_s", self.planner_interval_s)
        if self.replica_startup_s is not None and not (
                math.isfinite(self.replica_startup_s) and self.replica_startup_s >= 0):
            raise ValueError(f"cluster.replica_startup_s must be a finite number >= 0, got "
                             f"{self.replica_startup_s}")
        if self.replica_load_link is not None:
            get_kv_link(self.replica_load_link)
        low, high = self.replica_caps
        _check_at_least("cluster", "min_replicas", low, 1)
        if high < 2:
            raise ValueError(f"cluster: planner {self.planner!r} has nothing to scale with "
                             f"max_replicas={high}; give max_replicas >= 2")
        if not low <= self.num_replicas <= high:
            raise ValueError(f"cluster: planner {self.planner!r}: num_replicas="
                             f"{self.num_replicas} (the replicas at the start) must lie within "
                             f"min_replicas={low} and max_replicas={high}")


class _TakesFlatKeywords(type):
    """RunSpec's metaclass: a call with 0.1's flat keywords (`RunSpec(engine="sim",
    rate=8.0, max_batch_size=32)`) builds the nested spec they mean, with a
    DeprecationWarning (`orca_jax._legacy.nested_run_spec_keywords`), for one release.
    Every other call is the dataclass's own."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        own = {field.name for field in dataclasses.fields(cls)}
        # 0.1 named the engine and the arrival process by strings where parts go now.
        flat = not kwargs.keys() <= own or any(isinstance(kwargs.get(part), str)
                                               for part in ("engine", "workload"))
        if not flat:
            return super().__call__(*args, **kwargs)
        parts = {"workload": WorkloadSpec, "jax": JaxEngineSpec, "sim": SimEngineSpec,
                 "limits": LimitsSpec, "cluster": ClusterSpec}
        return super().__call__(*args, **_legacy.nested_run_spec_keywords(kwargs, parts))


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunSpec(metaclass=_TakesFlatKeywords):
    """Everything but the policy that defines a run (the flags, resolved)."""

    workload: WorkloadSpec = dataclasses.field(default_factory=WorkloadSpec)
    engine: EngineSpec = dataclasses.field(default_factory=SimEngineSpec)
    limits: LimitsSpec = dataclasses.field(default_factory=LimitsSpec)
    cluster: ClusterSpec = dataclasses.field(default_factory=ClusterSpec)
    seed: int = _knob(0, "Workload and sampling seed (and a real engine's random weights).")
    ttft_slo_s: Optional[float] = _knob(None, "TTFT SLO for goodput, seconds.")
    tpot_slo_s: Optional[float] = _knob(None, "TPOT SLO for goodput, seconds.")
    program_slo_s: Optional[float] = _knob(None, "Agent programs: completion-time SLO of a "
                                           "program (first call's arrival to last call's "
                                           "finish), seconds, for program_slo_attainment and "
                                           "program_goodput_per_s.")
    log_token_times: bool = _knob(False, "Keep every output token's time (16 bytes a token) "
                                  "and write each request's as token_times in requests.jsonl "
                                  "(run-clock seconds, as first_token_s), with its Andes QoE "
                                  "(qoe; summary.json: qoe_mean, qoe_p10, qoe_p50, "
                                  "qoe_attainment). docs/token_times_and_qoe.md.")
    qoe_ttft_s: float = _knob(1.0, "QoE (with log_token_times): the time to first token a "
                              "user expects, seconds (Andes's default).")
    qoe_tokens_per_s: float = _knob(4.8, "QoE (with log_token_times): the token delivery "
                                    "speed a user expects (reading speed), tokens/s "
                                    "(Andes's default).")

    def __post_init__(self) -> None:
        parts: dict[str, tuple[type, ...]] = {
            "workload": (WorkloadSpec,), "engine": (JaxEngineSpec, SimEngineSpec),
            "limits": (LimitsSpec,), "cluster": (ClusterSpec,)}
        for field, kinds in parts.items():
            value = getattr(self, field)
            if not isinstance(value, kinds):
                raise TypeError(f"RunSpec.{field} must be a "
                                f"{' or '.join(kind.__name__ for kind in kinds)}, got {value!r}")
        _check_at_least("run", "seed", self.seed, 0)
        _check_positive("run", "ttft_slo_s", self.ttft_slo_s)
        _check_positive("run", "program_slo_s", self.program_slo_s)
        _check_positive("run", "tpot_slo_s", self.tpot_slo_s)
        _check_positive("run", "qoe_ttft_s", self.qoe_ttft_s, " (seconds)")
        _check_positive("run", "qoe_tokens_per_s", self.qoe_tokens_per_s, " (tokens per second)")
        if self.limits.bucket_ladder is not None and self.engine.kind != "sim":
            raise ValueError(f"limits.bucket_ladder {self.limits.bucket_ladder!r} is fitted to a "
                             f"simulator pilot run, not for engine {self.engine.kind!r}: give "
                             "its sizes (a sim run's config.json holds them) or a rule")
        if (self.limits.bucket_ladder is not None and isinstance(self.engine, SimEngineSpec)
                and self.engine.cost_fit is not None):
            raise ValueError(f"limits.bucket_ladder {self.limits.bucket_ladder!r}: a cost fit "
                             f"({self.engine.cost_fit}) prices only its own buckets; give them")
        pp = getattr(self.engine, "pp", 1)
        if pp > 1 and (self.cluster.num_replicas > 1 or self.cluster.disaggregated):
            raise ValueError(f"engine.pp {pp}: pipeline stages serve one replica for now; give "
                             "--num_replicas=1 without prefill/decode pools")
        if pp > 1 and self.limits.count_host_time:
            raise ValueError(f"engine.pp {pp}: count_host_time puts measured host time on the "
                             "clock, which the pipeline's schedule does not take")
        check_caps(self)  # counts this machine cannot hold: refused before anything allocates
        if (self.limits.spec_k > 0 and isinstance(self.engine, JaxEngineSpec)
                and self.engine.drafter == "none"):
            raise ValueError(f"limits.spec_k {self.limits.spec_k}: the jax engine speculates "
                             "only with a drafter (--drafter=ngram, or --drafter=model with "
                             "--draft_model)")
        if speculates(self) and (self.cluster.num_replicas > 1 or self.cluster.disaggregated
                                 or pp > 1):
            raise ValueError("speculative decoding (--spec_k, --spec_acceptance, "
                             "--draft_model) runs on one replica of one pipeline stage for "
                             "now: give --num_replicas=1 without prefill/decode pools, --pp=1")
        tiered = any(getattr(self.limits, field) is not None for field in (
            "kv_host_gb", "kv_host_pages", "kv_disk_gb", "kv_disk_pages"))
        disk = any(getattr(self.limits, field) is not None
                   for field in ("kv_disk_gb", "kv_disk_pages"))
        if disk and not isinstance(self.engine, SimEngineSpec):
            raise ValueError("--kv_disk_gb/--kv_disk_pages: the jax engine holds a host KV tier "
                             "only (the disk tier is simulated only for now); drop the disk "
                             "tier or use --engine=sim")
        if tiered and pp > 1 and not isinstance(self.engine, SimEngineSpec):
            raise ValueError(f"engine.pp {pp}: a host KV tier (--kv_host_*) is not built for "
                             "the jax engine's pipeline stages; run one stage or --engine=sim")
        if tiered and (self.cluster.num_replicas > 1 or self.cluster.disaggregated):
            raise ValueError("KV tiers (--kv_host_*, --kv_disk_*) serve one replica for now: "
                             "give --num_replicas=1 without prefill/decode pools")
        if tiered:
            tier_configs(self.limits, *engine_kv_shape(self.engine))
        if self.limits.kv_pin_s and (self.cluster.num_replicas > 1
                                     or self.cluster.disaggregated):
            raise ValueError("--kv_pin_s pins a program's KV on one replica for now (a cluster "
                             "may route the next call elsewhere): give --num_replicas=1 "
                             "without prefill/decode pools")
        if (self.workload.arrival in ("programs", "program_trace")
                and self.cluster.disaggregated):
            raise ValueError(f"--workload={self.workload.arrival}: the disaggregated cluster "
                             "does not run agent programs yet; give --num_replicas instead "
                             "of prefill/decode pools")


def speculates(spec: "RunSpec") -> bool:
    """Whether the run's engine verifies draft tokens: the simulator's when `--spec_k` > 0,
    or `--spec_acceptance` or `--draft_model` given; the jax engine's with a `--drafter`."""
    engine = spec.engine
    if isinstance(engine, JaxEngineSpec):
        return engine.drafter != "none"
    return spec.limits.spec_k > 0 or engine.spec_acceptance is not None or (
        engine.draft_model is not None)
