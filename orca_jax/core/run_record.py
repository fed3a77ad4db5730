"""What a run records as it goes: one log entry per step and one per generated token.

Appending is O(1) Python per step (a tuple, or an array chunk for the tokens of
a step), so recording does not add per-request work to the hot path; the
arrays are assembled once, when results are written.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional

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


@dataclasses.dataclass
class RunRecord:
    """The per-step and per-token logs of one run."""

    num_requests: int
    steps: list[StepLog] = dataclasses.field(default_factory=list)
    num_preemptions: int = 0
    _token_req: list[NDArray[np.int64]] = dataclasses.field(default_factory=list)
    _token_time: list[float] = dataclasses.field(default_factory=list)
    _token_count: list[int] = dataclasses.field(default_factory=list)
    _token_ids: list[NDArray[np.int32]] = dataclasses.field(default_factory=list)
    # (request indices [n], tokens [n]) of each step, when the scheduler logs them.
    step_requests: list[tuple[NDArray[np.int64], NDArray[np.int64]]] = dataclasses.field(
        default_factory=list)

    def log_step(self, entry: StepLog) -> None:
        self.steps.append(entry)

    def log_step_requests(self, requests: NDArray[np.int64],  # [n]
                          num_tokens: NDArray[np.int64]) -> None:  # [n]
        """Records the requests the step just logged computed, and their token counts."""
        self.step_requests.append((np.array(requests, np.int64), np.array(num_tokens, np.int64)))

    def log_tokens(self, requests: NDArray[np.int64],  # [k]
                   time_s: float, token_ids: Optional[NDArray[np.int32]]) -> None:  # [k]
        """Records that `requests` each got a token at `time_s`."""
        self._token_req.append(requests)
        self._token_time.append(time_s)
        self._token_count.append(int(requests.size))
        if token_ids is not None:
            self._token_ids.append(token_ids)

    def token_log(self) -> tuple[NDArray[np.int64], NDArray[np.float64]]:
        """`([K] request index, [K] time)` of every generated token, in time order."""
        if not self._token_req:
            return np.zeros(0, np.int64), np.zeros(0, np.float64)
        requests = np.concatenate(self._token_req)
        times = np.repeat(np.asarray(self._token_time), self._token_count)
        return requests, times

    def step_array(self, field: str) -> NDArray:
        """One StepLog field over all steps, `[num_steps]`."""
        return np.asarray([getattr(s, field) for s in self.steps])
