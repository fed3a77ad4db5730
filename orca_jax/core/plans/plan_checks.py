"""Checks a StepPlan against the scheduler's rules before anything is changed.

Every check reads state and raises `PlanError(policy, rule, detail)`; none
writes, so a rejected plan leaves the scheduler exactly as it was. The checks
are whole-array numpy expressions: they run every iteration on every scheduled
request, and the hot path must not grow a Python loop per request.
"""

from __future__ import annotations

import os
import traceback

import numpy as np
from numpy.typing import NDArray

from orca_jax.core.plans import plan as plan_module
from orca_jax.core.plans.plan import MalformedPlan, PlanError, StepPlan
from orca_jax.core.plans.scheduler_state import SchedulerState
from orca_jax.core.requests.request import RequestState
from orca_jax.core.requests.request_table import RequestTable, count_nonzero

# Plain ints: IntEnum attribute lookups cost a microsecond each on the hot path.
_PENDING, _WAITING, _RUNNING = int(RequestState.PENDING), int(RequestState.WAITING), int(
    RequestState.RUNNING)
_FINISHED = int(RequestState.FINISHED)
# The table's int8 state codes of a request a step may take, as bytes (`checked_counts`).
_WAITING_CODE = bytes([_WAITING])
_LIVE_CODES = bytes([_WAITING, _RUNNING])


_PLAN_FILE = os.path.realpath(plan_module.__file__)

# What `check_plan` counted of a plan's requests, each `[n]` in plan order, so that the
# step is not counted again after it: `needed` (new KV pages, what the allocation takes
# where `KVCapacity.needed_is_allocation`), `computed` (`num_computed` before the step),
# `context` (`computed` + tokens + draft positions: the step's KV lengths) and
# `uncomputed` (`num_uncomputed`, less the prefix hits where `counts_hits`). `computed`
# and `context` are before admission: an admission onto a prefix hit starts past it.
# `states` (`RequestState` before admission: WAITING ones are admitted) too.
PlanCounts = tuple[NDArray[np.int64], NDArray[np.int64], NDArray[np.int64], NDArray[np.int64],
                   NDArray[np.int8]]
# `PlanCounts`, then what the step is made of too (`checked_counts`): `admitting`
# (whether one of the requests is waiting: 1 or 0), `total` (the tokens the step
# computes, draft positions included: `context - computed` summed) and `growing`
# (`needed.nonzero()[0]`: the positions of the requests that take pages, `[g]`).
StepCounts = tuple[NDArray[np.int64], NDArray[np.int64], NDArray[np.int64], NDArray[np.int64],
                   NDArray[np.int8], int, int, NDArray[np.int64]]
_ONE = np.array(1, dtype=np.int64)  # 0-d: numpy converts a Python int operand on every call
_NONE = np.zeros(0, dtype=np.int64)
_NONE.setflags(write=False)
NO_COUNTS: StepCounts = (_NONE, _NONE, _NONE, _NONE, _NONE.astype(np.int8), 0, 0,
                          _NONE)  # runs nothing


def not_a_plan(name: str, error: MalformedPlan) -> PlanError:
    """Rule `not_a_plan` of policy `name`, for a StepPlan it could not build: the
    constructor's complaint and the line that called it (the policy's own, in a plugin)."""
    frames = [frame for frame in traceback.extract_tb(error.__traceback__)
              if os.path.realpath(frame.filename) != _PLAN_FILE]
    where = f" (StepPlan built at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    return PlanError(name, "not_a_plan", f"{error}{where}")


def _first(ids: NDArray[np.int64], mask: NDArray[np.bool_]) -> int:
    return int(ids[np.flatnonzero(mask)[0]])


# Every check runs every iteration: `count_nonzero(mask)` answers `mask.any()` without
# the Python frame numpy's `any` and `all` methods add (a third of their cost on a
# short array), and the reductions are called as ufunc methods for the same reason.
_any = count_nonzero
_sum = np.add.reduce


def _check_indices(name: str, field: str, ids: NDArray[np.int64], num_requests: int) -> None:
    if ids.size == 0:  # most steps preempt, release and reject nothing
        return
    # An increasing list (most plans) is distinct: its ends bound it, and no sort is needed.
    increasing = ids.size == 1 or _any(ids[1:] <= ids[:-1]) == 0
    ordered = ids
    if not increasing:
        ordered = ids.copy()
        ordered.sort()  # in place: np.sort's wrapper costs a third more on a short array
    if ordered.item(0) < 0 or ordered.item(-1) >= num_requests:  # name the first in plan order
        bad = (ids < 0) | (ids >= num_requests)
        raise PlanError(name, "unknown_request",
                        f"{field} names request index {_first(ids, bad)}, but there are "
                        f"{num_requests} requests")
    if not increasing:
        dup = ordered[1:] == ordered[:-1]
        if _any(dup):
            raise PlanError(name, "duplicate_request",
                            f"{field} names request {int(ordered[1:][dup][0])} more than once")


def _check_rejections(name: str, scheduler: SchedulerState, plan: StepPlan) -> None:
    """A plan rejects only waiting requests, and none it also schedules."""
    table = scheduler.table
    reject = plan.reject_ids
    not_waiting = table.state[reject] != _WAITING
    if not_waiting.any():
        request = _first(reject, not_waiting)
        raise PlanError(name, "reject_not_waiting",
                        f"request {request} is {RequestState(table.state[request]).name}, only "
                        "waiting requests can be rejected")
    both = np.isin(reject, plan.request_ids)
    if both.any():
        raise PlanError(name, "reject_and_schedule",
                        f"request {_first(reject, both)} is both rejected and scheduled")


def _check_held(name: str, table: RequestTable, plan: StepPlan) -> None:
    """Every request the plan names is held by this replica (rule `not_held`)."""
    for field, ids in (("request_ids", plan.request_ids), ("preempt", plan.preempt),
                       ("release", plan.release), ("reject", plan.reject_ids)):
        if ids.size == 0:
            continue
        elsewhere = ~table.held_here(ids)
        if elsewhere.any():
            request = _first(ids, elsewhere)
            holder = int(table.holder[request])
            raise PlanError(name, "not_held",
                            f"{field}: request {request} is held by "
                            + (f"replica {holder}" if holder >= 0 else "no replica")
                            + f", not this one ({table.replica}): plan over view.waiting "
                            "and view.running")


def _check_removals(name: str, scheduler: SchedulerState, plan: StepPlan) -> None:
    """The rules of a plan that preempts, releases or rejects requests, in the order the
    check asks them: their indices, then (on a cluster's replica) that every request the
    plan names is held here, then the rejections', releases' and preemptions' own rules."""
    table = scheduler.table
    n_requests = len(table)
    ids = plan.request_ids
    if plan.preempt.size:
        _check_indices(name, "preempt", plan.preempt, n_requests)
    if plan.release.size:
        _check_indices(name, "release", plan.release, n_requests)
    if plan.reject_ids.size:
        _check_indices(name, "reject", plan.reject_ids, n_requests)
    if table.shared:  # a cluster's replica: other replicas' rows are in its table too
        _check_held(name, table, plan)
    if plan.reject_ids.size:
        _check_rejections(name, scheduler, plan)

    if plan.release.size:
        if not scheduler.policy.defer_release:
            raise PlanError(name, "release_without_defer",
                            "the plan releases requests but the policy does not defer release")
        unreleased = (table.state[plan.release] == _FINISHED) & np.isnan(
            table.finish_s[plan.release])
        if not unreleased.all():
            raise PlanError(name, "release_not_finished",
                            f"request {_first(plan.release, ~unreleased)} is not a finished "
                            "request awaiting release")

    if plan.preempt.size:
        not_running = table.state[plan.preempt] != _RUNNING
        if not_running.any():
            request = _first(plan.preempt, not_running)
            raise PlanError(name, "preempt_not_running",
                            f"request {request} is {RequestState(table.state[request]).name}, "
                            "only running requests can be preempted")
        if ids.size:
            both = np.isin(ids, plan.preempt)
            if both.any():
                raise PlanError(name, "preempt_and_schedule",
                                f"request {_first(ids, both)} is both preempted and scheduled")


def check_plan(scheduler: SchedulerState, plan: StepPlan) -> PlanCounts:
    """Raises PlanError if `plan` breaks a rule; returns what it counted on the way.

    Args:
      scheduler: the scheduler's state (read only here).
      plan: the policy's plan for this iteration.

    Returns:
      `(needed, computed, context, uncomputed, states)`, each `[n]` over `plan.request_ids`
      (`PlanCounts`; empty for a plan that runs nothing).
    """
    return checked_counts(scheduler, plan)[:5]


def checked_counts(scheduler: SchedulerState, plan: StepPlan) -> StepCounts:
    """`check_plan`, and with its counts `admitting`, `total` and `growing` (`StepCounts`),
    which the step would otherwise count again: the scheduler's step asks this.

    Raises:
      PlanError: `plan` breaks a rule (nothing has changed).
    """
    name = scheduler.policy.name
    table = scheduler.table
    ids, tokens = plan.request_ids, plan.num_tokens
    # The scheduler's own running queue (a plan that admits nobody and runs every running
    # request, as vllm's decode steps do) holds distinct indices of the table: it was
    # made of admissions this check passed, and is read-only.
    if ids is not scheduler.running:
        _check_indices(name, "request_ids", ids, len(table))
    if plan.preempt.size or plan.release.size or plan.reject_ids.size:  # most plans: none
        _check_removals(name, scheduler, plan)
    elif table.shared:  # a cluster's replica: other replicas' rows are in its table too
        _check_held(name, table, plan)

    if ids.size == 0:
        return NO_COUNTS

    states = table.state[ids]
    # The states as bytes (int8: one each): whether one is neither waiting nor running, and
    # whether one waits, are then byte searches, not two ufunc reductions (4 us a step).
    codes = states.tobytes()
    if codes.translate(None, _LIVE_CODES):  # one has not arrived, or is done
        _check_arrived_and_not_done(name, scheduler, ids, states)
    busy = scheduler.busy
    if busy.size:  # only with more than one step in flight ahead of this one
        again = np.isin(ids, busy)
        if _any(again):
            raise PlanError(name, "busy_request",
                            f"request {_first(ids, again)} is busy: it is in a step in "
                            "flight the next step cannot follow (its newest token on the "
                            "device, or a micro-batch still in the pipeline's stages), or "
                            "waits for the next micro-batch (SchedulerView.busy)")
    if _any(tokens < _ONE):  # a count, not a min: a ufunc reduction's fixed cost is more
        bad = tokens < 1
        raise PlanError(name, "nonpositive_tokens",
                        f"request {_first(ids, bad)} is given {int(tokens[bad][0])} tokens")
    # The capacity question, asked directly: the same one `SchedulerView.kv_fits` asks
    # (`KVCapacity`), so they never disagree.
    capacity = scheduler.capacity
    # A preempted-and-waiting request recomputes from 0 (its counters were reset), or from
    # past its prefix-cache hit: an admission starts there.
    computed = table.num_computed[ids]  # read once: the pages count from it too
    uncomputed = table.num_uncomputed(ids, computed)
    if capacity.counts_hits:  # else every request's hit is 0: nothing to ask or subtract
        uncomputed = uncomputed - capacity.cached_tokens(ids)
    over = tokens > uncomputed
    if _any(over):
        i = int(np.flatnonzero(over)[0])
        request = int(ids[i])
        cached = capacity.cached_tokens(ids)
        raise PlanError(name, "tokens_over_uncomputed",
                        f"request {request} is given {int(tokens[i])} tokens but has "
                        f"{int(uncomputed[i])} uncomputed "
                        f"(prompt {int(table.prompt_len[request])}, "
                        f"computed {int(table.num_computed[request])}, "
                        f"generated {int(table.num_generated[request])}, "
                        f"cached {int(cached[i])}): give a request at most "
                        "view.requests.num_uncomputed(ids) - view.cached_tokens(ids) tokens "
                        "(a running decode takes 1)")
    total = int(_sum(tokens))
    spec = plan.spec_tokens
    if spec.size:  # speculative decoding: k more verified positions each
        _check_spec(name, scheduler, ids, tokens, spec)
        verified = total + int(spec.sum())
        tokens = tokens + spec  # the pages hold the k + 1 positions
    budget = scheduler.bucket_config.max_num_tokens
    if spec.size and verified > budget:
        raise PlanError(name, "token_budget",
                        f"{verified} verified tokens ({total} + {verified - total} draft "
                        f"tokens of spec_tokens) > budget {budget}")
    if total > budget:
        raise PlanError(name, "token_budget", f"{total} tokens > budget {budget}")
    if plan.min_bucket_tokens > budget:
        raise PlanError(name, "token_budget",
                        f"min_bucket_tokens {plan.min_bucket_tokens} > budget {budget}")
    cap = scheduler.bucket_config.max_num_seqs
    if ids.size > cap:
        raise PlanError(name, "batch_cap", f"{ids.size} sequences > batch cap {cap}")

    context = computed + tokens  # [n] (`tokens` with the drafts' positions, if any)
    needed = capacity.pages_for_context(ids, context)  # `capacity.pages_needed(ids, tokens)`
    # The requests that take pages: a few of most steps' batch (decodes entering a page,
    # admissions), found once for the KV rule's total and the allocation, which takes them
    # (`KVPool.allocate`'s `growing_at`). Their few counts are added in Python ints: a
    # ufunc reduction of the whole batch costs more than the search and the sum together.
    # (Only where the total decides the rule: elsewhere `rule_broken` counts its own.)
    growing = needed.nonzero()[0]  # [g] (the method: np.flatnonzero adds two calls)
    total_needed = (sum((needed[growing] if growing.size < needed.size else needed).tolist())
                    if capacity.totals_decide else None)
    # `kv_pages` or `kv_watermark`, if the KV does not fit; states are 1 or 2 here.
    admitting = _WAITING_CODE in codes
    broken = capacity.rule_broken(ids, needed, plan.preempt, bool(admitting), total_needed)
    if broken is not None:
        raise PlanError(name, *broken)
    return (needed, computed, context, uncomputed, states, int(admitting),
            verified if spec.size else total, growing)


def _check_spec(name: str, scheduler: SchedulerState,
                ids: NDArray[np.int64],  # [n]
                tokens: NDArray[np.int64],  # [n]
                spec: NDArray[np.int64]) -> None:  # [n]
    """The rules of `StepPlan.spec_tokens`: k >= 0, an engine that verifies drafts, and
    k > 0 only on a request decoding one token whose k + 1 positions fit its context and
    its remaining output (each broken rule one `PlanError`)."""
    if spec.min() < 0:
        raise PlanError(name, "spec_negative",
                        f"request {_first(ids, spec < 0)} is given "
                        f"{int(spec[spec < 0][0])} draft tokens (spec_tokens must be >= 0)")
    if not scheduler.engine.speculates:
        raise PlanError(name, "spec_unsupported",
                        f"request {_first(ids, spec > 0)} is given draft tokens, but engine "
                        f"{scheduler.engine.name!r} does not speculate (Engine.speculates: "
                        "run with --spec_k/--draft_model, or plan spec_tokens 0)")
    table = scheduler.table
    drafts = spec > 0
    decoding = ((tokens == 1) & (table.num_generated[ids] >= 1)
                & (table.state[ids] == _RUNNING) & (table.num_uncomputed(ids) == 1))
    bad = drafts & ~decoding
    if bad.any():
        request = _first(ids, bad)
        raise PlanError(name, "spec_not_decoding",
                        f"request {request} is given {int(spec[bad][0])} draft tokens but is "
                        f"not decoding (state {RequestState(table.state[request]).name}, "
                        f"{int(table.num_generated[request])} generated, "
                        f"{int(table.num_uncomputed(ids[bad][:1])[0])} uncomputed): only a "
                        "running request computing its 1 decode token speculates")
    context = table.num_computed[ids] + 1 + spec  # [n] its KV after the step
    limit = scheduler.config.limits.max_model_len
    over = drafts & (context > limit)
    if over.any():
        i = int(np.flatnonzero(over)[0])
        raise PlanError(name, "spec_past_context",
                        f"request {int(ids[i])} with {int(spec[i])} draft tokens would reach "
                        f"{int(context[i])} tokens > max_model_len {limit}")
    remaining = table.output_len[ids] - table.num_generated[ids]  # [n]
    over = drafts & (spec + 1 > remaining)
    if over.any():
        i = int(np.flatnonzero(over)[0])
        raise PlanError(name, "spec_past_output",
                        f"request {int(ids[i])} is given {int(spec[i])} draft tokens but has "
                        f"{int(remaining[i])} output tokens left (k + 1 <= remaining: "
                        "view.requests.remaining_output(ids) - 1 at most)")


def _check_arrived_and_not_done(name: str, scheduler: SchedulerState,
                                ids: NDArray[np.int64],  # [n]
                                states: NDArray[np.int8]) -> None:  # [n]
    """Raises for the first scheduled request that has not arrived, else for the first
    that is done (finished, rejected or routed away: the terminal states)."""
    table = scheduler.table
    pending = states == _PENDING
    if pending.any():
        request = _first(ids, pending)
        raise PlanError(name, "not_arrived",
                        f"request {request} arrives at {table.arrival_s[request]:.6f} s, "
                        f"now is {scheduler.now_s:.6f} s")
    done = states >= _FINISHED
    if done.any():
        request = _first(ids, done)
        raise PlanError(name, "finished_request",
                        f"request {request} is {RequestState(table.state[request]).name}")

