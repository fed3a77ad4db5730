"""SamplingConfig: how every request of a run samples (the `sampling` part of
`SchedulerConfig`); `packing.SamplingArrays` holds it per request."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingConfig:
    """The sampling parameters of every request (greedy by default) and the run's seed.

    Attributes:
      temperature: softmax temperature (0: greedy).
      top_k: keep the k likeliest tokens (0: all).
      top_p: keep the likeliest tokens up to this probability mass (1: all).
      seed: mixed into every request's sampling seed; policies and routers read it
        (`SchedulerView.seed`) to seed their own randomness.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"SchedulerConfig.sampling.temperature must be >= 0, "
                             f"got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"SchedulerConfig.sampling.top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SchedulerConfig.sampling.top_p must be in (0, 1], "
                             f"got {self.top_p}")
        if not 0 <= self.seed < 2**64:
            raise ValueError(f"SchedulerConfig.sampling.seed must be in [0, 2**64), "
                             f"got {self.seed}")
