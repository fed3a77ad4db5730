"""Requests: what a client asked for, and the states a request moves through.

A `Request` is immutable: it is the workload's description of one request. Its
mutable progress (tokens computed, tokens generated, KV pages, timestamps) lives
in the scheduler's `RequestTable`, a struct of numpy arrays indexed by the
request's *index* (its position in arrival order), so that the per-step hot
path works on whole arrays instead of on Python objects.

Token accounting follows vLLM v1, with no prefill or decode phase: a request
*knows* `prompt_len + num_generated` tokens and has *computed* (written K/V for)
`num_computed` of them. A step computes `n` of the uncomputed tokens; when a
step brings `num_computed` up to the number known, the engine samples one new
token. A decode is the case `known - computed == 1`; after a recompute
preemption `num_computed` is reset to 0 and the prompt and the tokens generated
so far are computed again before the next token is sampled.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Optional, Sequence

import numpy as np
from numpy.typing import NDArray


class RequestState(enum.IntEnum):
    """Where a request is in its life. Stored as int8 in the request table.

    The terminal states come last: `state >= FINISHED` means the request is done here.
    """

    PENDING = 0  # not arrived yet (arrival time is in the future)
    WAITING = 1  # arrived, not running: new, or back after a preemption
    RUNNING = 2  # admitted: holds KV pages, may be scheduled
    FINISHED = 3  # generated its whole output
    REJECTED = 4  # can never run (too long for the context or the KV pool)
    ROUTED_AWAY = 5  # a cluster's router sent it to another replica (orca_jax.cluster.replicas)


# Slots: a request is one object per row of a workload (10^6 of them in a large run),
# and without a __dict__ each takes about 80 bytes less.
@dataclasses.dataclass(frozen=True, kw_only=True, eq=False, slots=True)
class Request:
    """One request of a workload.

    Attributes:
      id: the caller's id for the request (written to results as is).
      arrival_s: arrival time in seconds from the start of the run.
      prompt_len: number of prompt tokens.
      output_len: number of tokens to generate (the request ends there; EOS is
        ignored, as serving benchmarks do).
      prompt_tokens: the prompt's token ids, `[prompt_len]` int32, or None when
        only the length is known (the simulator needs no ids).
      priority: smaller is more urgent (0 is the default).
      tenant: the client or tenant the request belongs to, for fairness policies.
      deadline_s: absolute completion deadline in seconds, or None.
      planned_output_tokens: the planned answer's token ids, `[output_len]` int32,
        or None. Never used to generate: a workload fixed beforehand whose later
        prompts hold this answer (a conversation's next turn) needs its ids
        chosen up front. The simulator's tokens are placeholders anyway; the
        jax engine samples its own answer, and the next turn's prompt still
        holds these planned ids, not the sampled ones.
      conversation_id: the conversation this request is a turn of, or None.
      turn: its 0-based turn in that conversation (set with `conversation_id`).
      program_id: the agent program (session) this request is a call of, or None
        (docs/programs.md).
      call_index: its index among its program's calls (set with `program_id`),
        unique in the program.
      parents: the call indices of the program's calls it waits for (empty: it
        starts the program, or a thread of it, at `arrival_s`).
      tool_s: seconds of tool time (or user time) after its last parent finishes
        before it is released. A call with parents is released at
        max(parents' finish) + tool_s by the run, never before `arrival_s`, which
        its source sets to the zero-service bound (the time it would arrive if
        every call before it took no time).
      spec_acceptance: the per-token rate at which the simulator accepts its draft
        tokens (a trace's `acceptance` column), in [0, 1]; None: the run's
        (`--spec_acceptance`). Read only by a speculating simulated run.
    """

    id: int
    arrival_s: float
    prompt_len: int
    output_len: int
    prompt_tokens: Optional[NDArray[np.int32]] = None  # [prompt_len]
    priority: int = 0
    tenant: str = "default"
    deadline_s: Optional[float] = None
    planned_output_tokens: Optional[NDArray[np.int32]] = None  # [output_len]
    conversation_id: Optional[int] = None
    turn: Optional[int] = None
    program_id: Optional[int] = None
    call_index: Optional[int] = None
    parents: tuple[int, ...] = ()
    tool_s: float = 0.0
    spec_acceptance: Optional[float] = None

    def __post_init__(self) -> None:
        if not (isinstance(self.arrival_s, (int, float)) and math.isfinite(self.arrival_s)
                and self.arrival_s >= 0):
            raise ValueError(f"request {self.id}: arrival_s must be a finite number >= 0, "
                             f"got {self.arrival_s!r}")
        if int(self.prompt_len) != self.prompt_len or self.prompt_len < 1:
            raise ValueError(f"request {self.id}: prompt_len must be an integer >= 1, "
                             f"got {self.prompt_len!r}")
        if int(self.output_len) != self.output_len or self.output_len < 1:
            raise ValueError(f"request {self.id}: output_len must be an integer >= 1, "
                             f"got {self.output_len!r}")
        self._freeze_tokens("prompt_tokens", self.prompt_len)
        self._freeze_tokens("planned_output_tokens", self.output_len)
        if self.deadline_s is not None and not math.isfinite(self.deadline_s):
            raise ValueError(f"request {self.id}: deadline_s must be finite, "
                             f"got {self.deadline_s!r}")
        if (self.conversation_id is None) != (self.turn is None):
            raise ValueError(f"request {self.id}: conversation_id and turn go together, got "
                             f"conversation_id={self.conversation_id!r}, turn={self.turn!r}")
        if self.turn is not None and (int(self.turn) != self.turn or self.turn < 0):
            raise ValueError(f"request {self.id}: turn must be an integer >= 0, "
                             f"got {self.turn!r}")
        self._check_program()
        if self.spec_acceptance is not None and not (
                isinstance(self.spec_acceptance, (int, float))
                and 0.0 <= self.spec_acceptance <= 1.0):
            raise ValueError(f"request {self.id}: spec_acceptance must be in [0, 1], "
                             f"got {self.spec_acceptance!r}")

    def _check_program(self) -> None:
        """The program fields go together: a call has a program, an index, its parents
        (other calls of its program) and a tool time >= 0."""
        if (self.program_id is None and self.call_index is None and type(self.parents) is tuple
                and not self.parents and type(self.tool_s) in (float, int)
                and self.tool_s == 0):  # not a call (most requests): nothing to check or fix
            return
        if (self.program_id is None) != (self.call_index is None):
            raise ValueError(f"request {self.id}: program_id and call_index go together, got "
                             f"program_id={self.program_id!r}, call_index={self.call_index!r}")
        parents = tuple(int(p) for p in self.parents)
        object.__setattr__(self, "parents", parents)
        if not (isinstance(self.tool_s, (int, float)) and math.isfinite(self.tool_s)
                and self.tool_s >= 0):
            raise ValueError(f"request {self.id}: tool_s must be a finite number >= 0, "
                             f"got {self.tool_s!r}")
        if self.program_id is None:
            if parents or self.tool_s:
                raise ValueError(f"request {self.id}: parents and tool_s need a program_id")
            return
        if self.call_index < 0 or int(self.call_index) != self.call_index:
            raise ValueError(f"request {self.id}: call_index must be an integer >= 0, "
                             f"got {self.call_index!r}")
        if len(set(parents)) != len(parents) or self.call_index in parents:
            raise ValueError(f"request {self.id}: parents {list(parents)} must be distinct "
                             f"calls other than itself (call {self.call_index})")

    def _freeze_tokens(self, field: str, length: int) -> None:
        """Stores the field's ids as a read-only `[length]` int32 array (None stays None)."""
        value = getattr(self, field)
        if value is None:
            return
        tokens = np.asarray(value, dtype=np.int32)
        if tokens.ndim != 1 or tokens.shape[0] != length:
            raise ValueError(f"request {self.id}: {field} has shape {tokens.shape}, "
                             f"expected ({length},)")
        tokens.setflags(write=False)
        object.__setattr__(self, field, tokens)

    def _key(self) -> tuple:
        tokens = None if self.prompt_tokens is None else self.prompt_tokens.tobytes()
        planned = self.planned_output_tokens
        answer = None if planned is None else planned.tobytes()
        return (self.id, self.arrival_s, self.prompt_len, self.output_len, tokens,
                self.priority, self.tenant, self.deadline_s, answer, self.conversation_id,
                self.turn, self.program_id, self.call_index, self.parents, self.tool_s)

    def __eq__(self, other: object) -> bool:
        # The generated __eq__ would compare the token arrays elementwise and fail.
        return isinstance(other, Request) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    @property
    def total_len(self) -> int:
        """Prompt plus output tokens: the KV this request holds at its end."""
        return self.prompt_len + self.output_len


def length_only_requests(arrival_s: NDArray[np.float64],  # [N]
                         prompt_len: NDArray[np.int64],  # [N]
                         output_len: NDArray[np.int64]  # [N]
                         ) -> list[Request]:
    """`[Request(id=i, arrival_s=float(arrival_s[i]), prompt_len=int(prompt_len[i]),
    output_len=int(output_len[i])) for i in range(N)]`: the same requests, every other
    field its default, made without a frozen `__init__`'s `object.__setattr__` per field
    and `__post_init__`'s checks a request at a time (half a synthetic workload's
    making, 10^6 of them in a large run), once the columns pass those checks whole
    (finite arrival times >= 0, integer lengths >= 1). Where a column does not, or a
    field takes its default from a factory, the requests are made one by one, so the
    first bad one raises as it does there."""
    arrival_s, prompt_len, output_len = (np.asarray(arrival_s), np.asarray(prompt_len),
                                         np.asarray(output_len))
    fields = dataclasses.fields(Request)
    rest = fields[4:]  # after id, arrival_s, prompt_len, output_len: each has a default
    columns_pass = (
        arrival_s.dtype.kind == "f" and prompt_len.dtype.kind in "iu"
        and output_len.dtype.kind in "iu"
        and arrival_s.shape == prompt_len.shape == output_len.shape == (arrival_s.size,)
        and bool(np.isfinite(arrival_s).all() and (arrival_s >= 0).all()
                 and (prompt_len >= 1).all() and (output_len >= 1).all()))
    if not columns_pass or any(field.default is dataclasses.MISSING for field in rest):
        return [Request(id=i, arrival_s=float(a), prompt_len=int(p), output_len=int(o))
                for i, (a, p, o) in enumerate(zip(arrival_s.tolist(), prompt_len.tolist(),
                                                  output_len.tolist()))]
    # Each slot's own setter (a frozen class refuses `setattr`, not its slots' setters).
    set_id, set_arrival, set_prompt, set_output = (vars(Request)[field.name].__set__
                                                   for field in fields[:4])
    defaults = [(vars(Request)[field.name].__set__, field.default) for field in rest]
    new = object.__new__
    requests = []
    for i, (arrival, prompt, output) in enumerate(zip(arrival_s.tolist(), prompt_len.tolist(),
                                                      output_len.tolist())):
        request = new(Request)
        set_id(request, i)
        set_arrival(request, arrival)
        set_prompt(request, prompt)
        set_output(request, output)
        for set_field, default in defaults:
            set_field(request, default)
        requests.append(request)
    return requests


def sort_by_arrival(requests: Sequence[Request]) -> list[Request]:
    """Returns the requests in arrival order; ties keep their given order."""
    return sorted(requests, key=lambda r: r.arrival_s)
