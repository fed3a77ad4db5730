"""The iteration-level scheduler (Orca's loop) over a virtual clock: its state.

A `Scheduler` holds a run's requests (the `RequestTable`), its queues (waiting,
running, finished but unreleased), its KV pages, and the changes a plan makes
to them: releases, preemptions (by recompute), rejections with a reason, and
admissions. Each iteration is two phases, `schedule()` and `update()`
(`orca_jax.core.loop.scheduler_loop`), run by an executor that owns the engine and
moves the clock (`orca_jax.core.loop.executor`); when nothing can run, the clock
jumps to the next arrival instead of sleeping. Requests that no admission
could ever take are rejected up front (`orca_jax.core.loop.admission`), and a run
in which no request gains a computed token or finishes for `no_progress_steps`
iterations fails (`no_progress`).

With prefix caching active (the run's switch `SchedulerConfig.kv.prefix_caching`
is `on`, or `policy` and the policy opts in: `Policy.prefix_caching`), an
admission shares the cached pages of its known tokens and starts past them, and
pages are named as they fill (`orca_jax.core.kv.prefix_cache`,
`orca_jax.core.kv.prefix_hits`).

All per-request state is in the `RequestTable`'s arrays and every per-step
operation is a whole-array numpy expression, so the host cost per iteration
stays a few microseconds per running request.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence, Union

import numpy as np
from numpy.typing import NDArray

from orca_jax.core.api.policy import Policy, check_kv_reservation, prefix_caching_active
from orca_jax.core.kv import KVMemory, PreemptionCosts, preempt, preemption_costs
from orca_jax.core.kv.preemption import RECOMPUTE, SWAP
from orca_jax.core.kv.prefix_hits import PrefixHits
from orca_jax.core.loop import cancel as cancelling
from orca_jax.core.loop import program_pins, request_export
from orca_jax.core.loop.admission import reject_impossible
from orca_jax.core.loop.arrival_join import ArrivalJoin
from orca_jax.core.loop.config import SchedulerConfig
from orca_jax.core.loop.executor import Executor
from orca_jax.core.loop.request_export import RequestExport
from orca_jax.core.loop.scheduler_loop import NO_REQUESTS, RUNNING_0D, WAITING_0D, SchedulerLoop
from orca_jax.core.loop.scheduler_loop import frozen as _frozen
from orca_jax.core.loop.watchdog import ProgressWatchdog
from orca_jax.core.plans.plan import PlanError, StepPlan
from orca_jax.core.plans.view import SchedulerView
from orca_jax.core.requests.request import Request, RequestState, sort_by_arrival
from orca_jax.core.requests.request_table import RequestTable, SpecCounts
from orca_jax.core.requests.run_record import RunRecord
from orca_jax.core.step.engine_api import NO_FRONT_END, Engine
from orca_jax.core.step.packing import SamplingArrays, bucket_config_for

# Plain ints: IntEnum attribute lookups cost a microsecond each on the hot path.
_PENDING, _WAITING, _RUNNING, _AWAY = (int(RequestState.PENDING), int(RequestState.WAITING),
                                       int(RequestState.RUNNING), int(RequestState.ROUTED_AWAY))
_WAITING_CODE = bytes([_WAITING])  # the table's int8 state code, as bytes (`_admit`)


class Scheduler(SchedulerLoop):
    """Runs `policy` over `requests` on `engine`. One instance per run.

    Args:
      requests: the workload (any order; indexed by arrival order).
      policy: the scheduling policy (fresh: policies keep bookkeeping).
      engine: a JaxEngine or SimEngine.
      config: the mechanism's settings, in parts (`SchedulerConfig`).
      submitted_only: no request arrives on its own: each comes by `submit` (a
        cluster's router) or `import_request` (a transfer, a migration), and one
        never given counts as routed away (a replica of a cluster).
      table: the request table of the replica's pool, as this replica sees it
        (`RequestTable.for_replica`; built over the same `requests`), shared with
        the pool's other replicas; default: a table of its own.
      log_tokens: keep every generated token's request and time (`RunResult.token_req`,
        `token_time_s`: 16 bytes a token); False counts them instead, which is all the
        metrics need (`RunRecord.logs_tokens`).
      kv_counts_only: keep KV page counts only, no page table, where nothing can read
        pages (`KVMemory.build`'s `counts_only`), given an engine that does not read them
        (`Engine.reads_kv_pages`) and one pipeline stage. The caller's word that nothing
        outside reads them either: the runner asks for it on one replica, and a cluster
        for its replicas when none of them exports or imports a request with its KV (no
        migration, no handoff: `Cluster`'s `kv_counts_only`). False (the default) keeps
        the full pool, for a caller that reads pages (`pages_of`, `export_request`) or
        checks them.

    Attributes:
      executor: runs its iterations (`step`, `run`) and keeps its clock; depth 2
        with `config.features.overlap` where the run allows it, else 1. Set another
        `Executor(scheduler, depth=N)` before the first step for another depth.
    """

    def __init__(self, requests: Sequence[Request], policy: Policy, engine: Engine,
                 config: SchedulerConfig, *, submitted_only: bool = False,
                 table: Optional[RequestTable] = None, log_tokens: bool = True,
                 kv_counts_only: bool = False) -> None:
        if not requests:
            raise ValueError("the workload has no requests")
        self.config = config
        # The part the per-step paths read, one attribute away (the page size they read
        # is the pool's: `self.kv.page_size`). Few attributes: see MAX_SCHEDULER_ATTRIBUTES.
        self.features = config.features
        limits, kv_config, sampling = config.limits, config.kv, config.sampling
        self.policy = policy
        self.engine = engine
        check_kv_reservation(policy, ValueError)
        policy.check_limits(limits)
        self.prefix_caching = prefix_caching_active(policy, kv_config.prefix_caching, ValueError)
        if table is not None and len(table) != len(requests):
            raise ValueError(f"Scheduler: the shared table has {len(table)} requests, the "
                             f"workload {len(requests)}; share a table of the same workload")
        ordered = sort_by_arrival(requests) if table is None else table.specs
        self.table = RequestTable(ordered) if table is None else table
        n = len(ordered)
        self.bucket_config = bucket_config_for(
            max_num_tokens=limits.max_num_tokens, max_num_seqs=limits.max_num_seqs,
            max_model_len=limits.max_model_len, page_size=kv_config.page_size,
            token_sizes=limits.token_buckets)
        self.kv_memory = KVMemory.build(
            self.table, policy_name=policy.name, config=kv_config,
            max_pages_per_seq=self.bucket_config.pages_per_seq,
            max_model_len=limits.max_model_len, reservation=self.kv_reservation,
            prefix_caching=self.prefix_caching, uses_planned_output=not engine.needs_token_ids,
            counts_only=(kv_counts_only and not getattr(engine, "reads_kv_pages", True)
                         and getattr(engine, "num_stages", 1) == 1))
        self.kv = self.kv_memory.pool
        self.capacity = self.kv_memory.capacity
        if self.kv_memory.linked is not None:  # slower tiers' links queue on our clock
            self.kv_memory.linked.clock = lambda: self.now_s
            self._hold_tier_contents(engine)
        if getattr(policy, "preemption_mode", RECOMPUTE) == SWAP and not kv_config.tiers:
            raise ValueError(f"policy {policy.name!r}: preemption_mode=swap needs a host KV "
                             "tier (--kv_host_gb or --kv_host_pages)")
        seeds = (np.arange(n, dtype=np.uint64) * np.uint64(0x9E3779B1)
                 + np.uint64(sampling.seed)) & np.uint64(0xFFFFFFFF)
        # One value for every request: read-only broadcast views, no memory per request.
        self.sampling = SamplingArrays(
            temperature=np.broadcast_to(np.float32(sampling.temperature), (n,)),
            top_k=np.broadcast_to(np.int32(sampling.top_k), (n,)),
            top_p=np.broadcast_to(np.float32(sampling.top_p), (n,)),
            rng_seeds=seeds.astype(np.uint32))
        self._generated: Optional[list[list[int]]] = (
            [[] for _ in range(n)] if engine.needs_token_ids else None)
        if engine.needs_token_ids and any(r.prompt_tokens is None for r in ordered):
            raise ValueError(f"engine {engine.name!r} needs prompt token ids; the workload has "
                             "requests with lengths only (give the workload a vocabulary size)")
        self.now_s = 0.0
        # When arrivals join the queue, and the rows that may (a cluster's replica: up to
        # its last submission).
        # (An engine of the duck-typed kind, not an `Engine`, declares no front end.)
        self.arrival_join = ArrivalJoin(
            engine.front_end if isinstance(engine, Engine) else NO_FRONT_END,
            horizon=0 if submitted_only else n)
        self.num_steps = 0
        self._next_arrival = 0
        # More requests may still be submitted: an iteration with nothing to do and nothing
        # to come waits for them instead of failing (a cluster's replica, until the last
        # arrival is routed).
        self.awaits_submissions = False
        self.waiting = self.running = self.unreleased = self.last_finished = NO_REQUESTS
        # Requests whose KV pages a transfer holds, outside the queues (`request_export`).
        self.in_transfer = NO_REQUESTS
        self._num_done = 0
        self.record = RunRecord(num_requests=n,
                                logs_step_requests=self.features.log_step_requests,
                                logs_tokens=log_tokens)
        if table is None or not table.replica:  # a shared table's first replica does it
            self._num_done += reject_impossible(self.table, self.capacity,
                                                config.limits.max_model_len)
        else:
            self._num_done += int(np.count_nonzero(self.table.state == RequestState.REJECTED))
        if submitted_only:  # every request still to route is held by no replica yet
            state = self.table.state
            absent = (state == _PENDING) | (state == _AWAY)
            state[absent] = _AWAY
            # Held by none: those to route, and those rejected up front (every replica's).
            self.table.holder[absent | (state == RequestState.REJECTED)] = -1
            self._num_done += int(np.count_nonzero(absent))
        programs = self.table.programs
        if config.kv.kv_pin_s and (submitted_only or table is not None):
            raise ValueError("kv_pin_s: pinning a program's KV across tool pauses is for one "
                             "replica for now (a cluster may route the next call elsewhere)")
        if programs is not None and table is None:  # the pool's first replica, or the only
            if not submitted_only:  # a call with parents comes by its release, not by time
                self.table.holder[programs.has_parents & (self.table.state == _PENDING)] = -1
            programs.start()
        if config.features.spec_k and not getattr(engine, "speculates", False):
            raise ValueError(f"spec_k={config.features.spec_k}: engine {engine.name!r} does "
                             "not speculate (give the simulator --spec_acceptance or "
                             "--draft_model, or the real engine a drafter)")
        if getattr(engine, "speculates", False):  # drafted and accepted tokens per request
            if submitted_only or table is not None or getattr(engine, "num_stages", 1) > 1:
                raise ValueError(f"engine {engine.name!r} speculates: speculative decoding "
                                 "runs on one replica of one pipeline stage for now")
            self.table.speculation = SpecCounts(n)
        self.watchdog = ProgressWatchdog(n, config.limits.no_progress_steps)
        self.view = SchedulerView(self)
        overlaps = (config.features.overlap and getattr(engine, "feeds_tokens", False)
                    and self.late_tokens_conflict() is None)
        if getattr(engine, "num_stages", 1) > 1:  # micro-batches through pipeline stages
            if submitted_only or table is not None:
                raise ValueError(f"engine {engine.name!r} has {engine.num_stages} pipeline "
                                 "stages; a replica of a cluster runs one stage for now")
            # Lazy: only an engine of several stages needs the pipeline's executor, so a
            # one-stage run (every simulator run without --pp) never imports it.
            from orca_jax.core.loop.pipeline import PipelineExecutor
            self.executor = PipelineExecutor(self)  # type: ignore[assignment]
            return
        # A run with slower KV tiers never leaps: their links move pages (prefetches,
        # write-throughs) on steps a leap would not see one by one.
        self.executor = Executor(self, depth=2 if overlaps else 1,
                                 leap=(config.features.leap and self.kv_memory.linked is None
                                       and (submitted_only or table is None)))
        if submitted_only and self.executor.leaper is not None:
            # A cluster's replica leaps only up to its loop's next event of another kind,
            # once the loop gives it (`set_leap_horizon`); until then, never.
            self.executor.leaper.horizon = None

    def set_leap_horizon(self, horizon: Callable[[], Optional[float]]) -> None:
        """A cluster's loop whose replicas do not act on each other's steps: this replica
        may leap up to `horizon()`, the loop's next event other than a replica's step
        (behind a state-blind router, its own next arrival or the loop's next event of
        another kind; None: none is left). Kept on the leaper: the scheduler's own attributes are
        capped (`MAX_SCHEDULER_ATTRIBUTES`)."""
        leaper = getattr(self.executor, "leaper", None)
        if leaper is not None:
            leaper.horizon = horizon

    def _hold_tier_contents(self, engine: Engine) -> None:
        """An engine whose cache holds real KV keeps the host tier's pages in host memory
        and copies them (`Engine.host_kv_store`); the simulator's tiers move none."""
        linked = self.kv_memory.linked
        assert linked is not None
        store = engine.host_kv_store() if isinstance(engine, Engine) else None
        if store is None:
            return
        if len(linked.lower) > 1:
            raise ValueError(f"engine {engine.name!r} holds a host KV tier only; a disk tier "
                             "(--kv_disk_gb/--kv_disk_pages) is simulated only for now")
        linked.contents = store  # type: ignore[assignment]

    # ------------------------------------------------------------- queries
    def next_arrival_s(self) -> Optional[float]:
        """When the next request arrives here: the next pending one's arrival, or the next
        program call's release (one replica releases its own; docs/programs.md)."""
        pending = self._next_pending()
        upcoming = (None if pending is None
                    else self.arrival_join.visible_s(float(self.table.arrival_s[pending])))
        programs = self.table.programs
        if programs is not None:
            events = [upcoming, programs.next_release_s() if programs.self_release else None,
                      programs.next_pin_end_s() if programs.pins else None]  # a pin's end
            known = [when for when in events if when is not None]  # frees pages: leaps stop
            upcoming = min(known) if known else None
        return upcoming

    def _release_calls(self) -> None:
        """Program calls whose release time has come arrive here (their `arrival_s`, the
        zero-service bound, is no later than their release, so the arrivals take them)."""
        programs = self.table.programs
        assert programs is not None
        released = programs.release_due(self.now_s)
        if released.size:
            self.table.holder[released] = self.table.replica
            self._next_arrival = min(self._next_arrival, int(released.min()))

    def _next_pending(self) -> Optional[int]:
        state, holder, me = self.table.state, self.table.holder, self.table.replica
        i, horizon = self._next_arrival, self.arrival_join.horizon
        while i < horizon and (state[i] != _PENDING or holder[i] != me):
            i += 1
        self._next_arrival = i
        return i if i < horizon else None

    def pages_needed(self, ids: NDArray[np.int64], tokens: NDArray[np.int64]) -> NDArray[np.int64]:
        """New pages to run `tokens` of each request now (`KVCapacity.pages_needed`)."""
        return self.capacity.pages_needed(ids, tokens)

    def cached_tokens(self, ids: NDArray[np.int64]) -> NDArray[np.int64]:  # [n] -> [n]
        """Tokens an admission of each request now would take from the prefix cache
        (0 for a request running or done, and when caching is not active). A request
        not held here counts as if it were sent here (a router asks)."""
        return self.capacity.cached_tokens(ids)

    def preemption_costs(self, ids: NDArray[np.int64]) -> PreemptionCosts:  # [n]
        """Each request's cost under swap and recompute (`kv.preemption_costs`)."""
        return preemption_costs(self.kv_memory, ids)

    @property
    def kv_reservation(self) -> str:
        """The policy's `kv_reservation`: what an admission reserves."""
        return self.policy.kv_reservation

    @property
    def hits(self) -> Optional[PrefixHits]:
        """The prefix-cache lookups, or None when no cache is kept (`KVMemory.hits`)."""
        return self.kv_memory.hits

    @property
    def done(self) -> bool:
        """Every request finished and released, rejected, or routed away."""
        return self._num_done == len(self.table.specs)

    @property
    def num_done(self) -> int:
        """Requests finished and released, rejected, or routed away."""
        return self._num_done

    def submit(self, ids: Sequence[int]) -> None:
        """Gives this scheduler requests it does not hold (`submitted_only`): each
        arrives at its arrival time, or at once if that has passed.

        Raises:
          ValueError: a request is held here, done here, or rejected up front; nothing
            changes.
        """
        table = self.table
        if len(ids) == 1:  # a cluster's arrival: Python ints, no arrays
            where = first = last = int(ids[0])
            if table.state[first] != _AWAY:
                self._refuse_submit(first)
            count = 1
        else:
            where = np.asarray(ids, dtype=np.int64)
            away = table.state[where] == _AWAY  # [n]
            if not away.all():
                self._refuse_submit(int(where[np.argmin(away)]))
            if not where.size:
                return
            first, last, count = int(where.min()), int(where.max()), int(where.size)
        table.state[where] = _PENDING
        table.holder[where] = table.replica
        self._num_done -= count
        self._next_arrival = min(self._next_arrival, first)
        self.arrival_join.horizon = max(self.arrival_join.horizon, last + 1)

    def _refuse_submit(self, request: int) -> None:
        """`submit`'s error for a request it may not take (held or done here)."""
        raise ValueError(f"submit: request {request} is "
                         f"{RequestState(self.table.state[request]).name} here; only a "
                         "request this scheduler does not hold can be submitted")

    # ------------------------------------------------ requests ended from outside (cancel)
    def cancel(self, ids: Sequence[int], reason: str) -> int:
        """Ends requests whose clients left: rejected with `reason`, their pages freed,
        the policy told through `last_finished` (`cancel.cancel`). Returns how many
        were live."""
        return cancelling.cancel(self, np.asarray(ids, dtype=np.int64), reason)

    def stop(self, ids: Sequence[int]) -> int:
        """Finishes requests now with the tokens they have (a stop string, end of
        sequence; `cancel.stop`). Returns how many were live."""
        return cancelling.stop(self, np.asarray(ids, dtype=np.int64))

    def generated_tokens(self, request: int) -> list[int]:
        """The token ids `request` has generated that the host holds so far (with steps
        in flight, its newest may still be on the device). Empty without token ids."""
        return [] if self._generated is None else self._generated[request]

    # ------------------------------------------------ requests moving (request_export)
    def export_request(self, request: int, *, with_kv: bool = True) -> RequestExport:
        """A copy of `request`'s state here (`request_export.export_request`)."""
        self.executor.drain()  # its newest token may still be on the device
        tokens: Optional[list[int]] = None
        if self._generated is not None:
            tokens = self._generated[request]
        elif self.hits is not None:  # the receiver's cache names its pages by them
            tokens = self.hits.generated(request).tolist()
        return request_export.export_request(self, request, tokens, with_kv=with_kv)

    def reserve_pages(self, request: int, num_tokens: int) -> bool:
        """Pages for a request about to be imported (`request_export.reserve_pages`)."""
        return request_export.reserve_pages(self, request, num_tokens)

    def grow_reserved_pages(self, request: int, num_tokens: int) -> bool:
        """More reserved pages for an incoming request (`request_export.grow_reserved_pages`)."""
        return request_export.grow_reserved_pages(self, request, num_tokens)

    def cancel_reservation(self, request: int) -> None:
        """Its reserved pages back (`request_export.cancel_reservation`)."""
        request_export.cancel_reservation(self, request)

    def import_request(self, export: RequestExport, at_s: float) -> None:
        """Holds `export`'s request from `at_s` on, waiting (`request_export.import_request`).

        Raises:
          ValueError: as `request_export.import_request`, or the engine needs token ids
            and the export has none.
        """
        if self._generated is not None and export.output_tokens is None:
            raise ValueError(f"import_request: engine {self.engine.name!r} needs token ids; "
                             f"request {export.request}'s export has none")
        request_export.import_request(self, export, at_s)
        if self._generated is not None:
            self._generated[export.request] = list(export.output_tokens)
        self._num_done -= 1  # a request this scheduler did not hold counted as done

    def release_request(self, request: int, at_s: float) -> None:
        """Lets an exported request go (`request_export.release_request`)."""
        self.executor.drain()
        if request_export.release_request(self, request, at_s):
            self._num_done += 1

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
        # Waiting requests holding KV (received with it) while the plan runs nothing: their
        # pages may be what every other request waits for (a full decode pool whose policy
        # stops admitting at a request that needs pages), and nothing else frees any. They
        # recompute, as if preempted, and are logged so. Not behind a policy that never
        # preempts: it planned around them (a transfer took their reservation up front).
        pinned = self.table.programs is not None and bool(self.table.programs.pins)
        if pinned and self.waiting.size:
            program_pins.release_all(self)
            return False  # pinned pages never block the run: the policy looks again
        stalled = self.waiting[self.kv.num_held[self.waiting] > 0]
        if stalled.size and self.policy.preempts:
            self._evict(stalled)
            if self.features.log_step_requests:
                self.record.log_removed(stalled, NO_REQUESTS)
            return False
        upcoming = self.next_arrival_s()
        if upcoming is None and self.awaits_submissions:
            return True  # its cluster routes the next arrival and steps us again
        if upcoming is None:
            raise PlanError(self.policy.name, "no_progress",
                            f"the plan runs nothing at {self.now_s:.6f} s with "
                            f"{self.waiting.size} waiting, {self.running.size} running, "
                            f"{self.unreleased.size} unreleased and no arrivals to come")
        return True

    # ------------------------------------------------------ state changes
    def _apply_release(self, release: NDArray[np.int64]) -> None:
        if release.size == 0:
            return
        # Never before its last token: through pipeline stages a token is stamped when its
        # micro-batch leaves the last stage, after the clock of the next plan (one stage: now).
        self.table.finish_s[release] = np.maximum(self.now_s, self.table.last_token_s[release])
        self.unreleased = _frozen(self.unreleased[~np.isin(self.unreleased, release)])
        self._num_done += int(release.size)
        if self.table.programs is not None:  # the client has the answer: the program goes on
            self.table.programs.done(release, self.now_s)

    def _apply_preemption(self, victims: NDArray[np.int64]) -> float:
        """Preempts `victims`; returns the seconds their KV's moves between tiers take (a
        swap's move holds the step back; recompute: 0)."""
        if victims.size == 0:
            return 0.0
        table = self.table
        move_s = self._evict(victims, self.policy.preemption_modes(self.view, victims))
        table.state[victims] = _WAITING
        self.running = _frozen(self.running[table.state[self.running] == _RUNNING])
        self.waiting = _frozen(np.sort(np.concatenate([self.waiting, victims])))
        return move_s

    def _evict(self, victims: NDArray[np.int64],  # [n]
               modes: Union[str, Sequence[str]] = RECOMPUTE) -> float:
        """Takes the victims' KV off the device by their modes and counts it in the run's
        record: the preemptions, and the computed tokens a mode threw away (recompute:
        all of them; a swap: none). Returns the seconds the moves between tiers take."""
        table = self.table
        computed = int(table.num_computed[victims].sum())
        move_s = preempt(self.kv_memory, victims, modes)
        self.record.num_recomputed_tokens += computed - int(table.num_computed[victims].sum())
        self.record.num_preemptions += int(victims.size)
        return move_s

    def _apply_rejection(self, plan: StepPlan) -> None:
        reject = plan.reject_ids
        if reject.size == 0:
            return
        table = self.table
        table.state[reject] = RequestState.REJECTED
        self.kv_memory.free(reject)  # one received with its KV (import_request) waits with it
        for request, reason in zip(reject.tolist(), plan.reject_reasons):
            table.reject_reason[request] = f"policy {self.policy.name}: {reason}"
        self.waiting = _frozen(self.waiting[table.state[self.waiting] == _WAITING])
        self._num_done += int(reject.size)
        if table.programs is not None:
            table.programs.done(reject, self.now_s)

    def _admit(self, ids: NDArray[np.int64],  # [n]
               states: NDArray[np.int8],  # [n]
               admitting: bool = True) -> tuple[int, float]:
        """Admits the waiting ones of `ids` (`states`: theirs, as the plan check read them;
        `admitting`: whether one waits, as it found). Returns (tokens they took from the
        prefix cache, seconds of KV brought back from a slower tier: it holds the step
        back)."""
        linked = self.kv_memory.linked
        if linked is None and not admitting:  # none waits
            return 0, 0.0
        table = self.table
        # The states as bytes (int8: one each), as the plan check reads them: where the
        # waiting ones are the plan's tail (a policy plans running, then admissions: most
        # plans), they are a slice, found by two byte searches instead of a mask.
        codes = states.tobytes()
        first = codes.find(_WAITING_CODE)
        admitted = (ids[first:] if codes.count(_WAITING_CODE) == len(codes) - first
                    else ids[states == WAITING_0D])
        if linked is not None:  # slower tiers: the queue's head prefetches
            self.kv_memory.prefetch(self.waiting[~np.isin(self.waiting, admitted)])
        if admitted.size == 0:
            return 0, 0.0
        table.state[admitted] = RUNNING_0D
        table.admitted_s[admitted] = self.now_s
        is_first = np.isnan(table.first_scheduled_s[admitted])  # [a] never admitted before
        table.first_scheduled_s[admitted[is_first]] = self.now_s
        self.running = _frozen(np.concatenate([self.running, admitted]))
        waiting = self.waiting
        # Every queued request is waiting until a change takes it out of the queue, this
        # one included: when the head's `a` requests are the ones admitted, the rest
        # stays (a slice, no copy of a long queue); else keep the waiting ones. The head
        # is the admitted requests themselves in most steps (FCFS): their bytes compare
        # before any state is read.
        head = waiting[:admitted.size]
        if admitted.size <= waiting.size and (
                head.tobytes() == admitted.tobytes()
                or _WAITING_CODE not in table.state[head].tobytes()):
            self.waiting = waiting[admitted.size:]  # read-only, as a slice of a frozen queue
        else:
            self.waiting = _frozen(waiting[table.state[waiting] == WAITING_0D])
        admission = self.kv_memory.admit(admitted, is_first)
        if table.programs is not None and table.programs.pins:  # they shared their hits
            program_pins.unpin_admitted_parents(self, admitted)
        return admission
