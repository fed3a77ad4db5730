"""The pipeline executor: micro-batches in flight through an engine's P stages (Orca's PP).

An engine of `P > 1` stages (`Engine.num_stages`: the simulator or the real engine with
`--pp`) prices each step on every stage (`Engine.step_stages`). A step is a micro-batch: it enters
stage 0 when stage 0 is free, and stage `s` of micro-batch `m` starts when stage `s`
is free and stage `s - 1` of `m` has finished:

    start[m, 0] = max(inject[m], end[m - 1, 0])
    start[m, s] = max(end[m, s - 1], end[m - 1, s])       end[m, s] = start[m, s] + t[m, s]

The executor injects the next micro-batch as soon as stage 0 is free (`inject[m + 1]
= end[m, 0]`), while fewer than `P` are in flight; with `P` in flight it waits for
the oldest to leave the last stage. A request belongs to at most one micro-batch in
flight (Orca's rule: its next iteration needs the token its last one samples at the
last stage), so the requests of the micro-batches in flight are `busy`: the view's
`running` leaves them out (`SchedulerView.running`), and a plan that schedules one
breaks the rule `busy_request`. A finished request leaves after its last stage pass.

Each step is scheduled, priced and counted (`Scheduler.update`) when it is injected,
its tokens stamped with the time it leaves the last stage, `end[m, P - 1]`: the clock
(`Scheduler.now_s`) is then set back to the next injection. Micro-batches leave the
stages in the order they entered them, so stamps rise step after step. Pages a
finished request frees at its update may be taken by a later micro-batch at once:
the later one reaches each stage only after the earlier one has left it, and each
stage holds its own layers' KV, so no page is read after another micro-batch wrote it.

A real engine (`Engine.needs_token_ids`) leaves a micro-batch's tokens on the device:
`Engine.dispatch_stages` returns it pending, with its stage seconds priced at once (the
profiled clock), and the executor injects the next one without waiting, so JAX runs
several micro-batches on the stages' devices at once. The update counts the tokens at
injection as the simulator's does; their values are read back (`record_tokens`) when the
micro-batch lands, before its requests are free again, so the next step of each takes its
input token from the host. A run that needs token values at once (prefix caching: see
`late_tokens_conflict`) waits for each step at injection instead.

Bubbles: a stage idles while the pipeline holds a micro-batch (`busy_s`: time with
at least one in flight) for `bubble_s[s] = busy_s - stage_busy_s[s]`: waiting for the
stage before it, for the pipeline to fill (its first micro-batch) and to drain (the
last). Time with nothing in flight (no work: waiting for arrivals) is no bubble.
`stats()` reports them (`RunResult.pipeline`, the summary's `pipeline.*`).

No leaping (`orca_jax.core.loop.leap` runs one step at a time on one stage), no
measured host time on the clock, and one replica (a cluster's event loop steps its
replicas one iteration at a time).
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Any, Optional

import numpy as np

from orca_jax.core.loop.executor import TwoPhaseScheduler
from orca_jax.core.loop.scheduled_step import IdleStep, ScheduledStep, StepResult
from orca_jax.core.requests.request import RequestState
from orca_jax.core.step.engine_api import Engine, PendingStep

_RUNNING = int(RequestState.RUNNING)
_NONE = np.zeros(0, dtype=np.int64)
_NONE.setflags(write=False)


@dataclasses.dataclass(slots=True)
class _MicroBatch:
    """A step in flight through the stages."""

    request_ids: np.ndarray  # [n] its requests: busy until it leaves the last stage
    end_s: list[float]  # [P] when it leaves each stage
    # A real engine's step whose tokens are still on the device: read back when it lands.
    pending: Optional[tuple[PendingStep, ScheduledStep]] = None


class PipelineExecutor:
    """Runs `scheduler`'s steps through its engine's `num_stages` stages, up to that many
    micro-batches in flight (see the module docstring).

    Args:
      scheduler: the scheduler whose steps it runs; its engine has `num_stages` > 1.

    Raises:
      ValueError: the scheduler has run a step already, its engine has one stage, or the
        run counts measured host time on the clock.
    """

    leaper = None  # no leaping through a pipeline

    def __init__(self, scheduler: TwoPhaseScheduler) -> None:
        engine = scheduler.engine
        num_stages = engine.num_stages
        if num_stages < 2:
            raise ValueError(f"PipelineExecutor: engine {engine.name!r} has {num_stages} "
                             "stage; use Executor")
        if scheduler.num_steps:
            raise ValueError(f"PipelineExecutor: the scheduler has run {scheduler.num_steps} "
                             "steps; give it an executor before the first one")
        if scheduler.features.count_host_time:
            raise ValueError("PipelineExecutor: count_host_time puts measured host time on "
                             "the clock, which a pipeline's schedule does not take; turn it "
                             "off with pipeline stages")
        self.scheduler = scheduler
        self.engine = engine
        self.num_stages = num_stages
        self.depth = num_stages  # micro-batches in flight at most
        self._balance = scheduler.features.balance_micro_batches
        # An engine of real tokens leaves them on the device until the micro-batch lands
        # (its requests are busy until then), unless the run needs them at once.
        self._late_tokens = (isinstance(engine, Engine) and engine.needs_token_ids
                             and scheduler.late_tokens_conflict() is None)
        self._released = False  # an idle plan with requests held back: hold none next time
        self._queue: collections.deque[_MicroBatch] = collections.deque()
        self._stage_free = [0.0] * num_stages  # when each stage is free next
        # From when each stage's idleness counts as a bubble (None: the pipeline is empty).
        self._idle_from: list[Optional[float]] = [None] * num_stages
        self._busy_since = 0.0  # when the pipeline last went from empty to holding one
        self.busy_s = 0.0  # time with at least one micro-batch in flight (emptied periods)
        self.stage_busy_s = [0.0] * num_stages
        self.bubble_s = [0.0] * num_stages
        self.num_micro_batches = 0
        self._in_flight_sum = 0  # micro-batches in flight at each injection, summed
        scheduler.busy = _NONE

    @property
    def num_in_flight(self) -> int:
        """Micro-batches injected that have not left the last stage (as of the clock)."""
        return len(self._queue)

    def step(self) -> bool:
        """Runs one iteration: lands the micro-batches done by now, plans the next and
        injects it. Returns False when every request was done already."""
        scheduler = self.scheduler
        self._land_until(scheduler.now_s)
        if len(self._queue) >= self.num_stages:  # P in flight: wait for the oldest
            scheduler.now_s = max(scheduler.now_s, self._queue[0].end_s[-1])
            self._land_until(scheduler.now_s)
        if not (scheduler.running.size or scheduler.waiting.size or scheduler.unreleased.size):
            if scheduler.done:
                return False
            if not self._queue:
                upcoming = scheduler.next_arrival_s()
                if upcoming is not None and upcoming > scheduler.now_s:
                    scheduler.now_s = upcoming
        # Who is in flight (balancing: who waits for the next injection) as of now.
        self._set_busy(hold=self._balance and not self._released)
        step = scheduler.schedule()
        if type(step) is IdleStep:
            self._idle(step)
            return True
        self._released = False
        pending = None
        if self._late_tokens:
            pending, stages = self.engine.dispatch_stages(step.packed)
            step_s, tokens = pending.step_s, None
        else:
            output, stages = self.engine.step_stages(step.packed)
            step_s = output.step_s
            tokens = output.sampled_tokens[:step.request_ids.size][step.samples]
        inject_s = scheduler.now_s + step.kv_move_s
        if not self._queue:  # the pipeline fills again: idleness counts from here
            self._busy_since = inject_s
            self._idle_from = [inject_s] * self.num_stages
        self._in_flight_sum += len(self._queue)
        ready = inject_s
        ends = []
        for s, stage_s in enumerate(stages):
            start = max(ready, self._stage_free[s])
            idle_from = self._idle_from[s]
            assert idle_from is not None
            self.bubble_s[s] += start - idle_from
            ready = start + stage_s
            self.stage_busy_s[s] += stage_s
            self._stage_free[s] = self._idle_from[s] = ready
            ends.append(ready)
        self._queue.append(_MicroBatch(step.request_ids, ends,
                                       None if pending is None else (pending, step)))
        self.num_micro_batches += 1
        # Counted now, stamped when it leaves the last stage; the clock then goes back to
        # the next injection: when stage 0 is free.
        scheduler.now_s = ready
        scheduler.update(step, StepResult(inject_s, ready, step_s,
                                          step.host_s + step.packed.build_s, tokens))
        scheduler.now_s = ends[0]
        return True

    def drain(self) -> None:
        """Waits for every micro-batch in flight: the clock moves to the last one's end."""
        if self._queue:
            end = self._queue[-1].end_s[-1]
            self._land_until(end)
            self.scheduler.now_s = max(self.scheduler.now_s, end)

    def _idle(self, step: IdleStep) -> None:
        """A plan that runs nothing: the clock jumps to the next arrival, or (requests
        busy) to the next arrival or the oldest micro-batch's end, whichever is first."""
        scheduler = self.scheduler
        scheduler.now_s += step.kv_move_s
        if step.resume_s is not None and step.resume_s > scheduler.now_s:
            scheduler.now_s = step.resume_s
        if step.waits and not self._queue and scheduler.busy.size:
            # Only held back, nothing in flight to wait for: the next plan sees them all.
            self._released = True
        elif step.waits and self._queue:
            until = self._queue[0].end_s[-1]
            upcoming = scheduler.next_arrival_s()
            if upcoming is not None and scheduler.now_s < upcoming < until:
                until = upcoming
            scheduler.now_s = max(scheduler.now_s, until)
            self._land_until(scheduler.now_s)
        scheduler.update(step, None)

    def _land_until(self, now_s: float) -> None:
        """Lets the micro-batches that left the last stage by `now_s` go."""
        queue = self._queue
        if not queue or queue[0].end_s[-1] > now_s:
            return
        while queue and queue[0].end_s[-1] <= now_s:
            landed = queue.popleft()
            if landed.pending is not None:  # its tokens: the host's now (waits for them)
                pending, step = landed.pending
                self.scheduler.record_tokens(step.sampled, pending.output().sampled_tokens
                                             [:step.request_ids.size][step.samples])
        if not queue:  # empty: each stage idled from its last end until this one's
            end = landed.end_s[-1]
            for s in range(self.num_stages):
                idle_from = self._idle_from[s]
                assert idle_from is not None
                self.bubble_s[s] += end - idle_from
                self._idle_from[s] = None
            self.busy_s += end - self._busy_since
        self._set_busy()

    def _set_busy(self, hold: bool = False) -> None:
        """The requests of the micro-batches in flight: no plan may take them, and an
        admission must leave the pages they need for their next token (else admissions
        beside them could take every page, and a request that lands would find none:
        a policy then preempts it, admits another, and the run livelocks)."""
        scheduler = self.scheduler
        capacity = scheduler.capacity
        if not self._queue and not hold:
            scheduler.busy = _NONE
            capacity.held_back_pages = 0
            return
        busy = (np.unique(np.concatenate([mb.request_ids for mb in self._queue]))
                if self._queue else _NONE)
        in_flight = busy[scheduler.table.state[busy] == _RUNNING]
        capacity.held_back_pages = int(
            capacity.pages_needed(in_flight, np.ones(in_flight.size, np.int64)).sum())
        if hold:  # the runnable beyond an even share wait for the next injection
            running = scheduler.running
            runnable = running[~np.isin(running, busy)]
            share = -(-running.size // self.num_stages)
            if runnable.size > share:
                busy = np.union1d(busy, runnable[share:])
        if busy is not _NONE:
            busy.setflags(write=False)
        scheduler.busy = busy

    def stats(self) -> dict[str, Any]:
        """The pipeline's figures so far (micro-batches in flight count up to the last
        one landed): stages, micro-batches, time with one in flight, and per stage its
        busy and bubble seconds and bubble fraction."""
        busy = self.busy_s
        per_stage = {f"stage{s}": {"busy_s": self.stage_busy_s[s], "bubble_s": self.bubble_s[s],
                                   "bubble_fraction": self.bubble_s[s] / busy if busy else 0.0}
                     for s in range(self.num_stages)}
        bubbles = math.fsum(self.bubble_s)
        return {"stages": self.num_stages, "micro_batches": self.num_micro_batches,
                "in_flight_mean": (1 + self._in_flight_sum / self.num_micro_batches
                                   if self.num_micro_batches else 0.0),
                "busy_s": busy,
                "bubble_fraction": bubbles / (busy * self.num_stages) if busy else 0.0,
                **per_stage}
