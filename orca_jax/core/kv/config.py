"""KVConfig: a scheduler's KV memory settings (the `kv` part of `SchedulerConfig`).

The layout's checks live here, beside the layouts, so no code outside this folder
branches on the layout: a cluster asks `receives_transfers` instead.
"""

from __future__ import annotations

import dataclasses
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
    """

    num_kv_pages: int = 4096
    page_size: int = 16
    watermark_pages: int = 0
    kv_layout: str = "paged"
    prefix_caching: str = "policy"

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
