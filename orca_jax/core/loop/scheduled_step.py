"""What crosses between the two phases of an iteration: `schedule()` -> executor -> `update()`.

`Scheduler.schedule()` returns a `ScheduledStep` (a step to run: planned,
checked, its pages allocated, its descriptor packed) or an `IdleStep` (the
plan runs nothing). The executor runs a `ScheduledStep` on the engine and
answers with a `StepResult`; `Scheduler.update(step, result)` then counts it.
All three are plain values, as vLLM v1's `SchedulerOutput`: an executor, a
test or a later event loop can hold, queue and inspect them, and none changes
one once made. One `ScheduledStep` and one `StepResult` are made and read
about twenty times every iteration, so they are slotted dataclasses, not frozen:
a frozen dataclass's `__init__` (one `object.__setattr__` per field) costs
microseconds the loop does not have, and a `NamedTuple`'s fields are read
through a descriptor CPython 3.11 does not specialize (several times a slot's
cost). `IdleStep`, made only when nothing runs, stays a `NamedTuple`.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional

import numpy as np
from numpy.typing import NDArray

from orca_jax.core.step.engine_api import PackedStep


@dataclasses.dataclass(slots=True)
class ScheduledStep:
    """A step `Scheduler.schedule()` made ready: nothing of it has run yet.

    Its requests' admissions, pages and (for those that sample) token counts are
    the scheduler's state already only once `update` counts it; until then the
    scheduler's queues and pages say what `schedule()` left (admitted, allocated).
    """

    index: int  # the step's number: Scheduler.num_steps when it was scheduled
    request_ids: NDArray[np.int64]  # [n] the requests it computes, in the descriptor's order
    num_tokens: NDArray[np.int64]  # [n] tokens each computes (>= 1)
    kv_lens: NDArray[np.int64]  # [n] each one's computed tokens after the step (its context)
    # [n] whether each of request_ids samples a token in it: computes all it knows.
    samples: NDArray[np.bool_]
    sampled: NDArray[np.int64]  # [m] those requests: request_ids[samples]
    packed: PackedStep  # the bucket, the lengths, and the padded descriptor (built when read)
    num_real_tokens: int  # tokens it computes: num_tokens.sum() (the rest of the bucket pads)
    num_cached_tokens: int  # tokens its admissions took from the prefix cache
    progressed: bool  # the plan released or rejected a request (progress for the watchdog)
    host_s: float  # host seconds schedule() took: arrivals, plan, checks, pages, packing
    # Seconds of KV moves between memory tiers the step waits for (a swap's victims out,
    # readmissions' KV back in; 0 with the device tier alone): the executor starts it later.
    kv_move_s: float = 0.0
    # [n] draft tokens each request verifies after its decode token (speculative decoding,
    # `StepPlan.spec_tokens`); None: none. Counted in `kv_lens`, `num_real_tokens` and the
    # packed lengths: `update` keeps only the accepted ones (`StepResult.num_accepted`).
    spec_tokens: Optional[NDArray[np.int64]] = None
    # The plan's `min_bucket_tokens` (its bucket is the smallest holding this many tokens
    # or its own): a leap that repeats the plan with fewer requests selects its bucket so.
    min_bucket_tokens: int = 0


class IdleStep(NamedTuple):
    """An iteration whose plan runs nothing (it may still have released, preempted or
    rejected requests: those changes are made)."""

    # The next arrival, when the iteration waits for it: the clock may jump there.
    # None: the clock stays (the plan changed state, or a transfer's end or a step
    # in flight is awaited, or every request is done).
    resume_s: Optional[float]
    # Whether it waits for something outside the plan (an arrival, a transfer's end,
    # a step in flight to land): no livelock, so the watchdog does not count it.
    waits: bool
    progressed: bool  # the plan released or rejected a request (progress for the watchdog)
    kv_move_s: float = 0.0  # seconds of KV moves between tiers its preemptions started


@dataclasses.dataclass(slots=True)
class StepResult:
    """What the executor tells `Scheduler.update` of a step it dispatched."""

    start_s: float  # virtual time the step started: the clock when it was dispatched
    end_s: float  # virtual time it ends: its tokens' timestamp (the clock is there at update)
    step_s: float  # the engine's seconds for it (measured, profiled or modelled)
    host_s: float  # host seconds of the iteration so far: schedule(), dispatch, landing
    # [m] the tokens of `ScheduledStep.sampled`, in order; None while they are still on
    # the device (a step in flight): they come later, by `Scheduler.record_tokens`.
    sampled_tokens: Optional[NDArray[np.int32]]
    # [n] draft tokens each of `ScheduledStep.request_ids` had accepted (0..k), from the
    # engine's `StepOutput.num_accepted`; None for a step that speculated none.
    num_accepted: Optional[NDArray[np.int64]] = None
    # [n, K] the accepted draft token ids (row i: its first num_accepted[i]); None when
    # the engine has no token values or nothing speculated.
    accepted_tokens: Optional[NDArray[np.int32]] = None
    draft_s: float = 0.0  # seconds of step_s the drafter took
