"""Streams a live run's logs into its `RunFolder`, step by step.

`StreamResults` is a per-step observer (`Scheduler.run(progress=...)` calls it
after every iteration): every `STREAM_EVERY_STEPS` iterations (or sooner, once the
folder's streams are due to reach the file) it appends the
steps the scheduler logged since to steps.jsonl and, once `STREAM_BATCH` finished
requests wait or the folder's streams are due to reach the file
(`RunFolder.flush_due`, every `FLUSH_EVERY_S`), the requests that finished since
then to requests.jsonl, in the order they finished; `flush()` (the run's end, a
failure) appends the rest. A run killed outright so loses what it logged
in the last `FLUSH_EVERY_S` or so, as when each batch was written at once. Its
rows are the rows of the finished run's files (`orca_jax.results.summary.step_row`,
`request_row`, encoded by `orca_jax.results.row_lines`), but for `output_tokens`,
which a request's streamed row leaves out (the live scheduler keeps them to
itself); the finished run's requests.jsonl, rewritten in arrival order at the end,
has them.

Only this runner layer reads a live scheduler; `orca_jax.results` reads values.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
from numpy.typing import NDArray

from orca_jax.core.loop.scheduler import Scheduler
from orca_jax.results.row_lines import plain_request_lines, step_lines
from orca_jax.results.run_folder import RunFolder
from orca_jax.results.summary import step_row

# Whether rows go out is looked at every this many iterations (and at the run's end): a
# write per iteration cost more than its rows.
LOOK_EVERY_STEPS = 32
# Step lines go out every this many iterations, or at a look where the file is due
# (`RunFolder.flush_due`, so a slow engine's kill loses no more than before): a batch of
# them costs ~13 us besides its rows (its column checks, the log's slice, the append),
# 0.4 us a step at 32 iterations, 0.1 at 128; still far fewer than the `PACK_STEPS`
# steps the log holds as tuples, so the steps are read before it packs them.
STREAM_EVERY_STEPS = 128
# Request rows go out once this many wait (or the file is due, every `FLUSH_EVERY_S`):
# a request line's time texts are made once per distinct time of the batch
# (`row_lines.plain_request_lines`), and a batch of ~25 rows cost ~2x a row what one of
# ~1,000 does.
STREAM_BATCH = 1024


class StreamResults:
    """Appends a live scheduler's new steps and finished requests to `folder`'s logs.

    Args:
      folder: the run's folder, begun (`RunFolder.begin`).
      scheduler: the run's scheduler.
    """

    def __init__(self, folder: RunFolder, scheduler: Scheduler) -> None:
        self.folder = folder
        self.scheduler = scheduler
        self.num_steps_written = 0
        self._written = np.zeros(len(scheduler.table), dtype=bool)  # [N] request rows out
        # [N] each request's line in the streamed requests.jsonl (from 0), -1 if not there.
        self.request_line_of = np.full(len(scheduler.table), -1, dtype=np.int64)
        self.num_request_lines = 0
        # Finished but not yet released (a policy that defers release): their row waits
        # for the finish time the release gives them.
        self._awaiting_release = np.zeros(0, dtype=np.int64)
        self._finished: list[NDArray[np.int64]] = []  # each iteration's since the last flush
        self._num_finished = 0  # in `_finished`
        self._num_calls = 0

    def __call__(self, scheduler: Scheduler) -> None:
        del scheduler  # the one given at construction
        finished = self.scheduler.last_finished  # finished in this iteration only: keep
        if finished.size:
            self._finished.append(finished)
            self._num_finished += finished.size
        self._num_calls += 1
        if self._num_calls % LOOK_EVERY_STEPS == 0:
            due = self.folder.flush_due()
            # The requests first: a due file's first append sends both files.
            if due or self._num_finished >= STREAM_BATCH:
                self.stream_requests()
            # The steps at least every `STREAM_EVERY_STEPS`: read while the log holds them
            # as tuples (it packs every `PACK_STEPS`, and a packed step is read back one
            # at a time).
            if due or self._num_calls % STREAM_EVERY_STEPS == 0:
                self.stream_steps()

    def flush(self) -> None:
        """Appends every step logged and every request finished (and released) since the
        last flush (the run's end and a failure flush what is left)."""
        self.stream_steps()
        self.stream_requests()

    def stream_steps(self) -> None:
        """Appends every step logged since the last call."""
        record = self.scheduler.record
        new = record.steps[self.num_steps_written:]
        if not new:
            return
        ids = self.scheduler.table.specs
        logged = record.step_requests[self.num_steps_written:] if record.logs_step_requests \
            else None
        prefix_caching = self.scheduler.prefix_caching
        first = self.num_steps_written
        # With slower KV tiers each row says the seconds its step waited for their moves.
        stalls = record.kv_stall_s if self.scheduler.kv_memory.linked is not None else None
        if logged is None:  # the common case, one line a step: made from a format
            lines = step_lines(new, prefix_caching=prefix_caching)
            if stalls is not None:
                lines = (f'{line[:-1]}, "kv_stall_s": {float(stalls.get(first + k, 0.0))!r}}}'
                         for k, line in enumerate(lines))
            self.folder.append_lines("steps.jsonl", lines)
            self.num_steps_written += len(new)
            return
        self.folder.append_steps(
            _with_stall(step_row(step, prefix_caching=prefix_caching,
                     request_ids=([ids[i].id for i in logged[k][0].tolist()]
                                  if logged is not None else None),
                     request_tokens=logged[k][1].tolist() if logged is not None else None,
                     preempted_ids=([ids[i].id for i in logged[k][3].tolist()]
                                    if logged is not None else None),
                     rejected_ids=([ids[i].id for i in logged[k][4].tolist()]
                                   if logged is not None else None)),
                        stalls, first + k)
            for k, step in enumerate(new))
        self.num_steps_written += len(new)

    def stream_requests(self) -> None:
        """Appends the requests finished (and released) since the last call, in the order
        they finished: by finish time, then index."""
        scheduler = self.scheduler
        table = scheduler.table
        chunks, self._finished, self._num_finished = self._finished, [], 0
        if not chunks and self._awaiting_release.size == 0:
            return  # most steps finish nothing
        candidates = np.concatenate([self._awaiting_release, *chunks])  # [c]
        if self._awaiting_release.size:  # one may be among the new ones too
            candidates = np.unique(candidates)
        candidates = candidates[~self._written[candidates]]
        released = np.isfinite(table.finish_s[candidates])
        self._awaiting_release = candidates[~released]
        done = candidates[released]
        # In the order they finished, however many iterations the batch covers (a policy
        # that defers release: the order it released them in): by the finish time, then
        # by index; a few numpy calls.
        done = done[np.lexsort((done, table.finish_s[done]))]
        if done.size == 0:
            return
        self._written[done] = True
        self.request_line_of[done] = np.arange(self.num_request_lines,
                                               self.num_request_lines + done.size)
        self.num_request_lines += done.size
        specs, names = table.specs, table.tenant_names
        rows = done.tolist()
        self.folder.append_lines("requests.jsonl", plain_request_lines(
            table, rows, request_ids=[specs[i].id for i in rows],
            tenants=[names[t] for t in table.tenant[done].tolist()],
            reasons=[None] * len(rows),  # a streamed row names no reason (its final row does)
            prefix_caching=scheduler.prefix_caching,
            programs=(None if table.programs is None else
                      [(specs[i].program_id, specs[i].call_index) for i in rows]),
            speculation=table.speculation))


def _with_stall(row: dict, stalls: Optional[dict], step: int) -> dict:
    """`row` with its step's `kv_stall_s` when the run has slower KV tiers."""
    if stalls is not None:
        row["kv_stall_s"] = float(stalls.get(step, 0.0))
    return row
