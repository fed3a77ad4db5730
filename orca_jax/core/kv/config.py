"""KVConfig: a scheduler's KV memory settings (the `kv` part of `SchedulerConfig`).

The layout's checks live here, beside the layouts, so no code outside this folder
branches on the layout: a cluster asks `receives_transfers` instead.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any

from orca_jax.core.kv.pool import KV_LAYOUTS

# The run's prefix-caching switch (`KVConfig.prefix_caching`, `--prefix_caching`):
# `policy` each policy's own opt-in (`Policy.prefix_caching`), `on` every policy, `off` none.
PREFIX_CACHING_MODES = ("policy", "on", "off")
# 0.2's boolean knob, read for one release: True left it to the policy, False turned it off.
_OLD_KNOB = "enable_prefix_caching"


def prefix_caching_of_old_knob(enable: Any) -> str:
    """The `prefix_caching` mode 0.2's `enable_prefix_caching=enable` meant (True: `policy`,
    False: `off`), with one DeprecationWarning naming the new knob."""
    mode = "policy" if enable else "off"
    warnings.warn(f"KVConfig.enable_prefix_caching={enable!r} is deprecated and goes in the next "
                  f"release; write prefix_caching={mode!r} (one of {PREFIX_CACHING_MODES})",
                  DeprecationWarning, stacklevel=3)
    return mode


class _TakesOldKnob(type):
    """KVConfig's metaclass: `KVConfig(enable_prefix_caching=...)` (0.2's name) builds the
    `prefix_caching` mode it meant, with a DeprecationWarning, for one release."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if _OLD_KNOB in kwargs:
            if "prefix_caching" in kwargs:
                raise TypeError(f"KVConfig: {_OLD_KNOB} (deprecated) and prefix_caching both "
                                "given; give only prefix_caching")
            kwargs["prefix_caching"] = prefix_caching_of_old_knob(kwargs.pop(_OLD_KNOB))
        return super().__call__(*args, **kwargs)

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
class KVConfig(metaclass=_TakesOldKnob):
    """The KV pool's size, page, watermark, layout and prefix caching.

    Attributes:
      num_kv_pages: usable KV pages in the pool.
      page_size: tokens per KV page.
      watermark_pages: free pages an admission must leave (vLLM v0's watermark).
      kv_layout: `paged` (any free page serves) or `buddy` (each request's
        reservation one contiguous power-of-two block from a buddy allocator, as
        the vLLM paper's Orca baselines; needs a reserving `kv_reservation`).
      prefix_caching: the run's switch for sharing cached KV pages of common
        prefixes between requests (`PREFIX_CACHING_MODES`): `policy` (the
        default) leaves it to each policy's opt-in (`Policy.prefix_caching`),
        `on` turns it on for every policy (one that declares
        `Policy.prefix_caching_unsupported` is refused), `off` for none. The
        switch wins over a policy's opt-in; without caching every run is exactly
        as without a cache. Not with the `buddy` layout. (0.2's boolean
        `enable_prefix_caching` still sets it for one release: True is `policy`,
        False `off`.)
      tiers: slower tiers under the device (host, then disk), none by default
        (`orca_jax.core.kv.lower_tiers`).
      cache_policy: the slower tiers' cache policy, a registered name
        (`orca_jax.core.kv.cache_policies`); with `cache_policy_opts`, its knobs.
      kv_pin_s: seconds a finished program call's KV pages stay pinned for its
        program's next call (0: freed at once; inf: until that call is admitted); each
        policy decides per call (`Policy.kv_pin_s`, whose default reads this). With
        prefix caching only (docs/programs.md).
    """

    num_kv_pages: int = 4096
    page_size: int = 16
    watermark_pages: int = 0
    kv_layout: str = "paged"
    prefix_caching: str = "policy"
    tiers: tuple[TierConfig, ...] = ()
    cache_policy: str = "lru"
    cache_policy_opts: tuple[tuple[str, object], ...] = ()
    kv_pin_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.kv_pin_s >= 0:  # inf is allowed: until the next call
            raise ValueError(f"SchedulerConfig.kv.kv_pin_s must be >= 0 (seconds; inf: until "
                             f"the program's next call), got {self.kv_pin_s}")
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
        if self.prefix_caching not in PREFIX_CACHING_MODES:
            raise ValueError(f"SchedulerConfig.kv.prefix_caching {self.prefix_caching!r} is not "
                             f"one of {PREFIX_CACHING_MODES}")
        if self.prefix_caching == "on" and self.kv_layout == "buddy":
            raise ValueError("SchedulerConfig.kv.prefix_caching 'on' shares single KV pages and "
                             "kv_layout 'buddy' hands out whole blocks; choose one")

    @property
    def enable_prefix_caching(self) -> bool:
        """0.2's read of the switch (deprecated): whether it lets any policy cache."""
        warnings.warn("KVConfig.enable_prefix_caching is deprecated and goes in the next release; "
                      "read KVConfig.prefix_caching", DeprecationWarning, stacklevel=2)
        return self.prefix_caching != "off"

    @property
    def receives_transfers(self) -> bool:
        """Whether a pool of these settings can take a transferred request's pages (a
        disaggregated decode replica): they are reserved before its admission, which
        only the paged layout can place page by page."""
        return self.kv_layout == "paged"
