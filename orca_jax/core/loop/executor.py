"""The executor: runs a scheduler's steps on its engine and keeps the virtual clock.

One iteration is `schedule()` (the scheduler's first phase), the engine's step,
and `update(step, result)` (its second phase). The executor does the middle and
moves the clock: over an idle gap to the next arrival, and past each step by the
step's seconds (and, with `count_host_time`, the host's).

Its queue holds the steps in flight (`orca_jax.core.loop.in_flight`): those
dispatched whose sampled tokens are not read back yet. `depth` is how many
steps are in flight right after one is dispatched:

- depth 1: the engine runs each step before the next is planned (`Engine.step_packed`).
- depth 2: overlap (`SchedulerConfig.features.overlap`): step N+1 is planned and packed while
  step N runs; N+1's decodes read N's tokens on the device
  (`Engine.step_async(inputs, token_source)`) and N's tokens are read back
  once N+1 is dispatched.
- depth N: N - 1 steps in flight while the next is planned; the view's `busy`
  names the requests the next step cannot take (see `in_flight`).

The scheduler counts a step's tokens at `update` whatever the depth (plans
depend on how many tokens a request has, never on their values), so plans,
steps and tokens are the same at every depth.
"""

from __future__ import annotations

import time
from typing import Callable, Optional, Protocol, Union

import numpy as np
from numpy.typing import NDArray

from orca_jax.core.loop.in_flight import StepsInFlight
from orca_jax.core.loop.leap import Leaper
from orca_jax.core.loop.scheduled_step import IdleStep, ScheduledStep, StepResult
from orca_jax.core.plans.scheduler_state import SchedulerState
from orca_jax.core.step.engine_api import Engine, PackedStep, StepOutput


class HostClockFeatures(Protocol):
    """What the executor reads of the scheduler's features (`LoopFeatures`)."""

    @property
    def count_host_time(self) -> bool: ...

    @property
    def leap(self) -> bool: ...

    @property
    def balance_micro_batches(self) -> bool: ...


class TwoPhaseScheduler(SchedulerState, Protocol):
    """What an executor drives (`Scheduler` is one): the state its view and plan checks
    read (`SchedulerState`), and the two phases."""

    engine: Engine
    now_s: float  # the virtual clock: the scheduler reads it, the executor moves it
    # [b] requests the next step cannot take (`StepsInFlight.busy`): the executor sets it
    # whenever steps land, so the scheduler's plan check reads an attribute, not a call.
    busy: NDArray[np.int64]

    @property
    def features(self) -> HostClockFeatures: ...

    @property
    def done(self) -> bool: ...

    def late_tokens_conflict(self) -> Optional[str]:
        """Why step tokens cannot be read back late in this run (None: they can)."""
        ...

    def schedule(self) -> Union[ScheduledStep, IdleStep]: ...

    def update(self, step: Union[ScheduledStep, IdleStep],
               result: Optional[StepResult]) -> float: ...

    def record_tokens(self, sampled: NDArray[np.int64],  # [m]
                      tokens: NDArray[np.int32]) -> None: ...  # [m]


class Executor:
    """Runs `scheduler`'s iterations with up to `depth` steps in flight.

    A `Scheduler` builds its own (`Scheduler.executor`, through which its `step`,
    `run` and `result` go): of depth 2 with `SchedulerConfig.features.overlap` where the run
    allows it, else of depth 1. To choose the depth, set another before the first
    step: `scheduler.executor = Executor(scheduler, depth=3)`.

    Args:
      scheduler: the scheduler whose steps it runs (and whose engine it uses).
      depth: steps in flight right after a dispatch (1: each step runs in step).
      leap: at depth 1 and without `count_host_time`, run stretches of steady decode
        steps at once (`orca_jax.core.loop.leap.Leaper`: the same results bit for bit)
        where the policy and the engine allow it; the scheduler passes its
        `features.leap` (off for a replica of a cluster).

    Raises:
      ValueError: `depth` < 1; the scheduler has already run a step; or `depth` > 1
        and the engine cannot feed sampled tokens on the device, or the run needs
        each step's tokens before the next plan (prefix caching, a KV handoff).
    """

    def __init__(self, scheduler: TwoPhaseScheduler, depth: int = 1, *,
                 leap: bool = False) -> None:
        if not isinstance(depth, int) or depth < 1:
            raise ValueError(f"Executor: depth must be an int >= 1, got {depth!r}")
        if scheduler.num_steps:
            raise ValueError(f"Executor: the scheduler has run {scheduler.num_steps} steps; "
                             "give it an executor before the first one")
        engine = scheduler.engine
        if depth > 1:
            if not (isinstance(engine, Engine) and engine.feeds_tokens):
                raise ValueError(f"Executor: depth {depth} leaves tokens on the device, and "
                                 f"engine {engine.name!r} does not feed them to the next step "
                                 "(Engine.feeds_tokens); use depth 1")
            conflict = scheduler.late_tokens_conflict()
            if conflict is not None:
                raise ValueError(f"Executor: depth {depth} reads tokens back late, but "
                                 f"{conflict}; use depth 1")
        self.scheduler = scheduler
        self.engine = engine
        self.depth = depth
        self.in_flight = StepsInFlight(len(scheduler.table))  # stays empty at depth 1
        scheduler.busy = self.in_flight.busy
        self._count_host_time = scheduler.features.count_host_time
        # Made only where a leap can be exact: each step in step, no measured host time.
        self.leaper: Optional[Leaper] = (
            Leaper(scheduler) if leap and depth == 1 and not self._count_host_time  # type: ignore[arg-type]
            else None)
        # An `Engine` may price a step from its lengths, never building the padded
        # descriptor (the simulator); a duck-typed engine has only `step`. Chosen once.
        self._run_packed: Callable[[PackedStep], StepOutput] = (
            engine.step_packed if isinstance(engine, Engine)
            else lambda packed: engine.step(packed.inputs))

    @property
    def num_in_flight(self) -> int:
        """Steps dispatched whose tokens are not read back yet."""
        return len(self.in_flight)

    def step(self) -> bool:
        """Runs one iteration. Returns False when every request was done already."""
        scheduler = self.scheduler
        leaper = self.leaper
        if leaper is not None and leaper.leap():
            return True
        # Every request done (then no request waits, runs or awaits release), or an idle
        # gap: the next arrival is next. Asked in this order, most steps ask only the sizes.
        if not (scheduler.running.size or scheduler.waiting.size or scheduler.unreleased.size):
            if scheduler.done:
                return False
            upcoming = scheduler.next_arrival_s()
            if upcoming is not None and upcoming > scheduler.now_s:
                scheduler.now_s = upcoming
        step = scheduler.schedule()
        if leaper is not None:
            leaper.note(step)
        if type(step) is IdleStep:
            self._idle(step)
            return True
        result_spec: tuple = ()  # (num_accepted, accepted_tokens, draft_s) when drafting
        if self.depth == 1:
            output = self._run_packed(step.packed)
            step_s = output.step_s
            host_s = step.host_s + step.packed.build_s  # the descriptor, if the engine read it
            tokens: Optional[NDArray[np.int32]] = output.sampled_tokens[:step.request_ids.size]
            if step.sampled is not step.request_ids:  # some did not sample (a prompt's chunk)
                tokens = tokens[step.samples]
            if step.spec_tokens is not None:
                result_spec = _speculation(step, output)
        else:
            step_s, host_s = self._dispatch(step)
            tokens = None
        # A step whose KV moves between tiers (swap out, back in) starts once they are done.
        start_s = scheduler.now_s + step.kv_move_s
        # With count_host_time the engine starts only once the host has planned the step.
        end_s = start_s + step_s + (host_s if self._count_host_time else 0.0)
        scheduler.now_s = end_s  # the update happens at the step's end
        update_s = scheduler.update(step, StepResult(start_s, end_s, step_s, host_s, tokens,
                                                     *result_spec))
        if self._count_host_time:
            scheduler.now_s = end_s + update_s
        return True

    def drain(self) -> None:
        """Reads every step in flight back (waits for them) and records their tokens."""
        self._record(self.in_flight.land(keep=0))

    def _dispatch(self, step: ScheduledStep) -> tuple[float, float]:
        """Dispatches `step` without waiting for it, then reads back the steps beyond
        `depth - 1` in flight. Returns (the step's seconds, host seconds so far)."""
        source_start = time.perf_counter()
        source = self.in_flight.token_source(step)
        host_s = step.host_s + (time.perf_counter() - source_start)
        pending = self.engine.step_async(step.packed.inputs, source)
        step_s = pending.step_s
        self.in_flight.push(pending, step)
        landed = self.in_flight.land(keep=self.depth - 1)  # waits for the device: not host time
        record_start = time.perf_counter()
        self._record(landed)
        return step_s, host_s + step.packed.build_s + (time.perf_counter() - record_start)

    def _idle(self, step: IdleStep) -> None:
        """An iteration that runs nothing: the clock may jump to the next arrival; a plan
        that waits for busy requests gets the oldest step in flight landed."""
        scheduler = self.scheduler
        scheduler.now_s += step.kv_move_s  # its preemptions' KV moves
        if step.resume_s is not None and step.resume_s > scheduler.now_s:
            scheduler.now_s = step.resume_s
        if step.waits and self.in_flight.busy.size:
            self._record(self.in_flight.land(keep=len(self.in_flight) - 1))
        scheduler.update(step, None)

    def _record(self, landed: list[tuple[NDArray[np.int64], NDArray[np.int32]]]) -> None:
        """Records the tokens of steps just landed; their requests may be free again."""
        scheduler = self.scheduler
        for sampled, tokens in landed:
            scheduler.record_tokens(sampled, tokens)
        scheduler.busy = self.in_flight.busy


def _speculation(step: ScheduledStep, output: StepOutput
                 ) -> tuple[NDArray[np.int64], Optional[NDArray[np.int32]], float]:
    """The accepted draft counts `[n]` (and token ids `[n, K]`, if any) of a step that
    speculated, from its engine's output.

    Raises:
      ValueError: the engine gave no counts, or one outside 0..k.
    """
    n = step.request_ids.size
    if output.num_accepted is None:
        raise ValueError("Executor: a speculative step's StepOutput has no num_accepted "
                         "(an engine that speculates answers every step that drafts)")
    accepted = np.asarray(output.num_accepted[:n], dtype=np.int64)
    assert step.spec_tokens is not None
    if accepted.min() < 0 or (accepted > step.spec_tokens).any():
        raise ValueError(f"Executor: num_accepted {accepted.tolist()} outside 0..spec_tokens "
                         f"{step.spec_tokens.tolist()}")
    drafts = None if output.accepted_tokens is None else output.accepted_tokens[:n]
    return accepted, drafts, output.draft_s
