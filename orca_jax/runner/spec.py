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
from typing import Optional, Union

from orca_jax.core.bucket_fit import max_fitted_sizes, parse_fit_ladder
from orca_jax.core.kv import KV_LAYOUTS
from orca_jax.core.plugins import parse_options
from orca_jax.specs.hardware import get_hardware, get_kv_link
from orca_jax.specs.model_config import get_model_config
from orca_jax.workloads.synthetic import parse_length_spec

WORKLOADS = ("poisson", "gamma", "burst", "trace", "shared_prefix", "conversation")
ENGINES = ("sim", "jax")
DTYPES = ("float32", "bfloat16")
ATTENTIONS = ("auto", "reference", "bucketed", "pallas", "pallas_interpret")
CLOCKS = ("profiled", "wall")
# The prefix workloads' length specs -> the column an `empirical:PATH` spec of each reads.
LENGTH_COLUMNS = {"prefix_len": "prompt_len", "suffix_len": "prompt_len",
                  "num_turns": "num_turns", "think_time_ms": "think_time_ms"}


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

    # poisson, gamma, burst (all at t=0), trace, shared_prefix (system prompts and private
    # suffixes, Poisson) or conversation (multi-turn chats, Poisson starts)
    arrival: str = "poisson"
    trace: Optional[str] = None  # the trace file (JSONL or CSV) of arrival "trace"
    trace_time_scale: float = 1.0  # multiplies a trace's arrival times (0.5: twice the rate)
    # Of a trace: its first N (None: the whole trace); of conversation: turns.
    num_requests: Optional[int] = 200
    rate: float = 4.0  # requests/s (poisson, gamma, shared_prefix); conversations/s
    cv: float = 1.0  # coefficient of variation of gamma inter-arrival gaps
    prompt_len: str = "uniform:32:512"  # a length spec (`workloads.synthetic.parse_length_spec`)
    output_len: str = "uniform:1:128"
    num_prefixes: int = 8  # shared_prefix: the system prompts
    prefix_len: str = "fixed:1024"  # shared_prefix: each system prompt's length
    prefix_zipf: float = 1.1  # shared_prefix: system prompt k's weight is (k + 1)**-prefix_zipf
    # The private tokens of each prompt: after the system prompt (shared_prefix), or a
    # turn's new message (conversation).
    suffix_len: str = "uniform:16:256"
    num_turns: str = "uniform:1:8"  # conversation: turns per conversation
    think_time_ms: str = "lognormal:10000:1"  # conversation: from a turn's arrival to the next

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
        if self.arrival == "trace" and not self.trace:
            raise ValueError("workload.arrival 'trace' needs a trace file (workload.trace, "
                             "--trace)")
        _check_at_least("workload", "num_requests", self.num_requests, 1)
        _check_positive("workload", "rate", self.rate, " (requests per second)")
        _check_positive("workload", "cv", self.cv)
        if not (math.isfinite(self.trace_time_scale) and self.trace_time_scale > 0):
            raise ValueError(f"workload.trace_time_scale must be a finite number > 0, got "
                             f"{self.trace_time_scale}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class JaxEngineSpec:
    """The real engine: the Flax model on this machine's devices."""

    kind: str = dataclasses.field(default="jax", init=False)  # names the engine in config.json
    model: str = "llama3-8b"  # a preset, or the name of the checkpoint's model
    checkpoint: Optional[str] = None  # an orbax directory or a LLaMA-format folder
    dtype: str = "float32"  # parameters, activations and KV cache
    attention: str = "auto"  # auto (pallas on GPU, bucketed elsewhere), reference, bucketed, pallas
    sampling: str = "greedy"  # greedy, or temperature:T[:top_k[:top_p]]
    clock: str = "profiled"  # profiled (a fit of what each step holds, measured at warm-up) or wall
    tp: int = 1  # devices the step is split over
    # The profiled clock's per-bucket table: read if the file exists, else measured and
    # written there (default: measured, and written beside the results).
    profile_table: Optional[str] = None
    # Plan and pack step N+1 while step N runs (the decodes fed N's tokens on the device);
    # the same plans, steps and tokens as without (SchedulerConfig.overlap).
    overlap: bool = True

    def __post_init__(self) -> None:
        _check_choice("engine", "dtype", self.dtype, DTYPES)
        _check_choice("engine", "attention", self.attention, ATTENTIONS)
        _check_choice("engine", "clock", self.clock, CLOCKS)
        sampling_params(self.sampling)  # fails early, naming the value
        _check_at_least("engine", "tp", self.tp, 1)
        if self.profile_table is not None and self.clock != "profiled":
            raise ValueError(f"engine.profile_table ({self.profile_table!r}) is the profiled "
                             f"clock's table; engine.clock is {self.clock!r}")
        if not (self.checkpoint and os.path.isfile(os.path.join(self.checkpoint, "config.json"))):
            get_model_config(self.model)  # a preset gives the shapes: fails early, naming them


@dataclasses.dataclass(frozen=True, kw_only=True)
class SimEngineSpec:
    """The simulator: a cost model of the model on a hardware preset."""

    kind: str = dataclasses.field(default="sim", init=False)  # names the engine in config.json
    model: str = "llama3-8b"  # a model preset
    hardware: str = "a100"  # a hardware preset
    tp: int = 1  # the replica's tensor-parallel degree
    step_time_ms: Optional[float] = None  # a fixed step time instead of the roofline
    cost_fit: Optional[str] = None  # a cost fit JSON written by experiments.calibrate

    def __post_init__(self) -> None:
        get_model_config(self.model)  # fails early, naming the presets
        get_hardware(self.hardware)
        _check_at_least("engine", "tp", self.tp, 1)
        _check_positive("engine", "step_time_ms", self.step_time_ms)
        if self.cost_fit is not None and self.step_time_ms is not None:
            raise ValueError(f"engine.cost_fit ({self.cost_fit!r}) and engine.step_time_ms "
                             f"({self.step_time_ms}) both set; choose one step-time model")


EngineSpec = Union[JaxEngineSpec, SimEngineSpec]


@dataclasses.dataclass(frozen=True, kw_only=True)
class LimitsSpec:
    """The scheduler's limits and clock setting (resolved into a `SchedulerConfig` by
    `build.scheduler_config`)."""

    max_num_seqs: int = 64  # most sequences in one step (the batch cap)
    max_num_tokens: int = 2048  # most tokens in one step (the largest bucket)
    num_kv_pages: Optional[int] = None  # the KV pool in pages (default: kv_memory_gb, the GPU)
    kv_memory_gb: Optional[float] = None  # the KV pool in GB (decimal) over the replica
    page_size: int = 16  # tokens per KV page
    max_model_len: Optional[int] = None  # the context limit (default: the model's context)
    token_buckets: Optional[tuple[int, ...]] = None  # step sizes (default: powers of two)
    # `fit:K`: token_buckets are fitted to a simulator pilot run (`runner.bucket_pilot`),
    # which fills them in; None: token_buckets as given.
    bucket_ladder: Optional[str] = None
    log_step_requests: bool = False  # steps.jsonl: each step's request ids and tokens
    # paged, or buddy: each reservation one power-of-two block (the vLLM paper's Orca)
    kv_layout: str = "paged"
    # Add the scheduler's measured host time to the virtual clock (no longer repeatable).
    count_host_time: bool = False
    # Fail the run (no_progress) after this many iterations in a row without progress.
    no_progress_steps: int = 10_000

    def __post_init__(self) -> None:
        for field in ("max_num_seqs", "max_num_tokens", "num_kv_pages", "page_size",
                      "no_progress_steps"):
            _check_at_least("limits", field, getattr(self, field), 1)
        _check_at_least("limits", "max_model_len", self.max_model_len, 2)
        _check_choice("limits", "kv_layout", self.kv_layout, KV_LAYOUTS)
        _check_positive("limits", "kv_memory_gb", self.kv_memory_gb)
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

    num_replicas: int = 1  # sim only: each with its own scheduler, KV pool and engine
    router: str = "round_robin"  # a registered router, module:Class or file.py:Class
    router_opts: str = ""  # the router's knobs, key=value,...
    num_prefill_replicas: int = 0  # disaggregated: the prefill pool (0: colocated)
    num_decode_replicas: int = 0  # disaggregated: the decode pool
    prefill_policy: Optional[str] = None  # default: the run's policy
    decode_policy: Optional[str] = None
    prefill_policy_opts: Optional[str] = None  # default: the run's options, for its policy
    decode_policy_opts: Optional[str] = None
    prefill_router: str = "least_outstanding"
    decode_router: str = "least_outstanding"
    kv_link: str = "ib200"  # a KV link preset (orca_jax.specs.hardware.KV_LINK_PRESETS)
    kv_link_max_concurrent: int = 1  # transfers in flight on one link at once

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
        for field in ("prefill_policy_opts", "decode_policy_opts"):
            if getattr(self, field) is not None:
                parse_options(getattr(self, field))

    @property
    def disaggregated(self) -> bool:
        """Whether the cluster has a prefill and a decode pool."""
        return self.num_prefill_replicas > 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunSpec:
    """Everything but the policy that defines a run (the flags, resolved)."""

    workload: WorkloadSpec = dataclasses.field(default_factory=WorkloadSpec)
    engine: EngineSpec = dataclasses.field(default_factory=SimEngineSpec)
    limits: LimitsSpec = dataclasses.field(default_factory=LimitsSpec)
    cluster: ClusterSpec = dataclasses.field(default_factory=ClusterSpec)
    seed: int = 0  # the workload's and the sampling's seed (and a real engine's weights)
    ttft_slo_s: Optional[float] = None  # for goodput
    tpot_slo_s: Optional[float] = None

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
        _check_positive("run", "tpot_slo_s", self.tpot_slo_s)
        if self.limits.bucket_ladder is not None and self.engine.kind != "sim":
            raise ValueError(f"limits.bucket_ladder {self.limits.bucket_ladder!r} is fitted to a "
                             f"simulator pilot run, not for engine {self.engine.kind!r}: give "
                             "its sizes (a sim run's config.json holds them) or a rule")
        if (self.limits.bucket_ladder is not None and isinstance(self.engine, SimEngineSpec)
                and self.engine.cost_fit is not None):
            raise ValueError(f"limits.bucket_ladder {self.limits.bucket_ladder!r}: a cost fit "
                             f"({self.engine.cost_fit}) prices only its own buckets; give them")
        if self.cluster.num_replicas > 1 and self.engine.kind != "sim":
            raise ValueError(f"num_replicas={self.cluster.num_replicas} needs engine 'sim' (the "
                             f"real engine runs one replica per process), got "
                             f"{self.engine.kind!r}")

