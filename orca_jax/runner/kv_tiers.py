"""The slower KV tiers a run's flags ask for (`--kv_host_gb`, `--kv_disk_gb`, ...), as the
core's `TierConfig`s: sizes in pages of the run's model, links from the presets.

A tier's size is over the replica (as `--kv_memory_gb`); a page's move crosses
each GPU's own link with that GPU's share of the KV heads (as a disaggregated
transfer, `orca_jax.cluster.transfers`), so a link prices one shard's bytes.

A tier holds at most `MAX_TIER_PAGES` pages, the device pool's own cap (page ids
are int32): 2^31 pages of llama3-8b (2 MiB each) are 4 PiB, beyond any host's
DRAM or disk, so a larger tier is a typo, not a machine. On the jax engine the
host tier's pages are copied into this machine's memory, so its bytes are also
capped by the machine's physical memory (`check_host_tier_memory`).
"""

from __future__ import annotations

import math
from typing import Optional

from orca_jax.core.kv.config import TierConfig
from orca_jax.runner.spec_caps import MAX_INT32, physical_memory
from orca_jax.specs.hardware import get_kv_link
from orca_jax.specs.memory import DTYPE_BYTES, kv_bytes_per_token
from orca_jax.specs.model_config import PRESETS, ModelConfig

MAX_TIER_PAGES = MAX_INT32 - 1  # the device pool's cap (page 0 is its null page)


def tier_configs(limits: object, model: Optional[ModelConfig], tp: int = 1,
                 dtype_bytes: int = DTYPE_BYTES) -> tuple[TierConfig, ...]:
    """The tiers of `limits` (a `LimitsSpec`) for `model` at tensor parallelism `tp`, its
    KV `dtype_bytes` bytes a value (the jax engine's dtype; the simulator's bf16).

    Raises:
      ValueError: one line naming the flag: a tier smaller than one page or larger than
        `MAX_TIER_PAGES`, a link preset that does not exist, a disk tier without a host
        tier.
    """
    host = _size(limits, "host")
    disk = _size(limits, "disk")
    if host is None and disk is None:
        return ()
    if host is None:
        raise ValueError("--kv_disk_gb/--kv_disk_pages: a disk KV tier sits under a host "
                         "tier; give --kv_host_gb or --kv_host_pages too")
    if model is None:
        raise ValueError("--kv_host_gb/--kv_disk_gb need a model preset to size pages; give "
                         "--kv_host_pages/--kv_disk_pages instead")
    page_size = getattr(limits, "page_size")
    page_bytes = kv_bytes_per_token(model, dtype_bytes) * page_size  # the replica's, every shard
    shard_bytes = math.ceil(page_bytes * math.ceil(model.num_kv_heads / tp)
                            / model.num_kv_heads)
    tiers = []
    for name, size in (("host", host), ("disk", disk)):
        if size is None:
            continue
        flag, value = size
        pages = value if flag.endswith("pages") else int(value * 1e9 // page_bytes)
        if pages < 1:
            raise ValueError(f"--{flag}={value} holds no KV page: one page of {model.name} "
                             f"is {page_bytes / 1e6:.3g} MB ({page_size} tokens)")
        if pages > MAX_TIER_PAGES:
            shown = f"{value:g}" if isinstance(value, float) else value
            raise ValueError(f"--{flag}={shown} gives {int(pages):,} KV pages, above the "
                             f"cap of {MAX_TIER_PAGES:,} pages a tier holds (the device "
                             "pool's: page ids are int32)")
        link_flag = f"kv_{name}_link"
        try:
            link = get_kv_link(getattr(limits, link_flag))
        except ValueError as e:
            raise ValueError(f"--{link_flag}: {e}") from None
        tiers.append(TierConfig(name=name, num_pages=int(pages), page_bytes=shard_bytes,
                                link=link.name, link_latency_s=link.latency_s,
                                link_bytes_per_s=link.bytes_per_s))
    return tuple(tiers)


def check_host_tier_memory(tiers: tuple[TierConfig, ...], tp: int,
                           memory: Optional[int] = None) -> None:
    """Refuses a host tier whose pages (every shard's, as the jax engine copies them into
    this process) cannot fit this machine's physical memory (`memory`, None: this
    machine's).

    Raises:
      ValueError: naming the host tier's flags, its pages, their bytes and the memory.
    """
    memory = physical_memory() if memory is None else memory
    for tier in tiers:
        if tier.name != "host" or memory is None:
            continue
        page_bytes = tier.page_bytes * tp  # the shards of a page, all in this process
        cap = memory // page_bytes
        if tier.num_pages > cap:
            raise ValueError(f"--kv_host_gb/--kv_host_pages: {tier.num_pages:,} host KV pages "
                             f"of {page_bytes:,} B are {tier.num_pages * page_bytes / 2**30:,.1f}"
                             f" GiB, above the cap of {cap:,} pages: the jax engine copies "
                             f"them into this machine's {memory / 2**30:.1f} GiB of memory")


def _size(limits: object, name: str) -> Optional[tuple[str, float]]:
    """(flag, value) of tier `name`'s size, or None when unset."""
    gb, pages = getattr(limits, f"kv_{name}_gb"), getattr(limits, f"kv_{name}_pages")
    if gb is not None and pages is not None:
        raise ValueError(f"--kv_{name}_gb={gb} and --kv_{name}_pages={pages} both set; "
                         "give one")
    if pages is not None:
        return f"kv_{name}_pages", pages
    return None if gb is None else (f"kv_{name}_gb", gb)


def engine_kv_shape(engine: object) -> tuple[Optional[ModelConfig], int, int]:
    """`(model, tp, KV dtype bytes)` of an engine spec, for `tier_configs`: the jax
    engine's KV is of its dtype, and a checkpoint's model without a preset has no shape
    here (then only page counts size a tier)."""
    name = getattr(engine, "model")
    model = PRESETS.get(name)
    dtype = getattr(engine, "dtype", "bfloat16")  # the simulator prices bf16 KV
    return model, int(getattr(engine, "tp")), 4 if dtype == "float32" else DTYPE_BYTES
