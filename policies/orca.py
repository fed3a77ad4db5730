"""Orca (OSDI'22): iteration-level FCFS scheduling with a batch cap and KV reservation.

Every iteration, every running request gets its next tokens (its whole prompt in
one step, or one decode token); then waiting requests are admitted in arrival
order while the batch cap, the token budget and the KV pool allow. A request
reserves its maximum context at admission (`kv_reservation = "max"`), so a
running request never runs out of KV and nothing is ever preempted. Finished
requests leave at once and new ones join on the next step.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from orca_jax import Policy, SchedulerView, StepPlan, fit_to_budget, register


@register("orca")
@dataclasses.dataclass(kw_only=True)
class Orca(Policy):
    """FCFS continuous batching.

    Attributes:
      max_num_seqs: the batch cap (None: the scheduler's).
      kv_reservation: `max` as in the paper; `pow2` and `exact` give the
        vLLM paper's Orca (Pow2) and Orca (Oracle) variants.
    """

    renamed_options = {"max_batch_size": "max_num_seqs"}

    max_num_seqs: Optional[int] = None
    kv_reservation: str = "max"

    def schedule(self, view: SchedulerView) -> StepPlan:
        cap = min(self.max_num_seqs or view.max_num_seqs, view.max_num_seqs)
        budget = view.max_num_tokens
        running = view.running
        # Each running request gets its whole rest (a prompt, or 1 decode token); only a
        # prompt longer than the budget is chunked, in FCFS order.
        running, tokens = fit_to_budget(running, view.requests.num_uncomputed(running), budget)
        ids, counts = running.tolist(), tokens.tolist()
        budget -= int(tokens.sum())
        free_pages = view.num_free_pages - view.watermark_pages
        for request in view.waiting.tolist():
            if len(ids) >= cap or budget <= 0:
                break
            # A prompt longer than the whole budget is chunked rather than starved.
            count = min(int(view.requests.num_uncomputed([request])[0]), view.max_num_tokens)
            if count > budget:
                break
            pages = int(view.pages_needed([request], [count])[0])
            if pages > free_pages:
                break
            ids.append(request)
            counts.append(count)
            budget -= count
            free_pages -= pages
        return StepPlan(ids, counts)
