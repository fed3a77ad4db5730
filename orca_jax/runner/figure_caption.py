"""The caption line a figure carries: what was run, so the picture stands on its own.

A bar chart or a curve read away from its folder (in a report, a chat, a slide)
says nothing of the workload, engine, model, hardware, rate or how many runs each
point is; `figure_caption` says it in one line, from the run's spec.
"""

from __future__ import annotations

import os
import sys
from typing import Optional, Sequence

from orca_jax.runner.spec import JaxEngineSpec, RunSpec


def _workload(spec: RunSpec) -> str:
    workload = spec.workload
    count = ("all requests" if workload.num_requests is None
             else f"{workload.num_requests} requests")
    if workload.arrival == "programs" and workload.program_count is not None:
        count = f"{workload.program_count} programs"  # num_requests is not read
    if workload.arrival == "trace":
        scale = ("" if workload.trace_time_scale == 1.0
                 else f", times x{workload.trace_time_scale:g}")
        return f"trace {os.path.basename(str(workload.trace))} ({count}{scale})"
    if workload.arrival == "shared_prefix":
        return (f"shared_prefix ({count}, {workload.num_prefixes} prefixes of "
                f"{workload.prefix_len}, suffixes {workload.suffix_len}, outputs "
                f"{workload.output_len})")
    if workload.arrival == "conversation":
        return f"conversation ({count}, turns {workload.num_turns}, outputs {workload.output_len})"
    return (f"{workload.arrival} ({count}, prompts {workload.prompt_len}, outputs "
            f"{workload.output_len})")


def _engine(spec: RunSpec) -> str:
    """The engine, its model and the hardware it ran on (or the simulator priced)."""
    engine = spec.engine
    tp = f", tp {engine.tp}" if engine.tp > 1 else ""
    if isinstance(engine, JaxEngineSpec):
        device = "this machine's device"
        if "jax" in sys.modules:  # the run has used it: name the device it ran on
            device = sys.modules["jax"].devices()[0].device_kind
        return (f"engine jax ({engine.clock} clock, {engine.dtype}), model {engine.model}, "
                f"{device}{tp}")
    return f"engine sim, model {engine.model}, {engine.hardware}{tp}"


def _cluster(spec: RunSpec) -> str:
    cluster = spec.cluster
    if cluster.num_prefill_replicas:
        return (f"; disaggregated {cluster.num_prefill_replicas} prefill + "
                f"{cluster.num_decode_replicas} decode")
    if cluster.num_replicas > 1:
        return f"; {cluster.num_replicas} replicas, router {cluster.router}"
    return ""


def figure_caption(spec: RunSpec, *, rates: Optional[Sequence[float]] = None,
                   seeds: Optional[Sequence[int]] = None, repeats: int = 1) -> str:
    """One line: workload; engine, model, hardware; rate(s); seeds and repeats.

    Args:
      spec: the run's spec (a sweep's: its rate and seed are replaced by `rates`, `seeds`).
      rates: a sweep's rates (None: the spec's own rate).
      seeds: a sweep's seeds (None: the spec's own seed).
      repeats: runs of each policy per point (compare's --repeats).
    """
    workload = spec.workload
    if rates is not None:
        rate = f"rates {', '.join(f'{r:g}' for r in rates)} req/s"
    elif workload.arrival in ("trace", "program_trace") and workload.trace_at_rate:
        rate = f"the trace's arrivals rescaled to a mean {workload.rate:g} req/s"
    elif workload.arrival == "trace":
        rate = "the trace's arrival times"
    elif workload.arrival == "burst":
        rate = "all at t=0"
    else:
        rate = f"rate {workload.rate:g} req/s"
    seeds = [spec.seed] if seeds is None else list(seeds)
    runs = (f"seed {seeds[0]}" if len(seeds) == 1
            else f"{len(seeds)} seeds ({', '.join(str(s) for s in seeds)})")
    if repeats > 1:
        runs += f", {repeats} repeats"
    return f"{_workload(spec)}; {_engine(spec)}{_cluster(spec)}; {rate}; {runs}"
