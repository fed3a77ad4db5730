"""KVConfig: a scheduler's KV memory settings (the `kv` part of `SchedulerConfig`).

The layout's checks live here, beside the layouts, so no code outside this folder
branches on the layout: a cluster asks `receives_transfers` instead.
"""

from __future__ import annotations

import dataclasses
import math

from orca_jax.core.kv.pool import KV_LAYOUTS

TIER_NAMES = ("host", "disk")  # the slower tiers, in order under the device


@dataclasses.dataclass(frozen=True, kw_only=True)
class TierConfig:
    """One slower KV tier under the device, and the link joining it to the tier above.

    Attributes:
      name: `host` (DRAM, under the device) or `disk` (under the host).
      num_pages: pages it holds (KV pages of the device's page size).
      page_bytes: KV bytes of one page (every layer, K and V).
      link: the link preset's name (`orca_jax.specs.hardware.KV_LINK_PRESETS`).
      link_latency_s: its fixed time per transfer.
      link_bytes_per_s: its bandwidth, one direction.
    """

    name: str
    num_pages: int
    page_bytes: int
    link: str
    link_latency_s: float
    link_bytes_per_s: float

    def __post_init__(self) -> None:
        if self.name not in TIER_NAMES:
            raise ValueError(f"KV tier {self.name!r} is not one of {TIER_NAMES}")
        if self.num_pages < 1:
            raise ValueError(f"KV tier {self.name!r} holds {self.num_pages} pages; it must "
                             "hold at least one")
        if self.page_bytes < 1:
            raise ValueError(f"KV tier {self.name!r}: page_bytes must be >= 1, "
                             f"got {self.page_bytes}")
        if not (math.isfinite(self.link_bytes_per_s) and self.link_bytes_per_s > 0
                and math.isfinite(self.link_latency_s) and self.link_latency_s >= 0):
            raise ValueError(f"KV tier {self.name!r}: link {self.link!r} needs a bandwidth "
                             f"> 0 and a latency >= 0")


@dataclasses.dataclass(frozen=True, kw_only=True)
class KVConfig:
    """The KV pool's size, page, watermark, layout and prefix caching.

    Attributes:
      num_kv_pages: usable KV pages in the pool.
      page_size: tokens per KV page.
      watermark_pages: free pages an admission must leave (vLLM v0's watermark).
      kv_layout: `paged` (any free page serves) or `buddy` (each request's
        reservation one contiguous power-of-two block from a buddy allocator, as
        the vLLM paper's Orca baselines; needs a reserving `kv_reservation`).
      enable_prefix_caching: share cached KV pages of common prefixes between
        requests, for policies that opt in (`Policy.prefix_caching`); off, every
        run is exactly as without caching. Not with the `buddy` layout.
      tiers: slower tiers under the device (host, then disk), none by default
        (`orca_jax.core.kv.lower_tiers`).
      cache_policy: the slower tiers' cache policy, a registered name
        (`orca_jax.core.kv.cache_policies`); with `cache_policy_opts`, its knobs.
    """

    num_kv_pages: int = 4096
    page_size: int = 16
    watermark_pages: int = 0
    kv_layout: str = "paged"
    enable_prefix_caching: bool = True
    tiers: tuple[TierConfig, ...] = ()
    cache_policy: str = "lru"
    cache_policy_opts: tuple[tuple[str, object], ...] = ()

    def __post_init__(self) -> None:
        for field in ("num_kv_pages", "page_size"):
            if getattr(self, field) < 1:
                raise ValueError(f"SchedulerConfig.kv.{field} must be >= 1, "
                                 f"got {getattr(self, field)}")
        if not 0 <= self.watermark_pages < self.num_kv_pages:
            raise ValueError(f"SchedulerConfig.kv.watermark_pages must be in [0, num_kv_pages="
                             f"{self.num_kv_pages}), got {self.watermark_pages}")
        if self.kv_layout not in KV_LAYOUTS:
            raise ValueError(f"SchedulerConfig.kv.kv_layout {self.kv_layout!r} is not one of "
                             f"{KV_LAYOUTS}")
        names = tuple(tier.name for tier in self.tiers)
        if names not in ((), TIER_NAMES[:1], TIER_NAMES):
            raise ValueError(f"SchedulerConfig.kv.tiers {names}: give a host tier, or a host "
                             "and a disk tier, in that order")
        if any(tier.page_bytes != self.tiers[0].page_bytes for tier in self.tiers):
            raise ValueError("SchedulerConfig.kv.tiers: every tier's page_bytes must agree")
        if self.tiers and self.kv_layout != "paged":
            raise ValueError("SchedulerConfig.kv.tiers need the paged KV layout")

    @property
    def receives_transfers(self) -> bool:
        """Whether a pool of these settings can take a transferred request's pages (a
        disaggregated decode replica): they are reserved before its admission, which
        only the paged layout can place page by page."""
        return self.kv_layout == "paged"
