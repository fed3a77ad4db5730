"""Per-token times and Andes's Quality-of-Experience (QoE) metric computed from them.

A run with `--log_token_times` keeps every output token's time (the end of the step
that sampled it, on the run's clock: the same clock as `arrival_s`, `first_token_s`
and `finish_s`) and writes each request's as `token_times` in requests.jsonl.
`TokenTimes` holds them grouped by request, and each finished request's QoE.

QoE (Liu et al., "Andes: Defining and Enhancing Quality-of-Experience in LLM-Based
Text Streaming Services", arXiv 2404.16283, section 3.1) compares the timeline on
which a user digests a streamed answer with the one they expect. A user expects
the first token `ttft_s` after the request (the expected TTFT) and then reads at
`tokens_per_s` (the expected token delivery speed, TDS: a reading or listening
speed), so of an answer of l tokens, token i (from 1) is expected at

    e_i = ttft_s + (i - 1) / tokens_per_s        (seconds since arrival).

A user cannot digest faster than that pace, nor before the expected start: a token
that arrives early waits (Andes's client-side buffer), one that arrives late holds
back every later one. Token i, arriving at a_i, is digested at

    d_1 = max(a_1, e_1),    d_i = max(a_i, d_{i-1} + 1 / tokens_per_s),

which is `d_i = e_i + D_i` with `D_i = max(0, max_{j <= i} (a_j - e_j))`: the largest
lateness so far. The expected and the digested timelines count tokens over time
(step curves); QoE is the area under the digested one over the area under the
expected one, both from arrival to the last token's digestion `H = d_l`:

    S_expected = sum_i (H - e_i),   S_actual = sum_i (H - d_i),
    QoE = S_actual / S_expected = (g l(l-1)/2 + l D_l - sum_i D_i) / (g l(l-1)/2 + l D_l)

with `g = 1 / tokens_per_s`. QoE is 1.0 when every token arrives no later than
expected (every `D_i` is 0, even for a burst that arrives early: it cannot exceed 1),
lower the later and the longer the stalls, and 0 for a one-token answer that came
late (nothing was digested before the window closed). It is 1.0 for l = 1 on time.

The paper's defaults, which the flags take (`--qoe_ttft_s`, `--qoe_tokens_per_s`):
an expected TTFT of 1 s and a TDS of 4.8 tokens/s (an average reader); it counts an
average QoE of at least 0.9 as acceptable, which `qoe_attainment` (the share of
finished requests with QoE >= `QOE_ACCEPTABLE`) reports per request.

Memory: the token times are 16 bytes a token in the run's result (request index and
time), and grouping them here adds 16 more (`TokenTimes`: 8 a token, and the sort); a
run peaks at about 42 bytes a token (docs/token_times_and_qoe.md).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import numpy as np
from numpy.typing import NDArray

# Andes's evaluation defaults: an expected TTFT of 1 s, an expected TDS of 4.8 tokens/s.
ANDES_TTFT_S = 1.0
ANDES_TOKENS_PER_S = 4.8
# The QoE Andes counts as acceptable (its figures' threshold on average QoE).
QOE_ACCEPTABLE = 0.9
# Tokens handled at once (the temporaries of `andes_qoe_grouped` are a few per token).
CHUNK_TOKENS = 1 << 16


@dataclasses.dataclass(frozen=True)
class QoETargets:
    """What a user expects of a streamed answer (Andes's expected TTFT and TDS).

    Attributes:
      ttft_s: the expected time to first token, seconds from arrival (> 0).
      tokens_per_s: the expected token delivery speed, tokens per second (> 0).
    """

    ttft_s: float = ANDES_TTFT_S
    tokens_per_s: float = ANDES_TOKENS_PER_S

    def __post_init__(self) -> None:
        for name in ("ttft_s", "tokens_per_s"):
            value = getattr(self, name)
            if not (np.isfinite(value) and value > 0):
                raise ValueError(f"QoETargets.{name} must be a finite number > 0, got {value}")


def _segmented_cummax(values: NDArray[np.float64],  # [K] in place
                      position: NDArray[np.int64]) -> None:  # [K]
    """Each value raised to the largest before it in its segment (`position` counts from 0
    at each segment's start): a doubling scan, log2(longest segment) numpy passes, exact."""
    shift = 1
    longest = int(position.max()) + 1 if position.size else 0
    while shift < longest:
        inside = position[shift:] >= shift  # [K - shift] the one `shift` back is its segment's
        raised = np.maximum(values[shift:], values[:-shift])  # both before this pass
        values[shift:] = np.where(inside, raised, values[shift:])
        shift *= 2


def andes_qoe_grouped(times_s: NDArray[np.float64],  # [K]
                      offsets: NDArray[np.int64],  # [N + 1]
                      arrival_s: NDArray[np.float64],  # [N]
                      targets: QoETargets) -> NDArray[np.float64]:  # [N]
    """Every request's QoE (the module docstring's formula), NaN for one without tokens.

    Args:
      times_s: `[K]` every token's time on the run's clock, grouped by request (request
        r's are `times_s[offsets[r]:offsets[r + 1]]`), each request's in time order.
      offsets: `[N + 1]` where each request's tokens start, ascending; `offsets[N] = K`.
      arrival_s: `[N]` each request's arrival on the same clock.
      targets: the expected TTFT and TDS.
    """
    n = int(arrival_s.shape[0])
    gap = 1.0 / targets.tokens_per_s
    qoe = np.full(n, np.nan)
    start = 0
    while start < n:
        # Requests [start, stop) whose tokens fit a chunk (at least one request).
        stop = int(np.searchsorted(offsets, offsets[start] + CHUNK_TOKENS, side="right")) - 1
        stop = min(max(stop, start + 1), n)
        first, last = int(offsets[start]), int(offsets[stop])
        counts = np.diff(offsets[start:stop + 1])  # [c] tokens of each request
        has = counts > 0
        if has.any():
            starts = offsets[start:stop][has] - first  # [h] its first token in the chunk
            owner = np.repeat(np.arange(start, stop), counts)  # [k] each token's request
            position = np.arange(last - first) - np.repeat(offsets[start:stop] - first,
                                                           counts)  # [k] i - 1
            expected = targets.ttft_s + position * gap  # [k] e_i, seconds since arrival
            # D_i: the largest lateness of tokens 1..i (0 when none was late).
            delay = np.maximum(times_s[first:last] - arrival_s[owner] - expected, 0.0)
            _segmented_cummax(delay, position)
            length = counts[has].astype(np.float64)  # [h] l
            final = delay[starts + counts[has] - 1]  # [h] D_l
            base = gap * length * (length - 1) / 2 + length * final  # [h] S_expected
            digested = base - np.add.reduceat(delay, starts)  # [h] S_actual
            # S_expected is 0 only for one token on time (then S_actual is 0 too): QoE 1.
            safe = np.where(base > 0, base, 1.0)
            qoe[start:stop][has] = np.where(base > 0, digested / safe, 1.0)
        start = stop
    return qoe


def andes_qoe(times_s: NDArray[np.float64], arrival_s: float,  # [l]
              targets: QoETargets = QoETargets()) -> float:
    """One request's QoE from its tokens' times (`andes_qoe_grouped` of one request).

    Args:
      times_s: `[l]` its tokens' times, in order, on the clock of `arrival_s`.
      arrival_s: its arrival.
      targets: the expected TTFT and TDS.

    Returns:
      QoE in [0, 1]; NaN without tokens.

    Raises:
      ValueError: the times go backwards.
    """
    times = np.asarray(times_s, dtype=np.float64).ravel()
    if np.any(np.diff(times) < 0):
        raise ValueError(f"andes_qoe: token times must be in time order, got {times.tolist()}")
    return float(andes_qoe_grouped(times, np.array([0, times.size]),
                                   np.array([arrival_s], dtype=np.float64), targets)[0])


@dataclasses.dataclass(frozen=True, eq=False)
class TokenTimes:
    """A run's token times grouped by request, and each finished request's QoE.

    Attributes:
      times_s: `[K]` every token's time, request by request, each request's in order.
      offsets: `[N + 1]` where each request's tokens start in `times_s`.
      qoe: `[N]` each finished request's QoE; NaN for the rest.
      targets: the expected TTFT and TDS the QoE was computed for.
    """

    times_s: NDArray[np.float64]
    offsets: NDArray[np.int64]
    qoe: NDArray[np.float64]
    targets: QoETargets

    @classmethod
    def from_log(cls, token_req: NDArray[np.int64],  # [K]
                 token_time_s: NDArray[np.float64],  # [K]
                 arrival_s: NDArray[np.float64],  # [N]
                 finished: NDArray[np.bool_],  # [N]
                 targets: QoETargets) -> TokenTimes:
        """Groups a run's token log (in time order) by request and computes the QoE.

        A stable sort by request keeps each request's tokens in time order.
        """
        order = np.argsort(token_req, kind="stable")  # [K]
        times = token_time_s[order]
        del order
        counts = np.bincount(token_req, minlength=arrival_s.shape[0])  # [N]
        offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        qoe = andes_qoe_grouped(times, offsets, arrival_s, targets)
        qoe[~finished] = np.nan
        return cls(times_s=times, offsets=offsets, qoe=qoe, targets=targets)

    def of(self, i: int) -> NDArray[np.float64]:
        """`[l]` request `i`'s token times."""
        return self.times_s[self.offsets[i]:self.offsets[i + 1]]

    def summary(self) -> dict[str, Any]:
        """summary.json's QoE fields, over the finished requests: `qoe_mean`, `qoe_p10`,
        `qoe_p50`, `qoe_attainment` (the share with QoE >= `QOE_ACCEPTABLE`), and the
        targets (`qoe_ttft_s`, `qoe_tokens_per_s`); None where no request finished."""
        values = self.qoe[~np.isnan(self.qoe)]
        some = values.size > 0
        return {"qoe_mean": float(values.mean()) if some else None,
                "qoe_p10": float(np.percentile(values, 10)) if some else None,
                "qoe_p50": float(np.percentile(values, 50)) if some else None,
                "qoe_attainment": (float((values >= QOE_ACCEPTABLE).mean()) if some
                                   else None),
                "qoe_ttft_s": self.targets.ttft_s,
                "qoe_tokens_per_s": self.targets.tokens_per_s}


def row_fields(token_times: Optional[TokenTimes], i: int) -> dict[str, Any]:
    """Request `i`'s requests.jsonl fields of the token times: `token_times` (its tokens'
    times) and `qoe` (None unless it finished); none without token times."""
    if token_times is None:
        return {}
    qoe = token_times.qoe[i]
    return {"token_times": token_times.of(i).tolist(),
            "qoe": None if np.isnan(qoe) else float(qoe)}
