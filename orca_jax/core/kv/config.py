"""KVConfig: a scheduler's KV memory settings (the `kv` part of `SchedulerConfig`).

The layout's checks live here, beside the layouts, so no code outside this folder
branches on the layout: a cluster asks `receives_transfers` instead.
"""

from __future__ import annotations

import dataclasses

from orca_jax.core.kv.pool import KV_LAYOUTS


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
    """

    num_kv_pages: int = 4096
    page_size: int = 16
    watermark_pages: int = 0
    kv_layout: str = "paged"
    enable_prefix_caching: bool = True

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

    @property
    def receives_transfers(self) -> bool:
        """Whether a pool of these settings can take a transferred request's pages (a
        disaggregated decode replica): they are reserved before its admission, which
        only the paged layout can place page by page."""
        return self.kv_layout == "paged"
