"""The iteration-level scheduler (Orca's loop) over a virtual clock: its state.

A `Scheduler` holds a run's requests (the `RequestTable`), its queues (waiting,
running, finished but unreleased), its KV pages, and the changes a plan makes
to them: releases, preemptions (by recompute), rejections with a reason, and
admissions. Each iteration is two phases, `schedule()` and `update()`
(`orca_jax.core.scheduler_loop`), run by an executor that owns the engine and
moves the clock (`orca_jax.core.executor`); when nothing can run, the clock
jumps to the next arrival instead of sleeping. Requests that no admission
could ever take are rejected up front (`orca_jax.core.admission`), and a run
in which no request gains a computed token or finishes for `no_progress_steps`
iterations fails (`no_progress`).

With prefix caching active (`SchedulerConfig.enable_prefix_caching` and the
policy's `prefix_caching`), an admission shares the cached pages of its known
tokens and starts past them, and pages are named as they fill
(`orca_jax.core.prefix_cache`, `orca_jax.core.prefix_hits`).

All per-request state is in the `RequestTable`'s arrays and every per-step
operation is a whole-array numpy expression, so the host cost per iteration
stays a few microseconds per running request.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import numpy as np
from numpy.typing import NDArray

from orca_jax.core.admission import reject_impossible, reservation_tokens
from orca_jax.core.engine_api import Engine
from orca_jax.core.executor import Executor
from orca_jax.core.kv_pages import KV_LAYOUTS, KVPageManager
from orca_jax.core.packing import SamplingArrays, bucket_config_for
from orca_jax.core.plan import PlanError, StepPlan
from orca_jax.core.policy import KV_RESERVATIONS, Policy, check_kv_reservation
from orca_jax.core.prefix_cache import PrefixCache
from orca_jax.core.prefix_hits import PrefixHits
from orca_jax.core.request import Request, RequestState, sort_by_arrival
from orca_jax.core.request_table import RequestTable
from orca_jax.core.run_record import RunRecord
from orca_jax.core.scheduler_loop import SchedulerLoop
from orca_jax.core.scheduler_loop import frozen as _frozen
from orca_jax.core.view import SchedulerView
from orca_jax.core.watchdog import ProgressWatchdog

# Plain ints: IntEnum attribute lookups cost a microsecond each on the hot path.
_PENDING, _WAITING, _RUNNING = (int(RequestState.PENDING), int(RequestState.WAITING),
                                int(RequestState.RUNNING))


@dataclasses.dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """The mechanism's limits (policy knobs live on the policy).

    Attributes:
      max_num_seqs: most sequences in one step (the batch cap).
      max_num_tokens: most tokens computed in one step (the largest bucket).
      num_kv_pages: usable KV pages in the pool.
      page_size: tokens per KV page.
      max_model_len: context limit: prompt + output of any request.
      token_buckets: step sizes T to pad to (default: powers of two up to the budget).
      watermark_pages: free pages an admission must leave (vLLM v0's watermark).
      kv_layout: `paged` (any free page serves) or `buddy` (each request's
        reservation one contiguous power-of-two block from a buddy allocator, as
        the vLLM paper's Orca baselines; needs a reserving `kv_reservation`).
      enable_prefix_caching: share cached KV pages of common prefixes between
        requests, for policies that opt in (`Policy.prefix_caching`); off, every
        run is exactly as without caching. Not with the `buddy` layout.
      count_host_time: add measured host time to the virtual clock (then runs
        are no longer bit-for-bit repeatable).
      overlap: plan and pack step N+1 while step N runs, its decodes fed step N's
        tokens on the device and N's tokens read back one step late
        (`orca_jax.core.overlap`); plans, steps and tokens are the same as without.
        Needs an engine that `feeds_tokens`, and not active with prefix caching
        (pages are named by token values before the next plan) or `kv_handoff` (the
        transfer carries the first token); else it runs in step.
      log_step_requests: record which requests each step computed, how many tokens
        each, and which hold a batch place after it (`RunResult.step_requests`,
        `step_tokens`, `step_held`; memory grows with steps x batch).
      temperature, top_k, top_p: sampling parameters of every request (greedy default).
      seed: mixed into every request's sampling seed; policies and routers read it
        (`SchedulerView.seed`) to seed their own randomness.
      ttft_slo_s, tpot_slo_s: the run's SLOs (None: unset), for policies to read
        (`SchedulerView.ttft_slo_s`); the core does not enforce them.
      kv_handoff: a finished request keeps its KV pages (in `in_transfer`) until a
        transfer hands them on (`orca_jax.core.handoff`: a disaggregated prefill replica).
      no_progress_steps: the run fails (`no_progress`) after this many iterations
        in a row in which no request computed a token past the most it had ever
        computed, finished, was released or was rejected, while work remains (a
        livelock: preempting and readmitting forever).
    """

    max_num_seqs: int = 256
    max_num_tokens: int = 2048
    num_kv_pages: int = 4096
    page_size: int = 16
    max_model_len: int = 2048
    token_buckets: Optional[tuple[int, ...]] = None
    watermark_pages: int = 0
    kv_layout: str = "paged"
    enable_prefix_caching: bool = True
    count_host_time: bool = False
    overlap: bool = False
    log_step_requests: bool = False
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    ttft_slo_s: Optional[float] = None
    tpot_slo_s: Optional[float] = None
    no_progress_steps: int = 10_000
    kv_handoff: bool = False

    def __post_init__(self) -> None:
        for field in ("max_num_seqs", "max_num_tokens", "num_kv_pages", "page_size",
                      "max_model_len", "no_progress_steps"):
            if getattr(self, field) < 1:
                raise ValueError(f"SchedulerConfig.{field} must be >= 1, "
                                 f"got {getattr(self, field)}")
        if self.watermark_pages < 0 or self.watermark_pages >= self.num_kv_pages:
            raise ValueError(f"SchedulerConfig.watermark_pages must be in [0, num_kv_pages), "
                             f"got {self.watermark_pages}")
        if self.kv_layout not in KV_LAYOUTS:
            raise ValueError(f"SchedulerConfig.kv_layout {self.kv_layout!r} is not one of "
                             f"{KV_LAYOUTS}")
        for field in ("ttft_slo_s", "tpot_slo_s"):
            value = getattr(self, field)
            if value is not None and not value > 0:
                raise ValueError(f"SchedulerConfig.{field} must be > 0 or None, got {value}")


class Scheduler(SchedulerLoop):
    """Runs `policy` over `requests` on `engine`. One instance per run.

    Args:
      requests: the workload (any order; indexed by arrival order).
      policy: the scheduling policy (fresh: policies keep bookkeeping).
      engine: a JaxEngine or SimEngine.
      config: the mechanism's limits.

    Attributes:
      executor: runs its iterations (`step`, `run`) and keeps its clock; depth 2
        with `config.overlap` where the run allows it, else 1. Set another
        `Executor(scheduler, depth=N)` before the first step for another depth.
    """

    def __init__(self, requests: Sequence[Request], policy: Policy, engine: Engine,
                 config: SchedulerConfig) -> None:
        if not requests:
            raise ValueError("the workload has no requests")
        self.config = config
        self.policy = policy
        self.engine = engine
        check_kv_reservation(policy, ValueError)
        self.kv_reservation = policy.kv_reservation
        if config.kv_layout == "buddy" and self.kv_reservation == "none":
            raise ValueError(f"policy {policy.name!r}: kv_layout 'buddy' gives each request one "
                             "block at admission, so it needs a reserving kv_reservation "
                             f"({KV_RESERVATIONS[1:]}), not 'none'")
        self.prefix_caching = bool(config.enable_prefix_caching and policy.prefix_caching)
        if self.prefix_caching and config.kv_layout == "buddy":
            raise ValueError(f"policy {policy.name!r}: prefix caching shares single KV pages and "
                             "the buddy layout hands out whole blocks; turn one off "
                             "(SchedulerConfig.enable_prefix_caching or the policy's knob)")
        ordered = sort_by_arrival(requests)
        self.table = RequestTable(ordered)
        n = len(ordered)
        self.bucket_config = bucket_config_for(
            max_num_tokens=config.max_num_tokens, max_num_seqs=config.max_num_seqs,
            max_model_len=config.max_model_len, page_size=config.page_size,
            token_sizes=config.token_buckets)
        # A workload of lengths only has no ids to match: no admission could ever hit, so
        # no cache is kept and every step takes the uncached path (same results, faster).
        cache = (PrefixCache(num_kv_pages=config.num_kv_pages, page_size=config.page_size,
                             num_requests=n)
                 if self.prefix_caching and any(r.prompt_tokens is not None for r in ordered)
                 else None)
        self.kv = KVPageManager(num_kv_pages=config.num_kv_pages, page_size=config.page_size,
                                max_pages_per_seq=self.bucket_config.pages_per_seq,
                                num_requests=n, layout=config.kv_layout, prefix_cache=cache)
        self._reserve_tokens = reservation_tokens(self.kv_reservation, self.table,
                                                  config.max_model_len)
        seeds = (np.arange(n, dtype=np.uint64) * np.uint64(0x9E3779B1)
                 + np.uint64(config.seed)) & np.uint64(0xFFFFFFFF)
        self.sampling = SamplingArrays(
            temperature=np.full(n, config.temperature, np.float32),
            top_k=np.full(n, config.top_k, np.int32), top_p=np.full(n, config.top_p, np.float32),
            rng_seeds=seeds.astype(np.uint32))
        self._generated: Optional[list[list[int]]] = (
            [[] for _ in range(n)] if engine.needs_token_ids else None)
        if engine.needs_token_ids and any(r.prompt_tokens is None for r in ordered):
            raise ValueError(f"engine {engine.name!r} needs prompt token ids; the workload has "
                             "requests with lengths only (give the workload a vocabulary size)")
        self.now_s = 0.0
        self.num_steps = 0
        self._next_arrival = 0
        self._empty = _frozen(np.zeros(0, dtype=np.int64))
        self.waiting = self.running = self.unreleased = self.last_finished = self._empty
        # Requests whose KV pages a transfer holds, outside the queues (`core.handoff`).
        self.in_transfer = self._empty
        self._num_done = 0
        self._num_requests = n  # `done` is asked twice an iteration: no len() call
        self.record = RunRecord(num_requests=n, logs_step_requests=config.log_step_requests)
        self.hits: Optional[PrefixHits] = (
            PrefixHits(self.table, self.kv, cache, uses_planned_output=not engine.needs_token_ids)
            if cache is not None else None)
        # Whether `pages_needed` counts exactly what `kv.allocate` will take (no page
        # reserved at admission, no hit shared): the plan check's count is then reused.
        self._needed_is_allocation = self.kv_reservation == "none" and self.hits is None
        self._step_cached_tokens = 0
        self._num_done += reject_impossible(self.table, self.kv, config, self._reserve_tokens)
        self.watchdog = ProgressWatchdog(n, config.no_progress_steps)
        self.view = SchedulerView(self)
        overlaps = (config.overlap and getattr(engine, "feeds_tokens", False)
                    and self.late_tokens_conflict() is None)
        self.executor = Executor(self, depth=2 if overlaps else 1)

    # ------------------------------------------------------------- queries
    def next_arrival_s(self) -> Optional[float]:
        pending = self._next_pending()
        return None if pending is None else float(self.table.arrival_s[pending])

    def _next_pending(self) -> Optional[int]:
        state = self.table.state
        i = self._next_arrival
        while i < len(self.table) and state[i] != _PENDING:
            i += 1
        self._next_arrival = i
        return i if i < len(self.table) else None

    def pages_needed(self, ids: NDArray[np.int64], tokens: NDArray[np.int64]) -> NDArray[np.int64]:
        """New pages to run `tokens` of each request now (admissions reserve first).

        With prefix caching, an admission's tokens start past its hit: it needs the
        pages past the hit, plus each hit page that is free now (sharing takes it).
        """
        target = self.table.num_computed[ids] + tokens
        if self.kv_reservation == "none" and self.hits is None:
            return self.kv.pages_needed(ids, target)
        admitting = self.table.state[ids] == _WAITING
        hit_pages = free_hits = None
        if self.hits is not None and admitting.any():
            hit_pages, free_hits = self.hits.hit_counts(ids, admitting)
            target = target + hit_pages * self.config.page_size
        if self.kv_reservation != "none":
            target = np.where(admitting, np.maximum(target, self._reserve_tokens[ids]), target)
        needed = self.kv.pages_needed(ids, target)
        if hit_pages is None:
            return needed
        return needed - hit_pages + free_hits

    def cached_tokens(self, ids: NDArray[np.int64]) -> NDArray[np.int64]:  # [n] -> [n]
        """Tokens an admission of each request now would take from the prefix cache
        (0 for a request running or done, and when caching is not active)."""
        if self.hits is None:
            return np.zeros(ids.size, dtype=np.int64)
        return self.hits.hit_counts(ids, self.table.state[ids] <= _WAITING)[0] * (
            self.config.page_size)

    def pool_demand(self, ids: NDArray[np.int64],  # [n]
                    needed: NDArray[np.int64],  # [n] from pages_needed
                    preempt: NDArray[np.int64]) -> tuple[int, int]:  # [p]
        """(pages the plan takes from the free pool, pages its preemptions free).

        `needed.sum()` counts a free page that several admissions hit once for each;
        the pool gives it once. A page freed by preemption that an admission hits
        is taken again at once, so it counts on neither side.
        """
        if self.hits is None:
            return int(needed.sum()), int(self.kv.num_held[preempt].sum()) if preempt.size else 0
        admitted = ids[self.table.state[ids] == _WAITING]
        if admitted.size == 0 and preempt.size == 0:  # most steps: nothing shared is taken
            return int(needed.sum()), 0
        hit = self.hits.hit_pages(admitted)  # [h] distinct
        overcount = self.hits.free_hit_overcount(admitted, hit)
        freed = self.kv.num_freed_by(preempt, hit) if preempt.size else 0
        return int(needed.sum()) - overcount, freed

    @property
    def done(self) -> bool:
        """Every request finished and released, rejected, or routed away."""
        return self._num_done == self._num_requests

    @property
    def num_done(self) -> int:
        """Requests finished and released, rejected, or routed away."""
        return self._num_done

    def has_work(self, before_s: float) -> bool:
        """Whether an iteration now would do something before `before_s` arrives.

        True while requests wait, run or await release, or one arrives before
        `before_s`: a cluster steps its replicas up to each arrival with this.
        """
        if self.waiting.size or self.running.size or self.unreleased.size:
            return True
        upcoming = self.next_arrival_s()
        return upcoming is not None and upcoming < before_s

    def withdraw(self, ids: Sequence[int]) -> None:
        """Takes requests that have not arrived yet out of this run.

        A cluster's router calls this on every replica but the one it sends a
        request to; withdrawn requests count as done and have no results here.

        Raises:
          ValueError: a request has already arrived (or is done); nothing changes.
        """
        ids = np.asarray(ids, dtype=np.int64)
        states = self.table.state[ids]
        if (states != _PENDING).any():
            first = int(np.argmax(states != _PENDING))
            raise ValueError(f"withdraw: request {int(ids[first])} is "
                             f"{RequestState(states[first]).name}; only requests that have not "
                             "arrived can be routed away")
        self.table.state[ids] = RequestState.ROUTED_AWAY
        self._num_done += int(ids.size)

    def _idle(self, plan: StepPlan) -> bool:
        """An iteration that runs nothing: wait for the next arrival, or fail if stuck.
        Returns True when it waits (for work: no livelock)."""
        if plan.release.size or plan.preempt.size or plan.reject_ids.size:
            return False  # the plan changed state; let the policy look again
        if self.done:
            return False
        if self.in_transfer.size:
            return True  # a transfer's end frees or brings pages: its cluster steps us again
        if self.busy.size:
            return True  # the executor lands a step in flight: its requests are free again
        stalled = self.waiting[self.kv.num_held[self.waiting] > 0]  # received with their KV
        if stalled.size and not self.running.size:  # and their pages block every admission
            self.kv.free(stalled)  # so they recompute, as if preempted
            self.table.num_computed[stalled] = 0
            self.table.num_preemptions[stalled] += 1
            self.record.num_preemptions += int(stalled.size)
            return False
        if self.next_arrival_s() is None:
            raise PlanError(self.policy.name, "no_progress",
                            f"the plan runs nothing at {self.now_s:.6f} s with "
                            f"{self.waiting.size} waiting, {self.running.size} running, "
                            f"{self.unreleased.size} unreleased and no arrivals to come")
        return True

    # ------------------------------------------------------ state changes
    def _apply_release(self, release: NDArray[np.int64]) -> None:
        if release.size == 0:
            return
        self.table.finish_s[release] = self.now_s
        self.unreleased = _frozen(self.unreleased[~np.isin(self.unreleased, release)])
        self._num_done += int(release.size)

    def _apply_preemption(self, preempt: NDArray[np.int64]) -> None:
        if preempt.size == 0:
            return
        table = self.table
        self.kv.free(preempt)
        table.state[preempt] = _WAITING
        table.num_computed[preempt] = 0
        table.num_preemptions[preempt] += 1
        self.running = _frozen(self.running[table.state[self.running] == _RUNNING])
        self.waiting = _frozen(np.sort(np.concatenate([self.waiting, preempt])))
        self.record.num_preemptions += int(preempt.size)

    def _apply_rejection(self, plan: StepPlan) -> None:
        reject = plan.reject_ids
        if reject.size == 0:
            return
        table = self.table
        table.state[reject] = RequestState.REJECTED
        self.kv.free(reject)  # a request received with its KV (core.handoff) waits with pages
        for request, reason in zip(reject.tolist(), plan.reject_reasons):
            table.reject_reason[request] = f"policy {self.policy.name}: {reason}"
        self.waiting = _frozen(self.waiting[table.state[self.waiting] == _WAITING])
        self._num_done += int(reject.size)

    def _admit(self, ids: NDArray[np.int64]) -> None:
        table = self.table
        admitted = ids[table.state[ids] == _WAITING]
        if admitted.size == 0:
            return
        table.state[admitted] = _RUNNING
        table.admitted_s[admitted] = self.now_s
        is_first = np.isnan(table.first_scheduled_s[admitted])  # [a] never admitted before
        table.first_scheduled_s[admitted[is_first]] = self.now_s
        self.running = _frozen(np.concatenate([self.running, admitted]))
        self.waiting = _frozen(self.waiting[table.state[self.waiting] == _WAITING])
        if self.hits is not None:  # share the hits before any allocation can evict them
            cached = self.hits.admit(admitted)
            table.num_computed[admitted] = cached
            # A request readmitted after preemption finds its own freed pages: that saves
            # recompute but is no prefix hit, so a request's hit is its first admission's.
            table.num_cached_tokens[admitted[is_first]] = cached[is_first]
            self._step_cached_tokens = int(cached.sum())
        if self.kv_reservation != "none":
            self.kv.allocate(admitted, np.maximum(table.num_computed[admitted],
                                                  self._reserve_tokens[admitted]))
