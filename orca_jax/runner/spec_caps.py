"""Range caps on a run's counts: a number that cannot fit this machine is refused up front.

A count (requests, KV pages, the context limit, the step budget) sizes host arrays
that the run allocates long after its flags were read: `--num_kv_pages=100000000000`
used to end in numpy's `ArrayMemoryError` deep in the KV pool, `--max_num_tokens` of
10^10 in listing 10^9 step sizes for minutes. Each cap here is the count at which the
run's own tables alone would fill this machine's physical memory (`physical_memory`,
from `os.sysconf`): the bytes one unit costs at least (`BYTES_PER_*`) times the count.
Such a run cannot finish, so it is refused before anything is allocated, in one line
naming the setting, its value, the cap and why. Ids and positions are int32 on every
engine, which caps page counts and context lengths on any machine too.

`check_caps` is called where a `RunSpec` checks itself (`RunSpec.__post_init__`),
so `run`, `compare`, `sweep` and a script's own spec all pass through it;
`check_step_tokens` alone is what the command-line flags need before they list a
bucket ladder out of `max_num_tokens`.

The caps are lower bounds on what a run needs, not estimates of it: a count under
its cap may still be more than the machine can take with everything else a run
holds (see `benchmarks/memory_at_scale.py` for what a run really peaks at).
"""

from __future__ import annotations

import os
from typing import Any, Optional

from orca_jax.sim.pipeline_stages import stage_layers
from orca_jax.specs.hardware import get_hardware
from orca_jax.specs.memory import num_kv_pages_for_memory
from orca_jax.specs.model_config import get_model_config

# A `runner.spec.RunSpec` (and its `LimitsSpec`): the spec module calls this one, so this
# one reads them by their fields, without importing it.
RunSpecLike = Any

# What one unit costs the run on the host at least, in bytes.
# A request through the simulator: 716 B at 10^6 requests (its Request object alone about
# 200, the scheduler's table and KV columns about 230; benchmarks/results/
# memory_at_scale_1e6.txt), rounded down: a lower bound, so no run that fits is refused.
BYTES_PER_REQUEST = 512
# A KV page: the pool's ref count (int64) and free list (int32), the prefix cache's flag
# (bool), rounded up.
BYTES_PER_KV_PAGE = 16
# A page-table entry (an int32 page id) of a sequence's row, in the pool's table and again
# in each step's packed copy.
BYTES_PER_PAGE_ENTRY = 2 * 4
# A token of the step budget: a packed step's int32 and int64 arrays per token (ids,
# positions, slots, sequence index) and the bucket ladders listed up to the budget.
BYTES_PER_STEP_TOKEN = 32
# An output token of a run that keeps every token's time (`RunSpec.log_token_times`, and
# every cluster): its request index (int64) and time (float64) in the result's token log.
BYTES_PER_LOGGED_TOKEN = 16
# Page ids are int32 and page 0 is the null page; positions are int32.
MAX_INT32 = 2**31 - 1


def physical_memory() -> Optional[int]:
    """This machine's physical memory in bytes, or None where the OS does not say."""
    try:
        size = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None
    return size if size > 0 else None


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / 2**30:.1f} GiB"


def _refuse(setting: str, value: object, cap: int, why: str) -> ValueError:
    return ValueError(f"{setting}={value} is above its cap of {cap:,}: {why}")


def count_cap(bytes_per_unit: int, memory: Optional[int] = None) -> Optional[int]:
    """The most units of `bytes_per_unit` this machine's memory holds (None: unknown)."""
    memory = physical_memory() if memory is None else memory
    return None if memory is None else memory // bytes_per_unit


def _check_int32(setting: str, value: Optional[int], why: str, cap: int = MAX_INT32) -> None:
    """Refuses `value` above `cap` (an int32's largest, by default), for `why`."""
    if value is not None and value > cap:
        raise _refuse(setting, value, cap, why)


def _check_count(setting: str, value: Optional[int], bytes_per_unit: int, what: str) -> None:
    """Refuses `value` units of `bytes_per_unit` each above this machine's memory."""
    if value is None:
        return
    memory = physical_memory()
    cap = count_cap(bytes_per_unit, memory)
    if cap is not None and value > cap:
        raise _refuse(setting, value, cap, f"{what} take at least {bytes_per_unit} B each and "
                      f"this machine has {_gib(memory)} of memory")


def check_step_tokens(max_num_tokens: int) -> None:
    """Refuses a step budget whose packed arrays and ladders cannot fit this machine.

    Raises:
      ValueError: naming `limits.max_num_tokens`, its value, the cap and why.
    """
    _check_count("limits.max_num_tokens", max_num_tokens, BYTES_PER_STEP_TOKEN,
                 "a step's tokens")
    _check_int32("limits.max_num_tokens", max_num_tokens, "token positions are int32")


def _check_int32_limits(limits: RunSpecLike) -> None:
    _check_int32("limits.max_model_len", limits.max_model_len, "token positions are int32")
    _check_int32("limits.page_size", limits.page_size, "token positions are int32")


def _num_replicas(spec: RunSpecLike) -> int:
    """The replicas whose KV pools the run holds at once."""
    cluster = spec.cluster
    if cluster.disaggregated:
        return cluster.num_prefill_replicas + cluster.num_decode_replicas
    return cluster.num_replicas


def _kv_pages(spec: RunSpecLike) -> tuple[Optional[int], str, str]:
    """The pages of one replica's KV pool as `build.scheduler_config` resolves them, the
    setting they come from (`limits.num_kv_pages=N`) and what it means; (None, "", "") when
    they are a preset GPU's own (its HBM: never beyond a cap) or the real engine's (its
    batch of full contexts, capped through the page table).

    Raises:
      ValueError: the KV memory holds no page of `page_size` tokens, or the model's
        weights leave the preset GPU no KV memory (naming the setting).
    """
    limits, engine = spec.limits, spec.engine
    if limits.num_kv_pages is not None:
        return limits.num_kv_pages, f"limits.num_kv_pages={limits.num_kv_pages}", ""
    if engine.kind != "sim":
        return None, "", ""
    model, hardware = get_model_config(engine.model), get_hardware(engine.hardware)
    stages = (stage_layers(model.num_layers, engine.pp, engine.pp_layers, where="engine.pp")
              if engine.pp > 1 else None)
    try:
        num_kv_pages_for_memory(model, hardware, engine.tp, 1, kv_memory_gb=limits.kv_memory_gb,
                                stage_layers=stages)
    except ValueError as e:  # not even a page of one token: the weights fill the GPU
        raise ValueError(f"engine.model={engine.model}: {e}") from None
    try:
        pages = num_kv_pages_for_memory(model, hardware, engine.tp, limits.page_size,
                                        kv_memory_gb=limits.kv_memory_gb, stage_layers=stages)
    except ValueError as e:
        raise ValueError(f"limits.page_size={limits.page_size}: {e}") from None
    if limits.kv_memory_gb is None:
        return None, "", ""
    return pages, f"limits.kv_memory_gb={limits.kv_memory_gb:g}", (
        f" (of {engine.model}, page_size {limits.page_size})")


def _least_logged_tokens(spec: RunSpecLike) -> int:
    """The fewest output tokens a request of the run logs the time of: none when the run
    counts its tokens (one replica without `log_token_times`); else the least its output
    length distribution gives (`fixed:N`, `uniform:LO:HI`), at least one."""
    cluster = spec.cluster
    if not (spec.log_token_times or cluster.num_replicas > 1 or cluster.disaggregated):
        return 0
    kind, _, rest = (spec.workload.output_len or "").partition(":")
    try:
        if kind == "fixed":
            return max(int(rest), 1)
        if kind == "uniform":
            return max(int(rest.split(":")[0]), 1)
    except ValueError:
        pass  # the workload spec names its own malformed value
    return 1


def check_caps(spec: RunSpecLike) -> None:
    """Refuses a run whose counts cannot fit this machine (see the module docstring).

    Args:
      spec: the run (its parts already checked their own ranges).

    Raises:
      ValueError: one line, led by the setting (`limits.num_kv_pages=...`), its value,
        the cap and why.
    """
    limits = spec.limits
    check_step_tokens(limits.max_num_tokens)
    least = _least_logged_tokens(spec)
    _check_count("workload.num_requests", spec.workload.num_requests,
                 BYTES_PER_REQUEST + BYTES_PER_LOGGED_TOKEN * least,
                 f"requests (with their {least} output token{'s' if least > 1 else ''}' "
                 "logged times)" if least else "requests")
    pages, source, meaning = _kv_pages(spec)
    replicas = _num_replicas(spec)
    memory = physical_memory()
    if pages is not None:
        per = f" in each of {replicas} replicas" if replicas > 1 else ""
        cap = count_cap(BYTES_PER_KV_PAGE * replicas, memory)
        if cap is not None and pages > cap:
            raise ValueError(f"{source} gives {pages:,} KV pages{meaning}{per}, above the cap "
                             f"of {cap:,} pages: KV pages take at least {BYTES_PER_KV_PAGE} B "
                             f"each of host tables and this machine has {_gib(memory)} of "
                             "memory")
        if pages > MAX_INT32 - 1:
            raise ValueError(f"{source} gives {pages:,} KV pages{meaning}, above the cap of "
                             f"{MAX_INT32 - 1:,} pages: page ids are int32 and page 0 is the "
                             "null page")
    if limits.max_model_len is not None:
        # Every sequence of a step has a page-table row as wide as the longest context.
        width = -(-limits.max_model_len // limits.page_size)
        row_bytes = BYTES_PER_PAGE_ENTRY * limits.max_num_seqs * replicas
        cap = count_cap(row_bytes, memory)
        if cap is not None and width > cap:
            raise _refuse("limits.max_model_len", limits.max_model_len, cap * limits.page_size,
                          f"page tables of max_num_seqs={limits.max_num_seqs} rows of "
                          f"{width:,} pages (page_size {limits.page_size}) take at least "
                          f"{_gib(width * row_bytes)} and this machine has {_gib(memory)} of "
                          "memory")
    _check_int32_limits(limits)  # what no machine's memory changes
