"""When an arrived request joins a scheduler's queue: at once, or after the engine's front end.

An engine may declare a front end (`engine_api.FrontEnd`): the serving stack that a
request crosses before its engine's scheduler sees it (`delay_s`), and planning one
step ahead (`plans_ahead`, vLLM's async scheduling: step N+1 is planned while step N
runs, so a request that reaches the queue during step N joins the plan of step N+2).
`ArrivalJoin` turns that into the two questions the scheduler asks: when is a request
due to join (`visible_s`), and up to which arrivals join at a plan made now
(`due_end`). With no front end (`NO_FRONT_END`, every engine of this tree but the
simulator under a serving engine's profile) both answers are the arrival times
themselves, compared with the same floats as before.

Planning ahead and leaps (`core.loop.leap`): a leap stops at the first step that starts
at or after a request is due, and the planned steps from there join it; with planning
ahead the plan made at that step still sees the queue as of the step before (no request
was due then, or the leap would have stopped earlier), and the plan after joins it, so
leaped and step-by-step runs plan the same steps. Arrivals joining inside a leap
(`Policy.arrivals_wait`) are not taken where the engine plans ahead.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
from numpy.typing import NDArray

from orca_jax.core.step.engine_api import FrontEnd


class ArrivalJoin:
    """Which arrived requests join the queue at a plan (the front end's delay and lag).

    Args:
      front_end: the engine's (`Engine.front_end`).
      horizon: rows of the request table (in arrival order) past which none is pending
        here (a cluster's replica: one past its last submission; it grows as it gets more).
    """

    def __init__(self, front_end: FrontEnd, horizon: int) -> None:
        self.horizon = horizon
        self.delay_s = float(front_end.delay_s)
        self.plans_ahead = bool(front_end.plans_ahead)
        # When the plan before this one was made (None: none yet, or the engine was idle).
        self._previous_plan_s: Optional[float] = None

    @property
    def delays(self) -> bool:
        """Whether requests join later than they arrive (a delay or planning ahead)."""
        return self.delay_s > 0.0 or self.plans_ahead

    def visible_s(self, arrival_s: float) -> float:
        """When a request that arrived at `arrival_s` reaches the scheduler's queue."""
        return arrival_s + self.delay_s

    def cutoff_s(self, now_s: float, busy: bool) -> float:
        """The time a plan made at `now_s` sees arrivals up to, and notes the plan.

        Args:
          now_s: the virtual clock.
          busy: whether requests are running (an engine planning ahead is planning
            while the step before runs; an idle one plans at once).
        """
        previous, self._previous_plan_s = self._previous_plan_s, now_s
        if self.plans_ahead and busy and previous is not None:
            return previous
        return now_s

    def due_end(self, arrival_s: NDArray[np.float64],  # [N] non-decreasing
                first: int, cutoff_s: float) -> int:
        """One past the last request from `first` on that has reached the queue by
        `cutoff_s` (`first` itself if it has not): `visible_s(a) <= cutoff_s`, the same
        comparison `visible_s` is checked with, so a clock moved to a request's
        `visible_s` always joins it."""
        delay = self.delay_s
        size = arrival_s.size
        if arrival_s[first] + delay > cutoff_s:  # most plans: nobody new yet
            return first
        end = first + 1
        if end < size and arrival_s[end] + delay <= cutoff_s:
            end = int(arrival_s.searchsorted(cutoff_s - delay, "right"))
            # `cutoff - delay` rounds; the sums decide, as `visible_s` makes them.
            while end > first + 1 and arrival_s[end - 1] + delay > cutoff_s:
                end -= 1
            while end < size and arrival_s[end] + delay <= cutoff_s:
                end += 1
        return end
