"""Agent programs: calls that wait for their parents and a tool pause (docs/programs.md).

A request may be a call of a program (`Request.program_id`, `call_index`,
`parents`, `tool_s`). A call with parents is not in the workload's arrival
stream: it is *released* when its last parent is done, plus its tool pause,
so its arrival depends on how fast the run served its program. The
`ProgramBook` keeps, beside the request table (`RequestTable.programs`; None
for a workload without programs, so a run without programs does no work for
them), each call's parents and children, and a heap of the calls whose
release time is known but has not come. The scheduler (one replica: it
releases them itself) or a cluster's event loop (which routes each release as
an arrival) pops them from there.

A parent is *done* when it finished (its answer went back to the client),
or was rejected or cancelled: its children are released all the same (the
agent goes on with an error), at max(parents' done times) + tool_s, never
before the call's own `arrival_s`.

The book also keeps what the view's program fields read (`ProgramsView`): the
service each program's done calls attained, its calls done, and the
critical-path service of each done call (for ATLAS).
"""

from __future__ import annotations

import dataclasses
import heapq
from typing import Any, Optional, Sequence

import numpy as np
from numpy.typing import NDArray

from orca_jax.core.requests.request import Request, RequestState

_RUNNING, _REJECTED = int(RequestState.RUNNING), int(RequestState.REJECTED)


def has_programs(requests: Sequence[Request]) -> bool:
    """Whether any request is a call of a program."""
    return any(r.program_id is not None for r in requests)


def check_programs(requests: Sequence[Request]) -> None:
    """Checks the calls of a workload's programs: each call index once per program,
    parents that are calls of the program, and no cycle.

    Raises:
      ValueError: naming the request and the broken rule (the first found).
    """
    _graph(requests)


def _graph(requests: Sequence[Request]) -> tuple[dict[int, int], list[list[int]]]:
    """(program id -> program index, [N] each row's parent rows); raises as
    `check_programs`."""
    rows: dict[tuple[int, int], int] = {}
    programs: dict[int, int] = {}
    for row, r in enumerate(requests):
        if r.program_id is None:
            continue
        programs.setdefault(int(r.program_id), len(programs))
        key = (int(r.program_id), int(r.call_index))
        if key in rows:
            raise ValueError(f"request {r.id}: program {key[0]} has call {key[1]} twice "
                             f"(also request {requests[rows[key]].id})")
        rows[key] = row
    parents: list[list[int]] = [[] for _ in requests]
    for row, r in enumerate(requests):
        for parent in r.parents:
            key = (int(r.program_id), parent)
            if key not in rows:
                raise ValueError(f"request {r.id}: program {r.program_id} call {r.call_index} "
                                 f"names parent call {parent}, which the program does not have")
            parents[row].append(rows[key])
    # Kahn's order over the calls with parents: what is left at the end lies on a cycle.
    left = [len(p) for p in parents]
    children: list[list[int]] = [[] for _ in requests]
    for row, ps in enumerate(parents):
        for p in ps:
            children[p].append(row)
    ready = [row for row, count in enumerate(left) if count == 0]
    seen = 0
    while ready:
        row = ready.pop()
        seen += 1
        for child in children[row]:
            left[child] -= 1
            if left[child] == 0:
                ready.append(child)
    if seen != len(requests):
        row = next(i for i, count in enumerate(left) if count)
        r = requests[row]
        raise ValueError(f"request {r.id}: program {r.program_id} call {r.call_index} lies "
                         "on a cycle of parents")
    return programs, parents


class ProgramBook:
    """The programs of one workload (one per request table, shared by a pool's replicas).

    Args:
      table: the request table (its rows in arrival order); the book reads its
        progress columns and keeps references to them.

    Attributes:
      program: `[N]` each row's program index (-1: not a call of a program).
      program_ids: `[P]` each program's `Request.program_id`.
      tool_s: `[N]` the pause before each call.
      release_s: `[N]` when each call was released (its arrival; a call without
        parents: its `arrival_s`), NaN until then.
      done_s: `[N]` when each call was done (finished, rejected or cancelled), NaN until then.
      self_release: the scheduler releases due calls itself (one replica); a
        cluster's event loop sets it False and routes each release.
    """

    # `table` is the `RequestTable` that builds the book (it imports this module).
    def __init__(self, table: Any) -> None:
        specs = table.specs
        programs, parent_rows = _graph(specs)
        n, p = len(specs), len(programs)
        self._table = table
        self.program_ids = np.array(list(programs), dtype=np.int64)  # [P]
        self.program = np.array([-1 if r.program_id is None else programs[int(r.program_id)]
                                 for r in specs], dtype=np.int64)  # [N]
        self.tool_s = np.array([r.tool_s for r in specs], dtype=np.float64)  # [N]
        self.call_index = np.array([-1 if r.call_index is None else r.call_index
                                    for r in specs], dtype=np.int64)  # [N]
        counts = [len(ps) for ps in parent_rows]
        self._parents_left = np.array(counts, dtype=np.int64)  # [N]
        self.has_parents = self._parents_left > 0  # [N]
        self._parent_rows = parent_rows
        children: list[list[int]] = [[] for _ in specs]
        for row, ps in enumerate(parent_rows):
            for parent in ps:
                children[parent].append(row)
        self._children = children
        self.has_children = np.array([bool(c) for c in children], dtype=bool)  # [N]
        # KV pinned across tool pauses (`core.loop.program_pins`): row -> when its pin
        # ends, and row -> (when it began, pages held); the pins' totals.
        self.pins: dict[int, float] = {}
        self._pinned_at: dict[int, tuple[float, int]] = {}
        self.num_pins = self.num_pin_hits = 0
        self.pinned_page_s = 0.0
        self.max_pinned_pages = 0
        self._ready_s = np.full(n, -np.inf)  # [N] latest done time of its parents so far
        self.release_s = np.where((self.program >= 0) & ~self.has_parents, table.arrival_s,
                                  np.nan)  # [N]
        self.done_s = np.full(n, np.nan)  # [N]
        # [N] service (tokens) on the longest chain of done calls ending at each done call;
        # for a released call, the longest of its parents' chains.
        self.path_service = np.zeros(n, dtype=np.float64)
        in_program = self.program >= 0
        self.num_calls = np.bincount(self.program[in_program], minlength=p)  # [P]
        self.calls_done = np.zeros(p, dtype=np.int64)  # [P]
        self.service_done = np.zeros(p, dtype=np.float64)  # [P] tokens of its done calls
        self.path_max = np.zeros(p, dtype=np.float64)  # [P] its longest chain of done calls
        self._heap: list[tuple[float, int]] = []  # (release time, row) of known releases
        self._routing: dict[int, float] = {}  # row -> release time: popped, not fired yet
        self.self_release = True

    def children(self, row: int) -> list[int]:
        """The calls that wait on `row` (its children), in row order."""
        return list(self._children[row])

    @property
    def num_programs(self) -> int:
        return int(self.program_ids.size)

    # --------------------------------------------------------- the run's events
    def start(self) -> None:
        """Marks the calls rejected before the run (and without parents) done at their
        arrival, releasing what follows them; called once the up-front rejections are made."""
        table = self._table
        roots = np.flatnonzero((self.program >= 0) & ~self.has_parents
                               & (table.state == _REJECTED))
        for row in roots.tolist():
            self._done_one(row, float(table.arrival_s[row]))

    def done(self, rows: NDArray[np.int64], at_s: float) -> None:  # [k]
        """Rows done at `at_s` (finished, rejected, cancelled): their program's counts
        move, and each child whose parents are all done gets its release time."""
        for row in rows[self.program[rows] >= 0].tolist():
            if np.isnan(self.done_s[row]):
                self._done_one(row, at_s)

    def _done_one(self, row: int, at_s: float) -> None:
        table = self._table
        program = int(self.program[row])
        self.done_s[row] = at_s
        service = float(self.service_of(np.asarray([row]))[0])
        self.calls_done[program] += 1
        self.service_done[program] += service
        self.path_service[row] += service  # its parents' longest chain, then its own
        self.path_max[program] = max(self.path_max[program], self.path_service[row])
        for child in self._children[row]:
            self._ready_s[child] = max(self._ready_s[child], at_s)
            self.path_service[child] = max(self.path_service[child], self.path_service[row])
            self._parents_left[child] -= 1
            if self._parents_left[child]:
                continue
            release = max(self._ready_s[child] + self.tool_s[child],
                          float(table.arrival_s[child]))
            if table.state[child] == _REJECTED:  # rejected up front: done as it comes
                self.release_s[child] = release
                self._done_one(child, release)
            else:
                heapq.heappush(self._heap, (release, child))

    def next_release_s(self) -> Optional[float]:
        """The earliest known release not yet made (None: none known now)."""
        return self._heap[0][0] if self._heap else None

    def release_due(self, now_s: float) -> NDArray[np.int64]:  # -> [k]
        """Pops the calls whose release time has come (<= `now_s`) and marks them
        released at it. Returns their rows."""
        heap = self._heap
        rows = []
        while heap and heap[0][0] <= now_s:
            when, row = heapq.heappop(heap)
            self.release_s[row] = when
            rows.append(row)
        return np.asarray(rows, dtype=np.int64)

    def pop_releases(self) -> list[tuple[float, int]]:
        """Pops every known release (time, row), for an event loop to fire each at its
        time (`released`)."""
        heap, self._heap = self._heap, []
        self._routing.update((row, when) for when, row in heap)
        return sorted(heap)

    def released(self, row: int, at_s: float) -> None:
        """A call popped by `pop_releases` is released at `at_s`."""
        self.release_s[row] = at_s
        self._routing.pop(row, None)

    # ------------------------------------------------------------------ pins
    def pin(self, row: int, at_s: float, until_s: float, pages: int) -> None:
        """Records that finished call `row` keeps its `pages` for its program until
        `until_s` (inf: until a child is admitted)."""
        self.pins[row] = until_s
        self._pinned_at[row] = (at_s, pages)
        self.num_pins += 1
        self.max_pinned_pages = max(self.max_pinned_pages, self.pinned_pages)

    def unpin(self, row: int, at_s: float, hit: bool) -> None:
        """Ends `row`'s pin at `at_s` (`hit`: a child was admitted over its pages)."""
        del self.pins[row]
        start, pages = self._pinned_at.pop(row)
        self.pinned_page_s += pages * max(at_s - start, 0.0)
        self.num_pin_hits += int(hit)

    @property
    def pinned_pages(self) -> int:
        """Pages the pins hold now (a page two pins share counts twice)."""
        return sum(pages for _, pages in self._pinned_at.values())

    def next_pin_end_s(self) -> Optional[float]:
        """When the next pin's time runs out (None: no pin ends by time)."""
        ends = [until for until in self.pins.values() if until < np.inf]
        return min(ends) if ends else None

    def pinned_parents(self, rows: NDArray[np.int64]) -> list[int]:  # [a]
        """The pinned parents of these calls."""
        return sorted({p for row in rows.tolist() for p in self._parent_rows[row]
                       if p in self.pins})

    @property
    def num_unreleased(self) -> int:
        """Calls with parents not released yet (nor done)."""
        return int(np.count_nonzero(self.has_parents & np.isnan(self.release_s)))

    # ---------------------------------------------------------------- service
    def service_of(self, rows: NDArray[np.int64]) -> NDArray[np.float64]:  # [k] -> [k]
        """Tokens each call has been served: its prompt and output once its first token
        is out (a recompute preemption after it takes none back), else what it computed."""
        table = self._table
        generated = table.num_generated[rows]
        return np.where(generated > 0, table.prompt_len[rows] + generated,
                        table.num_computed[rows]).astype(np.float64)

    def live_rows(self) -> NDArray[np.int64]:  # -> [k]
        """Calls released and not done (waiting or running on some replica)."""
        return np.flatnonzero(~np.isnan(self.release_s) & np.isnan(self.done_s)
                              & (self._table.state < int(RequestState.FINISHED)))

    def pending_releases(self) -> list[tuple[float, int]]:
        """Known releases not yet made, (time, row), in no order."""
        return list(self._heap) + [(when, row) for row, when in self._routing.items()]

    def running_rows(self) -> NDArray[np.int64]:  # -> [k]
        """Calls running now (on any replica)."""
        live = self.live_rows()
        return live[self._table.state[live] == _RUNNING]


@dataclasses.dataclass(frozen=True)
class ProgramRecord:
    """A finished run's programs, for its metrics (`RunResult.programs`).

    Attributes:
      program: `[N]` each request's program index (-1: not a call of a program).
      program_ids: `[P]` each program's `Request.program_id`.
      release_s: `[N]` when each call was released (NaN: never).
      tool_s: `[N]` the pause before each call.
      call_index: `[N]` each call's index in its program (-1: not a call of a program).
    """

    program: NDArray[np.int64]
    program_ids: NDArray[np.int64]
    release_s: NDArray[np.float64]
    tool_s: NDArray[np.float64]
    call_index: NDArray[np.int64]
    # KV pinned across tool pauses: pins made, pins a child was admitted over, page-seconds
    # pinned (ended pins), and the most pages pinned at once.
    num_pins: int = 0
    num_pin_hits: int = 0
    pinned_page_s: float = 0.0
    max_pinned_pages: int = 0

    @classmethod
    def of(cls, book: ProgramBook) -> ProgramRecord:
        """A copy of the book's figures now (read-only)."""
        arrays = [book.program.copy(), book.program_ids.copy(), book.release_s.copy(),
                  book.tool_s.copy(), book.call_index.copy()]
        for array in arrays:
            array.setflags(write=False)
        return cls(*arrays, num_pins=book.num_pins, num_pin_hits=book.num_pin_hits,
                   pinned_page_s=book.pinned_page_s, max_pinned_pages=book.max_pinned_pages)
