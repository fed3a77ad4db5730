"""Continuum's idea: keep an agent call's KV across a short tool pause, for a time-to-live.

An agent's next call holds its program's history as a prefix; freed after its
call, that history is cached but evictable, and under load a tool pause is long
enough for other requests to evict it, so the next call computes it again.
Continuum (KV cache time-to-live for multi-turn agents) pins a call's KV for a TTL
chosen from the tool call it waits on: worth it when the tool returns soon (the
pages come back into use before long), not when it takes long (the pages would sit
pinned, and other requests lack them).

* `continuum`: vLLM's scheduling (`vllm`, every knob) and, when a program's call
  finishes, its pages pinned for `pin_ttl_s` seconds if the tool pause that
  follows it (`SchedulerView.programs.next_pause_s`, the workload's planned pause)
  is at most `pin_ttl_s`, else freed at once. A pin ends early when the next call is
  admitted over the pages (docs/programs.md); pins need prefix caching (vllm's
  default) and one replica.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
from numpy.typing import NDArray

from orca_jax import SchedulerView, register
from policies.vllm import VLLM


@register("continuum")
@dataclasses.dataclass(kw_only=True)
class Continuum(VLLM):
    """vLLM with a call's KV pinned across a tool pause no longer than a TTL.

    Attributes:
      pin_ttl_s: the time-to-live of a pin, seconds; a call is pinned only when the
        pause after it is at most this (a longer pause frees its pages at once).
    """

    pin_ttl_s: float = 5.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if not (math.isfinite(self.pin_ttl_s) and self.pin_ttl_s > 0):
            raise ValueError(f"policy continuum: pin_ttl_s must be a finite number > 0, got "
                             f"{self.pin_ttl_s}")

    def kv_pin_s(self, view: SchedulerView, finished: NDArray[np.int64]  # [f]
                 ) -> NDArray[np.float64]:  # -> [f]
        programs = view.programs
        if programs is None:
            return np.zeros(len(finished))
        short = programs.next_pause_s(finished) <= self.pin_ttl_s  # [f]
        return np.where(short, self.pin_ttl_s, 0.0)
