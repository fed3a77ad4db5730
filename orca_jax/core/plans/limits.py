"""The limits a plan must keep and the run's targets: `StepLimits` (the `limits`
part of `SchedulerConfig`) and `SLOTargets` (its `slo` part), both read by the
plan checks and the view."""

from __future__ import annotations

import dataclasses
from typing import Optional


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepLimits:
    """What one step may hold and how long a run may go without progress.

    Attributes:
      max_num_seqs: most sequences in one step (the batch cap).
      max_num_tokens: most tokens computed in one step (the largest bucket).
      max_model_len: context limit: prompt + output of any request.
      token_buckets: step sizes T to pad to (default: powers of two up to the budget).
      no_progress_steps: the run fails (`no_progress`) after this many iterations
        in a row in which no request computed a token past the most it had ever
        computed, finished, was released or was rejected, while work remains (a
        livelock: preempting and readmitting forever).
    """

    max_num_seqs: int = 256
    max_num_tokens: int = 2048
    max_model_len: int = 2048
    token_buckets: Optional[tuple[int, ...]] = None
    no_progress_steps: int = 10_000

    def __post_init__(self) -> None:
        for field in ("max_num_seqs", "max_num_tokens", "max_model_len", "no_progress_steps"):
            if getattr(self, field) < 1:
                raise ValueError(f"SchedulerConfig.limits.{field} must be >= 1, "
                                 f"got {getattr(self, field)}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SLOTargets:
    """The run's service-level objectives (None: unset), for policies to read
    (`SchedulerView.ttft_slo_s`); the core does not enforce them.

    Attributes:
      ttft_slo_s: time to first token, seconds.
      tpot_slo_s: time per output token after the first, seconds.
    """

    ttft_slo_s: Optional[float] = None
    tpot_slo_s: Optional[float] = None

    def __post_init__(self) -> None:
        for field in ("ttft_slo_s", "tpot_slo_s"):
            value = getattr(self, field)
            if value is not None and not value > 0:
                raise ValueError(f"SchedulerConfig.slo.{field} must be > 0 or None, got {value}")
