"""Sarathi-Serve (OSDI'24): stall-free batching under a per-step token budget.

Each step is filled in a fixed order: first one decode token for every running
request whose prefill is done, then the next chunks of running requests whose
prefill is partly done, then new prefills from the waiting queue (FCFS), each
prefill chunk cut to the budget left. A long prompt therefore never holds up
the decodes already running: it is spread over as many steps as it takes.

KV pages are taken on demand (`kv_reservation` none). A waiting request is
admitted only if the pages of its whole known sequence fit the free pool
(Sarathi-Serve's `can_allocate`), and while fewer than `max_num_seqs` run. When
a running request cannot get its pages, the most recently admitted running
request not yet scheduled this step is preempted by recompute (possibly the
request itself), as Sarathi-Serve pops the tail of its running queue; a step
that preempted admits nobody (as vLLM; Sarathi-Serve's own admission test
would fail then anyway in all but corner cases).

With prefix caching active (`--prefix_caching=on`; Sarathi-Serve's scheduler
has no prefix cache, so it does not opt in), a new prefill starts past its
cache hit: it wants only its uncached tokens, `can_allocate` counts the pages
past its hits (as vLLM's `get_computed_blocks`), and a preemption frees a
shared page only with its last holder.

Decodes are charged to the budget too, one token each; if more requests
decode than the budget holds (a batch cap above the budget), the oldest get
the tokens and the rest wait a step, since a step can never exceed the budget.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Optional

import numpy as np
from numpy.typing import NDArray

from orca_jax import Policy, SchedulerView, StepPlan, register
from policies._common import STEADY


@register("sarathi")
@dataclasses.dataclass(kw_only=True)
class Sarathi(Policy):
    """Stall-free batching with chunked prefills.

    Attributes:
      max_num_tokens: tokens per step, decodes included (Sarathi-Serve's chunk
        size); also capped by the scheduler's `max_num_tokens`.
      max_num_seqs: most running requests (None: the scheduler's batch cap).
    """

    renamed_options = {"token_budget": "max_num_tokens"}
    stable_through_finishes: ClassVar[bool] = True  # see stable_steps
    stable_after_prefills: ClassVar[bool] = True

    max_num_tokens: int = 512
    max_num_seqs: Optional[int] = None

    def __post_init__(self) -> None:
        if self.max_num_tokens < 1:
            raise ValueError(f"max_num_tokens must be >= 1, got {self.max_num_tokens}")
        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1 or None, got {self.max_num_seqs}")

    def schedule(self, view: SchedulerView) -> StepPlan:
        budget = min(self.max_num_tokens, view.max_num_tokens)
        running = view.running
        decoding = view.requests.prefill_done(running)  # [r]
        decodes = running[decoding][:budget]  # [d]
        prefills = running[~decoding]  # [p]
        want = view.requests.num_uncomputed(prefills)  # [p]
        left = budget - decodes.size
        chunks = np.clip(left - (np.cumsum(want) - want), 0, want)  # [p] min(want, budget left)
        num_chunked = int(np.count_nonzero(chunks))  # the budget runs out on a prefix
        ids = np.concatenate([decodes, prefills[:num_chunked]])
        tokens = np.concatenate([np.ones(decodes.size, np.int64), chunks[:num_chunked]])
        needed = int(view.pages_needed(ids, tokens).sum())
        free = view.num_free_pages
        if needed > free:
            return self._schedule_with_preemption(view, budget, decodes, prefills, want)
        new_ids, new_tokens = self._admit(view, budget - int(tokens.sum()), free - needed,
                                          int(running.size))
        return StepPlan(np.concatenate([ids, new_ids]), np.concatenate([tokens, new_tokens]))

    def stable_steps(self, view: SchedulerView) -> Optional[int]:
        """Steady while every running request decodes within the budget and `_admit`
        admits nobody: the plan is then the decodes in admission order, and while only
        decodes happen the queue, budget and seats stay and the free pages only fall
        (which admits fewer). No bookkeeping, no clock. Through finishes and after
        prefills that ended (`stable_through_finishes`, `stable_after_prefills`) the
        same question is asked of the state `schedule()` would see, and the decodes
        are then every running request in admission order (`view.running`'s)."""
        running = view.running
        budget = min(self.max_num_tokens, view.max_num_tokens)
        if running.size > budget:
            return None
        new_ids, _ = self._admit(view, budget - int(running.size), view.num_free_pages,
                                 int(running.size))
        return None if new_ids.size else STEADY

    def _schedule_with_preemption(self, view: SchedulerView, budget: int,
                                  decodes: NDArray[np.int64],  # [d]
                                  prefills: NDArray[np.int64],  # [p]
                                  want: NDArray[np.int64]) -> StepPlan:  # [p]
        """Decodes, then chunks, one at a time, preempting the newest unscheduled request."""
        alive = view.running.tolist()  # admission order
        held_of = dict(zip(alive, view.pages_held(view.running).tolist()))
        want_of = dict(zip(prefills.tolist(), want.tolist()))
        want_of.update(dict.fromkeys(decodes.tolist(), 1))
        shared = view.prefix_caching  # a shared page is freed only with its last holder
        free = view.num_free_pages
        scheduled: dict[int, int] = {}
        preempted: list[int] = []
        for request in decodes.tolist() + prefills.tolist():
            if request in preempted or budget <= 0:
                continue
            count = min(want_of[request], budget)
            pages = int(view.pages_needed(np.array([request]), np.array([count]))[0])
            while pages > free:
                victim = next(r for r in reversed(alive) if r not in scheduled)
                alive.remove(victim)
                freed_before = view.pages_freed(preempted) if shared else 0
                preempted.append(victim)
                free += (view.pages_freed(preempted) - freed_before if shared
                         else held_of[victim])
                if victim == request:
                    break
            if request in preempted:
                continue
            scheduled[request] = count
            budget -= count
            free -= pages
        ids, tokens = list(scheduled), list(scheduled.values())
        if not preempted:
            new_ids, new_tokens = self._admit(view, budget, free, len(alive))
            ids += new_ids.tolist()
            tokens += new_tokens.tolist()
        return StepPlan(ids, tokens, preempt=preempted)

    def _admit(self, view: SchedulerView, budget: int, free: int, num_running: int
               ) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
        """New prefills: waiting ids `[a]` in FCFS order and their chunks `[a]`."""
        cap = view.max_num_seqs if self.max_num_seqs is None else min(self.max_num_seqs,
                                                                       view.max_num_seqs)
        waiting = view.waiting
        if budget <= 0 or num_running >= cap or waiting.size == 0:
            return waiting[:0], waiting[:0]
        candidates = waiting[:min(cap - num_running, budget)]  # [c]
        requests = view.requests
        want = requests.num_uncomputed(candidates)  # [c]
        if view.prefix_caching:  # an admission starts past its cache hit
            want = want - view.cached_tokens(candidates)
        before = np.cumsum(want) - want  # [c]
        tokens = np.minimum(want, budget - before)  # [c]
        pages = view.pages_needed(candidates, np.maximum(tokens, 1))  # [c]
        if view.prefix_caching:  # its whole sequence's pages less its hits and what it holds
            full_pages = view.pages_needed(candidates, want)  # [c]
        else:  # less the pages it holds: one received with its KV (disaggregated decode)
            full_pages = (-(-requests.num_known(candidates) // view.page_size)
                          - view.pages_held(candidates))  # [c]
        fits = (before < budget) & (full_pages <= view.kv_room(free - (np.cumsum(pages) - pages)))
        num_admitted = int(fits.size) if fits.all() else int(np.argmin(fits))
        return candidates[:num_admitted], tokens[:num_admitted]
