"""What a run records as it goes: one log entry per step and one per generated token.

Appending is O(1) Python per step (a tuple, or an array chunk for the tokens of
a step), so recording does not add per-request work to the hot path; the
arrays are assembled once, into the run's `RunResult` (`RunResult.from_log`).

Steps are kept as rows of structured arrays (`StepLogs`: 96 bytes a step). The
log of every token (16 bytes a token) is kept only with `logs_tokens`; without
it the tokens are counted into a `TokenTally` (a few bytes a request and a
step), which gives the metrics the same numbers.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Sequence

import numpy as np
from numpy.typing import NDArray

from orca_jax.core.requests.step_logs import StepLog, StepLogs
from orca_jax.core.requests.token_stats import TokenStats, TokenTally

__all__ = ["RunRecord", "StepLog", "StepLogs", "TransferLog"]  # StepLog's old home


class TransferLog(NamedTuple):
    """One KV transfer of a disaggregated cluster, as written to transfers.jsonl."""

    request: int  # request index (arrival order)
    from_replica: int  # the prefill replica (cluster numbering)
    to_replica: int  # the decode replica (cluster numbering)
    num_bytes: int  # the request's KV on one TP shard (what each shard's link carries)
    ready_s: float  # the first token was sampled: the transfer queued
    start_s: float  # a link slot and the decode pages were free
    end_s: float  # the decode replica may admit it; the prefill replica frees its pages


@dataclasses.dataclass
class RunRecord:
    """The scheduler's append-only log of one run: its steps, tokens and preemptions."""

    num_requests: int
    logs_step_requests: bool = False  # SchedulerConfig.features.log_step_requests
    # Keep every token's request and time (`token_log`); False counts them instead.
    logs_tokens: bool = True
    steps: StepLogs = dataclasses.field(default_factory=StepLogs)
    num_preemptions: int = 0  # over the run
    # Computed tokens the preemptions threw away (a recompute victim's `num_computed`), which
    # it computes again when readmitted (less what the prefix cache still holds then).
    num_recomputed_tokens: int = 0
    # Step index -> seconds it waited for KV moves between memory tiers before it started
    # (only steps that waited: empty without slower tiers).
    kv_stall_s: dict[int, float] = dataclasses.field(default_factory=dict)
    # Step index -> (draft tokens verified, of them accepted, drafting seconds) of each
    # step that speculated (empty without speculative decoding).
    spec_steps: dict[int, tuple[int, int, float]] = dataclasses.field(default_factory=dict)
    _token_req: list[NDArray[np.int64]] = dataclasses.field(default_factory=list)
    _token_time: list[float] = dataclasses.field(default_factory=list)
    _token_count: list[int] = dataclasses.field(default_factory=list)
    # (request indices [n], tokens [n], requests holding a batch place after it [m],
    # preempted [p], rejected by the policy [j]) of each step, when `logs_step_requests`.
    step_requests: list[tuple[NDArray[np.int64], ...]] = dataclasses.field(
        default_factory=list)
    # Preempted and rejected since the last logged step (an iteration that runs
    # nothing logs no step: its removals go with the next step that does).
    _removed: list[tuple[NDArray[np.int64], NDArray[np.int64]]] = dataclasses.field(
        default_factory=list)

    def __post_init__(self) -> None:
        self._tally = None if self.logs_tokens else TokenTally(self.num_requests)
        if self._tally is not None:
            # Counted: `log_tokens` and `log_token_span` are the tally's `add` and
            # `add_span` themselves, one Python frame fewer on every step and leap
            # (instance attributes over the methods below).
            self.log_tokens = self._tally.add  # type: ignore[method-assign]
            self.log_token_span = self._tally.add_span  # type: ignore[method-assign]

    def log_speculation(self, step: int, drafted: int, accepted: int, draft_s: float) -> None:
        """Records that step `step` verified `drafted` draft tokens, accepted `accepted`,
        and spent `draft_s` of its seconds drafting."""
        self.spec_steps[step] = (drafted, accepted, draft_s)

    def log_step(self, entry: StepLog) -> None:
        self.steps.append(entry)

    def log_step_requests(self, requests: NDArray[np.int64],  # [n]
                          num_tokens: NDArray[np.int64],  # [n]
                          held: NDArray[np.int64]) -> None:  # [m]
        """Records the requests the step just logged computed, their token counts, and
        the requests that hold a place in the batch after it."""
        preempted, rejected = self._take_removed()
        self.step_requests.append((np.array(requests, np.int64), np.array(num_tokens, np.int64),
                                   np.array(held, np.int64), preempted, rejected))

    def log_removed(self, preempted: NDArray[np.int64],  # [p]
                    rejected: NDArray[np.int64]) -> None:  # [j]
        """Records the requests an iteration's plan preempted and rejected (logged with
        the next step, or the last one if none follows: `flush_removed`)."""
        if preempted.size or rejected.size:
            self._removed.append((np.array(preempted, np.int64), np.array(rejected, np.int64)))

    def _take_removed(self) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
        removed, self._removed = self._removed, []
        if not removed:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        return (np.concatenate([p for p, _ in removed]),
                np.concatenate([j for _, j in removed]))

    def flush_removed(self) -> None:
        """Adds removals no step has logged yet to the last logged step."""
        if not self._removed or not self.step_requests:
            return
        preempted, rejected = self._take_removed()
        *kept, last_preempted, last_rejected = self.step_requests[-1]
        self.step_requests[-1] = (*kept, np.concatenate([last_preempted, preempted]),
                                  np.concatenate([last_rejected, rejected]))

    def log_tokens(self, requests: NDArray[np.int64], time_s: float) -> None:  # [k]
        """Records that `requests` (distinct) each got a token at `time_s` (a record that
        counts its tokens has the tally's `TokenTally.add` here instead)."""
        self._token_req.append(requests)
        self._token_time.append(time_s)
        self._token_count.append(int(requests.size))

    def log_token_span(self, requests: NDArray[np.int64],  # [k] distinct
                       times_s: Sequence[float]) -> None:  # [c]
        """`log_tokens(requests, t)` for each `t` of `times_s` (Python floats, or an array
        of them), in order (a leap's steps; a record that counts its tokens has the
        tally's `TokenTally.add_span` here instead)."""
        count = len(times_s)
        self._token_req.extend([requests] * count)
        self._token_time.extend(times_s.tolist() if isinstance(times_s, np.ndarray)
                                else times_s)
        self._token_count.extend([int(requests.size)] * count)

    def token_stats(self, finished: NDArray[np.bool_]) -> TokenStats:  # [N]
        """The tokens so far as the metrics read them; `finished` the requests whose
        inter-token gaps count (`TokenStats`)."""
        if self._tally is not None:
            return self._tally.stats(finished)
        return TokenStats.from_log(*self.token_log(), finished)

    def token_log(self) -> tuple[NDArray[np.int64], NDArray[np.float64]]:
        """`([K] request index, [K] time)` of every generated token, in time order.

        Raises:
          ValueError: the record counts its tokens (`logs_tokens` False).
        """
        if self._tally is not None:
            raise ValueError("token_log: this run counted its tokens without logging each "
                             "(RunRecord.logs_tokens is False)")
        if not self._token_req:
            return np.zeros(0, np.int64), np.zeros(0, np.float64)
        requests = np.concatenate(self._token_req)
        times = np.repeat(np.asarray(self._token_time), self._token_count)
        return requests, times
