"""What the metrics need of a run's generated tokens, without a row per token.

The serving metrics read three things of the token log: each request's token
count and last token time, each request's largest gap between consecutive
tokens, and every inter-token gap of the finished requests (for its p99). A
log of every token holds 16 bytes a token (10^6 requests: about 1 GB); these
hold a few bytes a request and a step, and give the very same numbers.

`TokenTally` counts them as a scheduler runs. A request's tokens come in
*runs*: tokens at consecutive `add` calls (a decode every step). The gap inside
a run is the difference of two consecutive call times, so the gaps of every run
together are one count per call (a difference array over the runs); gaps
between runs (after a preemption, a prefill between two tokens) are few, and
kept as they are measured. `TokenStats` is the frozen value, made from a tally
(`TokenTally.stats`) or from a whole token log (`TokenStats.from_log`): the two
agree bit for bit.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator, Sequence

import numpy as np
from numpy.typing import NDArray

from orca_jax.core.requests.request_table import count_nonzero

# 0 as a 0-d array of the calls' type: numpy converts a Python int operand on every call.
_ZERO_32 = np.array(0, dtype=np.int32)
# Tokens handled at once by the chunked gap computations of a whole log: sorting a log
# of millions of tokens whole would take several copies of it.
CHUNK_TOKENS = 1 << 16


def check_token_log(token_req: NDArray, token_time_s: NDArray
                    ) -> tuple[NDArray[np.int64], NDArray[np.float64]]:
    """The token log as arrays (no copy of arrays already so), checked chunk by chunk.

    Args:
      token_req: `[K]` request index of each generated token.
      token_time_s: `[K]` its time, non-decreasing.

    Raises:
      ValueError: the arrays are not 1-D of one length, or the times go backwards.
    """
    req = np.asarray(token_req, dtype=np.int64)
    times = np.asarray(token_time_s, dtype=np.float64)
    if req.ndim != 1 or req.shape != times.shape:
        raise ValueError(f"token_req {req.shape} and token_time_s {times.shape} must be 1-D "
                         f"arrays of the same length")
    for start in range(0, max(times.size - 1, 0), CHUNK_TOKENS):
        backwards = np.diff(times[start:start + CHUNK_TOKENS + 1]) < 0
        if backwards.any():
            k = start + int(np.argmax(backwards)) + 1
            raise ValueError(f"token_time_s must be in time order; token {k} at {times[k]} "
                             f"comes after {times[k - 1]}")
    return req, times


def gap_chunks(req: NDArray[np.int64], times: NDArray[np.float64], n: int
               ) -> Iterator[tuple[NDArray[np.int64], NDArray[np.float64]]]:
    """Yields `([g] request index, [g] gap)` for the token log a slice of time at a time:
    every gap between consecutive tokens of the same request, once, in no set order.

    One pass over the log, `CHUNK_TOKENS` tokens at a time; each request's last token
    time so far is carried from one slice to the next, so a gap across two slices counts.

    Args:
      req: `[K]` request index of each token, in [0, n).
      times: `[K]` its time, non-decreasing.
      n: the number of requests.
    """
    last_seen = np.full(n, np.nan)  # [N] each request's latest token time so far
    for start in range(0, req.size, CHUNK_TOKENS):
        # A stable sort by request keeps each request's tokens in time order.
        order = np.argsort(req[start:start + CHUNK_TOKENS], kind="stable")
        chunk_req = req[start:start + CHUNK_TOKENS][order]
        chunk_times = times[start:start + CHUNK_TOKENS][order]
        starts = np.ones(chunk_req.size, dtype=bool)  # a request's first token in the slice
        starts[1:] = chunk_req[1:] != chunk_req[:-1]
        previous = np.empty_like(chunk_times)
        previous[1:] = chunk_times[:-1]
        previous[starts] = last_seen[chunk_req[starts]]
        ends = np.ones(chunk_req.size, dtype=bool)  # its last token in the slice
        ends[:-1] = starts[1:]
        last_seen[chunk_req[ends]] = chunk_times[ends]
        has_previous = ~np.isnan(previous)
        yield chunk_req[has_previous], (chunk_times - previous)[has_previous]


def _merge_counts(values: NDArray[np.float64],  # [u] any order, repeats allowed
                  counts: NDArray[np.int64]  # [u]
                  ) -> tuple[NDArray[np.float64], NDArray[np.int64]]:  # ([U], [U])
    """The multiset `values` (each `counts` times) as sorted distinct values and counts."""
    keep = counts > 0
    values, counts = values[keep], counts[keep]
    order = np.argsort(values, kind="stable")
    values, counts = values[order], counts[order]
    first = np.ones(values.size, dtype=bool)
    first[1:] = values[1:] != values[:-1]
    starts = np.flatnonzero(first)
    summed = np.add.reduceat(counts, starts) if starts.size else counts[:0]
    return values[starts], summed.astype(np.int64)


@dataclasses.dataclass(frozen=True, eq=False)
class TokenStats:
    """A run's generated tokens as the metrics read them (N requests).

    Attributes:
      num_tokens: `[N]` tokens each request generated (in this log).
      last_token_s: `[N]` the time of its last token, -inf without one.
      max_gap_s: `[N]` its largest gap between consecutive tokens, -inf with fewer than two.
      gap_values: `[U]` the distinct inter-token gaps of the requests counted as finished
        (`finished` where made), ascending.
      gap_counts: `[U]` how many gaps have each value.
    """

    num_tokens: NDArray[np.int64]
    last_token_s: NDArray[np.float64]
    max_gap_s: NDArray[np.float64]
    gap_values: NDArray[np.float64]
    gap_counts: NDArray[np.int64]

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            getattr(self, field.name).setflags(write=False)

    @classmethod
    def from_log(cls, token_req: NDArray, token_time_s: NDArray,  # [K], [K]
                 finished: NDArray[np.bool_], *, gaps: bool = True) -> TokenStats:  # [N]
        """The stats of a whole token log, a slice of it at a time (no sort of it whole).

        Args:
          token_req: `[K]` request index of every generated token, in [0, N).
          token_time_s: `[K]` its time, non-decreasing.
          finished: `[N]` the requests whose gaps `gap_values` counts.
          gaps: False leaves `gap_values` empty (per-request figures only).

        Raises:
          ValueError: as `check_token_log`, or an index outside [0, N).
        """
        req, times = check_token_log(token_req, token_time_s)
        n = int(finished.shape[0])
        if req.size and (req.min() < 0 or req.max() >= n):
            raise ValueError(f"token_req holds request indices outside [0, {n}): "
                             f"min {req.min()}, max {req.max()}")
        last_token = np.full(n, -np.inf)
        np.maximum.at(last_token, req, times)
        max_gap = np.full(n, -np.inf)
        values, counts = [np.zeros(0)], [np.zeros(0, np.int64)]  # merged first, then chunks'
        for gap_req, chunk_gaps in gap_chunks(req, times, n):
            np.maximum.at(max_gap, gap_req, chunk_gaps)
            if gaps:
                distinct, count = np.unique(chunk_gaps[finished[gap_req]], return_counts=True)
                values.append(distinct)
                counts.append(count)
                # Merged whenever the chunks' values outgrow the merged ones: each chunk's
                # distinct gaps repeat the others' (step times), and kept apart they would
                # add up to the log's size.
                if sum(v.size for v in values[1:]) > max(values[0].size, CHUNK_TOKENS):
                    merged = _merge_counts(np.concatenate(values), np.concatenate(counts))
                    values, counts = [merged[0]], [merged[1]]
        gap_values, gap_counts = _merge_counts(np.concatenate(values), np.concatenate(counts))
        return cls(num_tokens=np.bincount(req, minlength=n).astype(np.int64),
                   last_token_s=last_token, max_gap_s=max_gap, gap_values=gap_values,
                   gap_counts=gap_counts)

    @classmethod
    def joined(cls, parts: Sequence[TokenStats]) -> TokenStats:
        """The stats of logs whose requests are apart (each request's tokens all in one
        part's log), as `from_log` gives them of the logs merged, bit for bit: the gaps of
        a request are those of its own part. Each part's `[N]` covers every request."""
        values, counts = _merge_counts(np.concatenate([p.gap_values for p in parts]),
                                       np.concatenate([p.gap_counts for p in parts]))
        num_tokens = parts[0].num_tokens.astype(np.int64)  # [N] copies, one part at a time
        last_token, max_gap = parts[0].last_token_s.copy(), parts[0].max_gap_s.copy()
        for part in parts[1:]:
            num_tokens += part.num_tokens
            np.maximum(last_token, part.last_token_s, out=last_token)
            np.maximum(max_gap, part.max_gap_s, out=max_gap)
        return cls(num_tokens=num_tokens, last_token_s=last_token, max_gap_s=max_gap,
                   gap_values=values, gap_counts=counts)

    def gap_percentile(self, p: float) -> float:
        """The `p`th percentile of the counted gaps, as `np.percentile` (linear) gives it
        over them all; NaN when there are none.

        `np.percentile` interpolates between the two order statistics around
        `(G - 1) * p / 100`; these are found in the counts, and the interpolation is
        numpy's own (`np.quantile` of the pair at the same fraction).
        """
        total = int(self.gap_counts.sum())
        if total == 0:
            return float("nan")
        virtual = (total - 1) * np.true_divide(p, 100)  # numpy's virtual index, as it makes it
        if virtual >= total - 1:
            return float(self.gap_values[-1])
        below = int(np.floor(virtual))
        ends = np.cumsum(self.gap_counts)  # [U] order statistics below each value's end
        low = self.gap_values[np.searchsorted(ends, below, side="right")]
        high = self.gap_values[np.searchsorted(ends, below + 1, side="right")]
        return float(np.quantile(np.array([low, high]), virtual - below))


class TokenTally:
    """Counts a live run's tokens into `TokenStats`: 8 bytes a request and a step, and 28
    a break in a request's tokens (a preemption, a prefill between two of its tokens).

    Args:
      num_requests: N, the requests of the run (indices 0..N-1).
    """

    def __init__(self, num_requests: int) -> None:
        n = num_requests
        self._times = np.zeros(1024)  # [C'] each call's time; grown by doubling
        self._num_calls = 0
        # [N] the call of its latest token; -2 before its first, so that no first token
        # (not even at call 0) continues a run that ends at call - 1.
        # int32: 2^31 calls (steps) would take years of simulation.
        self._last_call = np.full(n, -2, np.int32)
        self._run_start = np.full(n, -1, np.int32)  # [N] the first call of its current run
        # `add`'s call and the one before, as 0-d operands of `_last_call`'s type: numpy
        # converts a Python int operand anew on every call (0.56 against 0.35 us a compare).
        self._call_0d = np.zeros((), np.int32)
        self._previous_0d = np.zeros((), np.int32)
        # Runs that ended (the request's next token came later than the next call), per
        # `add` that ended some: (requests [b], each run's first call [b] and last call
        # [b], the gap from its last token to the next one [b]).
        self._closed: list[tuple[NDArray, NDArray, NDArray, NDArray[np.float64]]] = []

    def add(self, requests: NDArray[np.int64], time_s: float) -> None:  # [k] distinct
        """Counts a token of each of `requests` at `time_s` (not before the last call's).

        A few numpy operations a call whatever its size: the per-request figures are
        made at the end (`stats`), from the runs.
        """
        call = self._num_calls
        if call == self._times.size:
            self._times = np.concatenate([self._times, np.zeros(call)])
        self._times[call] = time_s
        self._num_calls = call + 1
        last_call, call_0d, previous_0d = self._last_call, self._call_0d, self._previous_0d
        call_0d[()] = call
        previous_0d[()] = call - 1
        previous = last_call[requests]  # [k]
        broke = previous != previous_0d  # [k] starts a run: its first token, or after a break
        num_broke = count_nonzero(broke)  # broke.any(), without the method's Python frame
        if num_broke:
            self._start_runs(requests, previous, broke, num_broke, call, time_s)
        last_call[requests] = call_0d

    def add_span(self, requests: NDArray[np.int64],  # [k] distinct
                 times_s: Sequence[float]) -> None:  # [c] non-decreasing, c >= 1
        """Counts a token of each of `requests` at each of `times_s` (Python floats, or an
        array of them): `c` calls of `add` with the same requests (a leap over steady
        decodes), in O(1) numpy calls. After the first call every request continues its
        run, so only the first can break one: `add`'s steps once, its calls `c` at once."""
        call = self._num_calls
        end = call + len(times_s)
        if end > self._times.size:
            self._times = np.concatenate([self._times, np.zeros(max(end, 2 * self._times.size)
                                                                - self._times.size)])
        self._times[call:end] = times_s
        self._num_calls = end
        # The calls as the 0-d operands `add` keeps (numpy converts a Python int anew).
        call_0d, previous_0d = self._call_0d, self._previous_0d
        previous_0d[()] = call - 1
        call_0d[()] = end - 1
        previous = self._last_call[requests]  # [k]
        broke = previous != previous_0d  # [k] starts a run: its first token, or after a break
        num_broke = count_nonzero(broke)
        if num_broke:
            self._start_runs(requests, previous, broke, num_broke, call, float(times_s[0]))
        self._last_call[requests] = call_0d

    def _start_runs(self, requests: NDArray[np.int64],  # [k]
                    previous: NDArray[np.int32],  # [k] each one's last call before `call`
                    broke: NDArray[np.bool_],  # [k] previous != call - 1
                    num_broke: int, call: int, time_s: float) -> None:
        """Runs start at `call` for the `num_broke` requests that broke (a first token, or
        one after a break), and those that broke after a token close their run, its gap
        ending at `time_s` (`add`'s and `add_span`'s first call)."""
        if num_broke == 1 and previous[at := int(broke.argmax())] < 0:
            # One request's first token (most calls that start a run: an admission's
            # prompt ended): no run ends, and its start is one Python-int write, not the
            # masks below (numpy's fixed cost per call, on a 64-entry batch).
            self._run_start[requests[at]] = call
            return
        # A run ends where a request broke after a token (previous >= 0). The others that
        # broke are those with no token yet (previous < 0, all of which broke), so a run
        # ends only where they are fewer than `num_broke`: rare (after a preemption), and
        # one count instead of the mask below on most calls.
        if count_nonzero(previous < _ZERO_32) < num_broke:
            had = broke & (previous >= _ZERO_32)  # [k] after a break: a run ends
            ended, ended_at = requests[had], previous[had]
            self._closed.append((ended, self._run_start[ended], ended_at,
                                 time_s - self._times[ended_at]))
        self._run_start[requests[broke]] = call

    def stats(self, finished: NDArray[np.bool_]) -> TokenStats:  # [N]
        """The tally so far as `TokenStats` (copies), `finished` the requests whose gaps count."""
        n, num_calls = self._last_call.size, self._num_calls
        times = self._times[:num_calls]  # [C]
        last_call, run_start = self._last_call, self._run_start
        started = last_call >= 0  # [N] has a token: its current run is open
        num_tokens = np.where(started, last_call - run_start + 1, 0).astype(np.int64)  # [N]
        last_token = np.full(n, -np.inf)
        last_token[started] = times[last_call[started]]
        if self._closed:
            closed_req, closed_first, closed_last, closed_gap = (
                np.concatenate(parts) for parts in zip(*self._closed))
        else:
            closed_req = closed_first = closed_last = np.zeros(0, np.int32)
            closed_gap = np.zeros(0)
        np.add.at(num_tokens, closed_req, closed_last - closed_first + 1)
        # Gaps inside the runs of finished requests: one per call after a run's first,
        # counted with a difference array over the calls.
        open_runs = np.flatnonzero(started & finished)
        kept = finished[closed_req]
        firsts = np.concatenate([run_start[open_runs], closed_first[kept]]) + 1
        lasts = np.concatenate([last_call[open_runs], closed_last[kept]]) + 1
        del open_runs
        per_call = np.cumsum((np.bincount(firsts, minlength=num_calls + 1)
                              - np.bincount(lasts, minlength=num_calls + 1))[:num_calls])
        del firsts, lasts
        call_gaps = np.diff(times, prepend=np.nan)  # [C] each call's time since the last
        # Gaps between the runs of finished requests, as their breaks measured them.
        between = closed_gap[kept]
        gap_values, gap_counts = _merge_counts(
            np.concatenate([call_gaps, between]),
            np.concatenate([per_call, np.ones(between.size, np.int64)]))
        max_gap = np.full(n, -np.inf)  # [N]
        np.maximum.at(max_gap, closed_req, closed_gap)
        open_runs = np.flatnonzero(started & (last_call > run_start))  # with a gap inside
        padded = np.append(call_gaps, -np.inf)  # [C + 1]: a run's end + 1 may be C
        _max_inside_runs(max_gap, padded, open_runs, run_start[open_runs],
                         last_call[open_runs])
        del open_runs
        _max_inside_runs(max_gap, padded, closed_req, closed_first, closed_last)
        return TokenStats(num_tokens=num_tokens, last_token_s=last_token, max_gap_s=max_gap,
                          gap_values=gap_values, gap_counts=gap_counts)


def _max_inside_runs(max_gap: NDArray[np.float64],  # [N] raised in place
                     gaps: NDArray[np.float64],  # [C + 1] each call's time since the last
                     req: NDArray, first: NDArray, last: NDArray) -> None:  # [R] each
    """Raises each request's `max_gap` to the largest gap inside its runs: request
    `req[i]`'s tokens at calls `first[i]..last[i]`, whose gaps are `gaps[first+1..last]`.

    With the runs sorted by start, `np.maximum.reduceat` over the indices `s0+1, e0+1,
    s1+1, e1+1, ...` gives each run's maximum at the even places; the odd places reduce
    the stretches between one run's end and the next one's start, which sorted starts
    keep to one pass over the calls. `CHUNK_TOKENS` runs at a time.
    """
    order = np.argsort(first, kind="stable")
    for start in range(0, order.size, CHUNK_TOKENS):
        chunk = order[start:start + CHUNK_TOKENS]
        bounds = np.empty(2 * chunk.size, np.int64)
        bounds[0::2] = first[chunk] + 1
        bounds[1::2] = last[chunk] + 1
        inside = last[chunk] > first[chunk]  # a run of one token has no gap inside
        run_max = np.maximum.reduceat(gaps, bounds)[0::2]
        np.maximum.at(max_gap, req[chunk][inside], run_max[inside])
