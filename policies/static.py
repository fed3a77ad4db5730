"""Request-level (static) batching: the FasterTransformer baseline that Orca compares with.

A batch of up to `max_num_seqs` waiting requests is formed; it runs until its
longest member is done, and nobody joins mid-batch. Answers go back to their
clients together when the whole batch is done (`defer_release`), as a
request-level serving system returns a batch. Each member reserves its maximum
context, like Orca, so the comparison isolates the scheduling granularity.

With prefix caching active (`--prefix_caching=on`; it does not opt in itself),
a member's prompt starts past its cache hit at its admission, and its
reservation counts the hit pages it shares (`view.kv_budget`).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Optional

import numpy as np

from orca_jax import Policy, RequestState, SchedulerView, StepPlan, fit_to_budget, register
from policies._common import STEADY


@register("static")
@dataclasses.dataclass(kw_only=True)
class Static(Policy):
    """Static batching.

    Attributes:
      max_num_seqs: requests per batch (None: the scheduler's batch cap).
      kv_reservation: as Orca's (`max`).
      hold_batch_shape: pad every step of a batch to a bucket holding the whole
        batch, so finished members keep costing their rows until the batch is
        done (FasterTransformer's request-level batching). False lets the
        step shrink as members finish.
    """

    renamed_options = {"max_batch_size": "max_num_seqs"}

    max_num_seqs: Optional[int] = None
    hold_batch_shape: bool = True
    kv_reservation: str = "max"
    preempts: ClassVar[bool] = False  # so it refuses kv_reservation=none (Policy.preempts)
    stable_through_finishes: ClassVar[bool] = True  # see stable_steps
    defer_release: bool = dataclasses.field(default=True, init=False)
    _batch: np.ndarray = dataclasses.field(  # request indices of the current batch
        default_factory=lambda: np.zeros(0, np.int64), init=False, repr=False)

    def stable_steps(self, view: SchedulerView) -> Optional[int]:
        """Steady while its batch runs: nobody joins mid-batch, and the plan is the
        members not finished (one token each, the batch's shape held) until the last
        finishes; the release waits for the plan after the last. Through a member's
        finish (`stable_through_finishes`) the plan is the rest in the batch's order,
        its `min_bucket_tokens` (the shape) the same; `schedule()` notes nothing of a
        finish but the last's. Not after prefills (`stable_after_prefills`), kept
        simple: a batch's prefill steps are few beside its decodes."""
        self._keep_held(view)
        states = view.requests.state[self._batch]
        return STEADY if (states != RequestState.FINISHED).any() else None

    def schedule(self, view: SchedulerView) -> StepPlan:
        release = np.zeros(0, np.int64)
        self._keep_held(view)
        states = view.requests.state[self._batch]
        if self._batch.size and (states == RequestState.FINISHED).all():
            release, self._batch = self._batch, np.zeros(0, np.int64)
        if self._batch.size == 0:
            self._batch = self._form_batch(view)
        members = self._batch[view.requests.state[self._batch] != RequestState.FINISHED]
        if view.busy.size:  # through pipeline stages: the members not in a micro-batch in flight
            members = members[~np.isin(members, view.busy)]
        # Prefills that do not fit the step's budget together wait for the next step
        # (a prompt longer than the whole budget is chunked).
        left = view.requests.num_uncomputed(members)
        if view.prefix_caching:  # a member not yet admitted starts past its cache hit
            left = left - view.cached_tokens(members)
        members, tokens = fit_to_budget(members, left, view.max_num_tokens)
        # The batch keeps its shape until its longest member is done: finished members
        # still occupy (and cost) their rows, as in FasterTransformer.
        shape = min(int(self._batch.size), view.max_num_tokens) if self.hold_batch_shape else 0
        return StepPlan(members, tokens, release=release, min_bucket_tokens=shape)

    def _keep_held(self, view: SchedulerView) -> None:
        """Drops from the batch the members this replica no longer holds: a cluster's
        rebalancer migrated them (their new replica batches them there). Every other
        member is waiting, running, busy in a step in flight, or finished awaiting its
        release here."""
        if self._batch.size == 0:
            return
        here = np.concatenate([view.running, view.waiting, view.busy, view.unreleased])
        held = np.isin(self._batch, here)
        if not held.all():
            self._batch = self._batch[held]

    def _form_batch(self, view: SchedulerView) -> np.ndarray:
        cap = min(self.max_num_seqs or view.max_num_seqs, view.max_num_seqs)
        budget = view.kv_budget()  # the KV admissions may take now
        batch: list[int] = []
        for request in view.waiting[:cap].tolist():
            prompt = int(view.requests.num_uncomputed([request])[0])
            if view.prefix_caching:  # its admission starts past its cache hit
                prompt -= int(view.cached_tokens([request])[0])
            prompt = min(prompt, view.max_num_tokens)
            if not budget.take(request, prompt):
                break
            batch.append(request)
        return np.asarray(batch, dtype=np.int64)
