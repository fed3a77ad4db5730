"""The scheduler's loop: an iteration in two phases, `schedule()` and `update()`.

`schedule()`: requests whose arrival time has come join the waiting queue; the
policy reads a `SchedulerView` and returns a `StepPlan`; the plan is checked
(`plan_checks`, which changes nothing); finished answers are released,
preemptions free their pages, rejections leave, admissions and growth get pages,
and `pack_step()` builds the step's descriptor. The result is a `ScheduledStep`
(or an `IdleStep` when the plan runs nothing). The executor
(`orca_jax.core.loop.executor`) runs it on the engine and moves the virtual clock;
`update(step, result)` then counts its tokens, stamps them, finishes requests
(freeing their pages at once), logs the step and feeds the progress watchdog.
A step's token values may come later than its counts (`record_tokens`): with
steps in flight they are read back from the device one or more steps late.

`SchedulerLoop` is a part of `Scheduler` (its base class): the loop lives here,
the state it works on and the changes a plan makes to it (admission,
preemption, rejection) in `orca_jax.core.loop.scheduler`.
"""

from __future__ import annotations

import time
from typing import Callable, Optional, Union

import numpy as np
from numpy.typing import NDArray

from orca_jax.core.api.policy import Policy
from orca_jax.core.api.policy_helpers import add_drafts
from orca_jax.core.kv import KVCapacity, KVMemory, KVPool
from orca_jax.core.loop import program_pins
from orca_jax.core.loop.arrival_join import ArrivalJoin
from orca_jax.core.loop.config import LoopFeatures
from orca_jax.core.loop.executor import Executor
from orca_jax.core.loop.scheduled_step import IdleStep, ScheduledStep, StepResult
from orca_jax.core.loop.watchdog import ProgressWatchdog
from orca_jax.core.plans.plan import MalformedPlan, PlanError, StepPlan
from orca_jax.core.plans.plan_checks import checked_counts, not_a_plan
from orca_jax.core.plans.view import SchedulerView
from orca_jax.core.requests.request import RequestState
from orca_jax.core.requests.request_table import RequestTable, count_nonzero
from orca_jax.core.requests.run_record import RunRecord
from orca_jax.core.requests.run_result import RunResult
from orca_jax.core.requests.step_logs import step_log
from orca_jax.core.step.engine_api import Engine
from orca_jax.core.step.packing import BucketConfig, SamplingArrays, pack_step

# Plain ints: IntEnum attribute lookups cost a microsecond each on the hot path.
_PENDING, _WAITING, _RUNNING, _FINISHED = (int(RequestState.PENDING), int(RequestState.WAITING),
                                           int(RequestState.RUNNING), int(RequestState.FINISHED))
# The same codes as 0-d arrays of the table's type, for whole-array comparisons and writes:
# numpy converts a Python int operand anew on every call (0.8 us each on a step's arrays).
PENDING_0D, WAITING_0D, RUNNING_0D, FINISHED_0D = (
    np.array(code, dtype=np.int8) for code in (_PENDING, _WAITING, _RUNNING, _FINISHED))
_ONE = np.array(1, dtype=np.int64)


def frozen(array: NDArray[np.int64]) -> NDArray[np.int64]:
    """Marks a queue array read-only: the view hands it to policies as it is."""
    array.setflags(write=False)
    return array


NO_REQUESTS = frozen(np.zeros(0, dtype=np.int64))  # [0] an empty queue (read-only, shared)


def appended(queue: NDArray[np.int64],  # [w] read-only
             arrived: NDArray[np.int64],  # [k]
             indices: NDArray[np.int64]  # [N] the table's 0..N-1 (`RequestTable.indices`)
             ) -> NDArray[np.int64]:  # [w + k] read-only
    """`queue` and then `arrived`, read-only. Where both are runs of consecutive request
    indices, slices of the read-only `indices` that meet end to end (a queue that only
    ever took arrivals and gave up its head), the answer is the slice of `indices` they
    span: no copy, so a long queue (10^5 waiting at overload) costs nothing per arrival.
    Any other queue (one a preemption sorted a victim into) is copied as before. The
    values are the same either way; `indices` is never written, so no slice of it can
    change under a policy that keeps one."""
    if arrived.size == 0:
        return queue
    if arrived.base is indices and arrived.strides == (8,):
        start = int(arrived[0])
        return appended_run(queue, start, start + arrived.size, indices)
    return frozen(np.concatenate([queue, arrived]))


def appended_run(queue: NDArray[np.int64],  # [w] read-only
                 start: int, end: int,
                 indices: NDArray[np.int64]  # [N] the table's 0..N-1 (`RequestTable.indices`)
                 ) -> NDArray[np.int64]:  # [w + end - start] read-only
    """`appended(queue, indices[start:end], indices)` (`end > start`), for a caller that
    knows its arrivals are that run of indices (most steps' arrivals: no checks of it)."""
    if queue.size == 0:
        return indices[start:end]
    if queue.base is indices and queue.strides == (8,) and int(queue[-1]) + 1 == start:
        return indices[int(queue[0]):end]
    return frozen(np.concatenate([queue, indices[start:end]]))


def step_page_rows(pool: KVPool, ids: NDArray[np.int64],  # [n]
                   kv_lens: NDArray[np.int64]) -> NDArray[np.int32]:  # [n] -> [n, W]
    """The page-table rows of a step's requests, as its descriptor lists them: a copy, read
    when an engine first reads the descriptor (within the step), never for one that prices
    a step from its lengths (the simulator: the copy was some 4% of its loop).

    Only the pages of the step's widest context: a row's later pages (reserved ahead, or
    null) are never read by this step, and copying max_model_len-wide rows would make the
    host's page-table work grow with max_model_len instead of the contexts."""
    width = int(pool.pages_for_tokens(int(np.maximum.reduce(kv_lens))))
    return pool.page_table[pool.row_of[ids], :width]


# A scheduler keeps at most this many instance attributes. CPython 3.11 stores an
# instance's attributes in its class's shared key table of 30 keys; one attribute more and
# the instance gets a dict of its own, and then no `self.method()` call on it is specialized
# any more: 3,000 instructions an iteration more (0.6% at 32 running; callgrind).
# Derive a value in a property, or keep it on a part (`kv_memory`, `record`), instead.
MAX_SCHEDULER_ATTRIBUTES = 29


class SchedulerLoop:
    """The loop's methods of `Scheduler`. The attributes below (and `config`, its
    `SchedulerConfig`) are the scheduler's, `MAX_SCHEDULER_ATTRIBUTES` at most; the plan's
    state changes (`_apply_release`, `_apply_preemption`, `_apply_rejection`, `_admit`) and
    `_idle` are its methods."""

    policy: Policy
    engine: Engine
    table: RequestTable
    kv: KVPool
    kv_memory: KVMemory
    capacity: KVCapacity
    record: RunRecord
    watchdog: ProgressWatchdog
    view: SchedulerView
    bucket_config: BucketConfig
    sampling: SamplingArrays
    features: LoopFeatures  # config.features, read every step
    prefix_caching: bool
    now_s: float  # the virtual clock: read here, moved by the executor
    arrival_join: ArrivalJoin  # when arrived requests join the queue (the engine's front end)
    num_steps: int
    waiting: NDArray[np.int64]  # [w]
    running: NDArray[np.int64]  # [r]
    unreleased: NDArray[np.int64]  # [u]
    last_finished: NDArray[np.int64]  # [f]
    in_transfer: NDArray[np.int64]  # [t]
    # [b] requests the next step cannot take: their newest token is on the device in a step
    # in flight the next one cannot read it from (`SchedulerView.busy`). The executor sets
    # it as steps land: a plain attribute, read by every plan check.
    busy: NDArray[np.int64]
    _num_done: int
    _next_arrival: int
    # Each request's sampled token ids the host holds (None: the engine needs no ids).
    _generated: Optional[list[list[int]]]

    _executor: Executor

    @property
    def executor(self) -> Executor:
        """Runs its iterations (`step`, `run`) and keeps its clock."""
        return self._executor

    @executor.setter
    def executor(self, executor: Executor) -> None:
        self._executor = executor
        # An instance attribute over the method `step`: a call of `step()` goes straight to
        # the executor's, one Python call an iteration fewer.
        self.step = executor.step  # type: ignore[method-assign]

    def late_tokens_conflict(self) -> Optional[str]:
        """Why this run needs each step's token values before the next plan (None: it
        does not, and an executor may read them back late)."""
        if self.prefix_caching:
            return "prefix caching names pages by token values before the next plan"
        if self.features.kv_handoff:
            return "a KV handoff carries each request's first token"
        if getattr(self.engine, "speculates", False):  # a duck-typed engine: no
            return ("speculative decoding advances each request by the draft tokens its "
                    "step accepted, known only once the step has run")
        return None

    def run(self, progress: Optional[Callable[["SchedulerLoop"], None]] = None) -> RunResult:
        """Runs iterations until every request is done; returns the finished run."""
        self.engine.warmup(self.bucket_config.buckets())
        step = self.step  # False once every request is done
        while step():
            if progress is not None:
                progress(self)
        return self.result()

    def result(self) -> RunResult:
        """The run so far, as a value (a copy: stepping on does not change it)."""
        self.executor.drain()
        self.record.flush_removed()
        stats = getattr(self.executor, "stats", None)
        return RunResult.from_log(
            self.table, self.record, policy=self.policy.name, engine=self.engine.name,
            virtual_end_s=self.now_s,
            output_tokens=self._generated,
            prefix_caching=self.prefix_caching,
            num_evictions=self.kv.cache.num_evictions if self.kv.cache is not None else 0,
            kv_tiers=self.kv_memory.tier_summary(), kv_stall_s=self.record.kv_stall_s,
            pipeline=stats() if stats is not None else None)

    def step(self) -> bool:
        """Runs one iteration through the executor (`Executor.step`, bound to the instance
        when its executor is set). Returns False when there was nothing left to do."""
        return self._executor.step()

    def schedule(self) -> Union[ScheduledStep, IdleStep]:
        """The first phase of an iteration: arrivals join, the policy plans, the plan is
        checked, its releases, preemptions and rejections are made, its admissions admitted,
        its pages allocated and its descriptor packed. Nothing of the step is counted yet
        (`update`), and the clock does not move (the executor moves it).

        Returns:
          The step to run, or an `IdleStep` when the plan runs nothing (then too, every
          `schedule()` is answered by one `update()`).

        Raises:
          PlanError: the plan broke a rule; nothing has changed but the arrivals.
        """
        host_start = time.perf_counter()
        if self._num_done == len(self.table.specs):  # done, without a Python call
            return IdleStep(resume_s=None, waits=True, progressed=False)
        self._admit_arrivals()
        try:
            plan = self.policy.schedule(self.view)
        except MalformedPlan as e:  # a plan its fields could not make: the policy's error
            raise not_a_plan(self.policy.name, e) from None
        if not isinstance(plan, StepPlan):
            raise PlanError(self.policy.name, "not_a_plan",
                            f"schedule() returned {type(plan).__name__}, not a StepPlan")
        if self.features.spec_k and not self.policy.plans_speculation:  # --spec_k
            plan = add_drafts(self.view, plan, self.features.spec_k)
        needed, computed, context, uncomputed, states, admitting, num_real_tokens, growing = (
            checked_counts(self, plan))
        self.last_finished = NO_REQUESTS  # "finished since the previous schedule() call"
        kv_move_s, progressed = 0.0, False
        if plan.release.size or plan.preempt.size or plan.reject_ids.size:  # most plans: none
            self._apply_release(plan.release)
            kv_move_s = self._apply_preemption(plan.preempt)  # the executor counts the moves
            self._apply_rejection(plan)
            if self.features.log_step_requests:
                self.record.log_removed(plan.preempt, plan.reject_ids)
            progressed = bool(plan.release.size or plan.reject_ids.size)
        if plan.request_ids.size == 0:
            waits = self._idle(plan)
            # Only a wait for an arrival moves the clock: a transfer's end, or a step in
            # flight landing, is what the others wait for.
            jumps = waits and not (self.in_transfer.size or self.busy.size)
            return IdleStep(resume_s=self.next_arrival_s() if jumps else None, waits=waits,
                            progressed=progressed, kv_move_s=kv_move_s)
        ids, tokens = plan.request_ids, plan.num_tokens
        num_cached_tokens, admit_move_s = self._admit(ids, states, admitting)
        kv_move_s += admit_move_s
        table = self.table
        spec = plan.spec_tokens if plan.spec_tokens.size else None  # [n] draft tokens
        if self.capacity.counts_hits:  # an admission starts past its prefix hit: read again
            num_computed = table.num_computed[ids]  # [n] after admission (past any hit)
            # [n] each one's context after the step: the k draft positions too, whose pages
            # are allocated now and, past what the engine accepts, freed at `update`.
            kv_lens = num_computed + tokens if spec is None else num_computed + tokens + spec
            # A request samples a token when the step computes all it knows (a speculating
            # decode does: its drafts are past what it knows).
            samples = (kv_lens if spec is None else kv_lens - spec) == (
                table.prompt_len[ids] + table.num_generated[ids])
        else:  # admission moved no one: the check's counts are the step's
            num_computed, kv_lens = computed, context
            samples = tokens == uncomputed  # kv_lens - spec == prompt_len + num_generated
        if self.kv_memory.needed_is_allocation:
            # Without reservations or hits, admission took no pages: the check's count holds
            # (and the pool returns at once where no request grows: rare, so not asked here).
            self.kv.allocate(ids, kv_lens, need=needed, growing_at=growing)
        elif growing.size:  # needed.any(): the check found who grows
            self.kv.allocate(ids, kv_lens)
            if self.kv_memory.linked is not None:
                kv_move_s += self.kv_memory.take_stall()  # its evictions' write-backs
        if self.kv_memory.linked is not None:  # host-tier hits into the pages just allocated
            self.kv_memory.land_loads()
        kv = self.kv
        packed = pack_step(bucket_config=self.bucket_config, request_ids=ids, num_tokens=tokens,
                           num_computed=num_computed,
                           page_rows=lambda: step_page_rows(kv, ids, kv_lens),
                           page_size=kv.page_size, sampling=self.sampling,
                           token_ids=(None if self._generated is None
                                      else self._token_ids(ids, tokens, self._generated,
                                                           spec)),
                           min_bucket_tokens=plan.min_bucket_tokens,
                           num_real_tokens=num_real_tokens, spec_tokens=spec,
                           kv_lens=kv_lens)
        # Where every request samples (decodes, and prompts computed whole: most steps),
        # the sampled requests are the step's own array, not a copy of it; the executor
        # and the update then take the step's rows as they are (`sampled is request_ids`).
        # Not where the record keeps each step's sampled array (`logs_tokens`): it keeps a
        # copy, never the plan's array, which its policy may write again.
        sampled = (ids if count_nonzero(samples) == ids.size and not self.record.logs_tokens
                   else ids[samples])
        # Positional (the fields' order): keywords would cost a microsecond an iteration.
        return ScheduledStep(self.num_steps, ids, tokens, kv_lens, samples, sampled, packed,
                             num_real_tokens, num_cached_tokens, progressed,
                             time.perf_counter() - host_start, kv_move_s, spec,
                             plan.min_bucket_tokens)

    def update(self, step: Union[ScheduledStep, IdleStep], result: Optional[StepResult]) -> float:
        """The second phase of an iteration: counts `step`'s tokens (their values too, when
        `result` has them), finishes and frees requests, logs the step and feeds the
        watchdog. The clock is at the step's end (`result.end_s`).

        Args:
          step: what `schedule()` returned, each step once and in order.
          result: the executor's account of the step (None for an `IdleStep`).

        Returns:
          Host seconds the update took (the clock adds them under `count_host_time`).

        Raises:
          ValueError: `step` is not the next step to update.
          PlanError: rule `no_progress`, from the watchdog.
        """
        if type(step) is IdleStep:
            if not step.waits:
                self._watch_progress(step.progressed)
            return 0.0
        update_start = time.perf_counter()
        if step.index != self.num_steps or result is None:
            raise ValueError(f"update: step {step.index} with result {result!r}; the next step "
                             f"to update is {self.num_steps}, with its StepResult")
        step.packed.close()  # its descriptor reads the page table, which changes from here
        table = self.table
        ids, kv_lens, end_s = step.request_ids, step.kv_lens, result.end_s
        extra = None  # [n] accepted draft tokens of each request (speculative decoding)
        if step.spec_tokens is not None:
            extra = self._count_speculation(step, result)
            kv_lens = kv_lens - step.spec_tokens + extra  # the rejected positions go
        # The step's tokens count from now on, stamped end_s; their values are the result's,
        # or (None) on the device until the executor reads them back (`record_tokens`).
        table.num_computed[ids] = kv_lens
        if extra is not None:  # pages past the accepted tokens (or its reservation) go
            self.kv.trim(ids, self.capacity.reserved_tokens(ids, kv_lens))
        hits = self.kv_memory.hits
        if hits is not None:  # name the filled pages before finished ones free theirs
            hits.commit(ids)
        sampled = step.sampled
        record = self.record
        if sampled.size:
            gained = None if extra is None else extra[step.samples]  # [s] accepted drafts
            generated = table.num_generated[sampled] + _ONE  # [s]
            if gained is not None:
                generated += gained
            table.num_generated[sampled] = generated
            tokens = result.sampled_tokens
            if tokens is not None:
                if gained is not None and result.accepted_tokens is not None:
                    drafts = result.accepted_tokens[step.samples]  # [s, K]
                    for j in range(int(gained.max())):  # the accepted drafts, in order
                        self.record_tokens(sampled[gained > j], drafts[gained > j, j])
                self.record_tokens(sampled, tokens)
            table.last_token_s[sampled] = end_s
            first = np.isnan(table.first_token_s[sampled])  # [s] its first token
            if count_nonzero(first):  # most steps: none (only a prefill's ending has)
                table.first_token_s[sampled[first]] = end_s
            if gained is not None:  # each accepted draft is a token at the step's end too
                for j in range(int(gained.max())):
                    record.log_tokens(sampled[gained > j], end_s)
            record.log_tokens(sampled, end_s)
            finished = sampled[generated == table.output_len[sampled]]
            if finished.size:
                self._finish(finished, end_s)
        gained = self.watchdog.computed(ids, kv_lens)  # a gain is progress: it counts it
        update_s = time.perf_counter() - update_start
        num_padded = step.packed.bucket.num_tokens
        if step.kv_move_s:  # it waited for KV moves between tiers (never without tiers)
            record.kv_stall_s[self.num_steps] = step.kv_move_s
        # The fields in StepLog's order (step, start_s, num_seqs, num_tokens,
        # num_padded_tokens, bucket, host_s, step_s, num_running, num_waiting,
        # num_free_pages, num_cached_tokens), straight into the log: `step_log` makes the
        # tuple without the NamedTuple's Python `__new__`, and `RunRecord.log_step`'s frame
        # is skipped (a microsecond a step between them).
        record.steps.append(step_log((
            self.num_steps, result.start_s, ids.size, step.num_real_tokens, num_padded,
            num_padded, result.host_s + update_s, result.step_s, self.running.size,
            self.waiting.size, self.kv.num_free, step.num_cached_tokens)))
        if self.features.log_step_requests:  # each request's positions: drafts included
            record.log_step_requests(ids, step.num_tokens if step.spec_tokens is None
                                     else step.num_tokens + step.spec_tokens,
                                     np.concatenate([self.running, self.unreleased]))
        self.num_steps += 1
        if not gained:
            self._watch_progress(step.progressed)
        return update_s

    def _count_speculation(self, step: ScheduledStep, result: StepResult
                           ) -> NDArray[np.int64]:  # [n]
        """A speculative step's accepted draft counts (`result.num_accepted`), counted in
        each request's history (`RequestTable.speculation`) and the step's record."""
        accepted = result.num_accepted
        if accepted is None:
            raise ValueError(f"update: step {step.index} drafted tokens but its result has no "
                             "num_accepted")
        spec = step.spec_tokens
        assert spec is not None
        counts = self.table.speculation
        if counts is not None:
            counts.count(step.request_ids, spec, accepted, result.draft_s)
        self.record.log_speculation(self.num_steps, int(spec.sum()), int(accepted.sum()),
                                    result.draft_s)
        return accepted

    def _watch_progress(self, progressed: bool) -> None:
        """Counts an iteration toward the watchdog (`no_progress` once it runs out)."""
        if progressed:
            self.watchdog.progressed()
            return
        self.watchdog.iteration(
            self.done, policy=self.policy.name, step=self.num_steps,
            now_s=self.now_s,
            situation=lambda: (f"{self.waiting.size} waiting, {self.running.size} running, "
                               f"{self.record.num_preemptions} preemptions so far"))

    def _admit_arrivals(self) -> None:
        programs = self.table.programs
        if programs is not None:
            if programs.pins:
                program_pins.expire(self)
            if programs.self_release:
                self._release_calls()
        first = self._next_pending()
        if first is None:
            return
        table = self.table
        # The arrivals that reached the queue by this plan (the engine's front end:
        # `arrival_join`); most arrivals come one at a time.
        end = self.arrival_join.due_end(
            table.arrival_s, first, self.arrival_join.cutoff_s(self.now_s, self.running.size > 0))
        if end == first:  # most steps: nobody new yet
            return
        indices = table.indices
        if end - first == 1:  # most arrivals, one at a time: `first` is pending here
            table.state[first] = _WAITING
            self.waiting = appended_run(self.waiting, first, end, indices)
        else:  # the rows first..end-1 are a slice: read and written without a gather
            mine = (table.state[first:end] == PENDING_0D) & (table.holder[first:end]
                                                              == table.replica)
            if count_nonzero(mine) == mine.size:
                table.state[first:end] = WAITING_0D
                self.waiting = appended_run(self.waiting, first, end, indices)
            else:  # routed elsewhere, or here and gone already
                arrived = indices[first:end][mine]  # [k]
                table.state[arrived] = WAITING_0D
                self.waiting = appended(self.waiting, arrived, indices)
        self._next_arrival = end

    def record_tokens(self, sampled: NDArray[np.int64],  # [m]
                      new_tokens: NDArray[np.int32]) -> None:  # [m]
        """Keeps the values of tokens `update` counted: at once when the engine ran the step
        in step, else when the executor reads a step in flight back."""
        self.table.last_token[sampled] = new_tokens
        hits = self.kv_memory.hits
        if hits is not None:
            hits.record(sampled, new_tokens)
        if self._generated is not None:
            for request, token in zip(sampled.tolist(), new_tokens.tolist()):
                self._generated[request].append(token)

    def _token_ids(self, ids: NDArray[np.int64],  # [n]
                   tokens: NDArray[np.int64],  # [n]
                   generated_lists: list[list[int]],
                   spec: Optional[NDArray[np.int64]] = None  # [n] draft tokens or None
                   ) -> NDArray[np.int32]:  # [sum tokens (+ sum spec)]
        """The step's input token ids from the host's (`generated_lists`: each request's
        sampled ids), a placeholder where a token is still on the device (fed to the
        engine by the executor's token source), and placeholders (0) after each request's
        tokens for its `spec` draft positions (the engine's drafter fills them)."""
        if spec is not None:
            known = self._token_ids(ids, tokens, generated_lists)  # [sum tokens]
            ends = np.cumsum(tokens)  # [n] where each request's drafts go
            return np.insert(known, np.repeat(ends, spec), 0).astype(np.int32)
        table = self.table
        computed = table.num_computed[ids]
        if int(tokens.sum()) == ids.size and bool((table.num_uncomputed(ids) == 1).all()):
            return table.last_token[ids].astype(np.int32)  # all decodes: the newest tokens
        pieces = []
        for request, start, count, num_generated in zip(
                ids.tolist(), computed.tolist(), tokens.tolist(),
                table.num_generated[ids].tolist()):
            generated = generated_lists[request]
            if len(generated) < num_generated:  # the newest are on the device: token_source
                generated = [*generated, *[0] * (num_generated - len(generated))]
            known = np.concatenate([table.specs[request].prompt_tokens,
                                    np.asarray(generated, dtype=np.int32)])
            pieces.append(known[start:start + count])
        return np.concatenate(pieces).astype(np.int32)

    def _finish(self, finished: NDArray[np.int64], end_s: float) -> None:  # [f]
        """Requests that sampled their last token at `end_s`: their pages are freed (or
        held for a transfer), and they are done or await release."""
        table = self.table
        table.state[finished] = FINISHED_0D
        if self.features.kv_handoff:  # its pages go on to a decode replica (cluster.handoff)
            self.in_transfer = frozen(np.concatenate([self.in_transfer, finished]))
        elif table.programs is not None:  # a program's call may keep its KV for the next
            kept = program_pins.pin_finished(self, finished, end_s)
            self.kv.free(finished if kept is None else finished[~kept])
        else:
            self.kv.free(finished)
        hits = self.kv_memory.hits
        if hits is not None:
            hits.forget(finished)
        running = self.running[table.state[self.running] == RUNNING_0D]
        # Read-only, as `frozen` makes them, without its frame (two a finishing step).
        running.setflags(write=False)
        finished.setflags(write=False)
        self.running, self.last_finished = running, finished
        if self.policy.defer_release:
            self.unreleased = frozen(np.concatenate([self.unreleased, finished]))
        else:
            table.finish_s[finished] = end_s
            self._num_done += int(finished.size)
            if table.programs is not None:  # their children's tool pauses start
                table.programs.done(finished, end_s)
