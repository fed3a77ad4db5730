"""Agent programs as workloads: sessions of LLM calls with tool pauses (docs/programs.md).

  * `program_workload`: a generator. `copilot` programs are sequential
    sessions shaped by the GitHub Copilot coding-agent traces of 2026 (turns per
    session, LLM calls per turn, prompts far longer than completions); `parallel`
    programs fan each planning call out to k thread calls that join (Autellix's
    multi-threaded programs, for ATLAS).
  * `program_requests`: the calls of any source (this generator, or a program
    trace, `program_traces`) as `Request`s, with each call's arrival the
    zero-service bound: a program's first call arrives at its start, a later
    call `tool_s` after its latest parent's bound. The run releases it at
    max(parents' finish) + tool_s, never earlier (`core.requests.programs`).

Each call's prompt is its program's context so far: the previous call's prompt,
its answer and the tool's output (the prompt growth), so a prefix cache finds
the history. A context that would pass the model's compacts: the next prompt
starts over from the program's first prompt (agents summarize; we drop).
"""

from __future__ import annotations

import copy
import dataclasses
import heapq
from typing import Optional, Sequence, Union

import numpy as np
from numpy.typing import NDArray

from orca_jax.core.requests.request import Request
from orca_jax.workloads.program_defaults import COPILOT_DEFAULTS, PROGRAM_SHAPES
from orca_jax.workloads.synthetic import (
    LengthDistribution,
    as_distribution,
    check_seed,
    check_vocab_size,
    random_tokens,
)

Length = Union[LengthDistribution, str]


@dataclasses.dataclass
class ProgramCall:
    """One call of a program, as a source describes it, before it is a `Request`.

    Attributes:
      program: the program's id.
      call: its call index, unique in the program.
      parents: the call indices it waits for.
      tool_s: the pause after its latest parent is done.
      prompt: `[prompt_len]` its prompt's ids (None: lengths only).
      prompt_len, output_len: its lengths.
      start_s: when the program starts (read for a call without parents).
      answer: `[output_len]` its planned answer's ids, or None.
    """

    program: int
    call: int
    parents: tuple[int, ...]
    tool_s: float
    prompt_len: int
    output_len: int
    start_s: float = 0.0
    prompt: Optional[NDArray[np.int32]] = None
    answer: Optional[NDArray[np.int32]] = None


def planned_arrivals(calls: Sequence[ProgramCall]) -> list[float]:
    """Each call's zero-service arrival: its program's start without parents, else
    max(parents' arrivals) + tool_s. Parents must come before their children in `calls`
    (each program's calls in an order its parents allow)."""
    seen: dict[tuple[int, int], float] = {}
    result = []
    for c in calls:
        if c.parents:
            when = max(seen[(c.program, p)] for p in c.parents) + c.tool_s
        else:
            when = c.start_s
        seen[(c.program, c.call)] = when
        result.append(when)
    return result


def program_requests(calls: Sequence[ProgramCall],
                     num_requests: Optional[int] = None) -> list[Request]:
    """The calls as requests in planned arrival order (ties: program, then call index),
    ids 0..N-1, the first `num_requests` (a parent always comes before its child, so a
    cut keeps every kept call's parents)."""
    arrivals = planned_arrivals(calls)
    order = sorted(range(len(calls)),
                   key=lambda i: (arrivals[i], calls[i].program, calls[i].call))
    if num_requests is not None:
        order = order[:num_requests]
    return [Request(id=k, arrival_s=float(arrivals[i]), prompt_len=calls[i].prompt_len,
                    output_len=calls[i].output_len, prompt_tokens=calls[i].prompt,
                    planned_output_tokens=calls[i].answer, program_id=calls[i].program,
                    call_index=calls[i].call, parents=calls[i].parents,
                    tool_s=float(calls[i].tool_s))
            for k, i in enumerate(order)]


@dataclasses.dataclass(frozen=True)
class ProgramShape:
    """The generator's distributions (spec strings as `--prompt_len`'s, or distributions).

    Attributes:
      shape: `copilot` (sequential) or `parallel` (fan-out and join).
      turns: turns per program (parallel: stages of fan-out and join).
      calls_per_turn: LLM calls per turn (copilot).
      first_prompt: the first call's prompt tokens.
      prompt_growth: tokens a tool's output adds to the context before the next call.
      completion_len: each call's answer tokens.
      tool_ms: the tool pause before each call of a turn but its first (milliseconds).
      turn_gap_ms: the user's pause before a turn's first call (milliseconds).
      fanout: thread calls per stage (parallel).
    """

    shape: str = "copilot"
    turns: Length = COPILOT_DEFAULTS["turns"]
    calls_per_turn: Length = COPILOT_DEFAULTS["calls_per_turn"]
    first_prompt: Length = COPILOT_DEFAULTS["first_prompt"]
    prompt_growth: Length = COPILOT_DEFAULTS["prompt_growth"]
    completion_len: Length = COPILOT_DEFAULTS["completion_len"]
    tool_ms: Length = COPILOT_DEFAULTS["tool_ms"]
    turn_gap_ms: Length = COPILOT_DEFAULTS["turn_gap_ms"]
    fanout: int = 4

    def __post_init__(self) -> None:
        if self.shape not in PROGRAM_SHAPES:
            raise ValueError(f"program_shape must be one of {PROGRAM_SHAPES}, got "
                             f"{self.shape!r}")
        if isinstance(self.fanout, bool) or int(self.fanout) != self.fanout or self.fanout < 1:
            raise ValueError(f"program_fanout must be an integer >= 1, got {self.fanout!r}")
        for name in ("turns", "calls_per_turn", "first_prompt", "prompt_growth",
                     "completion_len", "tool_ms", "turn_gap_ms"):
            object.__setattr__(self, name, as_distribution(
                getattr(self, name), "prompt_len", f"program_{name}"))


class _Context:
    """A program's context as it grows: ids of every prompt, answer and tool output."""

    def __init__(self, rng: np.random.Generator, vocab_size: int, first: int,
                 context: Optional[int]) -> None:
        self.rng, self.vocab, self.limit = rng, vocab_size, context
        self.first = random_tokens(rng, first, vocab_size)
        self.history = self.first

    def call(self, output_len: int) -> tuple[NDArray[np.int32], NDArray[np.int32]]:
        """(prompt, answer) of a call on the context now; compacts first if it would not
        fit, and the answer joins the context."""
        if self.limit is not None and self.history.size + output_len > self.limit:
            self.history = self.first  # compaction: back to the first prompt
        prompt = self.history
        answer = random_tokens(self.rng, output_len, self.vocab)
        self.history = np.concatenate([prompt, answer])
        return prompt, answer

    def grow(self, tokens: int) -> None:
        """A tool's output joins the context."""
        self.history = np.concatenate([self.history,
                                       random_tokens(self.rng, tokens, self.vocab)])


def _program(index: int, start_s: float, seed: int, shape: ProgramShape, vocab_size: int,
             context: Optional[int]) -> list[ProgramCall]:
    """Program `index`'s calls, from its own streams (seed, index): the same program
    whichever others are drawn beside it."""
    length_seq, time_seq, token_seq = np.random.SeedSequence(
        int(seed), spawn_key=(1, index)).spawn(3)
    lengths, times = np.random.default_rng(length_seq), np.random.default_rng(time_seq)
    d = shape  # distributions (checked in ProgramShape)
    first = int(d.first_prompt.sample(lengths, 1)[0])  # type: ignore[union-attr]
    ctx = _Context(np.random.default_rng(token_seq), vocab_size, first, context)
    turns = int(d.turns.sample(lengths, 1)[0])  # type: ignore[union-attr]
    calls: list[ProgramCall] = []

    def add(parents: tuple[int, ...], tool_s: float, fork: Optional[_Context] = None
            ) -> int:
        on = ctx if fork is None else fork
        out = int(d.completion_len.sample(lengths, 1)[0])  # type: ignore[union-attr]
        prompt, answer = on.call(out)
        calls.append(ProgramCall(program=index, call=len(calls), parents=parents,
                                 tool_s=tool_s, prompt_len=int(prompt.size), output_len=out,
                                 start_s=start_s, prompt=prompt, answer=answer))
        return len(calls) - 1

    def tool_s() -> float:
        return float(d.tool_ms.sample(times, 1)[0]) / 1000  # type: ignore[union-attr]

    def growth() -> int:
        return int(d.prompt_growth.sample(lengths, 1)[0])  # type: ignore[union-attr]

    last: tuple[int, ...] = ()
    for turn in range(turns):
        gap = float(d.turn_gap_ms.sample(times, 1)[0]) / 1000 if turn else 0.0  # type: ignore[union-attr]
        if shape.shape == "copilot":
            count = int(d.calls_per_turn.sample(lengths, 1)[0])  # type: ignore[union-attr]
            for k in range(count):
                last = (add(last, gap if k == 0 else tool_s()),)
                ctx.grow(growth())
            continue
        planner = add(last, gap)  # parallel: a planning call fans out to k threads
        threads = []
        for _ in range(shape.fanout):
            fork = copy.copy(ctx)  # the planner's context, and this thread's tool output
            fork.grow(growth())
            threads.append(add((planner,), tool_s(), fork))
        answers = [calls[t].answer for t in threads]
        ctx.history = np.concatenate([ctx.history, *answers])
        last = tuple(threads)
    if shape.shape == "parallel":
        add(last, tool_s())  # the join: one call over every thread's answer
    return calls


def program_workload(*, num_requests: Optional[int], rate: float, shape: ProgramShape,
                     seed: int, vocab_size: int, context: Optional[int] = None,
                     program_count: Optional[int] = None) -> list[Request]:
    """Agent programs starting as a Poisson process at `rate` programs per second.

    Copilot programs are sequential sessions: `turns` turns of `calls_per_turn` calls,
    each call waiting for the one before: the turn's first call `turn_gap_ms` (the user),
    the others `tool_ms` (a tool). Parallel programs are `turns` stages of a planning
    call and `fanout` thread calls that wait for it, each after its own tool pause; the
    next stage's planner (or the final join) waits for all of them.

    The workload is the first `num_requests` calls in planned arrival order (programs
    are drawn until that many start before the next program does), so a larger
    `num_requests` extends it; a program cut off keeps its earlier calls. Which programs
    those are depends on the rate (more overlap: more programs start before the N-th
    call), so a rate sweep that must run the same programs at every rate gives
    `program_count` instead: programs 0..count-1, every call of each, whatever the rate
    (only their starts scale with 1 / rate).

    Args:
      num_requests: calls in the workload (>= 1); not read with `program_count`.
      rate: programs per second (> 0).
      shape: the distributions (`ProgramShape`).
      seed: the same seed gives the same workload bit for bit.
      vocab_size: ids are drawn from [1, vocab_size).
      context: the run's context limit: a program's context compacts before passing it.
      program_count: whole programs in the workload (>= 1), all their calls; None: the
        first `num_requests` calls.

    Returns:
      The calls as requests (`program_requests`).
    """
    check_seed(seed)
    check_vocab_size(vocab_size)
    if program_count is not None:
        _check_count("program_count", program_count)
    else:
        _check_count("num_requests", num_requests)
    if not (isinstance(rate, (int, float)) and np.isfinite(rate) and rate > 0):
        raise ValueError(f"rate must be a finite number > 0 (programs per second), got {rate!r}")
    arrival_rng = np.random.default_rng(np.random.SeedSequence(int(seed), spawn_key=(0,)))
    if program_count is not None:  # whole programs: the same ones at every rate
        calls, start_s = [], 0.0
        for index in range(int(program_count)):
            calls.extend(_program(index, start_s, seed, shape, vocab_size, context))
            start_s += float(arrival_rng.standard_exponential()) / rate
        return program_requests(calls)
    calls: list[ProgramCall] = []
    pending: list[float] = []  # planned arrivals not yet known to be among the first N
    settled, index, start_s = 0, 0, 0.0
    while settled < num_requests:
        program = _program(index, start_s, seed, shape, vocab_size, context)
        calls.extend(program)
        for when in planned_arrivals(program):
            heapq.heappush(pending, when)
        index += 1
        start_s += float(arrival_rng.standard_exponential()) / rate
        while pending and pending[0] <= start_s:
            heapq.heappop(pending)
            settled += 1
    return program_requests(calls, num_requests)


def _check_count(name: str, value: object) -> None:
    if (value is None or isinstance(value, bool) or int(value) != value  # type: ignore[call-overload]
            or value < 1):  # type: ignore[operator]
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def rescale_starts(requests: Sequence[Request], scale: float) -> list[Request]:
    """The programs with their starts multiplied by `scale` (a rate sweep's rescaling:
    `runner.sweep_point.workload_at`), tool pauses as they are: each call without
    parents arrives at `scale` times its arrival, each later call at its new
    zero-service bound (scaling those too would stretch the tool pauses). Requests of no
    program are scaled as starts."""
    by_call = {(r.program_id, r.call_index): r for r in requests if r.program_id is not None}
    new: dict[tuple[int, int], float] = {}

    def bound(r: Request) -> float:
        if r.program_id is None or not r.parents:
            return r.arrival_s * scale
        key = (r.program_id, r.call_index)
        if key not in new:  # parents first (iteratively deep chains would recurse)
            stack = [r]
            while stack:
                top = stack[-1]
                missing = [by_call[(top.program_id, p)] for p in top.parents
                           if (top.program_id, p) not in new
                           and by_call[(top.program_id, p)].parents]
                if missing:
                    stack.extend(missing)
                    continue
                stack.pop()
                new[(top.program_id, top.call_index)] = max(
                    new.get((top.program_id, p), by_call[(top.program_id, p)].arrival_s * scale)
                    for p in top.parents) + top.tool_s
        return new[key]

    return [dataclasses.replace(r, arrival_s=bound(r)) for r in requests]
