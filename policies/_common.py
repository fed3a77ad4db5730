"""Shared mechanics of the ranking policies: pack a ranked list into a plan, cache predictions.

Most policies in this package differ only in how they *rank* requests (shortest
remaining work, MLFQ level, tenant counter, priority, deadline). `plan_in_order`
turns a ranking into a legal plan with on-demand KV pages (`kv_reservation =
"none"`): it walks the ranking top-down, giving each request its uncomputed
tokens (a prefill chunk cut to the budget left, or one decode token) while the
batch cap, the token budget and the KV pool allow. A running request that is
not scheduled is *paused*: it keeps its pages and its progress. When a request
needs pages that are not free, the lowest-ranked running requests below it are
preempted by recompute (their pages freed) until it fits.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence

import numpy as np
from numpy.typing import NDArray

from orca_jax import Policy, RequestState, SchedulerView, StepPlan
from orca_jax.learned.length_predictor import checked_predictions, get_predictor


def plan_in_order(view: SchedulerView, order: NDArray[np.int64],  # [k]
                  *, preempt_over_cap: bool = False, admission_preempts: bool = True
                  ) -> StepPlan:
    """Schedules the ranked requests `order` top-down (best first).

    Args:
      view: the scheduler view.
      order: `[k]` request indices, best first; must hold every running request
        (those left out could never be chosen as preemption victims), and any
        waiting requests the policy is willing to admit.
      preempt_over_cap: preempt (recompute) the running requests ranked below a
        full batch instead of pausing them, so that the running set never
        exceeds the batch cap (strict priority frees their KV for its betters).
      admission_preempts: whether a waiting request may preempt lower-ranked
        running ones to get pages. Turn it off where ranks move both ways over
        time (MLFQ's demotions), or admissions and preemptions chase each other
        and every cycle throws away computed KV.

    Returns:
      The plan. Admissions stop at the first waiting request that cannot get
      its pages, so a large request is not overtaken forever by small ones
      ranked below it.
    """
    requests = view.requests
    order = np.asarray(order, dtype=np.int64)
    if order.size == 0:
        return StepPlan()
    cap, budget = view.max_batch_size, view.token_budget
    running = (requests.state[order] == RequestState.RUNNING).tolist()
    want = np.minimum(requests.num_uncomputed(order), budget)  # [k]
    pages = view.pages_needed(order, want).tolist()
    held = view.pages_held(order).tolist()
    want_list, order_list = want.tolist(), order.tolist()
    # Positions (ascending) of running requests holding pages: the victims of a request
    # at position p are those after p, taken lowest-ranked first (from the end).
    victims = [p for p in range(order.size) if running[p] and held[p] > 0]
    first_victim = 0  # victims[:first_victim] are ranked above the current position
    victim_pages = sum(held[p] for p in victims)
    is_preempted = [False] * order.size
    free, watermark = view.num_free_pages, view.watermark_pages
    ids: list[int] = []
    counts: list[int] = []
    preempted: list[int] = []
    admitted = False
    admitting = True
    for pos in range(order.size):
        if len(ids) >= cap or budget <= 0:
            break
        while first_victim < len(victims) and victims[first_victim] <= pos:
            victim_pages -= held[victims[first_victim]]
            first_victim += 1
        if is_preempted[pos] or (not running[pos] and not admitting):
            continue
        count = min(want_list[pos], budget)
        need = pages[pos] if count == want_list[pos] else int(
            view.pages_needed(order[pos:pos + 1], np.array([count]))[0])
        # An admission anywhere in the plan obliges the plan to leave the watermark free.
        floor = watermark if (admitted or not running[pos]) else 0
        usable = victim_pages if (running[pos] or admission_preempts) else 0
        if need - (free - floor) > usable:
            if not running[pos]:
                admitting = False
            continue  # pauses (running) or waits (waiting); preempting would not help
        while free - floor < need:
            victim = victims.pop()
            victim_pages -= held[victim]
            is_preempted[victim] = True
            preempted.append(order_list[victim])
            free += held[victim]
        ids.append(order_list[pos])
        counts.append(count)
        budget -= count
        free -= need
        admitted = admitted or not running[pos]
    if preempt_over_cap and len(ids) >= cap:
        # Everything left in victims[first_victim:] is running, unscheduled, below the cut.
        preempted += [order_list[p] for p in victims[first_victim:] if order_list[p] not in ids]
    return StepPlan(ids, counts, preempt=preempted)


class LastScheduled:
    """When the policy last scheduled each request (arrival if never): a starvation clock."""

    def __init__(self) -> None:
        self._at_s: Optional[NDArray[np.float64]] = None  # [N]

    def idle_s(self, view: SchedulerView, ids: NDArray[np.int64]) -> NDArray[np.float64]:
        """`[n]` seconds since each request was last scheduled (or arrived)."""
        if self._at_s is None:
            self._at_s = view.requests.arrival_s.copy()
        return view.now_s - self._at_s[ids]

    def mark(self, view: SchedulerView, plan: StepPlan) -> None:
        """Records that `plan`'s requests run now."""
        if self._at_s is None:
            self._at_s = view.requests.arrival_s.copy()
        self._at_s[plan.request_ids] = view.now_s


class PredictionCache:
    """Predicted output lengths, asked of the predictor once per request, when first seen."""

    def __init__(self, predictor: str) -> None:
        self.name = predictor
        self._predictor = get_predictor(predictor)
        self._predicted: Optional[NDArray[np.int64]] = None  # [N], 0 = not yet predicted

    def output_len(self, view: SchedulerView, ids: NDArray[np.int64]) -> NDArray[np.int64]:
        """`[n]` predicted output lengths of `ids` (arrived requests)."""
        if self._predicted is None:
            self._predicted = np.zeros(len(view.requests), dtype=np.int64)
        ids = np.asarray(ids, dtype=np.int64)
        new = ids[self._predicted[ids] == 0]
        if new.size:
            specs: Sequence = [view.requests.spec(int(i)) for i in new]
            self._predicted[new] = checked_predictions(
                self.name, self._predictor.predict_output_len(specs), new.size)
        return self._predicted[ids]


def candidates(view: SchedulerView) -> NDArray[np.int64]:
    """`[k]` every request a policy may schedule now: running, then waiting."""
    return np.concatenate([view.running, view.waiting])


@dataclasses.dataclass(kw_only=True)
class LengthRanked(Policy):
    """The knobs and prediction cache that length-ranking policies (sjf, srpt) share.

    Attributes:
      predictor: name of the output-length predictor (`oracle`, or a registered one).
      prompt_token_weight: work of one prompt token relative to one output token.
      starvation_s: how long a request may wait before it is promoted (inf: never).
    """

    predictor: str = "oracle"
    prompt_token_weight: float = 1.0
    starvation_s: float = math.inf
    _lengths: PredictionCache = dataclasses.field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.prompt_token_weight >= 0:
            raise ValueError(f"prompt_token_weight must be >= 0, got {self.prompt_token_weight}")
        if not self.starvation_s > 0:
            raise ValueError(f"starvation_s must be > 0, got {self.starvation_s}")
        self._lengths = PredictionCache(self.predictor)
