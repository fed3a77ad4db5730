"""The progress watchdog: a run in which nothing moves forward fails instead of spinning.

The plan check's `no_progress` catches a plan that runs nothing while nothing
can change. A livelock runs something every step and throws it away again
(preempting and readmitting forever), so the watchdog measures progress as
something a run cannot undo: a request computing a token past the most it has
ever computed, or a request leaving (finished, released or rejected).
"""

from __future__ import annotations

from typing import Callable

import numpy as np
from numpy.typing import NDArray

from orca_jax.core.plans.plan import PlanError
from orca_jax.core.requests.request_table import count_nonzero


class ProgressWatchdog:
    """Counts the iterations in a row without progress; raises at `limit`.

    Args:
      num_requests: N, the run's requests.
      limit: iterations without progress that fail the run (`no_progress_steps`).
    """

    def __init__(self, num_requests: int, limit: int) -> None:
        self.limit = limit
        self._most_computed = np.zeros(num_requests, dtype=np.int64)  # [N]
        self._stalled = 0

    def computed(self, ids: NDArray[np.int64],  # [n] distinct
                 num_computed: NDArray[np.int64]) -> bool:  # [n]
        """Records the requests' computed counts after a step; True if one got further.
        That is progress, counted here (as `progressed`): the caller counts the iteration
        only when it returns False."""
        gained = num_computed > self._most_computed[ids]
        num_gained = count_nonzero(gained)  # gained.any(), without its Python frame
        if not num_gained:
            return False
        if num_gained == ids.size:  # most steps: every one got further, no masks needed
            self._most_computed[ids] = num_computed
        else:
            self._most_computed[ids[gained]] = num_computed[gained]
        self._stalled = 0
        return True

    def gains(self, ids: NDArray[np.int64],  # [n]
              num_computed: NDArray[np.int64]) -> int:  # [n]
        """How many of `ids` `computed(ids, num_computed)` would count as getting further
        (reads only): progress where any."""
        return int(count_nonzero(num_computed > self._most_computed[ids]))

    def all_computed(self, ids: NDArray[np.int64],  # [n] distinct
                     num_computed: NDArray[np.int64]) -> None:  # [n]
        """`computed(ids, num_computed)` where every one of `ids` is known to get further:
        `gains` counted all of them for no more tokens each, and nothing recorded since (a
        leap, between its chance and its end). One write, not `computed`'s reads."""
        self._most_computed[ids] = num_computed
        self._stalled = 0

    def progressed(self) -> None:
        """Counts one iteration that made progress (the cheap path: most iterations)."""
        self._stalled = 0

    def iteration(self, progressed: bool, *, policy: str, step: int, now_s: float,
                  situation: Callable[[], str]) -> None:
        """Counts one iteration (that did not just wait for an arrival).

        Raises:
          PlanError: rule `no_progress`, on the `limit`-th iteration in a row without
            progress; `situation()` (queues, preemptions: built only then) goes into
            its message.
        """
        if progressed:
            self._stalled = 0
            return
        self._stalled += 1
        if self._stalled >= self.limit:
            raise PlanError(policy, "no_progress",
                            f"no request gained a computed token or finished in {self.limit} "
                            f"iterations (step {step}, {now_s:.6f} s; {situation()}); raise "
                            "SchedulerConfig.limits.no_progress_steps if the policy means it")
