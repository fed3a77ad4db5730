"""SGLang's longest-prefix-match scheduling (`--schedule-policy lpm`) as a policy.

SGLang (`python/sglang/srt/managers/schedule_policy.py`) orders its waiting
queue by the number of tokens of each request the prefix cache holds right
now, longest first (ties keep queue order, FCFS): the requests that reuse the
most computed K/V run while it is still cached, and requests of one prefix
run together instead of taking turns evicting each other's pages.

In-batch de-prioritisation: when several waiting requests share a prefix that
is not cached yet, admitting them together computes that prefix once per
request. SGLang lets only the first (in queue order) keep its rank and moves
the others behind every request without that conflict, so they find the
prefix cached once the first has computed it. A request takes part in the
check when the cache holds at most `in_batch_check_tokens` of it; two such
requests conflict when their first `in_batch_prefix_tokens` prompt tokens are
equal. (SGLang inserts each checked request into a radix tree of the waiting
queue and defers a request whose match there reaches the threshold; a match of
at least k tokens is exactly equality of the first k tokens, so comparing those
is the same test.) `in_batch` says what happens to the deferred requests:
`deprioritize` (SGLang) admits them after everyone else if room is left;
`defer` keeps them out of this step altogether, so each conflict costs the
later requests one step and never a recomputed prefix.

One step: running requests first, in admission order, each its uncomputed
tokens (a prompt chunked to the token budget left, or one decode token), with
pages on demand (`kv_reservation` none); when the pool cannot supply a
request's pages, the most recently admitted running requests are preempted by
recompute (a shared page counts as freed only with its last holder,
`view.pages_freed`). Then, if nothing was preempted, the ranked queue while
seats, budget and pages last, each admission computing only what its hit
leaves (`num_uncomputed - cached_tokens`); the first that does not get its
pages stops admission, so a large request is not overtaken forever. (The
public `plan_in_order` ranks running and waiting requests together and
preempts the lowest-ranked; SGLang keeps the running batch first and admits
only when nothing was preempted, hence this loop.) As SGLang, the queue
stays in FCFS order when it is longer than `max_ranked_waiting` (the lookups
of every waiting request are then skipped; only those admitted are looked up).

It opts in to prefix caching (`prefix_caching = True`): its ranking is the cache's
hits. Under `--prefix_caching=off` nothing hits, so only its in-batch check moves
a request out of FCFS order.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Literal, Optional, get_args

import numpy as np
from numpy.typing import NDArray

from orca_jax import Policy, SchedulerView, StepPlan, register
from policies._common import STEADY, admits_nobody

InBatch = Literal["off", "deprioritize", "defer"]


@register("lpm")
@dataclasses.dataclass(kw_only=True)
class LPM(Policy):
    """Longest cached prefix first, with SGLang's in-batch de-prioritisation.

    Attributes:
      in_batch: `deprioritize` (SGLang: a request whose uncached prefix an earlier
        waiting request shares goes behind every request without such a conflict),
        `defer` (it is not admitted this step), or `off`.
      in_batch_check_tokens: a request takes part in the in-batch check when the
        cache holds at most this many of its tokens (SGLang's
        `IN_BATCH_PREFIX_CACHING_CHECK_THRESHOLD`).
      in_batch_prefix_tokens: two requests conflict when their first this many
        prompt tokens are equal (SGLang's `IN_BATCH_PREFIX_CACHING_DEPRIORITIZE_THRESHOLD`).
      max_ranked_waiting: above this many waiting requests the queue stays FCFS
        (SGLang's cut-off: one prefix lookup per waiting request each step).
    """

    prefix_caching = True
    stable_through_finishes: ClassVar[bool] = True  # see stable_steps
    stable_after_prefills: ClassVar[bool] = True

    in_batch: InBatch = "deprioritize"
    in_batch_check_tokens: int = 32
    in_batch_prefix_tokens: int = 32
    max_ranked_waiting: int = 128
    # request -> its first `in_batch_prefix_tokens` prompt ids as bytes (None: too short,
    # or no token ids); a prompt never changes, so each is read once.
    _keys: dict[int, Optional[bytes]] = dataclasses.field(default_factory=dict, init=False,
                                                          repr=False)

    def __post_init__(self) -> None:
        if self.in_batch not in get_args(InBatch):
            raise ValueError(f"in_batch must be one of {get_args(InBatch)}, got {self.in_batch!r}")
        for field in ("in_batch_check_tokens", "max_ranked_waiting"):
            if getattr(self, field) < 0:
                raise ValueError(f"{field} must be >= 0, got {getattr(self, field)}")
        if self.in_batch_prefix_tokens < 1:
            raise ValueError(
                f"in_batch_prefix_tokens must be >= 1, got {self.in_batch_prefix_tokens}")

    def stable_steps(self, view: SchedulerView) -> Optional[int]:
        """Steady while nobody waiting could be admitted (`admits_nobody`; with prefix
        caching, only while nobody waits or no seat or budget is left). The running
        pass takes the running in admission order, one token each, and preempts only
        when pages run out (a leap takes only pages the pool has); the queue's ranking
        (prefix hits) does not matter when nobody gets in, and the free pages only fall,
        which admits fewer. Its per-request key cache is a cache: no bookkeeping.
        Through finishes and after prefills that ended (`stable_through_finishes`,
        `stable_after_prefills`) the same question is asked of the state `schedule()`
        would see (the finished ones' pages freed into the cache); the running pass is
        then every running request in admission order, one token each."""
        return STEADY if admits_nobody(view) else None

    def schedule(self, view: SchedulerView) -> StepPlan:
        waiting = view.waiting
        if view.prefix_caching and 1 < waiting.size <= self.max_ranked_waiting:
            waiting = self.rank(view, waiting)
        requests = view.requests
        budget, cap = view.max_num_tokens, view.max_num_seqs
        alive = view.running.tolist()
        want = dict(zip(alive, requests.num_uncomputed(view.running).tolist()))
        ids: list[int] = []
        counts: list[int] = []
        preempted: list[int] = []
        taken = 0  # pages the requests scheduled so far take from the pool
        free = view.num_free_pages
        while len(ids) < min(len(alive), cap) and budget > 0:
            request = alive[len(ids)]
            count = min(want[request], budget)
            need = int(view.pages_needed([request], [count])[0])
            while need > free and alive[-1] != request:
                preempted.append(alive.pop())  # the most recently admitted goes first
                free = view.num_free_pages + view.pages_freed(preempted) - taken
            if need > free:  # nobody newer is left: it preempts itself
                preempted.append(alive.pop())
                break
            ids.append(request)
            counts.append(count)
            budget, taken, free = budget - count, taken + need, free - need
        if preempted:
            return StepPlan(ids, counts, preempt=preempted)
        # Only the head the batch cap can reach: an overloaded queue is long.
        for request in waiting[:max(cap - len(ids), 0)].tolist():
            if len(ids) >= cap or budget <= 0:
                break
            uncached = requests.num_uncomputed([request]) - view.cached_tokens([request])
            count = min(int(uncached[0]), budget)
            need = int(view.pages_needed([request], [count])[0])
            if need > view.kv_room(free):
                break
            ids.append(request)
            counts.append(count)
            budget, free = budget - count, free - need
        return StepPlan(ids, counts)

    def rank(self, view: SchedulerView,
             waiting: NDArray[np.int64]) -> NDArray[np.int64]:  # [w] -> [k]
        """The waiting requests this step may admit, best first (`defer` drops some)."""
        cached = view.cached_tokens(waiting)  # [w]
        deferred = np.zeros(waiting.size, dtype=np.bool_)  # [w]
        if self.in_batch != "off":
            deferred = self.in_batch_conflicts(view, waiting, cached)
        # Longest hit first; the deferred after the rest; ties in queue order.
        order = np.lexsort((np.arange(waiting.size), np.where(deferred, 0, -cached), deferred))
        ranked = waiting[order]
        if self.in_batch == "defer":
            ranked = ranked[~deferred[order]]
        return ranked

    def in_batch_conflicts(self, view: SchedulerView, waiting: NDArray[np.int64],  # [w]
                           cached: NDArray[np.int64]) -> NDArray[np.bool_]:  # [w] -> [w]
        """`[w]` whether each request shares its uncached prefix with an earlier one."""
        seen: set[bytes] = set()
        conflict = np.zeros(waiting.size, dtype=np.bool_)
        for k in np.flatnonzero(cached <= self.in_batch_check_tokens).tolist():
            key = self._key(view, int(waiting[k]))
            if key is None:
                continue
            if key in seen:
                conflict[k] = True
            else:
                seen.add(key)
        return conflict

    def _key(self, view: SchedulerView, request: int) -> Optional[bytes]:
        """The request's first `in_batch_prefix_tokens` prompt ids, or None if it has fewer."""
        if request not in self._keys:
            tokens = view.requests.spec(request).prompt_tokens
            size = self.in_batch_prefix_tokens
            self._keys[request] = (None if tokens is None or tokens.size < size
                                   else np.asarray(tokens[:size], dtype=np.int64).tobytes())
        return self._keys[request]
