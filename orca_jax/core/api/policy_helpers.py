"""Helpers a policy builds its plan with (numpy only; part of the policy API).

`fit_to_budget` cuts a ranked list to the step's token budget (chunking the
first prompt that does not fit). `plan_in_order` turns a ranking into a legal
plan with on-demand KV pages (`kv_reservation = "none"`): it walks the ranking
top-down, giving each request its uncomputed tokens (a prefill chunk cut to the
budget left, or one decode token) while the batch cap, the token budget and the
KV pool allow. A running request that is not scheduled is *paused*: it keeps
its pages and its progress. When a request needs pages that are not free, the
lowest-ranked running requests below it are preempted by recompute (their
pages freed) until it fits. Most ranking policies differ only in their ranking
(shortest remaining work, MLFQ level, tenant counter, priority, deadline).

With prefix caching active (`view.prefix_caching`), a waiting request starts
past the tokens an admission takes from the cache (`view.cached_tokens`), and
whether a request fits (after which preemptions) is asked of the core
(`view.kv_fits`): shared pages make page counts add up differently (a victim
frees a page only with its last holder; a page it frees that an admission hits
again is freed for nobody).
"""

from __future__ import annotations

from typing import Optional, Union

import numpy as np
from numpy.typing import NDArray

from orca_jax.core.plans.plan import StepPlan
from orca_jax.core.plans.view import SchedulerView
from orca_jax.core.requests.request import RequestState


def fit_to_budget(ids: NDArray[np.int64],  # [n] in priority order
                  tokens: NDArray[np.int64],  # [n] tokens each wants
                  budget: int) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    """Takes requests in order while their tokens fit `budget`; chunks the first that does not.

    Returns:
      `(ids[:k], tokens[:k])` where the last one may be cut to the budget left,
      so a prompt longer than the whole budget is chunked rather than starved.
    """
    if ids.size == 0 or budget <= 0:
        return ids[:0], tokens[:0]
    cumulative = np.cumsum(tokens)
    if int(cumulative[-1]) <= budget:
        return ids, tokens
    whole = int(np.searchsorted(cumulative, budget, side="right"))
    left = budget - (int(cumulative[whole - 1]) if whole else 0)
    if left <= 0:
        return ids[:whole], tokens[:whole]
    cut = tokens[:whole + 1].copy()
    cut[whole] = left
    return ids[:whole + 1], cut


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
      ranked below it; a waiting request below it that needs no new pages (it
      holds its KV already: received by a disaggregated decode replica, or
      migrated) is still admitted, since it takes nothing the stopped one waits
      for, and holding it back can leave a full pool that nothing drains.
    """
    requests = view.requests
    order = np.asarray(order, dtype=np.int64)
    if order.size == 0:
        return StepPlan()
    cap, budget = view.max_num_seqs, view.max_num_tokens
    running = (requests.state[order] == RequestState.RUNNING).tolist()
    left = requests.num_uncomputed(order)  # [k]
    if view.prefix_caching:
        left = left - view.cached_tokens(order)  # an admission starts past its cache hit
    want = np.minimum(left, budget)  # [k]
    pages = view.pages_needed(order, want).tolist()
    held = view.pages_held(order).tolist()
    want_list, order_list = want.tolist(), order.tolist()
    # Positions (ascending) of running requests holding pages: the victims of a request
    # at position p are those after p, taken lowest-ranked first (from the end).
    victims = [p for p in range(order.size) if running[p] and held[p] > 0]
    first_victim = 0  # victims[:first_victim] are ranked above the current position
    victim_pages = sum(held[p] for p in victims)
    is_preempted = [False] * order.size
    # Pages the plan may still take: the free ones, less the watermark once it admits.
    room_running, room_admitting = view.kv_room(admitting=False), view.kv_room()
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
        if is_preempted[pos] or (not running[pos] and not admitting and (
                view.prefix_caching or pages[pos] > 0)):
            continue
        count = min(want_list[pos], budget)
        if view.prefix_caching:
            chosen = _victims_to_fit(view, order_list, ids + [order_list[pos]],
                                     counts + [count], preempted, victims, first_victim,
                                     running[pos] or admission_preempts)
            if chosen is None:
                if not running[pos]:
                    admitting = False
                continue
            for victim in chosen:
                victim_pages -= held[victim]
                is_preempted[victim] = True
                preempted.append(order_list[victim])
            ids.append(order_list[pos])
            counts.append(count)
            budget -= count
            continue
        need = pages[pos] if count == want_list[pos] else int(
            view.pages_needed(order[pos:pos + 1], np.array([count]))[0])
        # An admission anywhere in the plan obliges the plan to leave the watermark free.
        room = room_admitting if (admitted or not running[pos]) else room_running
        usable = victim_pages if (running[pos] or admission_preempts) else 0
        if need - room > usable:
            if not running[pos]:
                admitting = False
            continue  # pauses (running) or waits (waiting); preempting would not help
        while room < need:
            victim = victims.pop()
            victim_pages -= held[victim]
            is_preempted[victim] = True
            preempted.append(order_list[victim])
            room += held[victim]
            room_running += held[victim]
            room_admitting += held[victim]
        ids.append(order_list[pos])
        counts.append(count)
        budget -= count
        room_running -= need
        room_admitting -= need
        admitted = admitted or not running[pos]
    if preempt_over_cap and len(ids) >= cap:
        # Everything left in victims[first_victim:] is running, unscheduled, below the cut.
        preempted += [order_list[p] for p in victims[first_victim:] if order_list[p] not in ids]
    return StepPlan(ids, counts, preempt=preempted)


def _victims_to_fit(view: SchedulerView, order: list[int], ids: list[int], counts: list[int],
                    preempted: list[int], victims: list[int], first_victim: int,
                    may_preempt: bool) -> Optional[list[int]]:
    """With prefix caching: the victims (positions in `order`, lowest-ranked first) whose
    preemption lets the core give `ids` their `counts`, or None if no set of them does.

    Victims are taken from the end of `victims[first_victim:]` (ranked below the
    candidate) and popped from it only when the candidate fits.
    """
    chosen: list[int] = []
    while not view.kv_fits(np.array(ids), np.array(counts),
                           np.array(preempted + [order[v] for v in chosen], dtype=np.int64)):
        if not may_preempt or len(victims) - len(chosen) <= first_victim:
            return None
        chosen.append(victims[len(victims) - 1 - len(chosen)])
    del victims[len(victims) - len(chosen):]
    return chosen


def add_drafts(view: SchedulerView, plan: StepPlan,
               k: Union[int, NDArray[np.int64]]) -> StepPlan:  # k: one, or [n] per request
    """`plan` with up to `k` draft tokens on each decode it holds (speculative decoding,
    docs/speculative.md): the run's fixed `--spec_k`, which the loop applies to the plan
    of every policy that does not plan speculation itself (`Policy.plans_speculation`),
    or each request's own k (`[n]`, parallel to `plan.request_ids`: smartspec's).

    A decode gets fewer where its remaining output or the context allows fewer (k + 1
    tokens at most: its decode token and k accepted drafts); the plan's first decodes
    keep theirs where the token budget or the KV pages run short (the rest get 0), so
    the plan still passes every check it passed. A plan that speculates already, or
    holds no decode, comes back as it is.
    """
    ids, tokens = plan.request_ids, plan.num_tokens
    if plan.speculates or not ids.size or not np.any(np.asarray(k) > 0):
        return plan
    requests = view.requests
    decoding = ((tokens == 1) & requests.prefill_done(ids)
                & (requests.state[ids] == RequestState.RUNNING))
    if not decoding.any():
        return plan
    drafts = np.where(decoding, np.minimum(k, requests.remaining_output(ids) - 1), 0)
    drafts = np.clip(drafts, 0, view.max_model_len - requests.num_computed[ids] - 1)
    room = view.max_num_tokens - int(tokens.sum())  # the budget left for drafts
    before = np.cumsum(drafts) - drafts  # [n] drafts of the decodes ahead of each
    drafts = np.clip(room - before, 0, drafts)
    speculating = np.flatnonzero(drafts)
    keep = speculating.size
    while keep and not view.kv_fits(ids, tokens + drafts, plan.preempt):
        keep //= 2  # the first `keep` speculating decodes keep their drafts
        drafts[speculating[keep:]] = 0
    if not drafts.any():
        return plan
    return StepPlan(ids, tokens, preempt=plan.preempt, release=plan.release,
                    min_bucket_tokens=plan.min_bucket_tokens,
                    reject=list(zip(plan.reject_ids.tolist(), plan.reject_reasons)),
                    spec_tokens=drafts)
