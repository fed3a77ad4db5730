"""vLLM v1's scheduler (vllm/v1/core/sched/scheduler.py, release 0.33) as a policy.

There is no prefill or decode phase: every request has tokens it knows (prompt
plus generated) and tokens whose K/V are computed, and each step hands out
`min(tokens left to compute, budget left)` per request, so a long prompt is
split across steps by whatever budget is left (chunked prefill).

One step, in vLLM's order:
  1. Running requests, in admission order, while budget is left. Each gets its
     pages on demand; when the pool cannot supply them, the most recently
     admitted running request (`priority`: the running request with the largest
     (priority, arrival time); request index breaks ties, where vLLM's arrival
     times, taken from the wall clock, never tie) is preempted by recompute and
     the allocation retried. A request that ends up preempting itself stops
     the pass (FCFS), or is skipped (`priority`: later ones outrank it and may
     still fit); a victim already scheduled this step (`priority` only) hands
     its tokens back to the budget.
  2. Waiting requests, only if nothing was preempted this step, in FCFS order
     (`priority`: by (priority, arrival)), while budget is left and fewer than
     `max_num_seqs` requests run. A request is admitted only if the pages of
     its whole known sequence fit the free pool (vLLM's default
     `scheduler_reserve_full_isl`), though only its first chunk's pages are
     taken; with chunked prefill off it is admitted only if it fits the budget
     left whole. The first that does not fit stops admission (no skipping).

Preempted requests rejoin waiting at the front (FCFS) or by rank (priority).
vLLM's FCFS queue stays in arrival order under that rule (running requests are
always older than never-admitted ones), which is the order of `view.waiting`.

Prefix caching (`enable_prefix_caching`, on by default as in vLLM, under the
run's default `--prefix_caching=policy`; `on`/`off` decide instead) is the
core's: an admission starts past its cached pages, so a waiting request wants
only its uncached tokens (`view.cached_tokens`) and its pages count its hits
(`view.pages_needed`; both asked at once, `view.admission_needs`), as vLLM's
`get_computed_blocks` and `allocate_slots`.

Not modelled: vLLM's clamp of a chunk to `max_model_len - num_computed - 1`
never binds here (the core rejects requests longer than the context), and
speculative decoding, LoRA, encoders and KV connectors are outside this
framework. vLLM's KV pool of N blocks holds N - 1 usable blocks
(block 0 is its null block): compare with `num_kv_pages = N - 1`.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Optional

import numpy as np
from numpy.typing import NDArray

from orca_jax import Policy, SchedulerView, StepLimits, StepPlan, register
from policies._common import STEADY

_FIRST_LOOK = 4  # waiting requests `_admit` looks at before looking further


@register("vllm")
@dataclasses.dataclass(kw_only=True)
class VLLM(Policy):
    """vLLM v1's FCFS (or priority) scheduler; pages on demand (`kv_reservation` none).

    Attributes:
      max_num_seqs: most running requests (also capped by the scheduler's batch cap).
      max_num_tokens: tokens per step (vLLM's `max_num_batched_tokens`; also capped
        by the scheduler's `max_num_tokens`).
      enable_chunked_prefill: False admits a waiting request only if all its
        uncomputed tokens fit the budget left; it needs a budget of at least
        max_model_len (`check_limits`), as vLLM does.
      long_prefill_token_threshold: when > 0 and more than one request is running
        or waiting, no request gets more than this many tokens in a step.
      priority: order waiting by (priority, arrival) and preempt the running
        request of the largest (priority, arrival), as vLLM's `--scheduling-policy
        priority` (lower value = more urgent).
      enable_prefix_caching: opt in to the core's prefix caching (vLLM's
        `--enable-prefix-caching`, on by default); it decides only under the
        run's `--prefix_caching=policy` (the default): `on` and `off` decide for
        every policy, and refuse this knob given explicitly against them.
      preemption_mode: recompute (vLLM v1; the default) frees a victim's pages to
        compute again; swap (vLLM v0's `--preemption-mode swap`) moves them to the host
        KV tier and back (needs `--kv_host_gb` or `--kv_host_pages`).
    """

    renamed_options = {"max_num_batched_tokens": "max_num_tokens"}

    max_num_seqs: int = 256
    max_num_tokens: int = 2048
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    priority: bool = False
    enable_prefix_caching: bool = True
    preemption_mode: str = "recompute"
    prefix_caching_knob: ClassVar[str] = "enable_prefix_caching"
    stable_through_finishes: ClassVar[bool] = True  # see stable_steps
    stable_after_prefills: ClassVar[bool] = True
    # How many the last `_admit` admitted: the first look's size (see there). Not a field
    # (no annotation): no option, and no part of the policy's equality or repr.
    _last_admitted = 0

    @property
    def prefix_caching(self) -> bool:  # the core reads this (see `Policy.prefix_caching`)
        return self.enable_prefix_caching

    def __post_init__(self) -> None:
        for field in ("max_num_seqs", "max_num_tokens"):
            if getattr(self, field) < 1:
                raise ValueError(f"{field} must be >= 1, got {getattr(self, field)}")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be recompute or swap, got "
                             f"{self.preemption_mode!r}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0, got "
                             f"{self.long_prefill_token_threshold}")

    def preemption_modes(self, view: SchedulerView, victims: NDArray[np.int64]) -> str:
        """Every victim by `preemption_mode` (vLLM preempts all one way)."""
        del view, victims
        return self.preemption_mode

    def check_limits(self, limits: StepLimits) -> None:
        """Without chunked prefill, refuses a step budget below the context, as vLLM does
        (`SchedulerConfig`: max_num_batched_tokens < max_model_len): a prompt longer than
        the budget could never be admitted, and would block the FCFS queue forever."""
        budget = min(self.max_num_tokens, limits.max_num_tokens)
        if self.enable_chunked_prefill or budget >= limits.max_model_len:
            return
        knob = (f"--max_num_tokens={budget}" if budget == limits.max_num_tokens
                else f"option max_num_tokens={budget}")
        raise ValueError(
            f"policy {self.name!r}: enable_chunked_prefill=false computes each prompt whole in "
            f"one step, but the step budget ({knob}) is below --max_model_len="
            f"{limits.max_model_len} (vLLM refuses the same); raise the budget to "
            f"{limits.max_model_len}, lower --max_model_len, or turn chunked prefill on")

    def schedule(self, view: SchedulerView) -> StepPlan:
        budget = min(self.max_num_tokens, view.max_num_tokens)
        running = view.running
        threshold = self.long_prefill_token_threshold
        if running.size + view.waiting.size <= 1:
            threshold = 0  # a lone request has nobody to starve
        needed: Optional[NDArray[np.int64]] = None  # [s] the pages of the tokens planned
        if threshold:
            want = np.minimum(view.requests.num_uncomputed(running), threshold)  # [r]
        else:  # each wants all it has left: its pages asked with it, in one question
            want, needed = view.uncomputed_and_pages(running)  # [r] each >= 1, [r]
        # The ufunc: `sum` adds a Python frame (and the running sums only where the budget
        # runs out).
        num_tokens = int(np.add.reduce(want))
        if num_tokens <= budget:  # most steps: every one gets its want
            ids, tokens = running, want
        else:
            wanted = want.cumsum()  # [r] (the method: np.cumsum adds a Python call)
            # min(want, budget left) in order; the budget runs out on a prefix of running.
            tokens = np.minimum(np.maximum(budget - (wanted - want), 0), want)  # [r]
            num_scheduled = int(np.count_nonzero(tokens))
            ids, tokens = running[:num_scheduled], tokens[:num_scheduled]
            num_tokens = int(tokens.sum())
            needed = None  # a cut want takes fewer pages
        if needed is None:
            needed = view.pages_needed(ids, tokens)  # [s]
        num_needed = int(np.add.reduce(needed))  # the ufunc: `sum` adds a Python frame
        free = view.num_free_pages
        if num_needed > free:
            return self._schedule_with_preemption(view, budget, want, threshold)
        budget -= num_tokens
        free -= num_needed
        new_ids, new_tokens = self._admit(view, budget, free, int(running.size), threshold)
        if new_ids.size:  # the tokens' list joins as it is (numpy converts it to int64 once)
            ids, tokens = np.concatenate([ids, new_ids]), np.concatenate([tokens, new_tokens])
        return StepPlan(ids, tokens)

    def stable_steps(self, view: SchedulerView) -> Optional[int]:
        """Steady while every running request decodes and nobody could be admitted.

        After a step that decoded every running request, the next plan is again all of
        `running`, one token each, in admission order, as long as their tokens fit the
        budget and their pages fit the pool (the executor bounds the pages): no
        preemption then. It admits nobody as long as `_admit` admits nobody now: while
        only decodes happen the queue, the budget left, the seats and the prefix
        cache do not change, and the free pages only fall, which admits fewer. No
        bookkeeping, no clock: any number of steps.

        Through finishes (`stable_through_finishes`): asked again once they left, this
        is the same question of the state `schedule()` would see (their freed pages, a
        prefix cache that now holds them), and the running pass is then the rest in
        admission order; `schedule()` counts nothing about a finish. After prefills
        (`stable_after_prefills`): once every planned request computed all it knew,
        the running pass gives each running request one token, in admission order
        (`view.running`'s), the same question deciding the admissions. `continuum`
        (vLLM's plans, its pins) inherits both: a pin is made by the core at the
        finish, as one by one, and its end is an event that stops a leap.
        """
        running = view.running
        budget = min(self.max_num_tokens, view.max_num_tokens)
        if running.size > budget:
            return None
        threshold = self.long_prefill_token_threshold
        if running.size + view.waiting.size <= 1:
            threshold = 0
        new_ids, _ = self._admit(view, budget - int(running.size), view.num_free_pages,
                                 int(running.size), threshold, plans=False)
        return None if new_ids.size else STEADY

    def arrivals_wait(self, view: SchedulerView) -> bool:
        """An arrival waits while the steady plan repeats when every seat is taken (the
        batch cap), when the running pass leaves no budget, or, first come first served,
        when a request already waits: `stable_steps` found that nobody is admitted now,
        so admission stops at the queue's head, ahead of every arrival. Priority
        admission sorts the queue, so an arrival may go to its head and fit: there only
        the seats and the budget keep it out. (The long-prefill threshold that a lone
        request drops only caps prompts, never a decode's one token.)"""
        running = int(view.running.size)
        if running >= min(self.max_num_seqs, view.max_num_seqs):
            return True
        if min(self.max_num_tokens, view.max_num_tokens) <= running:
            return True
        return view.waiting.size > 0 and not self.priority

    def _schedule_with_preemption(self, view: SchedulerView, budget: int,
                                  want: NDArray[np.int64],  # [r]
                                  threshold: int) -> StepPlan:
        """The running pass one request at a time, preempting when pages run out."""
        requests = view.requests
        alive = view.running.tolist()
        want_of = dict(zip(alive, want.tolist()))
        held_of = dict(zip(alive, view.pages_held(view.running).tolist()))
        shared = view.prefix_caching  # a shared page is freed only with its last holder
        rank_of = dict(zip(alive, zip(requests.priority[view.running].tolist(),
                                      requests.arrival_s[view.running].tolist(), alive)))
        free = view.num_free_pages
        scheduled: dict[int, tuple[int, int]] = {}  # request -> (tokens, new pages)
        preempted: list[int] = []
        i = 0
        while i < len(alive) and budget > 0:
            request = alive[i]
            count = min(want_of[request], budget)
            pages = int(view.pages_needed(np.array([request]), np.array([count]))[0])
            while pages > free:
                if self.priority:
                    victim = max(alive, key=rank_of.__getitem__)
                else:
                    victim = alive[-1]
                position = alive.index(victim)
                del alive[position]
                if position < i:
                    i -= 1
                freed_before = view.pages_freed(preempted) if shared else 0
                preempted.append(victim)
                free += (view.pages_freed(preempted) - freed_before if shared
                         else held_of[victim])
                if victim in scheduled:  # only under priority: hand its share back
                    victim_tokens, victim_pages = scheduled.pop(victim)
                    budget += victim_tokens
                    free += victim_pages
                if victim == request:
                    break
            if preempted and preempted[-1] == request:
                if self.priority:
                    continue  # `i` already points at the next request
                break
            scheduled[request] = (count, pages)
            budget -= count
            free -= pages
            i += 1
        ids = list(scheduled)
        tokens = [t for t, _ in scheduled.values()]
        if not preempted:  # the whole pass fitted after all: admit as usual
            new_ids, new_tokens = self._admit(view, budget, free, len(alive), threshold)
            ids += new_ids.tolist()
            tokens += new_tokens
        return StepPlan(ids, tokens, preempt=preempted)

    def _admit(self, view: SchedulerView, budget: int, free: int, num_running: int,
               threshold: int, *, plans: bool = True
               ) -> tuple[NDArray[np.int64], list[int]]:
        """Waiting requests to admit after the running pass: ids `[a]` and tokens `[a]` (a
        list of ints: the plan joins it to the running pass's array in one call)
        (`plans` False: a question about the plan, `stable_steps`', which leaves the next
        plan's first-look guess as the last plan set it)."""
        cap = min(self.max_num_seqs, view.max_num_seqs)
        waiting = view.waiting
        if budget <= 0 or num_running >= cap or waiting.size == 0:
            return waiting[:0], []
        if self.priority:
            requests = view.requests
            waiting = waiting[np.lexsort((waiting, requests.arrival_s[waiting],
                                          requests.priority[waiting]))]
        # Each admission takes >= 1 token and one seat: only a prefix can get in.
        candidates = waiting[:min(cap - num_running, budget)]  # [c]
        # Admission stops at the first request that does not fit, and nothing about a
        # candidate depends on those after it: look at a short head first and further
        # only while all fit (each look at a waiting request's prefix hit is a walk over
        # its pages, and the cache changes every step). Any head answers the same (the
        # first that does not fit in it, or all of it, is where admission stops), so its
        # size is a guess only: twice the last admissions and one, since a saturated run
        # admits about as many each step as the step before, and one look is then enough
        # where growing from 4 took two for a step admitting more than four.
        size = max(_FIRST_LOOK, 2 * self._last_admitted + 1)
        while True:
            head = candidates[:size]
            num_fit, tokens = self._fits(view, head, budget, free, threshold)
            if num_fit < head.size or head.size == candidates.size:
                break
            size *= 4
        if plans:
            self._last_admitted = num_fit
        return head[:num_fit], tokens

    def _fits(self, view: SchedulerView, candidates: NDArray[np.int64],  # [c]
              budget: int, free: int, threshold: int) -> tuple[int, list[int]]:
        """How many of the candidates fit, from the first, each after those before it are
        admitted (admission stops at the first that does not), and the tokens each of those
        gets (`[a]`)."""
        # An admission starts past its cached pages: only the rest is left to compute. Its
        # whole sequence's pages, less its hits and the pages it holds (one received with
        # its KV, in disaggregated decode, has them): what the core would allocate. One
        # question, in Python ints (exact, as int64 sums are): `_admit` looks at a short
        # head first, and each numpy call on a few elements costs more than the whole loop.
        wants, full_pages = view.admission_needs(candidates.tolist())  # [c], [c]
        chunked = self.enable_chunked_prefill
        # vLLM asks the room of the whole prompt, with the free pages earlier admissions
        # left: the room is the free pages less what an admission must leave (`kv_room`),
        # so each candidate's is the room now less the pages taken before it.
        room = int(view.kv_room(free))
        tokens: list[int] = []
        before = 0  # tokens taken by earlier admissions
        for i, want in enumerate(wants):
            count = min(want, threshold) if threshold else want
            left = budget - before
            # Whole prompts only without chunking (`check_limits`: they fit an empty step).
            if before >= budget or not (chunked or count <= left) or full_pages[i] > room:
                break
            given = min(count, left)  # >= 1: some budget is left
            tokens.append(given)
            before += count
            # Most admissions get their whole prompt (the budget is not cut): their pages
            # then are those of the whole prompt, so the same count is not asked again.
            room -= (full_pages[i] if given == want else int(view.pages_needed(
                candidates[i:i + 1], np.array([given], dtype=np.int64))[0]))
        return len(tokens), tokens


@register("vllm-priority")
@dataclasses.dataclass(kw_only=True)
class VLLMPriority(VLLM):
    """vLLM v1's priority scheduler: `vllm` with `priority=True` (lower value first)."""

    priority: bool = True
