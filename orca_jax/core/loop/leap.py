"""Leaping: a stretch of steady decode steps run at once, exactly as one by one.

Most steps of a long simulation are decodes in which nothing happens: the same
requests each compute one token, nobody arrives, nobody finishes, the plan is
the one of the step before. A `Leaper` (made by an `Executor` at depth 1 when
`LoopFeatures.leap` is on) runs such a stretch as one iteration: it prices its
steps at once (`Engine.decode_span`: step j's KV lengths are the first step's
plus j), moves the clock past them, and records them as the single steps would
have been recorded — the request table, the token counts and times, the pages
taken, the finishes of the last step, one steps.jsonl row per step — so that a
run leaps or not with the same results bit for bit (`tests/test_leap.py`).

When it may leap, after a step that computed one token of every running request
in its plan's order and preempted, released and rejected nothing — or, where the
policy widens its promise (`Policy.stable_through_finishes`), such a step in which
some of them finished (the leap repeats the plan without them), or (`Policy.
stable_after_prefills`) a step in which every planned request computed all it knew,
prefills ending their prompts among them (the leap decodes `running`, in its order):

- the policy promises that its plan repeats (`Policy.stable_steps`; a policy
  that promises nothing, the default, is never leaped over, and neither is one
  whose `schedule` comes from a subclass of the class that made the promise:
  a plugin that overrides a built-in's `schedule` does not inherit its promise);
- the engine prices spans (`Engine.decode_span`; a real engine does not);
- no request arrives before a leaped step starts (it would join the queue), unless
  the policy says such arrivals wait through the steps (`Policy.arrivals_wait`): they
  then join at the leaped steps they would have joined at (a lone replica only),
  no request finishes before the last leaped step, and the watchdog counts the
  first step as progress (then every later one is);
- the pages the steps take fit the free pool (a paged pool; with prefix
  caching active, or another layout, no step may take a page, and with prefix
  caching a step that fills a page is the last: the cache's names change there).

A leap still ends with the step in which requests finish (their pages are freed as
`update()` frees them, by `Scheduler._finish`). Under `stable_through_finishes` the
next iteration starts a leap again from the plan without them, asking `stable_steps`
anew, where one by one it would have planned that step: the step's bucket is the one
packing selects for the fewer tokens (and the plan's `min_bucket_tokens`), and every
check above is made again, so the event's consequences (pages freed into a prefix
cache, a program's child call released, a pin started) are seen as `schedule()`
would see them. A replica whose finishes start a KV handoff (`in_transfer`) is not
leaped until the transfer is done. Where the policy refuses such a chance (someone
waiting fits once a request finished: a saturated replica, every step), the next 1,
then 3, 7, up to 15 chances after finishes or prefills are let go without asking it
(those steps are planned, as without the widening), until a leap starts so again.

It never leaps with `count_host_time` (each step's measured host time moves the
clock). A replica of a cluster leaps only where its loop sets a horizon
(`Scheduler.set_leap_horizon`; a colocated cluster without agent programs, whose
replicas do not act on each other's steps), and only over steps that start before
the loop's next event of another kind (an arrival, a rebalancer's or planner's call, a
migration's round): the events then see every replica as they would one step at a time.
Behind a router that reads no replica state (`Router.state_blind`), whose arrivals the
loop routes ahead, an arrival routed elsewhere does not cut a replica's leap: its
horizon is its own next arrival (`EventLoop.leap_to_own_arrivals`).
"""

from __future__ import annotations

import bisect
import time
from typing import Any, Callable, Optional, Sequence, Union

import numpy as np
from numpy.typing import NDArray

from orca_jax.core.api.plugins import declared_with
from orca_jax.core.loop.scheduled_step import IdleStep, ScheduledStep
from orca_jax.core.requests.request import RequestState
from orca_jax.core.requests.step_logs import step_log
from orca_jax.core.step.engine_api import Bucket

# RUNNING as a 0-d array of the table's type (numpy converts a Python int operand anew on
# every comparison), and RUNNING and FINISHED as bytes of the table's int8 states.
_RUNNING_0D = np.array(int(RequestState.RUNNING), dtype=np.int8)
_RUNNING_BYTE, _FINISHED_BYTE = (bytes([int(code)])
                                 for code in (RequestState.RUNNING, RequestState.FINISHED))
# The ufuncs' reductions called directly: `ndarray.min` adds a Python layer.
_min = np.minimum.reduce
# The most steps one leap runs: its arrays hold steps x batch entries.
MAX_LEAP_STEPS = 4096
# Steps priced at a time while an arrival may cut the leap short: pricing past the
# arrival is wasted work.
_FIRST_CHUNK = 32
# The most chances to leap after a finish or after prefills let go by after the policy
# refused such chances in a row (each refusal doubles the chances let go, up to this):
# a saturated replica, whose queue is admitted at nearly every finish, would else ask
# its policy for nothing on many steps (a third of them on the default workload at 30
# req/s). Letting one go is planning that step, which is always exact.
_MAX_BACKOFF = 15


def promise_covers_schedule(policy_type: type, promise: str = "stable_steps") -> bool:
    """Whether the `promise` of `policy_type` (`stable_steps`, or an attribute widening
    it: `stable_through_finishes`, `stable_after_prefills`) was written with its
    `schedule`: defined by the class that defines `schedule`, or by a subclass of it
    (and a widening, by the class that defines `stable_steps` or below it). A subclass
    that overrides `schedule` alone (a plugin that changes a built-in's plans) would
    otherwise be skipped on the strength of its parent's promise."""
    covers = declared_with(policy_type, promise, "schedule")
    if promise != "stable_steps":
        covers = covers and declared_with(policy_type, promise, "stable_steps") and bool(
            getattr(policy_type, promise))
    return covers


def leap_counts(leapers: Sequence[Leaper], num_steps: int) -> str:
    """A run's leaps as its log line says them, its replicas' `leapers` summed over
    `num_steps` steps: the steps leaped and the leaps, those that began after finishes
    and after prefills (the widenings), and the chances the policy refused or the
    back-off let go (`benchmarks/sim_speed.py` reads the line)."""
    def total(name: str) -> int:
        return sum(getattr(leaper, name) for leaper in leapers)
    return (f"leaped over {total('num_leaped_steps')} of {num_steps} steps in "
            f"{total('num_leaps')} leaps ({total('num_leaps_after_finishes')} after finishes, "
            f"{total('num_leaps_after_prefills')} after prefills; chances refused "
            f"{total('num_refusals')}, let go {total('num_let_go')}), "
            f"{total('num_leaps_past_arrivals')} of them past arrivals")


def _no_other_events() -> None:
    """A lone scheduler's horizon: no event but its own steps and arrivals."""
    return None


class Leaper:
    """Runs a scheduler's stretches of steady decode steps at once (see the module doc).

    Args:
      scheduler: the scheduler whose executor (depth 1) asks it before each iteration.

    Attributes:
      num_leaped_steps: steps run inside leaps so far.
      num_leaps: leaps so far.
      num_leaps_after_finishes: leaps that began right after a step in which requests
        finished (`Policy.stable_through_finishes`): each a step not planned.
      num_leaps_after_prefills: leaps that began right after a step with prefills
        (`Policy.stable_after_prefills`): each a step not planned.
      num_leaps_past_arrivals: leaps that ran on past arrivals (`Policy.arrivals_wait`),
        which joined the queue inside them.
      num_refusals: chances the policy refused (`stable_steps` asked, answer None or < 1).
      num_let_go: chances after finishes or prefills let go without asking it (the
        back-off after refusals).
    """

    # A `Scheduler`, typed loosely: it imports this module through its executor.
    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        # The steady step a leap repeats: (its requests [n] in its order, its bucket, the
        # plan's min_bucket_tokens, whether it held prefills: `running` decodes next).
        self._template: Optional[tuple[NDArray[np.int64], Bucket, int, bool]] = None
        self._preemptions = scheduler.record.num_preemptions
        # The engine prices no spans, or the policy's promise is not about its plans.
        policy_type = type(scheduler.policy)
        self._off = not promise_covers_schedule(policy_type)
        self._through_finishes = promise_covers_schedule(policy_type, "stable_through_finishes")
        self._after_prefills = promise_covers_schedule(policy_type, "stable_after_prefills")
        # Arrivals may join inside a leap (`Policy.arrivals_wait`) only where nothing but
        # the policy reads the queue they join: a lone replica (`horizon` stays
        # `_no_other_events`; checked per leap) without agent programs (whose releases and
        # pins are arrivals' events too) and without slower KV tiers.
        self._through_arrivals = (promise_covers_schedule(policy_type, "arrivals_wait")
                                  and scheduler.table.programs is None
                                  and scheduler.kv_memory.linked is None
                                  # joins at a step's start, never behind a front end
                                  and not scheduler.arrival_join.delays)
        # A fixed --spec_k rewrites the policy's plans (drafts where output, budget and
        # pages allow), which its promise does not cover: every step is planned.
        self._off |= bool(getattr(scheduler.features, "spec_k", 0))
        # An engine that takes token values from the host runs step by step.
        self._off |= bool(scheduler.engine.needs_token_ids)
        self.num_leaped_steps = 0
        self.num_leaps = 0
        self.num_leaps_after_finishes = 0
        self.num_leaps_after_prefills = 0
        self.num_leaps_past_arrivals = 0
        self.num_refusals = 0  # chances the policy refused (`stable_steps` None or < 1)
        self.num_let_go = 0  # chances after finishes or prefills let go without asking
        # Chances let go after the last refusal, and those still to let go, kept apart for
        # chances after finishes ([1]) and after prefills ([2]): on a replica whose batch
        # cap binds, a finish frees a seat the queue takes (refused, nearly always) while
        # the step after that admission fills the batch again (promised, nearly always).
        self._backoff = [0, 0, 0]
        self._skip = [0, 0, 0]
        self._pace = 0.0  # the seconds of the last step priced (0.0: none yet)
        # When the next event other than the scheduler's own steps and arrivals is (None
        # from it: none is left); a leap ends before it. A lone scheduler has none; a
        # cluster's replica gets its loop's (`Scheduler.set_leap_horizon`).
        self.horizon: Optional[Callable[[], Optional[float]]] = _no_other_events

    def note(self, step: Union[ScheduledStep, IdleStep]) -> None:
        """Called after each iteration run one by one: keeps `step` as the plan a leap
        may repeat if it decoded every request in it and changed nothing else (or,
        under `stable_after_prefills`, if every request in it computed all it knew)."""
        preemptions = self.scheduler.record.num_preemptions
        clean = (type(step) is ScheduledStep and preemptions == self._preemptions
                 and not step.progressed and step.kv_move_s == 0.0
                 and step.spec_tokens is None  # a speculative step's advance is drawn
                 and step.sampled.size == step.request_ids.size)  # all samples: no call
        self._preemptions = preemptions
        if not clean:
            self._template = None
        else:  # decodes: its plan repeats; prefills ended: `running` decodes next
            decodes = step.num_real_tokens == step.request_ids.size
            self._template = ((step.request_ids, step.packed.bucket, step.min_bucket_tokens,
                               not decodes) if decodes or self._after_prefills else None)

    def leap(self) -> bool:
        """Runs the steady steps that may run at once now. Returns False (nothing done)
        when none may; the executor then runs the next iteration as usual."""
        template = self._template
        if template is None or self._off:
            return False
        s = self.scheduler
        if s.busy.size or s.in_transfer.size:
            return False
        # An arrival (or another event) due now: the next step is planned. Asked first: a
        # leap that ended at an arrival is followed by this call every time, and a
        # saturated replica has one due at most steps (this is then all a step pays).
        now = s.now_s
        upcoming = s.next_arrival_s()
        horizon_of = self.horizon
        through_arrivals = self._through_arrivals and horizon_of is _no_other_events
        if upcoming is not None and upcoming <= now:
            # Where the policy says arrivals would not wait (a seat free and nobody ahead:
            # the next plan most likely admits them), the step is planned, as it is without
            # leaping past arrivals, and the policy is asked nothing more: asking
            # `stable_steps` at each such arrival would cost its refusal, and feed the
            # back-off that then lets the chances go that would leap. The answer is a hint
            # here; `arrivals_wait` is asked again, as promised, after `stable_steps`.
            if not (through_arrivals and s.policy.arrivals_wait(s.view)):
                return False
            # They join first, as `schedule()` joins them before it asks the policy (and
            # then finds none due): the policy's promises below are about that queue.
            s._admit_arrivals()
            upcoming = s.next_arrival_s()
        if horizon_of is None:  # a cluster's replica whose loop set no horizon
            return False
        if horizon_of is not _no_other_events:  # a cluster's replica: up to its loop's next
            horizon = horizon_of()
            if horizon is not None:
                if horizon <= now:
                    return False
                upcoming = horizon if upcoming is None else min(upcoming, horizon)
        host_start = time.perf_counter()
        ids, bucket, min_bucket, prefills = template
        if prefills and self._skip[2]:  # a chance after prefills, to let go: nothing to read
            self._skip[2] -= 1
            self.num_let_go += 1
            return False
        table = s.table
        after = 0  # 1: the template lost requests that finished; 2: it held prefills
        # The plan held every running request (in its own order): ids are distinct. Their
        # states counted as bytes (two byte counts, not two compares and two counts: most
        # chances here are let go below).
        codes = table.state[ids].tobytes()  # [n] one byte a state
        num_running = codes.count(_RUNNING_BYTE)
        if s.running.size != ids.size or num_running != ids.size:
            # Where the policy's promise covers the plan without them
            # (`stable_through_finishes`), the others must all have finished since and
            # those left be all of `running`; else the batch changed: plan the next step.
            if not (self._through_finishes and num_running == s.running.size and num_running
                    and codes.count(_FINISHED_BYTE) == ids.size - num_running):
                self._template = None
                return False
            after = 1
        if prefills:  # its requests (all of `running`) decode next, in `running`'s order
            after = 2
        if after:
            if self._skip[after]:  # the policy refused the last such chances: plan this step
                self._skip[after] -= 1
                self.num_let_go += 1
                return False
            # Only now, past the let-go chances (most of them on a saturated replica):
            # the requests left, in their order.
            ids = s.running if after == 2 else ids[table.state[ids] == _RUNNING_0D]
            bucket = s.bucket_config.select(max(int(ids.size), min_bucket))
        computed = table.num_computed[ids]  # [n]
        kv_lens = computed + 1  # [n] each one's context in the first step
        gaining = s.watchdog.gains(ids, kv_lens)
        if not gaining:
            return False
        promised = s.policy.stable_steps(s.view)
        if promised is None or promised < 1:
            self.num_refusals += 1
            if after:  # refused where it would plan: let the next chances go, more each time
                self._backoff[after] = min(2 * self._backoff[after] + 1, _MAX_BACKOFF)
                self._skip[after] = self._backoff[after]
            return False
        # Arrivals that would wait through the promised steps do not end the leap: they
        # join at the steps they would have joined at (`_apply`).
        crossing = (through_arrivals and upcoming is not None
                    and s.policy.arrivals_wait(s.view))
        if crossing:
            upcoming = None  # a lone replica: no other event ends the leap
        generated = table.num_generated[ids]  # [n]
        left = table.output_len[ids] - generated  # [n] tokens still to sample
        fewest = int(_min(left))  # a leap of this many steps ends with finishes
        limit = min(int(promised), MAX_LEAP_STEPS, fewest)
        # Priced first: the steps before the next arrival are a few where the finishes
        # allow a hundred, and the pages are counted over those alone.
        priced = self._price(bucket, kv_lens, limit, now, upcoming)
        if priced is None:
            return False
        step_s, tokens, starts, ends = priced
        runs, pages = self._page_limit(ids, computed, len(step_s))
        if runs < 1:
            return False
        if runs < len(step_s):
            del step_s[runs:], starts[runs:], ends[runs:]
        if after:  # from here on the plan it repeats is this one
            self._template = (ids, bucket, min_bucket, False)
            self._backoff[after] = 0
            if after == 1:
                self.num_leaps_after_finishes += 1
            else:
                self.num_leaps_after_prefills += 1
        self._apply(bucket, ids, computed, generated, left if len(step_s) == fewest else None,
                    pages, step_s, tokens, starts, ends, host_start, after == 2, crossing,
                    gaining == ids.size)
        return True

    def _page_limit(self, ids: NDArray[np.int64], computed: NDArray[np.int64], limit: int
                    ) -> tuple[int, Optional[tuple[list[int], NDArray[np.int64]]]]:
        """`(steps of the first `limit` the pool lets the leap run, (the pages the first j
        steps take, j = 0 .. steps, and the grants: `[g]` the requests that take one page
        each, in the order the steps take them, or `[steps, n]` the pages each step takes
        for each request), or None when they take none)`."""
        s = self.scheduler
        pool = s.kv
        if not pool.totals_decide:  # blocks to place (buddy): no page taken inside a leap
            needs = s.capacity.pages_needed(ids, np.full(ids.size, limit)).any()
            return (0 if needs else limit), None
        # A running request's pages are the pool's count of its context (no reservation,
        # no hit: `KVCapacity.pages_needed` of a running request): step j (from 1) needs a
        # new page where its context, computed + j, outgrows the pages held, that is where
        # j > room, the tokens its pages have left.
        room = pool.num_held[ids] * pool.page_size - computed  # [n]
        low = int(_min(room))
        if low >= limit:  # most requests of most short leaps: no page boundary crossed
            return limit, None
        if low >= 0 and limit == 1 and s.kv_memory.hits is None:
            # A leap of one step (half of them on issue 34's trace at 15 req/s): those
            # with no room left take a page each, in ids order.
            grants = ids[room < 1]  # [g]
            if grants.size > pool.num_free:
                return 0, None
            return 1, ([0, int(grants.size)], grants)
        if low >= 0 and limit <= pool.page_size and s.kv_memory.hits is None:
            # A short leap: each request takes at most one page, in step room + 1 (j >
            # room, and j <= room + page_size where one more page holds it).
            takers = (room < limit).nonzero()[0]  # [g] in ids order
            step_of = room[takers]  # [g] the step (from 0) each takes its page in
            per_step = np.bincount(step_of, minlength=limit).tolist()  # [k]
            taken, total, free = [0], 0, pool.num_free
            for count in per_step:
                total += count
                if total > free:
                    break
                taken.append(total)
            fits = len(taken) - 1
            if not taken[fits]:  # none (or none the pool has room for)
                return fits, None
            if fits < limit:
                kept = step_of < fits
                takers, step_of = takers[kept], step_of[kept]
            # By step, then in ids order, as the steps would take them one by one.
            return fits, (taken, ids[takers[step_of.argsort(kind="stable")]])
        steps = np.arange(limit + 1, dtype=np.int64)  # [k + 1]
        held_for = pool.pages_needed(ids, computed[None, :] + steps[:, None])  # [k + 1, n]
        taken_for = np.add.reduce(held_for, axis=1)  # [k + 1] pages the first j steps take
        if s.kv_memory.hits is not None:
            # Names change when a page fills, and the pool may evict cached pages when one
            # is taken: a leap takes none, and ends at the first step that fills one.
            fits = int(np.searchsorted(taken_for, 0, side="right")) - 1  # non-decreasing
            fills = (computed[None, :] + steps[1:, None]) % pool.page_size == 0  # [k, n]
            first_fill = np.flatnonzero(fills.any(axis=1))
            if first_fill.size:
                fits = min(fits, int(first_fill[0]) + 1)
            return fits, None
        fits = int(np.searchsorted(taken_for, pool.num_free, side="right")) - 1
        if not taken_for[fits]:
            return fits, None
        # [fits, n] pages each step takes: the pages to run j + 1 tokens less those to run j.
        need = held_for[1:fits + 1] - held_for[:fits]
        return fits, (taken_for[:fits + 1].tolist(), need)

    def _price(self, bucket: Bucket, kv_lens: NDArray[np.int64], limit: int,
               now: float, upcoming: Optional[float]
               ) -> Optional[tuple[list[float], NDArray[np.int32], list[float], list[float]]]:
        """`(step seconds [k], tokens [c, n] (c >= k: the first k rows are the steps'),
        starts [k], ends [k])` of the steps that run before the next arrival (each starts
        before it), at most `limit`; None if none. The seconds and times are Python
        floats: a leap's few steps are cheaper so than in arrays."""
        engine = self.scheduler.engine
        step_s: list[float] = []
        starts: list[float] = []
        ends: list[float] = []
        token_parts: list[NDArray[np.int32]] = []
        clock, done, chunk = now, 0, _FIRST_CHUNK
        # About the steps before the arrival, at the pace of the last step or of the last
        # step leaped, the faster (the step before a leap after prefills held them: it was
        # slower than the decodes after it, and a second span priced costs more than the
        # few steps priced past the arrival).
        pace = 0.0
        if upcoming is not None:
            pace = self.scheduler.record.steps.last().step_s
            if 0.0 < self._pace < pace:
                pace = self._pace
        while done < limit:
            if upcoming is None or pace <= 0.0:
                count = limit - done if upcoming is None else min(limit - done, chunk)
            else:
                count = min(limit - done, max(2, min(chunk, int((upcoming - clock) / pace
                                                                * 1.25) + 2)))
            span = engine.decode_span(bucket, kv_lens + done if done else kv_lens, count)
            if span is None:
                self._off = True
                return None
            seconds, tokens = span
            runs = 0
            # The clock's own additions, one step after another; a step runs if it starts
            # before the arrival.
            for seconds_j in seconds.tolist():
                if upcoming is not None and clock >= upcoming:
                    break
                starts.append(clock)
                clock += seconds_j
                ends.append(clock)
                step_s.append(seconds_j)
                runs += 1
            token_parts.append(tokens if runs == count else tokens[:runs])
            done += runs
            if runs < count:
                break
            pace = seconds_j
            chunk *= 2
        if done == 0:
            return None
        self._pace = seconds_j
        tokens = token_parts[0] if len(token_parts) == 1 else np.concatenate(token_parts)
        return step_s, tokens, starts, ends

    def _apply(self, bucket: Bucket, ids: NDArray[np.int64], computed: NDArray[np.int64],
               generated: NDArray[np.int64], left: Optional[NDArray[np.int64]],
               pages: Optional[tuple[list[int], NDArray[np.int64]]],
               step_s: list[float], tokens: NDArray[np.int32], starts: list[float],
               ends: list[float], host_start: float, after_prefills: bool,
               crossing: bool, all_gain: bool) -> None:
        """What `schedule()` and `update()` of each of the `k` steps would have done
        (`computed`, `generated`: `[n]` each request's counts before the steps, read
        when the leap began; `left`: `[n]` the tokens each had still to sample, or None
        where the fewest is more than `k`: nobody finishes; `tokens`: `[c >= k,
        n]`, the steps' first; `pages`: `_page_limit`'s; `after_prefills`: `ids` are
        `running` after a step with prefills, not the requests of the step repeated;
        `crossing`: arrivals join at the steps' starts, `Policy.arrivals_wait`;
        `all_gain`: the watchdog counted every request as getting further in the first
        step, so each does in the last)."""
        s = self.scheduler
        table, record = s.table, s.record
        k, n = len(step_s), int(ids.size)
        s.last_finished = s.last_finished[:0]  # "finished since the previous schedule()"
        free_before = int(s.kv.num_free)
        taken = None
        if pages is not None:
            taken, grants = pages
            if grants.ndim == 1:  # [g] one page each, in the order the steps take them
                s.kv.allocate_next_pages(grants)
            else:  # [k, n] pages each step takes
                s.kv.allocate_steps(ids, grants)
        end = ends[-1]
        computed = computed + k
        table.num_computed[ids] = computed
        table.num_generated[ids] = generated + k  # read at the chance; nothing wrote since
        table.last_token[ids] = tokens[k - 1]
        hits = s.kv_memory.hits
        if hits is not None:
            hits.record_span(ids, tokens[:k])
            hits.commit(ids)  # only the last step may fill a page (`_page_limit`)
        table.last_token_s[ids] = end
        if after_prefills:  # else each sampled in the step it repeats: has its first token
            no_token = np.isnan(table.first_token_s[ids])  # [n]
            if np.count_nonzero(no_token):
                table.first_token_s[ids[no_token]] = ends[0]
        record.log_token_span(ids, ends)
        held_before = (np.concatenate([s.running, s.unreleased])
                       if s.features.log_step_requests else None)
        num_waiting = [int(s.waiting.size)] * k  # each step's row's
        if crossing:  # before the finishes, as the last step's schedule() joins them first
            self.num_leaps_past_arrivals += self._join_arrivals(starts, num_waiting)
        if left is not None:  # the last step is some request's last token
            s._finish(ids[left == k], end)
        if all_gain:  # most leaps: every one ran at its most (no recomputation)
            s.watchdog.all_computed(ids, computed)
        else:
            s.watchdog.computed(ids, computed)
        # Each step's row, of Python numbers as `update()` makes them (a leap's few steps:
        # cheaper than a structured array's field writes and its `tolist`).
        free_pages = ([free_before] * k if taken is None
                      else [free_before - pages_taken for pages_taken in taken[1:]])
        free_pages[-1] = int(s.kv.num_free)
        num_running = [n] * k
        num_running[-1] = int(s.running.size)
        first_step, padded = s.num_steps, bucket.num_tokens
        if held_before is not None:
            held_after = np.concatenate([s.running, s.unreleased])
            ones = np.ones(n, np.int64)
            for j in range(k):
                record.log_step_requests(ids, ones, held_after if j == k - 1 else held_before)
        s.num_steps += k
        s.now_s = end
        self.num_leaped_steps += k
        self.num_leaps += 1
        host_s = (time.perf_counter() - host_start) / k  # the leap's, shared out
        record.steps.extend([
            step_log((first_step + j, starts[j], n, n, padded, padded, host_s, step_s[j],
                      num_running[j], num_waiting[j], free_pages[j], 0))
            for j in range(k)])

    def _join_arrivals(self, starts: list[float], num_waiting: list[int]) -> bool:
        """Arrivals join the queue at the leaped steps' starts (`starts`, `[k]`), each at
        the first step that starts at or after its arrival, as that step's `schedule()`
        would have joined it; `num_waiting[j]` becomes the queue's length from step j's
        joins on (its row's). The arrivals due at the first step's start joined before
        the policy was asked (`leap`). Returns whether any joined."""
        s = self.scheduler
        due = s.next_arrival_s()
        joined = False
        while due is not None and due <= starts[-1]:
            joined = True
            j = bisect.bisect_left(starts, due)  # >= 1: those due at starts[0] joined
            s.now_s = starts[j]  # arrivals join by the clock (`_apply` sets the end after)
            s._admit_arrivals()
            num_waiting[j:] = [int(s.waiting.size)] * (len(starts) - j)
            due = s.next_arrival_s()
        return joined
