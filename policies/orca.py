"""Orca (OSDI'22): iteration-level FCFS scheduling with a batch cap and KV reservation.

Every iteration, every running request gets its next tokens (its whole prompt in
one step, or one decode token); then waiting requests are admitted in arrival
order while the batch cap, the token budget and the KV pool allow. A request
reserves its maximum context at admission (`kv_reservation = "max"`), so a
running request never runs out of KV and nothing is ever preempted. Finished
requests leave at once and new ones join on the next step.

The paper has no per-step token limit: it runs a whole prompt in one
iteration. Ours has one (`max_num_tokens`, the largest compiled bucket). A
prompt longer than that minus one token per running request cannot run whole
until some of them finish, so it takes what is left of this step's budget as
a chunk, and its rest on the next steps: the nearest the bucket allows to the
paper's whole prompt at once. The alternative, letting the queue move on past it, was
rejected: it breaks FCFS, and a steady stream of short prompts could then
starve a long one forever. Waiting until enough running decodes finish would
stall the whole queue (FCFS) for as long as their outputs last. A prompt that
does fit beside the decodes but not in this step's budget left (a running
prefill holds it) still waits to run whole, which takes only until that
prefill is done: the next step.

With prefix caching active (`--prefix_caching=on`; Orca itself has no prefix
cache, so it does not opt in), an admission's prompt is the part past its cache
hit, and its reservation (max context) counts the hit pages it shares: the
core's `kv_budget` asks for the pages past them and the free hit pages once.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Optional

from orca_jax import Policy, SchedulerView, StepPlan, fit_to_budget, register
from policies._common import STEADY


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
    preempts: ClassVar[bool] = False  # so it refuses kv_reservation=none (Policy.preempts)
    stable_through_finishes: ClassVar[bool] = True  # see stable_steps
    stable_after_prefills: ClassVar[bool] = True

    def stable_steps(self, view: SchedulerView) -> Optional[int]:
        """Steady while its plan now admits nobody: every running request holds its whole
        reservation (no page is taken), so while only decodes happen the queue, the
        budget, the seats and the KV its admissions may take all stay, and so does the
        plan. It keeps no bookkeeping and reads no clock: asking is planning once.
        Through finishes and after prefills that ended (`stable_through_finishes`,
        `stable_after_prefills`) asking is planning the step `schedule()` would plan:
        each running request's rest is one token, in `view.running`'s order."""
        return STEADY if self.schedule(view).request_ids.size == view.running.size else None

    def schedule(self, view: SchedulerView) -> StepPlan:
        cap = min(self.max_num_seqs or view.max_num_seqs, view.max_num_seqs)
        budget = view.max_num_tokens
        running = view.running
        # Each running request gets its whole rest (a prompt, or 1 decode token); only a
        # prompt chunked at admission is cut again, in FCFS order.
        running, tokens = fit_to_budget(running, view.requests.num_uncomputed(running), budget)
        ids, counts = running.tolist(), tokens.tolist()
        budget -= int(tokens.sum())
        kv_budget = view.kv_budget(ids, counts)  # the KV admissions may take now
        # Each pass admits one request or stops, and none passes the cap: the queue's
        # first `cap - len(ids)` requests are all it can reach (an overloaded run's queue
        # grows with the run; reading it whole made each step O(queue)).
        for request in view.waiting[:max(cap - len(ids), 0)].tolist():
            if len(ids) >= cap or budget <= 0:
                break
            prompt = int(view.requests.num_uncomputed([request])[0])
            if view.prefix_caching:  # an admission starts past its cache hit
                prompt -= int(view.cached_tokens([request])[0])
            # Every request in `ids` takes at least one token a step until it finishes, so
            # a prompt over the rest of the whole budget waits for decodes to end unless it
            # is chunked (see the module docstring).
            if budget < prompt <= view.max_num_tokens - len(ids):
                break
            count = min(prompt, budget)
            if not kv_budget.take(request, count):
                break
            ids.append(request)
            counts.append(count)
            budget -= count
        return StepPlan(ids, counts)
