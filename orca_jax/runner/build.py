"""A run's pieces from its spec: the workload, the scheduler's limits, the engine.

Each is built on its own, so a caller that compares policies builds the
workload and the engine once and hands them to every run (`run_policy`).
`check_policies` loads every policy and the router, and checks their knobs
against the run's limits, before anything runs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import os
import sys
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Sequence

import numpy as np
from numpy.typing import NDArray

from orca_jax.cluster.planning import make_planner
from orca_jax.cluster.routing import Router, make_router, resolve_router_class
from orca_jax.core.api.plugins import PolicyLoadError, parse_options, resolve_cache_policy
from orca_jax.core.api.policy import Policy, make_policy, prefix_caching_active
from orca_jax.core.kv import KVConfig
from orca_jax.core.kv.cache_policies import make_cache_policy
from orca_jax.core.loop.config import LoopFeatures, SchedulerConfig
from orca_jax.core.plans.limits import SLOTargets, StepLimits
from orca_jax.core.requests.request import Request, sort_by_arrival
from orca_jax.core.step.engine_api import Engine, EngineConfigError
from orca_jax.core.step.packing import pages_per_seq_for
from orca_jax.core.step.sampling import SamplingConfig
from orca_jax.runner.engine_spec import FRESH_TABLE
from orca_jax.runner.kv_tiers import engine_kv_shape, tier_configs
from orca_jax.runner.spec import (
    JaxEngineSpec,
    RunSpec,
    SimEngineSpec,
    sampling_params,
    speculates,
)
from orca_jax.sim import cost_model
from orca_jax.sim.engine import SimEngine
from orca_jax.sim.engine_profiles import get_engine_profile
from orca_jax.sim.pipeline_stages import stage_layers
from orca_jax.specs.hardware import get_hardware, get_kv_link
from orca_jax.specs.memory import num_kv_pages_for_memory
from orca_jax.specs.model_config import ModelConfig, get_model_config
from orca_jax.workloads.arrival_rate import rescaled_to_rate
from orca_jax.workloads.synthetic import (
    parse_length_spec,
    synthetic_workload,
    with_prompt_tokens,
)
from orca_jax.workloads.traces import TraceError, load_trace, repeat_trace

if TYPE_CHECKING:  # the cluster's loop is imported by the runs that build a cluster only
    from orca_jax.cluster.elastic import ScalingSpec
    from orca_jax.cluster.replicas import Cluster
    from orca_jax.cluster.transfers import KVTransferCost  # its handoffs' and migrations'
    from orca_jax.sim.speculation import SpecConfig  # a speculating run's only


def model_config(spec: RunSpec) -> ModelConfig:
    """The run's model: from a real engine's checkpoint folder's config.json, or the preset."""
    engine = spec.engine
    if isinstance(engine, JaxEngineSpec) and engine.checkpoint and os.path.isfile(
            os.path.join(engine.checkpoint, "config.json")):
        from orca_jax.model.weights import read_hf_config  # jax: only for a real engine
        return read_hf_config(engine.checkpoint, name=engine.model)
    return get_model_config(engine.model)


def _at_rate(spec: RunSpec, requests: list[Request]) -> list[Request]:
    """A trace's requests at the spec's rate where it asks (`trace_at_rate`), else as read.

    Raises:
      TraceError: the trace's arrivals are all at one time (it has no rate to rescale).
    """
    workload = spec.workload
    if not workload.trace_at_rate:
        return requests
    try:
        return rescaled_to_rate(requests, workload.rate,
                                programs=workload.arrival == "program_trace")
    except ValueError as e:
        raise TraceError(f"--rate={workload.rate:g} with trace {workload.trace}: {e}") from e


def build_workload(spec: RunSpec) -> list[Request]:
    """The run's requests (synthetic from the seed, or a trace file).

    A real engine's requests get prompt token ids from its model's vocabulary; so do
    every engine's where sharing is a matter of ids (the prefix workloads, a trace's
    `hash_ids`), for a prefix cache to find.
    """
    workload = spec.workload
    vocab = model_config(spec).vocab_size
    real = spec.engine.kind == "jax"
    if workload.arrival == "trace":
        requests = load_trace(workload.trace, time_scale=workload.trace_time_scale,
                              max_requests=workload.num_requests, vocab_size=vocab,
                              block_size=workload.trace_block_size,
                              output_lens=_trace_output_lens(spec))
        requests = repeat_trace(_at_rate(spec, requests), workload.trace_repeat)
        return (with_prompt_tokens(requests, vocab, spec.seed, context=max_model_len(spec))
                if real else requests)
    # The workloads of other kinds are imported by the runs that build them only.
    if workload.arrival == "programs":
        from orca_jax.workloads.programs import ProgramShape, program_workload
        return program_workload(
            num_requests=workload.num_requests, rate=workload.rate, seed=spec.seed,
            shape=ProgramShape(
                shape=workload.program_shape, turns=workload.program_turns,
                calls_per_turn=workload.program_calls_per_turn,
                first_prompt=workload.program_first_prompt,
                prompt_growth=workload.program_prompt_growth,
                completion_len=workload.program_completion_len,
                tool_ms=workload.program_tool_ms, turn_gap_ms=workload.program_turn_gap_ms,
                fanout=workload.program_fanout),
            vocab_size=vocab, context=max_model_len(spec),
            program_count=workload.program_count)
    if workload.arrival == "program_trace":
        from orca_jax.workloads.program_traces import load_program_trace
        return _at_rate(spec, load_program_trace(
            workload.trace, max_requests=workload.num_requests, vocab_size=vocab,
            seed=spec.seed, time_scale=workload.trace_time_scale))
    if workload.arrival == "shared_prefix":
        from orca_jax.workloads.prefix_workloads import shared_prefix_workload
        return shared_prefix_workload(
            num_requests=workload.num_requests, rate=workload.rate,
            num_prefixes=workload.num_prefixes, prefix_len=workload.prefix_len,
            prefix_zipf=workload.prefix_zipf, suffix_len=workload.suffix_len,
            output_len=workload.output_len, seed=spec.seed, vocab_size=vocab,
            context=max_model_len(spec))
    if workload.arrival == "conversation":
        from orca_jax.workloads.prefix_workloads import conversation_workload
        return conversation_workload(
            num_requests=workload.num_requests, rate=workload.rate,
            num_turns=workload.num_turns, think_time_ms=workload.think_time_ms,
            message_len=workload.suffix_len, output_len=workload.output_len, seed=spec.seed,
            vocab_size=vocab, context=max_model_len(spec))
    return synthetic_workload(
        num_requests=workload.num_requests, arrival=workload.arrival,
        rate=None if workload.arrival == "burst" else workload.rate, cv=workload.cv,
        prompt_len=workload.prompt_len, output_len=workload.output_len, seed=spec.seed,
        vocab_size=vocab if real else None, context=max_model_len(spec) if real else None)


def _trace_output_lens(spec: RunSpec) -> Optional[Callable[[int], NDArray[np.int64]]]:
    """Draws the output lengths of a trace that has none from `workload.output_len` (None
    where that is unset), from the seed's stream a synthetic workload draws its own from."""
    output_len = spec.workload.output_len
    if output_len is None:
        return None

    def draw(n: int) -> NDArray[np.int64]:  # -> [n]
        stream = np.random.SeedSequence(int(spec.seed)).spawn(4)[2]
        return parse_length_spec(output_len, default_column="output_len").sample(
            np.random.default_rng(stream), n)
    return draw


def workload_line(spec: RunSpec, requests: Sequence[Request]) -> str:
    """What the run took, for the terminal: `workload: 8819 requests from trace FILE`."""
    workload = spec.workload
    if workload.arrival != "trace":
        return f"workload: {len(requests)} requests ({workload.arrival})"
    cut = ("" if workload.num_requests is None else
           f" (its first {workload.num_requests} at most: --num_requests)")
    batch = (", an offline batch: every request submitted at time 0"
             if requests and all(r.arrival_s == 0 for r in requests) else "")
    rescaled = (f", arrivals rescaled to a mean {workload.rate:g} req/s (--rate)"
                if workload.trace_at_rate else "")
    return (f"workload: {len(requests)} requests from trace {workload.trace}{cut}{batch}"
            f"{rescaled}")


def max_model_len(spec: RunSpec) -> int:
    """The context limit of the run."""
    return spec.limits.max_model_len or model_config(spec).max_context


def scheduler_config(spec: RunSpec) -> SchedulerConfig:
    """The scheduler's config, part by part; the KV pool from a page count, a memory budget
    or the GPU."""
    limits, engine = spec.limits, spec.engine
    sampling = engine.sampling if isinstance(engine, JaxEngineSpec) else "greedy"
    temperature, top_k, top_p = sampling_params(sampling)
    context = max_model_len(spec)
    if limits.num_kv_pages is not None:
        pages = limits.num_kv_pages
    elif isinstance(engine, JaxEngineSpec):
        # A real cache on this machine: room for a full batch of full contexts.
        pages = limits.max_num_seqs * pages_per_seq_for(context, limits.page_size)
    else:
        pages = num_kv_pages_for_memory(
            get_model_config(engine.model), get_hardware(engine.hardware), engine.tp,
            limits.page_size, kv_memory_gb=limits.kv_memory_gb,
            stage_layers=sim_stage_layers(engine))
    return SchedulerConfig(
        limits=StepLimits(max_num_seqs=limits.max_num_seqs, max_num_tokens=limits.max_num_tokens,
                          max_model_len=context, token_buckets=limits.token_buckets,
                          no_progress_steps=limits.no_progress_steps),
        kv=KVConfig(num_kv_pages=pages, page_size=limits.page_size, kv_layout=limits.kv_layout,
                    prefix_caching=limits.prefix_caching, kv_pin_s=limits.kv_pin_s,
                    **_tier_settings(spec)),
        sampling=SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p,
                                seed=spec.seed),
        slo=SLOTargets(ttft_slo_s=spec.ttft_slo_s, tpot_slo_s=spec.tpot_slo_s),
        features=LoopFeatures(count_host_time=limits.count_host_time,
                              # A speculative step's accepted tokens are known only once
                              # it has run: no overlap.
                              overlap=(isinstance(engine, JaxEngineSpec) and engine.overlap
                                       and engine.drafter == "none"),
                              log_step_requests=limits.log_step_requests,
                              leap=isinstance(engine, SimEngineSpec) and engine.leap,
                              balance_micro_batches=engine.pp_balance,
                              spec_k=limits.spec_k))


def _tier_settings(spec: RunSpec) -> dict[str, object]:
    """KVConfig's slower tiers and cache policy, when the run has tiers (else nothing:
    a run without tiers builds the KVConfig it always did)."""
    tiers = tier_configs(spec.limits, *engine_kv_shape(spec.engine))
    limits = spec.limits
    if not tiers:
        return {}
    name = resolve_cache_policy(limits.kv_cache_policy)
    options = tuple(parse_options(limits.kv_cache_policy_opts).items())
    try:
        make_cache_policy(name, {k: _option(v) for k, v in options})
    except (TypeError, ValueError) as e:
        raise PolicyLoadError(f"--kv_cache_policy_opts={limits.kv_cache_policy_opts!r}: "
                              f"{e}") from None
    return dict(tiers=tiers, cache_policy=name,
                cache_policy_opts=tuple((k, _option(v)) for k, v in options))


def _option(value: str) -> object:
    """A cache policy knob's text as a number where it is one."""
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


def build_engine(spec: RunSpec, config: SchedulerConfig, replica: int = 0,
                 workload: Optional[Sequence[Request]] = None) -> Engine:
    """The engine of the run, or of a cluster's `replica` (a real engine owns its KV
    cache: one per replica). `workload`: the run's requests, where the simulator reads
    each one's own draft acceptance (`Request.spec_acceptance`)."""
    engine = spec.engine
    if isinstance(engine, JaxEngineSpec):
        return _jax_engine(spec, engine, config, replica)
    cost = _cost_config(engine)
    return SimEngine(cost, speculation=sim_speculation(spec, cost, workload),
                     front_end=get_engine_profile(engine.engine_profile).front_end)


def sim_speculation(spec: RunSpec, cost: cost_model.CostModelConfig,
                    workload: Optional[Sequence[Request]] = None) -> Optional[SpecConfig]:
    """The simulator's speculative decoding (`orca_jax.sim.speculation`), None when the run
    does not speculate (`spec.speculates`): acceptance `--spec_acceptance` (0.7 unset), the
    draft `--draft_model` priced on the target's hardware and tp, draws seeded by `--seed`.
    A request of `workload` with its own rate (`Request.spec_acceptance`, a trace's
    `acceptance` column) draws at it (`SpecConfig.per_request`, in the scheduler's
    arrival order).
    """
    engine = spec.engine
    if not speculates(spec):
        return None
    assert isinstance(engine, SimEngineSpec)
    # Lazy: only a run that speculates builds a `SpecConfig`; the others never import it.
    from orca_jax.sim.speculation import DEFAULT_SPEC_ACCEPTANCE, SpecConfig
    draft = None
    if engine.draft_model is not None:
        draft = cost_model.CostModelConfig(model=engine.draft_model, hardware=cost.hardware,
                                           tp=cost.tp, step_padding="ragged")
    per_request = None
    if workload is not None and any(r.spec_acceptance is not None for r in workload):
        per_request = np.array([np.nan if r.spec_acceptance is None else r.spec_acceptance
                                for r in sort_by_arrival(workload)], np.float64)  # [N]
    return SpecConfig(acceptance=(DEFAULT_SPEC_ACCEPTANCE if engine.spec_acceptance is None
                                  else engine.spec_acceptance),
                      draft=draft, seed=spec.seed, per_request=per_request)


def _cost_config(engine: SimEngineSpec) -> cost_model.CostModelConfig:
    if engine.cost_fit is not None:
        from orca_jax.sim.calibration import cost_config_from_fit
        try:
            return cost_config_from_fit(engine.cost_fit, engine.model)
        except OSError as e:  # a missing or unreadable file: the user's input
            raise EngineConfigError(f"cost fit {engine.cost_fit}: {e.strerror or e}") from None
        except ValueError as e:  # not a fit: the message names the file
            raise EngineConfigError(str(e)) from None
    if engine.step_time_ms is not None:
        return cost_model.CostModelConfig(mode="fixed", model=engine.model,
                                          hardware=engine.hardware, tp=engine.tp,
                                          step_time_s=engine.step_time_ms / 1e3,
                                          pp_layers=sim_stage_layers(engine))
    profile = get_engine_profile(engine.engine_profile)
    return cost_model.CostModelConfig(
        model=engine.model, hardware=profile.hardware(get_hardware(engine.hardware)),
        tp=engine.tp, step_padding=engine.step_padding, pp_layers=sim_stage_layers(engine),
        step_overhead_s=profile.step_overhead_s,
        graph_sizes=profile.graph_sizes if engine.step_padding == "bucket" else None)


def sim_stage_layers(engine: SimEngineSpec) -> Optional[tuple[int, ...]]:
    """The layers of each pipeline stage of a simulated engine (None: one stage)."""
    if engine.pp == 1:
        return None
    return stage_layers(get_model_config(engine.model).num_layers, engine.pp, engine.pp_layers,
                        where="engine.pp")


def replica_devices(num_replicas: int, tp: int, replica: int,
                    devices: Sequence[Any]) -> list[Any]:
    """The devices of a cluster's `replica`: `tp` of its own when the machine has
    `num_replicas * tp` of them (a forced CPU device count, or one GPU each), else the
    first `tp`, shared by every replica (each still with its own weights and cache)."""
    if num_replicas * tp <= len(devices):
        return list(devices[replica * tp:(replica + 1) * tp])
    return list(devices[:tp])


def _jax_engine(spec: RunSpec, engine: JaxEngineSpec, config: SchedulerConfig,
                replica: int = 0) -> Engine:
    import jax
    import jax.numpy as jnp

    from orca_jax.model import distributed, sharding, weights
    from orca_jax.model.engine import JaxEngine
    from orca_jax.sim import profile_store  # a jax run's only, as the clock: see below
    from orca_jax.sim.profile_store import describe_machine
    from orca_jax.sim.profiled_clock import ProfiledClock

    model = model_config(spec)
    dtype = jnp.dtype(engine.dtype)
    if engine.checkpoint:  # a LLaMA folder brings its own config
        model, params = weights.load_params(engine.checkpoint, model, dtype=dtype)
    else:
        params = weights.init_params(model, seed=spec.seed, dtype=dtype)
    attention = engine.attention
    on_gpu = jax.default_backend() == "gpu"
    if attention == "auto":
        attention = "pallas" if on_gpu else "bucketed"  # bucketed: the vectorized CPU op
    elif attention == "pallas" and not on_gpu:
        attention = "pallas_interpret"  # the same kernel, run by the Pallas interpreter
    limits, kv = config.limits, config.kv
    pages_per_seq = pages_per_seq_for(limits.max_model_len, kv.page_size)
    speculates = engine.drafter != "none"  # refused with pp > 1 at the spec
    real: Engine
    if engine.pp > 1:  # clusters of pipelines are refused at the spec
        real = _pipelined_jax_engine(engine, model, params, config, attention=attention,
                                     dtype=dtype)
    else:
        # A cluster's replica on devices of its own, where this process has enough; one
        # replica on jax's devices, as ever (under several processes: all processes' ones).
        devices = (replica_devices(spec.cluster.num_replicas, engine.tp, replica,
                                   jax.local_devices())
                   if spec.cluster.num_replicas > 1 else None)
        mesh = sharding.make_mesh(engine.tp, model, devices) if engine.tp > 1 else None
        device = devices[0] if engine.tp == 1 and devices is not None else None
        real = JaxEngine(model, params, num_cache_pages=kv.num_kv_pages + 1,  # + the null page
                         page_size=kv.page_size, pages_per_seq=pages_per_seq, dtype=dtype,
                         attention=attention, mesh=mesh,
                         feed_tokens=engine.overlap and not speculates, device=device,
                         verify_rows=speculates)
        if speculates:
            return _speculative_engine(spec, engine, real, params)
    if engine.clock == "wall":
        return real
    # The profiled clock prices each step by a fit of what it holds, timed at warm-up or
    # read from the process's table store or --profile_table (then a run in another
    # process prices every step alike).
    identity = {"model": model.name, "model_sha256": _model_digest(model),
                "dtype": engine.dtype, "attention": attention, "tp": engine.tp}
    if engine.pp > 1:  # a pipeline's steps are timed through its stages
        identity["pp_layers"] = ",".join(map(str, getattr(real, "stage_layers")))
    # Not in `identity`: a --profile_table file may be used on another host on purpose.
    setup = {"machine": describe_machine(jax.default_backend(),
                                         [d.device_kind for d in jax.devices()],
                                         jax.__version__),
             "feed_tokens": engine.overlap and engine.pp == 1}  # another compiled step
    fresh = engine.profile_table == FRESH_TABLE
    table_file = None if fresh else engine.profile_table
    # Several processes time the grid together (each step is collective), so they must all
    # read a table or all time it: a store on each host cannot promise that, a file can.
    store = (profile_store.current()
             if table_file is None and not distributed.is_multiprocess() else None)
    return ProfiledClock(real, max_model_len=limits.max_model_len, page_size=kv.page_size,
                         pages_per_seq=pages_per_seq, num_pages=kv.num_kv_pages + 1,
                         table_file=table_file, identity=identity, setup=setup,
                         store=store, fresh=fresh)


def _pipelined_jax_engine(engine: JaxEngineSpec, model: ModelConfig, params: Any,
                          config: SchedulerConfig, *, attention: str, dtype: Any) -> Engine:
    """The real engine in `engine.pp` stages of `engine.tp` local devices each."""
    from orca_jax.model import distributed
    from orca_jax.model.pipeline_engine import PipelinedJaxEngine

    if distributed.is_multiprocess():
        raise EngineConfigError(f"engine.pp {engine.pp}: pipeline stages run on one "
                                "process's devices; drop --num_processes")
    try:  # a checkpoint folder's layers are known only now (a preset's: at the spec)
        layers = stage_layers(model.num_layers, engine.pp, engine.pp_layers, where="engine.pp")
    except ValueError as e:
        raise EngineConfigError(str(e)) from None
    kv = config.kv
    return PipelinedJaxEngine(
        model, params, stage_layers=layers, num_cache_pages=kv.num_kv_pages + 1,
        page_size=kv.page_size,
        pages_per_seq=pages_per_seq_for(config.limits.max_model_len, kv.page_size),
        dtype=dtype, attention=attention, tp=engine.tp)


def _speculative_engine(spec: RunSpec, engine: JaxEngineSpec, target: Engine,
                        params: object) -> Engine:
    """The target wrapped with its drafter (`--drafter`): a draft model gets its own engine
    of the target's page geometry, and the target's first layers where its shapes allow."""
    from orca_jax.model.engine import JaxEngine
    from orca_jax.model.speculative import SpeculativeEngine, draft_params

    assert isinstance(target, JaxEngine)
    draft = None
    if engine.draft_model is not None:
        draft_config = get_model_config(engine.draft_model)
        draft = JaxEngine(draft_config,
                          draft_params(target.model_config, params, draft_config,
                                       seed=spec.seed),
                          num_cache_pages=target.num_cache_pages, page_size=target.page_size,
                          pages_per_seq=target.pages_per_seq, dtype=target.dtype,
                          attention=target.attention)
    return SpeculativeEngine(target, drafter=engine.drafter, draft=draft)


def transfer_cost(spec: RunSpec) -> KVTransferCost:
    """The price of moving a request's KV: the model's KV on one TP shard, over the link
    (a disaggregated run's handoffs, a colocated run's migrations)."""
    from orca_jax.cluster.transfers import kv_transfer_cost  # a cluster's only

    engine = spec.engine
    dtype_bytes = 4 if isinstance(engine, JaxEngineSpec) and engine.dtype == "float32" else 2
    return kv_transfer_cost(model_config(spec),
                            get_kv_link(spec.cluster.kv_link, spec.cluster.kv_link_max_concurrent),
                            tp=engine.tp, dtype_bytes=dtype_bytes)


def build_cluster(spec: RunSpec, policy_spec: str, policy_options: Optional[Mapping[str, str]],
                  config: SchedulerConfig, workload: list[Request], *,
                  kv_counts_only: bool = False) -> Cluster:
    """`spec.cluster.num_replicas` replicas of `policy_spec` behind
    `spec.cluster.router`, each with its own engine of the spec (a real engine: its own
    weights and KV cache, in this process). `kv_counts_only`: `Cluster`'s (the replicas
    keep page counts only where no migration reads their pages)."""
    from orca_jax.cluster.migration import MigrationSpec
    from orca_jax.cluster.replicas import Cluster

    cluster = spec.cluster
    migration = None
    if cluster.rebalancer is not None:
        # A real engine on the wall clock: a migration's measured copy is on the clock too.
        measure = isinstance(spec.engine, JaxEngineSpec) and spec.engine.clock == "wall"
        migration = MigrationSpec(cost=transfer_cost(spec), mode=cluster.migration,
                                  interval_s=cluster.rebalance_interval_s,
                                  measure_copy=measure)
    replicas = itertools.count()  # each replica's engine on its own devices, if any
    return Cluster(workload, num_replicas=cluster.num_replicas,
                   router=cluster.router,
                   router_options=parse_options(cluster.router_opts),
                   make_policy=lambda: make_policy(policy_spec, policy_options),
                   make_engine=lambda: build_engine(spec, config, next(replicas)),
                   config=config,
                   rebalancer=cluster.rebalancer,
                   rebalancer_options=parse_options(cluster.rebalancer_opts),
                   migration=migration, planner=cluster.planner,
                   planner_options=parse_options(cluster.planner_opts),
                   scaling=scaling_spec(spec), kv_counts_only=kv_counts_only,
                   # As one replica: every token's time only for `--log_token_times`.
                   log_tokens=spec.log_token_times)


def replica_startup_s(spec: RunSpec) -> float:
    """Seconds a started replica takes to be ready: `replica_startup_s`, or each GPU
    loading its shard of the weights over `replica_load_link` (nvme by default)."""
    cluster = spec.cluster
    if cluster.replica_startup_s is not None:
        return cluster.replica_startup_s
    link = get_kv_link(cluster.replica_load_link or "nvme")
    engine = spec.engine
    dtype_bytes = 4 if isinstance(engine, JaxEngineSpec) and engine.dtype == "float32" else 2
    shard = model_config(spec).weight_bytes(dtype_bytes) / (engine.tp * engine.pp)
    return link.latency_s + shard / link.bytes_per_s


def scaling_spec(spec: RunSpec) -> Optional[ScalingSpec]:
    """A planner's caps, interval and start-up delay (None without a planner)."""
    from orca_jax.cluster.elastic import ScalingSpec

    cluster = spec.cluster
    if cluster.planner is None:
        return None
    low, high = cluster.replica_caps
    return ScalingSpec(interval_s=cluster.planner_interval_s or 30.0,
                       startup_s=replica_startup_s(spec), min_replicas=low, max_replicas=high)


PROFILE_TABLE_FILE = "profile.json"  # beside the results, unless --profile_table names one


def _model_digest(model: ModelConfig) -> str:
    """sha256 of the model's shapes: a table of another model under the same name is refused."""
    text = json.dumps(dataclasses.asdict(model), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def profile_table_record(engine: Engine, out_dir: str, *, write_dir: Optional[str] = None
                         ) -> Optional[dict[str, Any]]:
    """The profiled clock's per-bucket table of a finished run, for config.json.

    The table the run used (loaded from, or written to, `--profile_table`), or else
    written now as `profile.json` into `write_dir` (default `out_dir`; a staging folder
    that becomes `out_dir`), and named by its path in `out_dir`: a copy that
    `--profile_table` repeats the run by, whatever the store holds later. None for an
    engine without one.

    Returns:
      `{"path", "sha256", "loaded", "stored"}`: the file, the hash of its bytes,
      whether the run read its table (True) or timed it (False), and the stored
      tables it priced by (`profile_store.StoredTable`: key, store file, when and
      on what machine it was timed, reused or not; empty without a store).
    """
    # Only a jax run imports the profiled clock (`_jax_engine`, with its step profiler and
    # statistics, ~10 ms a process): an engine of a run that did not import it is none.
    profiled_clock = sys.modules.get("orca_jax.sim.profiled_clock")
    if profiled_clock is None or not isinstance(engine, profiled_clock.ProfiledClock) \
            or not engine.fit:
        return None
    path = engine.table_file
    if path is None:
        directory = write_dir if write_dir is not None else out_dir
        os.makedirs(directory, exist_ok=True)
        digest = engine.save_table(os.path.join(directory, PROFILE_TABLE_FILE))
        path = os.path.join(out_dir, PROFILE_TABLE_FILE)
    else:
        digest = profiled_clock.table_digest(path)
    return {"path": os.path.abspath(path), "sha256": digest, "loaded": engine.table_loaded,
            "stored": [dataclasses.asdict(table) for table in engine.stored]}


def _limits(config: SchedulerConfig) -> dict[str, int]:
    """The scheduler's capacities by name: its parts' int `max_*` and `num_*` fields."""
    return {f.name: getattr(part, f.name) for part in (config.limits, config.kv)
            for f in dataclasses.fields(part)
            if f.name.startswith(("max_", "num_")) and type(getattr(part, f.name)) is int}


def check_policy_limits(policy: Policy, options: Optional[Mapping[str, str]],
                        config: SchedulerConfig) -> None:
    """Refuses a knob set in `options` above the scheduler limit of the same name.

    A policy knob named like a scheduler capacity (`max_num_seqs`, `max_num_tokens`,
    `num_kv_pages`, `max_model_len`) cannot take effect above it: the core caps every
    plan at the scheduler's limits, so the knob would silently do nothing. Knobs left
    at their defaults are not checked (a default above the run's cap means "up to the
    scheduler's").

    Then asks the policy whether its knobs can serve under the run's limits at all
    (`Policy.check_limits`).

    Raises:
      PolicyLoadError: names the policy, the knob and the run's limit.
    """
    renamed: Mapping[str, str] = getattr(policy, "renamed_options", {})
    limits = _limits(config)
    for key in options or {}:
        knob = renamed.get(key, key)
        value, limit = getattr(policy, knob, None), limits.get(knob)
        if limit is not None and type(value) is int and value > limit:
            raise PolicyLoadError(
                f"policy {policy.name!r}: option {knob}={value} exceeds the run's "
                f"--{knob}={limit}, which caps every step; raise --{knob} or lower the option")
    try:
        policy.check_limits(config.limits)
    except ValueError as e:
        raise PolicyLoadError(str(e)) from None


def check_prefix_caching(policy: Policy, options: Optional[Mapping[str, str]],
                         config: SchedulerConfig) -> None:
    """Refuses a policy the run's prefix-caching switch cannot serve as asked.

    The switch (`--prefix_caching`) wins over a policy's own opt-in, so under `on` or
    `off` a policy's opt-in knob (`Policy.prefix_caching_knob`, vllm's
    `enable_prefix_caching`) does nothing: given explicitly against the switch it is a
    contradiction, refused rather than silently overruled (given in agreement, or left
    at its default, it is accepted). Under `on`, a policy that declares
    `prefix_caching_unsupported` is refused with its reason.

    Raises:
      PolicyLoadError: one line naming the policy, the knob or reason, and the switch.
    """
    mode, options = config.kv.prefix_caching, options or {}
    if mode == "policy":
        return
    prefix_caching_active(policy, mode, PolicyLoadError)
    renamed: Mapping[str, str] = getattr(policy, "renamed_options", {})
    knob = policy.prefix_caching_knob
    given = [key for key in options if renamed.get(key, key) == knob]
    if given and bool(policy.prefix_caching) != (mode == "on"):
        raise PolicyLoadError(
            f"policy {policy.name!r}: option {given[0]}={options[given[0]]} contradicts "
            f"--prefix_caching={mode}, which decides caching for every policy; drop the "
            f"option, or give --prefix_caching=policy to let the policy's knob decide")


def check_router(spec: RunSpec) -> Optional[Router]:
    """The run's router, built from its spec and options (None with one replica).

    With one replica the router class is still resolved, so a misspelt router fails; a
    disaggregated cluster's prefill and decode routers are built too.

    Raises:
      PolicyLoadError: the router does not resolve, or an option is unknown or mistyped.
    """
    cluster = spec.cluster
    if cluster.disaggregated:  # each pool's router, with its options
        for role in ("prefill", "decode"):
            try:
                make_router(getattr(cluster, f"{role}_router"),
                            parse_options(getattr(cluster, f"{role}_router_opts")))
            except PolicyLoadError as e:
                raise PolicyLoadError(f"{role} pool: {e}") from None
    if cluster.planner is not None:
        make_planner(cluster.planner, parse_options(cluster.planner_opts))
    if not cluster.colocated_cluster:
        resolve_router_class(cluster.router)
        return None
    return make_router(cluster.router, parse_options(cluster.router_opts))


def check_policies(spec: RunSpec, config: SchedulerConfig,
                   policies: Sequence[tuple[str, Optional[Mapping[str, str]]]]) -> list[Policy]:
    """Builds every policy (spec, options) and the router before anything runs.

    So a comparison or a sweep fails on its last policy's typo before its first run.

    Returns:
      The policies, built (fresh ones are built again for each run).

    Raises:
      PolicyLoadError: a policy or the router does not load, an option is unknown or
        mistyped, a knob exceeds a scheduler limit (`check_policy_limits`), or the
        run's prefix-caching switch cannot serve it (`check_prefix_caching`).
    """
    built = []
    for policy_spec, options in policies:
        policy = make_policy(policy_spec, options)
        check_policy_limits(policy, options, config)
        if getattr(policy, "preemption_mode", None) == "swap" and not config.kv.tiers:
            raise PolicyLoadError(f"policy {policy.name!r}: preemption_mode=swap needs a host "
                                  "KV tier (--kv_host_gb or --kv_host_pages)")
        check_prefix_caching(policy, options, config)
        if policy.plans_speculation and not speculates(spec):
            how = ("the simulator must speculate (give --spec_acceptance and/or --draft_model)"
                   if isinstance(spec.engine, SimEngineSpec) else
                   "the jax engine needs a drafter (--drafter=ngram, or --drafter=model with "
                   "--draft_model)")
            raise PolicyLoadError(f"policy {policy.name!r} chooses draft tokens per request: "
                                  f"{how}")
        built.append(policy)
    check_router(spec)
    return built
