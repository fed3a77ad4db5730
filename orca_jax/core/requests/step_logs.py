"""A run's steps: `StepLog` rows, kept as rows of a structured numpy array.

A `StepLog` of Python numbers takes about 300 bytes (the tuple and a float or
int object per field); 10^6 steps took 300 MB. `StepLogs` keeps the newest
steps as tuples and packs them, `PACK_STEPS` at a time, into structured arrays
of 96 bytes a step; read back, a row is the very `StepLog` appended (its int
fields ints, its float fields floats, the same values).
"""

from __future__ import annotations

import bisect
import functools
import typing
from typing import Callable, Iterable, Iterator, NamedTuple, Sequence, Union, overload

import numpy as np
from numpy.typing import NDArray


class StepLog(NamedTuple):
    """One step, as written to steps.jsonl."""

    step: int
    start_s: float
    num_seqs: int
    num_tokens: int  # real tokens
    num_padded_tokens: int  # tokens of the bucket the step was padded to
    bucket: int  # the bucket's T
    host_s: float  # host scheduling time of the iteration (engine excluded)
    step_s: float  # engine seconds
    num_running: int
    num_waiting: int
    num_free_pages: int
    num_cached_tokens: int = 0  # tokens this step's admissions took from the prefix cache


# `step_log(fields)`: the StepLog of a tuple of its fields in order, made by `tuple.__new__`
# in C (the NamedTuple's own `__new__` is a Python function: 0.3 against 0.12 us a call).
step_log: Callable[[tuple], StepLog] = functools.partial(tuple.__new__, StepLog)

# One row: each field as its kind (int64 for ints, float64 for floats), 96 bytes.
STEP_DTYPE = np.dtype([(name, np.float64 if kind is float else np.int64)
                       for name, kind in typing.get_type_hints(StepLog).items()])


def packed_rows(steps: Sequence[tuple]) -> NDArray:
    """`[len(steps)]` the steps as rows of `STEP_DTYPE`: `np.array(steps, STEP_DTYPE)`, the
    same values, a field at a time (each field's column of Python numbers converted as
    one array: a third less than numpy's row-by-row conversion of a structured array)."""
    rows = np.empty(len(steps), STEP_DTYPE)
    if steps:
        for name, column in zip(STEP_DTYPE.names, zip(*steps)):
            rows[name] = column
    return rows


# Steps kept as tuples before they are packed: packing costs about a microsecond a step.
PACK_STEPS = 4096


class StepLogs(Sequence[StepLog]):
    """Steps in order: appended one at a time (a live run), or packed whole (a result).

    Indexing, slicing and iteration give `StepLog`s; `column` gives one field of
    every step as an array, without making them.

    Args:
      steps: the steps to start with.
      frozen: a finished run's steps: `append` refuses, and the arrays are read-only.
    """

    def __init__(self, steps: Iterable[StepLog] = (), *, frozen: bool = False) -> None:
        self._packed: list[NDArray] = []  # structured [PACK_STEPS]-or-so chunks, in order
        self._starts: list[int] = []  # the index of each packed chunk's first step
        self._num_packed = 0
        self._tail: list[StepLog] = []  # the newest, not packed yet
        self._frozen = False
        for step in steps:
            self.append(step)
        if frozen:
            self._pack()
            for chunk in self._packed:
                chunk.setflags(write=False)
            self._frozen = True

    @classmethod
    def concat(cls, parts: Sequence[StepLogs]) -> StepLogs:
        """The steps of `parts`, one after the other (frozen)."""
        joined = cls()
        for part in parts:
            part_chunks = [*part._packed]
            if part._tail:
                part_chunks.append(packed_rows(part._tail))
            for chunk in part_chunks:
                joined._add_chunk(chunk)
        return joined.frozen()

    def frozen(self) -> StepLogs:
        """A frozen copy. It shares the packed arrays (made read-only: nothing writes a
        packed step again) and copies the newest steps."""
        copy = StepLogs()
        for chunk in self._packed:
            chunk.setflags(write=False)
            copy._add_chunk(chunk)
        if self._tail:
            copy._add_chunk(packed_rows(self._tail))
            copy._packed[-1].setflags(write=False)
        copy._frozen = True
        return copy

    def append(self, step: StepLog) -> None:
        """Adds the next step."""
        if self._frozen:
            raise ValueError("StepLogs.append: these steps are a finished run's")
        self._tail.append(step)
        if len(self._tail) >= PACK_STEPS:
            self._pack()

    def extend(self, steps: list[StepLog]) -> None:
        """Adds the next steps (a leap's), one after the other."""
        if self._frozen:
            raise ValueError("StepLogs.extend: these steps are a finished run's")
        # In the tail, packed with the steps around them: a leap of a few steps made into
        # a chunk of its own would leave the log in thousands of tiny chunks.
        self._tail.extend(steps)
        if len(self._tail) >= PACK_STEPS:
            self._pack()

    def _pack(self) -> None:
        if self._tail:
            self._add_chunk(packed_rows(self._tail))
            self._tail = []

    def _add_chunk(self, chunk: NDArray) -> None:
        if chunk.size:
            self._packed.append(chunk)
            self._starts.append(self._num_packed)
            self._num_packed += int(chunk.size)

    def column_rows(self) -> NDArray:
        """`[S]` every step as a row of `STEP_DTYPE` (a new array)."""
        chunks = [*self._packed]
        if self._tail:
            chunks.append(packed_rows(self._tail))
        return np.concatenate(chunks) if chunks else np.zeros(0, STEP_DTYPE)

    def column(self, field: str) -> NDArray:
        """`[S]` one StepLog field of every step (int64 or float64)."""
        chunks = [chunk[field] for chunk in self._packed]
        if self._tail:
            chunks.append(np.array([getattr(s, field) for s in self._tail],
                                   dtype=STEP_DTYPE[field]))
        return np.concatenate(chunks) if chunks else np.zeros(0, STEP_DTYPE[field])

    def last(self) -> StepLog:
        """The newest step (`self[-1]` without its index checks: a leap asks it for the
        pace of the last step).

        Raises:
          IndexError: no step yet.
        """
        return self._tail[-1] if self._tail else self[-1]

    def __len__(self) -> int:
        return self._num_packed + len(self._tail)

    @overload
    def __getitem__(self, index: int) -> StepLog: ...

    @overload
    def __getitem__(self, index: slice) -> list[StepLog]: ...

    def __getitem__(self, index: Union[int, slice]) -> Union[StepLog, list[StepLog]]:
        if isinstance(index, slice):
            start, stop, stride = index.indices(len(self))
            if stride == 1 and start >= self._num_packed:  # a live run's newest steps
                return self._tail[start - self._num_packed:stop - self._num_packed]
            return [self[i] for i in range(start, stop, stride)]
        i = int(index)
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"step {index} of {len(self)}")
        if i >= self._num_packed:
            return self._tail[i - self._num_packed]
        c = bisect.bisect_right(self._starts, i) - 1
        return StepLog._make(self._packed[c][i - self._starts[c]].item())

    def __iter__(self) -> Iterator[StepLog]:
        for chunk in self._packed:
            yield from map(StepLog._make, chunk.tolist())
        yield from self._tail

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, (StepLogs, list, tuple)):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other))

    __hash__ = None  # type: ignore[assignment]  (equal to a list of the same steps)

    def __repr__(self) -> str:
        return f"StepLogs({len(self)} steps)"
