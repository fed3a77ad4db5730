"""What defines a run, but for its policy: `RunSpec` and its parts.

A run is a workload (`WorkloadSpec`) served by an engine (`JaxEngineSpec` or
`SimEngineSpec`, in `engine_spec`) under the scheduler's limits (`LimitsSpec`), on one
replica or several (`ClusterSpec`, in `cluster_spec`), with a seed and SLOs. Each part is a frozen,
keyword-only dataclass that checks its own fields, and a setting that only one
engine reads lives only on that engine's part. The command-line flags resolve
to a `RunSpec` (`experiments/flags.py`); config.json's "run" section is
`dataclasses.asdict` of it, grouped the same way.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

from orca_jax import _legacy
from orca_jax.core.api.plugins import parse_options
from orca_jax.core.kv import KV_LAYOUTS
from orca_jax.core.kv.config import PREFIX_CACHING_MODES
from orca_jax.core.step.bucket_fit import (
    ladder_gap_error,
    max_fitted_sizes,
    parse_fit_ladder,
)
from orca_jax.runner.cluster_spec import KV_LINK_NAMES, PLANNER_FIELDS, ClusterSpec
from orca_jax.runner.engine_spec import (
    ATTENTIONS,
    CLOCKS,
    DTYPES,
    ENGINES,
    HARDWARE_NAMES,
    JAX_DRAFTERS,
    MODEL_PRESETS,
    EngineSpec,
    JaxEngineSpec,
    SimEngineSpec,
)
from orca_jax.runner.kv_tiers import check_host_tier_memory, engine_kv_shape, tier_configs
from orca_jax.runner.spec_caps import check_caps
from orca_jax.runner.spec_fields import (
    check_at_least,
    check_choice,
    check_positive,
    field_doc,
    knob,
    sampling_params,
    spec_field,
)
from orca_jax.specs.hardware import get_kv_link
from orca_jax.workloads.program_defaults import COPILOT_DEFAULTS, PROGRAM_SHAPES
from orca_jax.workloads.synthetic import parse_length_spec

# Re-exported: the parts and names every caller imports from here.
__all__ = ["ATTENTIONS", "CLOCKS", "COMMAND_DEFAULTS", "DTYPES", "ENGINES", "HARDWARE_NAMES",
           "JAX_DRAFTERS", "KV_LINK_NAMES", "LENGTH_COLUMNS", "MODEL_PRESETS", "PLANNER_FIELDS",
           "WORKLOADS", "ClusterSpec", "EngineSpec", "JaxEngineSpec", "LimitsSpec", "RunSpec",
           "SimEngineSpec", "WorkloadSpec", "field_doc", "sampling_params", "speculates"]

WORKLOADS = ("poisson", "gamma", "burst", "trace", "shared_prefix", "conversation", "programs",
             "program_trace")
# The prefix workloads' length specs -> the column an `empirical:PATH` spec of each reads.
LENGTH_COLUMNS = {"prefix_len": "prompt_len", "suffix_len": "prompt_len",
                  "num_turns": "num_turns", "think_time_ms": "think_time_ms",
                  **{f"program_{name}": "prompt_len" for name in COPILOT_DEFAULTS}}

# The commands' defaults (`experiments/flags.py`) of the settings whose default depends on
# the engine: a small workload the tiny real model serves in seconds on a laptop CPU, and a
# GPU-scale one for the simulator. A field's own default is the library's (`RunSpec()` in a
# script); the sim column differs from it only in num_requests (1000, not 200) and rate
# (32, not 4): a command's simulation is sized like a GPU's load, a script's for a quick
# check. A flag of one of these fields defaults to None (the engine's column) and its help
# names both columns.
COMMAND_DEFAULTS: dict[str, dict[str, object]] = {
    # The main job's (`compare`, static vs orca): requests queue (160 req/s, past either
    # policy's capacity) and output lengths vary as a chat's do (lognormal, mean 40, a long
    # tail), so static's request-level batches hold finished requests' seats until their
    # longest member ends: what continuous batching is for.
    "jax": dict(model="tiny", num_requests=64, rate=160.0, prompt_len="uniform:16:128",
                output_len="lognormal:40:1.0", max_num_seqs=16, max_num_tokens=256,
                prefix_len="fixed:256", suffix_len="uniform:16:64", num_turns="uniform:1:6"),
    "sim": dict(model="llama3-8b", num_requests=1000, rate=32.0, prompt_len="uniform:32:512",
                output_len="uniform:1:128", max_num_seqs=64, max_num_tokens=2048,
                prefix_len="fixed:1024", suffix_len="uniform:16:256", num_turns="uniform:1:8"),
}



@dataclasses.dataclass(frozen=True, kw_only=True)
class WorkloadSpec:
    """The requests: an arrival process with length distributions, a trace file, or a
    workload whose prompts share prefixes (`workloads.prefix_workloads`)."""

    arrival: str = knob("poisson", "Arrival process, a trace file, or prompts that share "
                        "prefixes: shared_prefix (a few system prompts, Zipf popularity, and "
                        "private suffixes) or conversation (multi-turn chats whose turns hold "
                        "the conversation so far); programs (agent sessions of LLM calls "
                        "with tool pauses, --program_*) or program_trace (--trace: a "
                        "program JSONL, ours or the Copilot agent trace's; "
                        "docs/programs.md).", choices=WORKLOADS)
    trace: Optional[str] = knob(None, "Trace file (JSONL or CSV) of arrival 'trace'; its "
                                "columns/fields (ours, Vidur's, Mooncake's), units and what "
                                "may be left out: docs/traces.md. Without arrival times it is "
                                "an offline batch (all at time 0, in file order).")
    trace_block_size: Optional[int] = knob(None, "Tokens per block of a trace's hash_ids "
                                           "where the file gives no block_size (None: "
                                           "Mooncake's 512); each block maps onto whole KV "
                                           "pages of the run's page_size (docs/traces.md).")
    trace_time_scale: float = knob(1.0, "Multiplies the trace's arrival times (and "
                                   "deadlines): 0.5 replays it at twice its request rate.")
    trace_repeat: int = knob(1, "Plays the trace (its first num_requests) this many times "
                             "back to back, each copy one period later (its last arrival "
                             "plus the mean gap), after trace_time_scale: a long run from a "
                             "short trace (ids 0..N*trace_repeat-1).")
    num_requests: Optional[int] = knob(200, "Requests in the workload (the first N of a "
                                       "trace, None: the whole trace; of conversation: "
                                       "turns).")
    rate: float = knob(4.0, "Arrival rate in requests/s (poisson, gamma, shared_prefix; "
                       "conversation: conversations/s; programs: programs/s). Given with "
                       "a trace (trace, program_trace): the trace's arrival times rescaled "
                       "so its mean rate (N-1 gaps over its span; of program starts) is "
                       "this, as each point of sweep --rates does; unset, the file's own "
                       "times (trace_time_scale stretches them instead).")
    trace_at_rate: bool = knob(False, "Whether a trace's arrivals are rescaled to rate "
                               "(set by giving --rate with a trace).")
    cv: float = knob(1.0, "Coefficient of variation of gamma inter-arrival gaps.")
    prompt_len: str = knob("uniform:32:512", "Prompt length distribution: fixed:N, "
                           "uniform:LO:HI, lognormal:MEAN:SIGMA, zipf:A:MAX, "
                           "empirical:PATH[:COLUMN].")
    output_len: Optional[str] = knob("uniform:1:128", "Output length distribution (as "
                                     "prompt_len); of a trace: only for a trace without "
                                     "output lengths (its own win), drawn per request (None: "
                                     "such a trace is an error).")
    num_prefixes: int = knob(8, "shared_prefix: the number of system prompts.")
    prefix_len: str = knob("fixed:1024", "shared_prefix: each system prompt's length (as "
                           "prompt_len).")
    prefix_zipf: float = knob(1.1, "shared_prefix: the popularity exponent; system prompt k "
                              "(from 0) is picked with weight (k + 1)**-prefix_zipf (0: "
                              "uniform).")
    suffix_len: str = knob("uniform:16:256", "The private part of each prompt (as "
                           "prompt_len): the suffix after the system prompt (shared_prefix), "
                           "or each turn's new message (conversation).")
    num_turns: str = knob("uniform:1:8", "conversation: turns per conversation (as "
                          "prompt_len).")
    think_time_ms: str = knob("lognormal:10000:1", "conversation: milliseconds from a turn's "
                              "arrival to the next turn's (as prompt_len).")
    program_shape: str = knob("copilot", "programs: copilot (sequential sessions of turns "
                              "of calls) or parallel (a planning call fans out to "
                              "--program_fanout threads that join).", choices=PROGRAM_SHAPES)
    program_turns: str = knob(COPILOT_DEFAULTS["turns"], "programs: turns per program "
                              "(parallel: fan-out stages); the default's mean is the Copilot "
                              "agent trace's 3.95 (as prompt_len).")
    program_calls_per_turn: str = knob(COPILOT_DEFAULTS["calls_per_turn"], "programs, "
                                       "copilot: LLM calls per turn; the default's mean is "
                                       "the Copilot agent trace's 7.83 (as prompt_len).")
    program_first_prompt: str = knob(COPILOT_DEFAULTS["first_prompt"], "programs: the "
                                     "first call's prompt tokens (as prompt_len).")
    program_prompt_growth: str = knob(COPILOT_DEFAULTS["prompt_growth"], "programs: tokens "
                                      "a tool's output adds to the context before the next "
                                      "call (as prompt_len).")
    program_completion_len: str = knob(COPILOT_DEFAULTS["completion_len"], "programs: each "
                                       "call's answer tokens (the defaults give prompts "
                                       "about 120 times the completions, as the Copilot "
                                       "trace's 128; as prompt_len).")
    program_tool_ms: str = knob(COPILOT_DEFAULTS["tool_ms"], "programs: the tool pause in "
                                "milliseconds before each call but a turn's first (as "
                                "prompt_len).")
    program_turn_gap_ms: str = knob(COPILOT_DEFAULTS["turn_gap_ms"], "programs: the user's "
                                    "pause in milliseconds before a turn's first call (as "
                                    "prompt_len).")
    program_fanout: int = knob(4, "programs, parallel: thread calls per stage.")
    program_count: Optional[int] = knob(None, "programs: generate exactly this many whole "
                                        "programs, all their calls (--num_requests is then "
                                        "not read), so each rate of a sweep runs the same "
                                        "programs, only started faster; None: the first "
                                        "--num_requests calls in planned order, which "
                                        "programs those are varying with the rate.")

    def __post_init__(self) -> None:
        check_choice("workload", "arrival", self.arrival, WORKLOADS)
        for field, column in LENGTH_COLUMNS.items():
            try:
                parse_length_spec(getattr(self, field), default_column=column)
            except (ValueError, OSError) as e:
                raise ValueError(f"workload.{field}: {e}") from None
        check_at_least("workload", "num_prefixes", self.num_prefixes, 1)
        if not (math.isfinite(self.prefix_zipf) and self.prefix_zipf >= 0):
            raise ValueError(f"workload.prefix_zipf must be a finite number >= 0, got "
                             f"{self.prefix_zipf}")
        if self.arrival in ("trace", "program_trace") and not self.trace:
            raise ValueError(f"workload.arrival {self.arrival!r} needs a trace file "
                             "(workload.trace, --trace)")
        check_at_least("workload", "program_fanout", self.program_fanout, 1)
        check_at_least("workload", "program_count", self.program_count, 1)
        if self.output_len is None and self.arrival != "trace":
            raise ValueError(f"workload.output_len: None is only for a trace (which then "
                             f"gives its own output lengths); workload {self.arrival!r} needs "
                             f"a distribution")
        check_at_least("workload", "trace_block_size", self.trace_block_size, 1)
        check_at_least("workload", "num_requests", self.num_requests, 1)
        check_positive("workload", "rate", self.rate, " (requests per second)")
        check_positive("workload", "cv", self.cv)
        check_at_least("workload", "trace_repeat", self.trace_repeat, 1)
        if self.trace_repeat > 1 and self.arrival != "trace":
            raise ValueError(f"workload.trace_repeat={self.trace_repeat} repeats a trace; "
                             f"arrival is {self.arrival!r}, not 'trace'")
        if self.trace_at_rate and self.arrival not in ("trace", "program_trace"):
            raise ValueError(f"workload.trace_at_rate rescales a trace to the rate; arrival "
                             f"is {self.arrival!r}, whose arrivals follow the rate already")
        if self.trace_at_rate and self.trace_time_scale != 1.0:
            raise ValueError(f"workload.trace_time_scale={self.trace_time_scale:g} and a "
                             f"rate of {self.rate:g}/s both set the trace's pace; give one "
                             "(--rate: a mean rate, --trace_time_scale: a stretch)")
        if not (math.isfinite(self.trace_time_scale) and self.trace_time_scale > 0):
            raise ValueError(f"workload.trace_time_scale must be a finite number > 0, got "
                             f"{self.trace_time_scale}")




@dataclasses.dataclass(frozen=True, kw_only=True)
class LimitsSpec:
    """The scheduler's limits and clock setting (resolved into a `SchedulerConfig` by
    `build.scheduler_config`)."""

    max_num_seqs: int = knob(64, "Batch cap: most sequences in one step.")
    max_num_tokens: int = knob(2048, "Most tokens in one step (the largest bucket).")
    num_kv_pages: Optional[int] = knob(None, "KV pool size in pages (None: from kv_memory_gb, "
                                       "else what the GPU holds beside the weights; jax: a "
                                       "full batch of full contexts).")
    kv_memory_gb: Optional[float] = knob(None, "KV pool size in GB (decimal) over the "
                                         "replica.")
    page_size: int = knob(16, "Tokens per KV page.")
    max_model_len: Optional[int] = knob(None, "Context limit (None: the model's).")
    token_buckets: Optional[tuple[int, ...]] = knob(None, "Step token sizes to pad to, "
                                                    "ending at max_num_tokens, none over 2x "
                                                    "the one below on the simulator (None: "
                                                    "powers of two).")
    bucket_ladder: Optional[str] = knob(None, "fit:K: token_buckets are fitted to simulator "
                                        "pilot runs of the policies that share them "
                                        "(runner.bucket_pilot), which fill them in; None: "
                                        "token_buckets as given.")
    log_step_requests: bool = knob(False, "Write each step's request ids and token counts to "
                                   "steps.jsonl (request_ids, request_tokens).")
    kv_layout: str = knob("paged", "KV pages: paged, or buddy: each reservation one "
                          "power-of-two block (the vLLM paper's Orca).", choices=KV_LAYOUTS)
    prefix_caching: str = knob("policy", "Share the KV pages of common prompt prefixes "
                               "between requests: policy (each policy's own opt-in: vllm's "
                               "enable_prefix_caching knob, lpm; the others off), on (every "
                               "policy), off (none). The switch wins over a policy's opt-in; "
                               "--describe_policy says what each does with it.",
                               choices=PREFIX_CACHING_MODES)
    kv_pin_s: float = knob(0.0, "Agent programs: seconds a finished call's KV pages stay "
                           "pinned on the device for its program's next call (0: freed at "
                           "once; inf: until that call is admitted); each policy decides "
                           "per call (Policy.kv_pin_s, whose default this is). With prefix "
                           "caching, on one replica (docs/programs.md).")
    count_host_time: bool = knob(False, "Add the scheduler's measured host time (planning, "
                                 "packing, bookkeeping) to the virtual clock, as a real "
                                 "server pays it; runs are then no longer repeatable bit for "
                                 "bit.")
    spec_k: int = knob(0, "Speculative decoding at a fixed k: each decode of a plan gets up "
                       "to this many draft tokens to verify (within its output, the context, "
                       "the token budget and the KV pages), for every policy that does not "
                       "choose them itself (smartspec does); 0: none. Needs an engine that "
                       "speculates (sim: --spec_acceptance/--draft_model; jax: --drafter). "
                       "docs/speculative.md.")
    no_progress_steps: int = knob(10_000, "Fail the run after this many iterations in a row "
                                  "in which no request gains a computed token or finishes.")
    kv_host_gb: Optional[float] = knob(None, "Host (DRAM) KV tier under the device's pool, in "
                                       "GB (decimal) over the replica: swapped-out requests "
                                       "and prefix pages the device evicts (None: no host "
                                       "tier). On the jax engine the pages are copied to host "
                                       "memory (pinned where the device offers it).")
    kv_host_pages: Optional[int] = knob(None, "Host KV tier in pages (instead of "
                                        "kv_host_gb).")
    kv_disk_gb: Optional[float] = knob(None, "Disk (or remote store) KV tier under the host "
                                       "tier, in GB: prefix pages the host evicts (None: no "
                                       "disk tier). Simulator only.")
    kv_disk_pages: Optional[int] = knob(None, "Disk KV tier in pages (instead of "
                                        "kv_disk_gb).")
    kv_host_link: str = knob("pcie4", "The link between the device and the host KV tier.",
                             presets=KV_LINK_NAMES)
    kv_disk_link: str = knob("nvme", "The link between the host and the disk KV tier.",
                             presets=KV_LINK_NAMES)
    kv_cache_policy: str = knob("lru", "The slower KV tiers' cache policy (which page to "
                                "evict, write_back/write_through/drop, what to prefetch): "
                                "lru, lfu, arc, prefetch-on-queue, or a plugin as "
                                "path/to/file.py:Class.")
    kv_cache_policy_opts: str = knob("", "The cache policy's knobs: key=value,... (e.g. "
                                     "placement=write_through).")

    def __post_init__(self) -> None:
        for field in ("max_num_seqs", "max_num_tokens", "num_kv_pages", "page_size",
                      "no_progress_steps"):
            check_at_least("limits", field, getattr(self, field), 1)
        check_at_least("limits", "max_model_len", self.max_model_len, 2)
        check_at_least("limits", "spec_k", self.spec_k, 0)
        check_choice("limits", "kv_layout", self.kv_layout, KV_LAYOUTS)
        check_choice("limits", "prefix_caching", self.prefix_caching, PREFIX_CACHING_MODES)
        if not self.kv_pin_s >= 0:
            raise ValueError(f"limits.kv_pin_s must be >= 0 (seconds; inf: until the next "
                             f"call), got {self.kv_pin_s}")
        if self.prefix_caching == "on" and self.kv_layout == "buddy":
            raise ValueError("limits.prefix_caching 'on' shares single KV pages and kv_layout "
                             "'buddy' hands out whole blocks; choose one")
        check_positive("limits", "kv_memory_gb", self.kv_memory_gb)
        for field in ("kv_host_gb", "kv_disk_gb"):
            check_positive("limits", field, getattr(self, field))
        for field in ("kv_host_pages", "kv_disk_pages"):
            check_at_least("limits", field, getattr(self, field), 1)
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



def gapless_ladder(engine: EngineSpec) -> bool:
    """Whether the engine's ladder must have no adjacent sizes more than 2x apart
    (`bucket_fit.MAX_SIZE_RATIO`): the simulator's, but under a cost fit. On the jax engine
    each size is a compile and its padding a measured cost, and a cost fit prices only the
    sizes it was calibrated on; on the simulator a gap is a modelling choice that charges
    the policies whose steps fall in it (issue 50)."""
    return isinstance(engine, SimEngineSpec) and engine.cost_fit is None


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
    seed: int = knob(0, "Workload and sampling seed (and a real engine's random weights).")
    ttft_slo_s: Optional[float] = knob(None, "TTFT SLO for goodput, seconds.")
    tpot_slo_s: Optional[float] = knob(None, "TPOT SLO for goodput, seconds.")
    program_slo_s: Optional[float] = knob(None, "Agent programs: completion-time SLO of a "
                                          "program (first call's arrival to last call's "
                                          "finish), seconds, for program_slo_attainment and "
                                          "program_goodput_per_s.")
    log_token_times: bool = knob(False, "Keep every output token's time (16 bytes a token) "
                                 "and write each request's as token_times in requests.jsonl "
                                 "(run-clock seconds, as first_token_s), with its Andes QoE "
                                 "(qoe; summary.json: qoe_mean, qoe_p10, qoe_p50, "
                                 "qoe_attainment). docs/token_times_and_qoe.md.")
    qoe_ttft_s: float = knob(1.0, "QoE (with log_token_times): the time to first token a "
                             "user expects, seconds (Andes's default).")
    qoe_tokens_per_s: float = knob(4.8, "QoE (with log_token_times): the token delivery "
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
        check_at_least("run", "seed", self.seed, 0)
        check_positive("run", "ttft_slo_s", self.ttft_slo_s)
        check_positive("run", "program_slo_s", self.program_slo_s)
        check_positive("run", "tpot_slo_s", self.tpot_slo_s)
        check_positive("run", "qoe_ttft_s", self.qoe_ttft_s, " (seconds)")
        check_positive("run", "qoe_tokens_per_s", self.qoe_tokens_per_s, " (tokens per second)")
        if self.limits.bucket_ladder is not None and self.engine.kind != "sim":
            raise ValueError(f"limits.bucket_ladder {self.limits.bucket_ladder!r} is fitted to a "
                             f"simulator pilot run, not for engine {self.engine.kind!r}: give "
                             "its sizes (a sim run's config.json holds them) or a rule")
        gap = (ladder_gap_error(self.limits.token_buckets) if self.limits.token_buckets
               and gapless_ladder(self.engine) else None)
        if gap is not None:
            raise ValueError(f"limits.token_buckets {self.limits.token_buckets}: {gap} on the "
                             "simulator")
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
            tiers = tier_configs(self.limits, *engine_kv_shape(self.engine))
            if isinstance(self.engine, JaxEngineSpec):
                check_host_tier_memory(tiers, self.engine.tp)
        else:
            _check_tier_settings_unused(self.limits)
        if self.limits.kv_pin_s and self.workload.arrival not in ("programs", "program_trace"):
            raise ValueError(f"limits.kv_pin_s {self.limits.kv_pin_s:g} pins an agent program's "
                             "KV between its calls; workload "
                             f"{self.workload.arrival!r} has no programs (--workload=programs "
                             "or program_trace), so nothing would be pinned")
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


# The settings of the slower KV tiers that only a tier reads, with their defaults.
TIER_SETTINGS = ("kv_cache_policy", "kv_cache_policy_opts", "kv_host_link", "kv_disk_link")


def _check_tier_settings_unused(limits: LimitsSpec) -> None:
    """Refuses a tier setting changed from its default on a run without slower tiers: a
    cache policy with no tier to evict from, a link to no tier, would do nothing."""
    for name in TIER_SETTINGS:
        value = getattr(limits, name)
        if value != spec_field(LimitsSpec, name).default:
            raise ValueError(f"limits.{name} {value!r} is a setting of the slower KV tiers, "
                             "and the run has none (the device pool evicts prefix pages LRU): "
                             "give --kv_host_gb or --kv_host_pages, or drop it")


def speculates(spec: "RunSpec") -> bool:
    """Whether the run's engine verifies draft tokens: the simulator's when `--spec_k` > 0,
    or `--spec_acceptance` or `--draft_model` given; the jax engine's with a `--drafter`."""
    engine = spec.engine
    if isinstance(engine, JaxEngineSpec):
        return engine.drafter != "none"
    return spec.limits.spec_k > 0 or engine.spec_acceptance is not None or (
        engine.draft_model is not None)
