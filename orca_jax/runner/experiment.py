"""One experiment run from its plumbing: workload, engine, limits, policy → results.

`RunSpec` is what the command-line flags resolve to (the experiment entry
points only parse flags into it). `run_policy` builds the workload, the engine
and the scheduler, runs one policy, writes the results and returns the summary.
Comparing policies is calling it once per policy with the same spec: the same
seed gives the same workload, and the same bucket set gives the same steps.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
from typing import Any, Mapping, Optional

from orca_jax.sim import cost_model
from orca_jax.cluster.replicas import Cluster
from orca_jax.core.engine_api import Engine
from orca_jax.core.packing import pages_per_seq_for
from orca_jax.core.json_files import to_json_value
from orca_jax.core.policy import make_policy, parse_options
from orca_jax.core.request import Request
from orca_jax.core.run_result import RunResult
from orca_jax.results.summary import summarize, write_results
from orca_jax.core.scheduler import Scheduler, SchedulerConfig
from orca_jax.sim.engine import SimEngine
from orca_jax.specs.hardware import get_hardware
from orca_jax.specs.memory import num_kv_pages_for_memory
from orca_jax.specs.model_config import ModelConfig, from_hf_config, get_model_config
from orca_jax.workloads.traces import load_trace
from orca_jax.workloads.synthetic import synthetic_workload, with_prompt_tokens

WORKLOADS = ("poisson", "gamma", "burst", "trace")
ENGINES = ("sim", "jax")
DTYPES = ("float32", "bfloat16")
ATTENTIONS = ("auto", "reference", "pallas", "pallas_interpret")


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


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunSpec:
    """Everything but the policy that defines a run (the flags, resolved)."""

    engine: str = "sim"
    model: str = "llama3-8b"
    checkpoint: Optional[str] = None  # jax: an orbax directory or a LLaMA-format folder
    dtype: str = "float32"  # jax: float32 or bfloat16
    attention: str = "auto"  # jax: auto (pallas on GPU, reference elsewhere), reference, pallas
    sampling: str = "greedy"  # jax: greedy, or temperature:T[:top_k[:top_p]]
    clock: str = "profiled"  # jax: profiled (warm-up bucket medians) or wall
    hardware: str = "a100"
    tp: int = 1  # sim: the replica's tensor-parallel degree; jax: devices the step is split over
    step_time_ms: Optional[float] = None  # fixed step time of the simulator
    cost_fit: Optional[str] = None  # sim: a cost fit JSON written by experiments.calibrate
    workload: str = "poisson"
    trace: Optional[str] = None
    trace_time_scale: float = 1.0  # multiplies a trace's arrival times (0.5: twice the rate)
    num_requests: int = 200
    rate: float = 4.0
    cv: float = 1.0
    prompt_len: str = "uniform:32:512"
    output_len: str = "uniform:1:128"
    max_batch_size: int = 64
    token_budget: int = 2048
    num_kv_pages: Optional[int] = None
    kv_memory_gb: Optional[float] = None
    page_size: int = 16
    max_model_len: Optional[int] = None  # default: the model's context
    token_buckets: Optional[tuple[int, ...]] = None
    ttft_slo_s: Optional[float] = None
    tpot_slo_s: Optional[float] = None
    seed: int = 0
    num_replicas: int = 1  # sim: replicas behind a global router (orca_jax.cluster.replicas)
    router: str = "round_robin"  # sim: a registered router, module:Class or file.py:Class
    router_opts: str = ""  # the router's knobs, key=value,...
    log_step_requests: bool = False  # steps.jsonl: each step's request ids and tokens

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {self.engine!r}")
        if self.workload not in WORKLOADS:
            raise ValueError(f"workload must be one of {WORKLOADS}, got {self.workload!r}")
        if self.workload == "trace" and not self.trace:
            raise ValueError("workload 'trace' needs a trace file (--trace)")
        if self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {ATTENTIONS}, got {self.attention!r}")
        if self.clock not in ("profiled", "wall"):
            raise ValueError(f"clock must be profiled or wall, got {self.clock!r}")
        sampling_params(self.sampling)  # fails early, naming the value
        if self.cost_fit is not None and self.step_time_ms is not None:
            raise ValueError("cost_fit and step_time_ms both set; choose one step-time model")
        if not (math.isfinite(self.trace_time_scale) and self.trace_time_scale > 0):
            raise ValueError(f"trace_time_scale must be a finite number > 0, got "
                             f"{self.trace_time_scale}")
        if self.num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {self.num_replicas}")
        if self.num_replicas > 1 and self.engine != "sim":
            raise ValueError(f"num_replicas={self.num_replicas} needs engine 'sim' (the real "
                             f"engine runs one replica per process), got {self.engine!r}")


def _model_facts(spec: RunSpec) -> tuple[int, int]:
    """(vocab size, context length) of the run's model."""
    config = model_config(spec) if spec.engine == "jax" else get_model_config(spec.model)
    return config.vocab_size, config.max_context


def model_config(spec: RunSpec) -> ModelConfig:
    """The real model's config: from the checkpoint folder's config.json, or the preset."""
    if spec.checkpoint and os.path.isfile(os.path.join(spec.checkpoint, "config.json")):
        with open(os.path.join(spec.checkpoint, "config.json")) as f:
            return from_hf_config(json.load(f), name=spec.model)
    return get_model_config(spec.model)


def build_workload(spec: RunSpec) -> list[Request]:
    """The run's requests (synthetic from the seed, or a trace file)."""
    vocab = _model_facts(spec)[0] if spec.engine == "jax" else None
    if spec.workload == "trace":
        requests = load_trace(spec.trace, time_scale=spec.trace_time_scale,
                              max_requests=spec.num_requests)
        return with_prompt_tokens(requests, vocab, spec.seed) if vocab else requests
    return synthetic_workload(
        num_requests=spec.num_requests, arrival=spec.workload,
        rate=None if spec.workload == "burst" else spec.rate, cv=spec.cv,
        prompt_len=spec.prompt_len, output_len=spec.output_len, seed=spec.seed,
        vocab_size=vocab)


def max_model_len(spec: RunSpec) -> int:
    """The context limit of the run."""
    return spec.max_model_len or _model_facts(spec)[1]


def scheduler_config(spec: RunSpec) -> SchedulerConfig:
    """The scheduler's limits; the KV pool from a page count, a memory budget or the GPU."""
    temperature, top_k, top_p = sampling_params(spec.sampling)
    context = max_model_len(spec)
    if spec.num_kv_pages is not None:
        pages = spec.num_kv_pages
    elif spec.engine == "jax":
        # A real cache on this machine: room for a full batch of full contexts.
        pages = spec.max_batch_size * pages_per_seq_for(context, spec.page_size)
    else:
        pages = num_kv_pages_for_memory(
            get_model_config(spec.model), get_hardware(spec.hardware), spec.tp,
            spec.page_size, kv_memory_gb=spec.kv_memory_gb)
    return SchedulerConfig(max_batch_size=spec.max_batch_size, token_budget=spec.token_budget,
                           num_kv_pages=pages, page_size=spec.page_size,
                           max_model_len=context, token_buckets=spec.token_buckets,
                           temperature=temperature, top_k=top_k, top_p=top_p, seed=spec.seed,
                           log_step_requests=spec.log_step_requests)


def build_engine(spec: RunSpec, config: SchedulerConfig) -> Engine:
    """The engine of the run (one per run: a real engine owns its KV cache)."""
    if spec.engine == "sim":
        if spec.cost_fit is not None:
            from orca_jax.sim.calibration import cost_config_from_fit
            return SimEngine(cost_config_from_fit(spec.cost_fit, spec.model))
        if spec.step_time_ms is not None:
            cost = cost_model.CostModelConfig(mode="fixed", model=spec.model,
                                              hardware=spec.hardware, tp=spec.tp,
                                              step_time_s=spec.step_time_ms / 1e3)
        else:
            cost = cost_model.CostModelConfig(model=spec.model, hardware=spec.hardware,
                                              tp=spec.tp)
        return SimEngine(cost)
    return _jax_engine(spec, config)


def _jax_engine(spec: RunSpec, config: SchedulerConfig) -> Engine:
    import jax
    import jax.numpy as jnp

    from orca_jax.model import sharding
    from orca_jax.model import weights
    from orca_jax.model.engine import JaxEngine

    model = model_config(spec)
    dtype = jnp.dtype(spec.dtype)
    if spec.checkpoint:  # a LLaMA folder brings its own config
        model, params = weights.load_params(spec.checkpoint, model, dtype=dtype)
    else:
        params = weights.init_params(model, seed=spec.seed, dtype=dtype)
    attention = spec.attention
    on_gpu = jax.default_backend() == "gpu"
    if attention == "auto":
        attention = "pallas" if on_gpu else "reference"
    elif attention == "pallas" and not on_gpu:
        attention = "pallas_interpret"  # the same kernel, run by the Pallas interpreter
    mesh = sharding.make_mesh(spec.tp, model) if spec.tp > 1 else None
    return JaxEngine(model, params, num_pages=config.num_kv_pages + 1,  # + the null page
                     page_size=config.page_size,
                     pages_per_seq=pages_per_seq_for(config.max_model_len, config.page_size),
                     dtype=dtype, attention=attention, clock=spec.clock, mesh=mesh)


class _Progress:
    """Prints a one-line progress bar to stderr once a run has taken a few seconds."""

    def __init__(self, label: str, total: int, after_s: float = 3.0) -> None:
        self.label, self.total, self.after_s = label, total, after_s
        self.start = time.perf_counter()
        self.last = self.start
        self.shown = False

    def __call__(self, scheduler: Scheduler) -> None:
        now = time.perf_counter()
        if now - self.start < self.after_s or (now - self.last < 0.5 and not scheduler.done):
            return
        self.last = now
        done = scheduler.num_done
        width = 30
        filled = int(width * done / self.total)
        sys.stderr.write(f"\r{self.label}: [{'#' * filled}{'.' * (width - filled)}] "
                         f"{done}/{self.total} requests, {scheduler.num_steps} steps, "
                         f"{now - self.start:.0f}s")
        self.shown = True
        if scheduler.done:
            sys.stderr.write("\n")
        sys.stderr.flush()


def run_policy(spec: RunSpec, policy_spec: str, policy_options: Optional[Mapping[str, str]] = None,
               *, out_dir: Optional[str] = None, requests: Optional[list[Request]] = None,
               engine: Optional[Engine] = None,
               progress: bool = True) -> tuple[dict[str, Any], RunResult]:
    """Runs one policy on the spec's workload; writes results if `out_dir` is given.

    Args:
      spec: the run's plumbing.
      policy_spec: registered name, `package.module:Class` or `file.py:Class`.
      policy_options: the policy's knobs as text (`--policy_opts`).
      out_dir: where to write config.json, requests.jsonl, steps.jsonl, summary.json.
      requests: the workload, if already built (compare builds it once).
      engine: the engine, if already built (compare shares one between policies,
        so every policy runs the very same compiled steps).
      progress: show a progress bar on runs longer than a few seconds.

    Returns:
      The summary dict and the finished run (of every replica, with several).
    """
    config = scheduler_config(spec)
    workload = requests if requests is not None else build_workload(spec)
    if spec.num_replicas > 1:
        return _run_cluster(spec, policy_spec, policy_options, config, workload, out_dir)
    policy = make_policy(policy_spec, policy_options)
    engine = engine if engine is not None else build_engine(spec, config)
    scheduler = Scheduler(workload, policy, engine, config)
    result = scheduler.run(progress=_Progress(policy.name, len(workload)) if progress else None)
    summary = summarize(result, ttft_slo_s=spec.ttft_slo_s, tpot_slo_s=spec.tpot_slo_s)
    if hasattr(engine, "fingerprints"):
        summary["num_compiles"] = engine.num_compiles
        summary["compiled_fingerprints"] = {
            str(b.num_tokens): h for b, h in sorted(engine.fingerprints().items(),
                                                     key=lambda item: item[0].num_tokens)}
        summary["tp"] = engine.tp
        summary["kv_cache_bytes_per_device"] = engine.kv_cache_bytes_per_device
    if out_dir is not None:
        write_results(out_dir, result, summary,
                      _resolved_config(spec, policy_spec, policy, config, engine))
    return summary, result


def _run_cluster(spec: RunSpec, policy_spec: str, policy_options: Optional[Mapping[str, str]],
                 config: SchedulerConfig, workload: list[Request],
                 out_dir: Optional[str]) -> tuple[dict[str, Any], RunResult]:
    """`spec.num_replicas` simulated replicas behind `spec.router`."""
    cluster = Cluster(workload, num_replicas=spec.num_replicas, router=spec.router,
                      router_options=parse_options(spec.router_opts),
                      make_policy=lambda: make_policy(policy_spec, policy_options),
                      make_engine=lambda: build_engine(spec, config), config=config)
    result = cluster.run()
    summary = summarize(result, ttft_slo_s=spec.ttft_slo_s, tpot_slo_s=spec.tpot_slo_s)
    if out_dir is not None:
        first = cluster.replicas[0]
        write_results(out_dir, result, summary, _resolved_config(
            spec, policy_spec, first.policy, config, first.engine))
    return summary, result


def _resolved_config(spec: RunSpec, policy_spec: str, policy: Any, config: SchedulerConfig,
                     engine: Engine) -> dict[str, Any]:
    """config.json: the run, the policy's knobs, the scheduler's limits, the engine."""
    return {
        "run": dataclasses.asdict(spec),
        "policy": {"spec": policy_spec, "name": policy.name,
                   **({f.name: _knob_value(getattr(policy, f.name))
                       for f in dataclasses.fields(policy) if f.init}
                      if dataclasses.is_dataclass(policy) else {})},
        "scheduler": dataclasses.asdict(config),
        "engine": engine.name,
    }


def _knob_value(value: object) -> object:
    """A policy knob as config.json holds it: a string, number or bool as JSON (inf as
    null), and any other object (a callable, a predictor) as its repr, for the reader."""
    if isinstance(value, (str, int, float, bool)) or value is None:
        return to_json_value(value)
    return repr(value)
