"""Earliest deadline first, with a knob for requests that can no longer meet theirs.

A request's deadline is its own `deadline_s` (a completion deadline) or, when
`ttft_slo_s` is set and it has none, `arrival_s + ttft_slo_s` (a first-token
deadline). Requests without either go last. Every step, running and waiting
requests are ranked by deadline (ties by arrival) and the best `max_num_seqs`
run; the others are paused (running ones keep their KV). When pages run out,
the lowest-ranked running requests are preempted by recompute.

Feasibility is estimated with one number, `time_per_token_s`, the seconds one
output token takes (one decode step): a request is infeasible when
`now + tokens_left * time_per_token_s > deadline`, where `tokens_left` is its
remaining output for a completion deadline, and 1 (0 once its first token is
out) for a first-token deadline. The core cannot drop a request, so
`infeasible="deprioritize"` moves infeasible requests after every feasible one
(requests without a deadline count as feasible: they cannot miss it), keeping
deadline order among them; `infeasible="ignore"` is plain EDF.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Literal, Optional

import numpy as np
from numpy.typing import NDArray

from orca_jax import Policy, RequestState, SchedulerView, StepPlan, plan_in_order, register
from policies._common import STEADY, admits_nobody, candidates


@register("edf")
@dataclasses.dataclass(kw_only=True)
class EDF(Policy):
    """Preemptive (by pausing) earliest deadline first.

    Attributes:
      ttft_slo_s: first-token SLO giving a deadline to requests without one (None: none).
      infeasible: `deprioritize` or `ignore` requests that can no longer meet theirs.
      time_per_token_s: estimated seconds per output token, for feasibility.
    """

    ttft_slo_s: Optional[float] = None
    infeasible: Literal["deprioritize", "ignore"] = "deprioritize"
    time_per_token_s: float = 0.02

    def __post_init__(self) -> None:
        if self.infeasible not in ("deprioritize", "ignore"):
            raise ValueError(f"infeasible must be 'deprioritize' or 'ignore', got "
                             f"{self.infeasible!r}")
        if self.ttft_slo_s is not None and not self.ttft_slo_s > 0:
            raise ValueError(f"ttft_slo_s must be > 0, got {self.ttft_slo_s}")
        if not self.time_per_token_s >= 0:
            raise ValueError(f"time_per_token_s must be >= 0, got {self.time_per_token_s}")

    def deadlines(self, view: SchedulerView, ids: NDArray[np.int64]
                  ) -> tuple[NDArray[np.float64], NDArray[np.int64]]:
        """`([n] deadline, [n] output tokens due by it)` of each request (inf: none)."""
        requests = view.requests
        deadline = requests.deadline_s[ids]
        tokens_left = requests.remaining_output(ids)
        if self.ttft_slo_s is not None:
            by_slo = np.isinf(deadline)
            deadline = np.where(by_slo, requests.arrival_s[ids] + self.ttft_slo_s, deadline)
            first_due = np.isnan(requests.first_token_s[ids]).astype(np.int64)
            tokens_left = np.where(by_slo, first_due, tokens_left)
        return deadline, tokens_left

    def order(self, view: SchedulerView) -> tuple[NDArray[np.int64], NDArray[np.int64],
                                                  NDArray[np.float64]]:
        """`([k] the running and waiting requests by (late, deadline, index), [k] each
        one's output tokens due by its deadline, [k] its deadline)`, in that order."""
        ids = candidates(view)
        deadline, tokens_left = self.deadlines(view, ids)
        late = np.zeros(ids.size, dtype=bool)
        if self.infeasible == "deprioritize":
            # A first-token deadline already met (nothing due) cannot be missed any more.
            late = (tokens_left > 0) & (view.now_s + tokens_left * self.time_per_token_s
                                        > deadline)
        ranked = np.lexsort((ids, deadline, late))
        return ids[ranked], tokens_left[ranked], deadline[ranked]

    def schedule(self, view: SchedulerView) -> StepPlan:
        return plan_in_order(view, self.order(view)[0])

    stable_through_finishes: ClassVar[bool] = True  # see stable_steps

    def stable_steps(self, view: SchedulerView) -> Optional[int]:
        """Steady while every running request ranks above every waiting one, nobody
        waiting could be admitted (`admits_nobody`), and no running request's rank can
        move. Deadlines are fixed; with `infeasible="deprioritize"` the rank also holds
        whether a request looks late, which moves with the clock and each token: it
        cannot move for a running request with no deadline or nothing due by it (a
        decoding request's first token is out), so every running one must be such;
        a waiting request can only turn late as the clock moves, which ranks it lower
        still. No bookkeeping: any number of steps. Through finishes
        (`stable_through_finishes`): the rest keep their ranks and so their order, and
        the question is asked again of the state after them. Not after prefills
        (`stable_after_prefills`): its plan runs in rank order, not `view.running`'s."""
        order, tokens_left, deadline = self.order(view)
        num_running = view.running.size
        if not (view.requests.state[order[:num_running]] == RequestState.RUNNING).all():
            return None
        if self.infeasible == "deprioritize":
            fixed = np.isinf(deadline[:num_running]) | (tokens_left[:num_running] == 0)
            if not fixed.all():
                return None
        return STEADY if admits_nobody(view) else None
