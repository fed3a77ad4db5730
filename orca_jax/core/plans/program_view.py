"""What a policy reads of agent programs: `SchedulerView.programs` (docs/programs.md).

Service is counted in tokens: a call's prompt and output once its first token
is out, else the tokens it has computed (`ProgramBook.service_of`). Autellix
(arXiv 2502.13965) counts a program's attained service the same way over its
calls: PLAS ranks by the sum over its calls so far, ATLAS by the longest chain
of calls so far (the critical path of a program with parallel threads).

Every method works on the live state when called, and costs O(N) numpy at
most; none runs unless a policy asks (a run without programs has no
`ProgramsView` at all: `SchedulerView.programs` is None).
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from orca_jax.core.requests.programs import ProgramBook


def _read_only(array: NDArray) -> NDArray:
    view = array.view()
    view.flags.writeable = False
    return view


class ProgramsView:
    """The programs of a run, as a policy sees them (read-only).

    Attributes:
      program: `[N]` each request's program index (-1: not a call of a program).
      program_ids: `[P]` each program's `Request.program_id`.
      tool_s: `[N]` the pause before each call.
      release_s: `[N]` when each call was released, NaN until then (a call without
        parents: its arrival).
      num_calls: `[P]` each program's calls in the workload.
    """

    def __init__(self, book: ProgramBook) -> None:
        self._book = book
        self.program = _read_only(book.program)
        self.program_ids = _read_only(book.program_ids)
        self.tool_s = _read_only(book.tool_s)
        self.release_s = _read_only(book.release_s)
        self.num_calls = _read_only(book.num_calls)

    @property
    def num_programs(self) -> int:
        return self._book.num_programs

    # -------------------------------------------------------------- per program
    def program_attained(self) -> NDArray[np.float64]:  # -> [P]
        """Tokens each program has been served: its done calls' and its live calls' so far."""
        book = self._book
        live = book.live_rows()
        return book.service_done + np.bincount(book.program[live], book.service_of(live),
                                               minlength=book.num_programs)

    def program_critical_path(self) -> NDArray[np.float64]:  # -> [P]
        """Each program's longest chain of calls so far, in tokens served: a live call's
        chain is its parents' longest and its own service so far."""
        book = self._book
        live = book.live_rows()
        best = book.path_max.copy()
        np.maximum.at(best, book.program[live], book.path_service[live] + book.service_of(live))
        return best

    def calls_done_of_program(self) -> NDArray[np.int64]:  # -> [P]
        """Calls of each program done so far (finished, rejected or cancelled)."""
        return self._book.calls_done.copy()

    def in_tool_pause(self, now_s: float) -> NDArray[np.bool_]:  # -> [P]
        """Whether each program waits only on a tool (or its user) at `now_s`: none of
        its calls is released and unfinished, and a release of one is planned."""
        return np.isfinite(self.pause_ends_s(now_s))

    def pause_ends_s(self, now_s: float) -> NDArray[np.float64]:  # -> [P]
        """When each program's tool pause ends (its next call's release; inf: not in one)."""
        book = self._book
        ends = np.full(book.num_programs, np.inf)
        for when, row in book.pending_releases():
            program = int(book.program[row])
            ends[program] = min(ends[program], when)
        live = np.bincount(book.program[book.live_rows()], minlength=book.num_programs)
        ends[live > 0] = np.inf
        return ends

    # ---------------------------------------------------------------- per request
    def _of_requests(self, per_program: NDArray, ids: NDArray[np.int64],
                     alone: NDArray) -> NDArray:  # [P], [n], [n] -> [n]
        program = self._book.program[ids]
        return np.where(program >= 0, per_program[np.maximum(program, 0)], alone)

    def attained(self, ids: NDArray[np.int64]) -> NDArray[np.float64]:  # [n] -> [n]
        """Each request's program's attained service (`program_attained`); a request of no
        program: its own service."""
        ids = np.asarray(ids, dtype=np.int64)
        return self._of_requests(self.program_attained(), ids, self._book.service_of(ids))

    def critical_path(self, ids: NDArray[np.int64]) -> NDArray[np.float64]:  # [n] -> [n]
        """Each request's program's longest chain so far (`program_critical_path`); a
        request of no program: its own service."""
        ids = np.asarray(ids, dtype=np.int64)
        return self._of_requests(self.program_critical_path(), ids, self._book.service_of(ids))

    def calls_done(self, ids: NDArray[np.int64]) -> NDArray[np.int64]:  # [n] -> [n]
        """Calls of each request's program done so far (0 for a request of no program)."""
        ids = np.asarray(ids, dtype=np.int64)
        return self._of_requests(self._book.calls_done, ids, np.zeros(ids.size, np.int64))

    def next_pause_s(self, ids: NDArray[np.int64]) -> NDArray[np.float64]:  # [n] -> [n]
        """The tool pause that follows each call: the shortest `tool_s` of the calls that
        wait on it (inf: none does, or not a call of a program). The workload's planned
        pause, as `tool_s` and `pause_ends_s` are (a serving system would predict it)."""
        ids = np.asarray(ids, dtype=np.int64)
        book = self._book
        return np.array([min((book.tool_s[c] for c in book.children(row)), default=np.inf)
                         for row in ids.tolist()], dtype=np.float64)

    def sibling_running(self, ids: NDArray[np.int64]) -> NDArray[np.bool_]:  # [n] -> [n]
        """Whether another call of each request's program is running (on any replica)."""
        ids = np.asarray(ids, dtype=np.int64)
        book = self._book
        running = book.running_rows()
        count = np.bincount(book.program[running], minlength=book.num_programs)
        program = book.program[ids]
        mine = np.isin(ids, running).astype(np.int64)
        return (program >= 0) & (count[np.maximum(program, 0)] - mine > 0)
