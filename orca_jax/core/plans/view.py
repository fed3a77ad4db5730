"""SchedulerView: the read-only window a policy decides through.

Everything a policy may know is here: the time, the waiting and running
requests (as arrays of request indices), every request's progress (a read-only
`RequestTableView`), the KV pool, and the step limits. Arrays are read-only; a
policy keeps its own bookkeeping in its own fields.

The limits' names before 0.2 (`token_budget`, `max_batch_size`,
`num_total_pages`) still read, with a DeprecationWarning once per process, and
so do `watermark_pages` and `kv_layout`: a policy asks the capacity question
(`pages_needed`, `kv_fits`, `kv_room`), which includes both, instead.
"""

from __future__ import annotations

import warnings
from typing import Callable, Optional, Sequence, Union

import numpy as np
from numpy.typing import NDArray

from orca_jax.core.kv.capacity import KVBudget
from orca_jax.core.kv.preemption import PreemptionCosts
from orca_jax.core.plans.plan import INT64
from orca_jax.core.plans.program_view import ProgramsView
from orca_jax.core.plans.scheduler_state import SchedulerState
from orca_jax.core.requests.request_table import RequestTableView

# Old attribute -> its name now. A plugin reads them every step: each warns only once.
RENAMED = {"token_budget": "max_num_tokens", "max_batch_size": "max_num_seqs",
           "num_total_pages": "num_kv_pages"}
_warned: set[str] = set()


def _deprecated(name: str, value: Callable[["SchedulerView"], object], advice: str,
                doc: str) -> property:
    """A read-only property under the old name `name`, warning once per process that
    it is deprecated (`advice` says what to use)."""

    def read(view: "SchedulerView") -> object:
        if name not in _warned:
            _warned.add(name)
            warnings.warn(f"SchedulerView.{name} is deprecated; {advice}", DeprecationWarning,
                          stacklevel=2)
        return value(view)

    return property(read, doc=f"Deprecated: {doc}.")


def _renamed(old: str) -> property:
    """The old name `old` of a view attribute (`RENAMED`)."""
    new = RENAMED[old]
    return _deprecated(old, lambda view: getattr(view, new), f"use SchedulerView.{new}",
                       f"`{new}`")


def _capacity_detail(name: str, value: Callable[["SchedulerView"], object]) -> property:
    """A detail the capacity question now includes."""
    return _deprecated(name, value, "ask kv_fits, kv_room or pages_needed, which include it",
                       f"`{name}` (the capacity question includes it)")


class SchedulerView:
    """What `Policy.schedule` sees. Created once per scheduler; reads its live state.

    Attributes:
      requests: read-only per-request arrays (`RequestTableView`).
      page_size: tokens per KV page.
      num_kv_pages: usable KV pages in the pool.
      max_num_tokens: most tokens a step may compute (the largest bucket).
      max_num_seqs: most sequences a step may hold.
      bucket_token_sizes: the configured step sizes (T of each bucket).
      max_model_len: the context limit (prompt + output) of every request.
      kv_reservation: this run's KV allocation mode (see `Policy.kv_reservation`).
      prefix_caching: whether prefix caching is active (the run's switch,
        `SchedulerConfig.kv.prefix_caching`, and under `policy` the policy's
        opt-in): an admission then starts past its hit (`cached_tokens`).
      ttft_slo_s, tpot_slo_s: the run's SLOs in seconds (`--ttft_slo_s`,
        `--tpot_slo_s`), None when unset; the core does not enforce them, a policy
        may (reject a request with `StepPlan(reject=...)`).
      seed: the run's seed (`--seed`): seed a policy's own randomness with it, so
        that sweeping seeds varies it and a rerun repeats it.
      programs: the agent programs of the workload (`ProgramsView`: each request's
        program, its attained service, calls done, a sibling running; each program's
        tool pause), None for a workload without programs (docs/programs.md).
      kv_pin_s: the run's `--kv_pin_s` (`Policy.kv_pin_s`'s default).
    """

    def __init__(self, scheduler: SchedulerState) -> None:
        self._scheduler = scheduler
        config = scheduler.config
        self.requests = RequestTableView(scheduler.table)
        self.page_size = config.kv.page_size
        self.num_kv_pages = config.kv.num_kv_pages
        self.max_num_tokens = scheduler.bucket_config.max_num_tokens
        self.max_num_seqs = config.limits.max_num_seqs
        self.bucket_token_sizes = scheduler.bucket_config.token_sizes
        self.max_model_len = config.limits.max_model_len
        self.kv_reservation = scheduler.kv_reservation
        self.prefix_caching = scheduler.prefix_caching
        self.ttft_slo_s: Optional[float] = config.slo.ttft_slo_s
        self.tpot_slo_s: Optional[float] = config.slo.tpot_slo_s
        self.seed: int = config.sampling.seed
        self.kv_pin_s: float = config.kv.kv_pin_s
        book = scheduler.table.programs
        self.programs: Optional[ProgramsView] = None if book is None else ProgramsView(book)

    token_budget = _renamed("token_budget")
    max_batch_size = _renamed("max_batch_size")
    num_total_pages = _renamed("num_total_pages")
    watermark_pages = _capacity_detail(
        "watermark_pages", lambda view: view._scheduler.capacity.watermark_pages)
    kv_layout = _capacity_detail("kv_layout", lambda view: view._scheduler.kv.layout)

    @property
    def now_s(self) -> float:
        """Virtual time at the start of this iteration."""
        return self._scheduler.now_s

    @property
    def step_index(self) -> int:
        """Number of steps run so far."""
        return self._scheduler.num_steps

    @property
    def waiting(self) -> NDArray[np.int64]:
        """`[w]` arrived requests not running, in arrival order (preempted ones included)."""
        return self._scheduler.waiting

    @property
    def running(self) -> NDArray[np.int64]:
        """`[r]` admitted requests holding KV that a step may take now, in admission order:
        those `busy` in a step in flight are left out (only through pipeline stages, where
        a request in a micro-batch in flight waits for it to leave the last stage), so a
        policy plans the runnable ones only and is unchanged by pipelining."""
        running = self._scheduler.running
        busy = self._scheduler.busy
        if busy.size == 0:  # every step but a pipeline's: the queue as it is
            return running
        runnable = running[~np.isin(running, busy)]
        runnable.setflags(write=False)
        return runnable

    @property
    def unreleased(self) -> NDArray[np.int64]:
        """`[u]` finished requests whose answers a `defer_release` policy still holds."""
        return self._scheduler.unreleased

    @property
    def last_finished(self) -> NDArray[np.int64]:
        """`[f]` requests that finished since the previous `schedule()` call."""
        return self._scheduler.last_finished

    @property
    def busy(self) -> NDArray[np.int64]:
        """`[b]` requests no step may take now, sorted: each has a sampled token still on
        the device in a step in flight that the next step cannot read it from (an engine
        feeds a step only the tokens of the step dispatched just before it). Scheduling
        one breaks the rule `busy_request`; it is free again once that step is read back.

        Always empty when steps run one at a time, and with overlap (two steps in flight:
        the next step is planned while the last one runs, and a request in the last one
        may be scheduled again, its decode reading the token on the device). Only a
        deeper queue of steps in flight (`orca_jax.core.loop.executor`) makes requests busy:
        a request that sampled in an older step in flight and not in the last one. Through
        pipeline stages (`orca_jax.core.loop.pipeline`) every request of a micro-batch in
        flight is busy until it leaves the last stage, and, with micro-batch balancing, the
        runnable requests beyond an even share wait for the next micro-batch. `running`
        leaves them all out.
        """
        return self._scheduler.busy

    @property
    def num_free_pages(self) -> int:
        """Free KV pages right now (with prefix caching, evictable cached pages too)."""
        return self._scheduler.kv.num_free

    @property
    def num_used_pages(self) -> int:
        """KV pages in use right now (a page shared by several requests counts once)."""
        return self._scheduler.kv.num_used

    @property
    def num_cached_pages(self) -> int:
        """KV pages holding a cached block, in use or free (0 without prefix caching)."""
        return self._scheduler.kv.num_cached

    def cached_tokens(self, ids: NDArray[np.int64]) -> NDArray[np.int64]:  # [n] -> [n]
        """Tokens of its known tokens an admission of each request right now would take
        from the prefix cache: whole pages, never its last token. 0 for running (or
        done) requests, requests without token ids, and when caching is not active.
        Works for requests not yet arrived too (a router asks before routing)."""
        return self._scheduler.cached_tokens(np.asarray(ids, dtype=np.int64))

    def preemption_costs(self, ids: NDArray[np.int64]) -> PreemptionCosts:  # [n]
        """What preempting each of these running requests would cost, by mode, so a
        policy can choose per victim (`Policy.preemption_modes`). Fields, each `[n]`:
        `pages` (device pages it holds), `swap_out_s` and `swap_in_s` (the host link's
        seconds to move them out now and back at readmission, unqueued; inf without a
        host tier), `swap_fits` (the host tier has room for them now), and
        `recompute_tokens` (what recompute computes again; its prefill time is the
        engine's). `swap_s` is out plus in. Reads only."""
        return self._scheduler.preemption_costs(np.asarray(ids, dtype=np.int64))

    @property
    def speculates(self) -> bool:
        """Whether this run's engine verifies draft tokens (`StepPlan.spec_tokens` > 0 is
        allowed); each request's history reads through `requests.num_drafted`,
        `requests.num_accepted` and `requests.acceptance_rate`."""
        return self._scheduler.engine.speculates

    def estimate_step_s(self, q_lens: NDArray[np.int64],  # [n]
                        kv_lens: NDArray[np.int64],  # [n]
                        spec_tokens: Optional[NDArray[np.int64]] = None  # [n]
                        ) -> Optional[float]:
        """The engine's estimate of a step's seconds, drafting included
        (`Engine.estimate_step_s`): `q_lens` new tokens of each sequence (a speculating
        decode: k + 1), `kv_lens` its context after the step, `spec_tokens` each one's k.
        None when the engine cannot estimate (then a policy should not speculate)."""
        return self._scheduler.engine.estimate_step_s(
            np.asarray(q_lens, np.int64), np.asarray(kv_lens, np.int64),
            None if spec_tokens is None else np.asarray(spec_tokens, np.int64))

    @property
    def next_arrival_s(self) -> Optional[float]:
        """Arrival time of the next request still to come, or None."""
        return self._scheduler.next_arrival_s()

    def pages_needed(self, ids: NDArray[np.int64],  # [n]
                     num_tokens: NDArray[np.int64]) -> NDArray[np.int64]:  # [n]
        """New KV pages the core would allocate to run `num_tokens` of each request now.

        Includes the reservation made when a waiting request is admitted under a
        reserving `kv_reservation` mode. With prefix caching, an admission's tokens
        count from past its hit (`cached_tokens`): it needs the pages past the hit,
        plus each hit page that is free now (sharing takes it out of the free pool).
        Returns `[n]`.
        """
        # The capacity question itself (`Scheduler.pages_needed` asks it): a call less, and
        # none to convert what a policy passes most (the view's own int64 arrays).
        if ids.__class__ is not np.ndarray or ids.dtype is not INT64:
            ids = np.asarray(ids, dtype=np.int64)
        if num_tokens.__class__ is not np.ndarray or num_tokens.dtype is not INT64:
            num_tokens = np.asarray(num_tokens, dtype=np.int64)
        return self._scheduler.capacity.pages_needed(ids, num_tokens)

    def uncomputed_and_pages(self, ids: NDArray[np.int64]  # [n]
                             ) -> tuple[NDArray[np.int64], NDArray[np.int64]]:  # [n], [n]
        """`(requests.num_uncomputed(ids), pages_needed(ids, those tokens))`, asked as one
        question (a running pass that gives every request all it has left reads each
        request's counts once): `[n]` tokens each could compute now and `[n]` the new KV
        pages to compute all of them. No prefix hit is subtracted (a running request has
        none; see `admission_needs` for waiting ones)."""
        if ids.__class__ is not np.ndarray or ids.dtype is not INT64:
            ids = np.asarray(ids, dtype=np.int64)
        return self._scheduler.capacity.uncomputed_and_pages(ids)

    def admission_needs(self, ids: Sequence[int]) -> tuple[list[int], list[int]]:
        """For each of a few waiting requests (a short head of the queue, as Python ints),
        what admitting it now would compute and take: `(uncached, pages)`, two lists of
        ints, `uncached` its tokens left past its prefix hit (`requests.num_uncomputed`
        less `cached_tokens`) and `pages` the new KV pages to hold them all
        (`pages_needed(ids, uncached)`). The same integers as those arrays' `tolist()`,
        counted without numpy where nothing is reserved or hit (a numpy call on a few
        elements costs more than counting them in Python)."""
        return self._scheduler.capacity.admission_needs(list(ids))

    def pages_held(self, ids: NDArray[np.int64]) -> NDArray[np.int64]:  # [n] -> [n]
        """KV pages each request holds (freed if it is preempted, but for shared pages:
        see `pages_freed`)."""
        return self._scheduler.kv.num_held[np.asarray(ids, dtype=np.int64)].copy()

    def pages_freed(self, ids: NDArray[np.int64]) -> int:  # [n]
        """KV pages that preempting these running requests together would free: with
        prefix caching, a shared page only if all its holders are among them."""
        return self._scheduler.kv.num_freed_by(np.asarray(ids, dtype=np.int64))

    def kv_fits(self, ids: NDArray[np.int64],  # [n]
                num_tokens: NDArray[np.int64],  # [n]
                preempt: Optional[NDArray[np.int64]] = None) -> bool:  # [p]
        """Whether the core can give the KV to run `num_tokens` of each request, all
        together, now, after preempting `preempt`: the plan check's `kv_pages` and
        `kv_watermark` rules (with prefix caching, a page a victim frees and an
        admission hits again counts on neither side).

        Under the `paged` layout this is `pages_needed(...).sum()` against the free
        pages (less the watermark when admitting; a free page several admissions hit
        counts once); under `buddy` every admission also needs a free block of its size
        (or a larger one to split).
        """
        ids = np.asarray(ids, dtype=np.int64)
        preempt = np.asarray(() if preempt is None else preempt, dtype=np.int64)
        return self._scheduler.capacity.kv_fits(ids, np.asarray(num_tokens, dtype=np.int64),
                                                preempt)

    def kv_budget(self, ids: Sequence[int] = (),
                  num_tokens: Sequence[int] = ()) -> KVBudget:
        """A budget to build a plan one admission at a time: `budget.take(request, tokens)`
        is True (and counts its pages) if the plan so far (`ids` with `num_tokens`, then
        what was taken) and that request fit, as `kv_fits` of the whole plan would say;
        it costs O(1) a request where page totals decide (the paged layout without
        prefix caching) and asks the whole plan where they do not."""
        return KVBudget(self._scheduler.capacity, ids, num_tokens)

    def kv_room(self, free_pages: Union[int, NDArray[np.int64], None] = None, *,
                admitting: bool = True) -> Union[int, NDArray[np.int64]]:
        """KV pages a plan may take from `free_pages` free pages (default: the free
        pages now; an int or an array, elementwise): less the watermark an admission
        must leave when the plan admits a request. A policy that counts pages as it
        builds a plan compares `pages_needed` against this; `kv_fits` asks the whole
        question at once (a layout whose free total is not enough included)."""
        return self._scheduler.capacity.room(free_pages, admitting=admitting)
