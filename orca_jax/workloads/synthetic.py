"""Synthetic workloads: length distributions, arrival processes, seeded requests.

Length distributions come from spec strings, the values of CLI flags:

  * `fixed:N`: every length is N.
  * `uniform:LO:HI`: integers in [LO, HI], both ends included.
  * `lognormal:MEAN:SIGMA`: MEAN is the mean of the lengths themselves (not of
    the underlying normal) and SIGMA the standard deviation of the underlying
    normal, so `mu = ln(MEAN) - SIGMA**2 / 2`. Samples are rounded to the
    nearest integer and raised to 1, which moves the mean by well under a token
    unless MEAN is near 1.
  * `zipf:A:MAX`: P(k) proportional to k**-A on 1..MAX (A > 1).
  * `empirical:PATH[:COLUMN]`: values drawn with replacement from one column of
    a CSV or JSON Lines file (e.g. Vidur's `num_prefill_tokens`); without
    COLUMN the caller's default column is used.

Arrival processes: `burst` (every request at t=0), `poisson` (exponential gaps
at `rate` req/s) and `gamma` (gamma gaps with mean 1/rate and coefficient of
variation `cv`; cv=1 is Poisson, cv>1 burstier). The first request arrives at
t=0 in every process.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Optional, Protocol, Sequence, Union, runtime_checkable

import numpy as np
from numpy.typing import NDArray

from orca_jax.core.requests.request import Request, length_only_requests
from orca_jax.workloads.trace_records import MAX_LENGTH
from orca_jax.workloads.traces import TraceError, load_length_column

ARRIVAL_PROCESSES = ("burst", "poisson", "gamma")
MAX_ZIPF_SUPPORT = 10_000_000  # the CDF table is MAX entries long


def _fmt(x: float) -> str:
    """Shortest text that parses back to `x` (so a spec round-trips)."""
    text = repr(float(x))
    return text[:-2] if text.endswith(".0") else text


_SPEC_FORMS = ("fixed:N, uniform:LO:HI, lognormal:MEAN:SIGMA, zipf:A:MAX, "
               "empirical:PATH[:COLUMN]")


@runtime_checkable
class LengthDistribution(Protocol):
    """A distribution of token counts (every sample >= 1)."""

    def sample(self, rng: np.random.Generator, n: int) -> NDArray[np.int64]:
        """Draws `[n]` int64 lengths, each >= 1."""

    @property
    def spec(self) -> str:
        """The spec string that `parse_length_spec` turns back into this distribution."""


@dataclasses.dataclass(frozen=True)
class FixedLength:
    """Every length is `value`."""

    value: int

    def __post_init__(self) -> None:
        if not 1 <= self.value <= MAX_LENGTH:
            raise ValueError(f"length spec {self.spec!r}: expected fixed:N with N >= 1 "
                             f"(at most {MAX_LENGTH})")

    def sample(self, rng: np.random.Generator, n: int) -> NDArray[np.int64]:
        return np.full(n, self.value, dtype=np.int64)  # [n]

    @property
    def spec(self) -> str:
        return f"fixed:{self.value}"


@dataclasses.dataclass(frozen=True)
class UniformLength:
    """Integers drawn uniformly from [low, high], both ends included."""

    low: int
    high: int

    def __post_init__(self) -> None:
        if not 1 <= self.low <= self.high <= MAX_LENGTH:
            raise ValueError(f"length spec {self.spec!r}: expected uniform:LO:HI with "
                             f"integers 1 <= LO <= HI <= {MAX_LENGTH}")

    def sample(self, rng: np.random.Generator, n: int) -> NDArray[np.int64]:
        return rng.integers(self.low, self.high, size=n, endpoint=True, dtype=np.int64)

    @property
    def spec(self) -> str:
        return f"uniform:{self.low}:{self.high}"


@dataclasses.dataclass(frozen=True)
class LognormalLength:
    """Lognormal lengths with mean `mean`; `sigma` is the underlying normal's sigma."""

    mean: float
    sigma: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.mean) and 1 <= self.mean <= MAX_LENGTH
                and math.isfinite(self.sigma) and self.sigma >= 0):
            raise ValueError(f"length spec {self.spec!r}: expected lognormal:MEAN:SIGMA with "
                             f"1 <= MEAN <= {MAX_LENGTH} (the mean length) and SIGMA >= 0")

    def sample(self, rng: np.random.Generator, n: int) -> NDArray[np.int64]:
        mu = math.log(self.mean) - self.sigma**2 / 2  # E[exp(N(mu, s^2))] = exp(mu + s^2/2)
        values = np.rint(rng.lognormal(mu, self.sigma, size=n))  # [n]
        # A heavy tail may draw past what an int64 holds; no request is longer than MAX_LENGTH.
        return np.clip(values, 1, MAX_LENGTH).astype(np.int64)

    @property
    def spec(self) -> str:
        return f"lognormal:{_fmt(self.mean)}:{_fmt(self.sigma)}"


@dataclasses.dataclass(frozen=True)
class ZipfLength:
    """Zipf lengths, P(k) proportional to k**-exponent, truncated to 1..max_value."""

    exponent: float
    max_value: int

    def __post_init__(self) -> None:
        if not (math.isfinite(self.exponent) and self.exponent > 1
                and 1 <= self.max_value <= MAX_ZIPF_SUPPORT):
            raise ValueError(f"length spec {self.spec!r}: expected zipf:A:MAX with A > 1 and "
                             f"1 <= MAX <= {MAX_ZIPF_SUPPORT}")

    def sample(self, rng: np.random.Generator, n: int) -> NDArray[np.int64]:
        # Inverse CDF on the finite support: exact truncation, no rejection loop.
        support = np.arange(1, self.max_value + 1, dtype=np.float64)  # [MAX]
        cdf = np.cumsum(support**-self.exponent)  # [MAX]
        cdf /= cdf[-1]
        index = np.searchsorted(cdf, rng.random(n), side="right")  # [n]
        return np.minimum(index, self.max_value - 1).astype(np.int64) + 1

    @property
    def spec(self) -> str:
        return f"zipf:{_fmt(self.exponent)}:{self.max_value}"


@dataclasses.dataclass(frozen=True)
class EmpiricalLength:
    """Lengths drawn with replacement from `values`, one column of a file."""

    path: str
    column: str
    values: NDArray[np.int64] = dataclasses.field(repr=False, compare=False)  # [num_rows]

    @classmethod
    def from_file(cls, path: Union[str, Path], column: str) -> "EmpiricalLength":
        """Reads `column` of a CSV/JSONL file (see `traces.load_length_column`)."""
        values = load_length_column(path, column)
        values.setflags(write=False)
        return cls(path=str(path), column=column, values=values)

    def sample(self, rng: np.random.Generator, n: int) -> NDArray[np.int64]:
        return self.values[rng.integers(0, len(self.values), size=n)]  # [n]

    @property
    def spec(self) -> str:
        return f"empirical:{self.path}:{self.column}"


def _spec_error(spec: str, expected: str) -> ValueError:
    return ValueError(f"length spec {spec!r}: expected {expected} "
                      f"(one of {_SPEC_FORMS})")


def _number(spec: str, text: str, expected: str, integer: bool) -> float:
    try:
        return int(text) if integer else float(text)
    except ValueError:
        raise _spec_error(spec, expected) from None


def _build(spec: str, expected: str, cls: type, *args: float) -> LengthDistribution:
    # Re-raise range errors under the user's spec text, not the canonical one.
    try:
        return cls(*args)
    except ValueError:
        raise _spec_error(spec, expected) from None


def parse_length_spec(spec: str, default_column: Optional[str] = None) -> LengthDistribution:
    """Parses a length-distribution spec string (see the module docstring).

    Args:
      spec: e.g. `uniform:16:512`, `lognormal:1000:0.8`,
        `empirical:traces/conv.csv:num_decode_tokens`.
      default_column: the column an `empirical:PATH` spec without a column reads
        (the caller knows whether it wants prompt or output lengths).

    Returns:
      The distribution.

    Raises:
      ValueError: a malformed spec, naming it and the expected forms. An
        empirical spec whose file is bad raises `traces.TraceError`.
    """
    kind, _, rest = spec.strip().partition(":")
    args = rest.split(":")
    if kind == "fixed":
        expected = f"fixed:N with an integer N >= 1 (at most {MAX_LENGTH})"
        if len(args) != 1:
            raise _spec_error(spec, expected)
        return _build(spec, expected, FixedLength, int(_number(spec, args[0], expected, True)))
    if kind == "uniform":
        expected = f"uniform:LO:HI with integers 1 <= LO <= HI <= {MAX_LENGTH}"
        if len(args) != 2:
            raise _spec_error(spec, expected)
        low, high = (int(_number(spec, a, expected, True)) for a in args)
        return _build(spec, expected, UniformLength, low, high)
    if kind == "lognormal":
        expected = (f"lognormal:MEAN:SIGMA with 1 <= MEAN <= {MAX_LENGTH} (the mean length) and "
                    "SIGMA >= 0")
        if len(args) != 2:
            raise _spec_error(spec, expected)
        mean, sigma = (_number(spec, a, expected, False) for a in args)
        return _build(spec, expected, LognormalLength, mean, sigma)
    if kind == "zipf":
        expected = f"zipf:A:MAX with a number A > 1 and an integer 1 <= MAX <= {MAX_ZIPF_SUPPORT}"
        if len(args) != 2:
            raise _spec_error(spec, expected)
        return _build(spec, expected, ZipfLength, _number(spec, args[0], expected, False),
                      int(_number(spec, args[1], expected, True)))
    if kind == "empirical":
        if not rest:
            raise _spec_error(spec, "empirical:PATH[:COLUMN]")
        path, column = rest, default_column
        # A path may itself hold ':'; only split off a column when the whole is no file.
        if not Path(rest).is_file() and ":" in rest:
            path, column = rest.rsplit(":", 1)
        if not Path(path).is_file():
            raise ValueError(f"length spec {spec!r}: no such file {path!r} "
                             f"(expected empirical:PATH[:COLUMN])")
        if not column:
            raise _spec_error(spec, "empirical:PATH:COLUMN (no default column here)")
        try:
            return EmpiricalLength.from_file(path, column)
        except TraceError as e:
            raise TraceError(f"length spec {spec!r}: {e}") from e
    raise _spec_error(spec, "a known distribution")


def arrival_times(process: str, num_requests: int, rng: np.random.Generator,
                  rate: Optional[float] = None, cv: float = 1.0) -> NDArray[np.float64]:
    """Draws sorted arrival times in seconds; the first is always 0.

    Gaps are drawn standardized (mean 1) and divided by `rate`, so with one
    seed a higher rate gives the same arrivals compressed in time.

    Args:
      process: `burst`, `poisson` or `gamma`.
      num_requests: number of arrivals (>= 1).
      rng: the arrival stream's generator.
      rate: requests per second (> 0; ignored by `burst`).
      cv: coefficient of variation of the gaps (> 0; `gamma` only).

    Returns:
      `[num_requests]` float64 non-decreasing arrival times.
    """
    if process not in ARRIVAL_PROCESSES:
        raise ValueError(f"arrival process {process!r}: expected one of "
                         f"{', '.join(ARRIVAL_PROCESSES)}")
    if isinstance(num_requests, bool) or int(num_requests) != num_requests or num_requests < 1:
        raise ValueError(f"num_requests must be an integer >= 1, got {num_requests!r}")
    if not (isinstance(cv, (int, float)) and math.isfinite(cv) and cv > 0):
        raise ValueError(f"arrival process {process!r}: cv must be a finite number > 0, "
                         f"got {cv!r}")
    if process == "burst":
        return np.zeros(num_requests, dtype=np.float64)
    if rate is None or not (math.isfinite(rate) and rate > 0):
        raise ValueError(f"arrival process {process!r}: rate must be a finite number > 0 "
                         f"(requests per second), got {rate!r}")
    if process == "poisson":
        gaps = rng.standard_exponential(num_requests - 1)  # [N-1], mean 1
    else:
        shape = 1.0 / cv**2  # gamma(k, 1/k) has mean 1 and cv 1/sqrt(k)
        gaps = rng.standard_gamma(shape, num_requests - 1) / shape  # [N-1]
    return np.concatenate([[0.0], np.cumsum(gaps / rate)])


def as_distribution(value: Union[LengthDistribution, str], default_column: str,
                    what: str) -> LengthDistribution:
    """A distribution as is, or parsed from its spec string; `what` names it in errors."""
    if isinstance(value, str):
        return parse_length_spec(value, default_column=default_column)
    if not isinstance(value, LengthDistribution):
        raise TypeError(f"{what}: expected a LengthDistribution or a spec string "
                        f"({_SPEC_FORMS}), got {type(value).__name__}")
    return value


def random_tokens(rng: np.random.Generator, num_tokens: int,
                  vocab_size: int) -> NDArray[np.int32]:
    """`[num_tokens]` random token ids in [1, vocab_size)."""
    # Id 0 is left out: it is the padding token of the packed step.
    return rng.integers(1, vocab_size, size=num_tokens, dtype=np.int32)


def check_vocab_size(vocab_size: int) -> None:
    """Fails unless `vocab_size` is an integer >= 2 (id 0 is padding)."""
    if isinstance(vocab_size, bool) or int(vocab_size) != vocab_size or vocab_size < 2:
        raise ValueError(f"vocab_size must be an integer >= 2, got {vocab_size!r}")


def check_seed(seed: int) -> None:
    """Fails unless `seed` is a non-negative integer."""
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")


def synthetic_workload(*, num_requests: int, arrival: str, rate: Optional[float],
                       cv: float = 1.0, prompt_len: Union[LengthDistribution, str],
                       output_len: Union[LengthDistribution, str], seed: int,
                       vocab_size: Optional[int] = None,
                       max_total_len: Optional[int] = None,
                       context: Optional[int] = None) -> list[Request]:
    """Builds a seeded synthetic workload.

    Arrivals, prompt lengths, output lengths and token ids each use their own
    stream spawned from `seed`, so changing the rate or the arrival process
    leaves the lengths (and the tokens) as they were.

    Args:
      num_requests: number of requests (>= 1).
      arrival: `burst`, `poisson` or `gamma`.
      rate: requests per second (> 0) for `poisson` and `gamma`; None for `burst`.
      cv: coefficient of variation of the gaps for `gamma` (> 0).
      prompt_len: distribution or spec string; `empirical:PATH` reads the
        prompt column (`prompt_len` or `num_prefill_tokens`).
      output_len: as `prompt_len`; `empirical:PATH` reads `output_len` or
        `num_decode_tokens`.
      seed: non-negative integer; the same seed gives the same workload bit for bit.
      vocab_size: if given, each request gets random prompt token ids in
        [1, vocab_size).
      max_total_len: if given, each request is clipped to fit: the prompt to at
        most `max_total_len - 1` tokens, then the output to what is left.
      context: the run's context limit, if known: a request whose prompt and output
        exceed it gets `placeholder_tokens` instead of drawn ids (see there).

    Returns:
      The requests in arrival order, with ids 0..N-1.
    """
    check_seed(seed)
    if max_total_len is not None and (int(max_total_len) != max_total_len or max_total_len < 2):
        raise ValueError(f"max_total_len must be an integer >= 2 (one prompt and one output "
                         f"token), got {max_total_len!r}")
    if vocab_size is not None:
        check_vocab_size(vocab_size)
    prompt_dist = as_distribution(prompt_len, "prompt_len", "prompt_len")
    output_dist = as_distribution(output_len, "output_len", "output_len")
    arrival_seq, prompt_seq, output_seq, token_seq = np.random.SeedSequence(int(seed)).spawn(4)
    arrivals = arrival_times(arrival, num_requests, np.random.default_rng(arrival_seq),
                             rate=rate, cv=cv)  # [N]
    prompt_lens = prompt_dist.sample(np.random.default_rng(prompt_seq), num_requests)  # [N]
    output_lens = output_dist.sample(np.random.default_rng(output_seq), num_requests)  # [N]
    if max_total_len is not None:
        prompt_lens = np.minimum(prompt_lens, max_total_len - 1)
        output_lens = np.minimum(output_lens, max_total_len - prompt_lens)
    if vocab_size is None:  # lengths only (the simulator's): made whole
        return length_only_requests(arrivals, prompt_lens, output_lens)
    token_rng = np.random.default_rng(token_seq)
    requests = []
    # Python numbers, not a numpy scalar per field and request (the same values).
    arrival_list, prompt_list = arrivals.tolist(), prompt_lens.tolist()
    output_list = output_lens.tolist()
    for i in range(num_requests):
        tokens = None
        if vocab_size is not None:
            fits = context is None or prompt_list[i] + output_list[i] <= context
            tokens = (random_tokens(token_rng, int(prompt_list[i]), int(vocab_size)) if fits
                      else placeholder_tokens(int(prompt_list[i])))
        requests.append(Request(id=i, arrival_s=float(arrival_list[i]),
                                prompt_len=int(prompt_list[i]),
                                output_len=int(output_list[i]), prompt_tokens=tokens))
    return requests


def placeholder_tokens(num_tokens: int) -> NDArray[np.int32]:
    """`[num_tokens]` ids for a prompt that no step will read: one id, broadcast.

    A request longer than the context is rejected by the scheduler before any
    step, so its ids are never read; drawing them would allocate 4 bytes per
    token first (7.45 GiB for a prompt of 2e9 tokens). The broadcast view takes
    no memory whatever its length.
    """
    return np.broadcast_to(np.int32(1), (num_tokens,))


def with_prompt_tokens(requests: Sequence[Request], vocab_size: int,
                       seed: int, context: Optional[int] = None) -> list[Request]:
    """Gives random prompt token ids to requests that have only a length.

    A request's ids depend only on `(seed, request.id)`, so subsampling or
    reordering a trace does not change the prompts of the requests kept.

    Args:
      requests: e.g. loaded from a trace; requests that already have
        `prompt_tokens` are returned unchanged.
      vocab_size: ids are drawn from [1, vocab_size).
      seed: non-negative integer.
      context: the run's context limit, if known: a request whose prompt and output
        exceed it gets `placeholder_tokens`.

    Returns:
      New requests, in the given order.
    """
    check_vocab_size(vocab_size)
    check_seed(seed)
    result = []
    for r in requests:
        if r.prompt_tokens is not None:
            result.append(r)
            continue
        if context is not None and r.total_len > context:
            result.append(dataclasses.replace(r, prompt_tokens=placeholder_tokens(r.prompt_len)))
            continue
        # Fixed-width spawn key (two uint32 words of the id folded into uint64), so
        # no two (seed, id) pairs share a stream.
        key = int(r.id) % 2**64
        rng = np.random.default_rng(np.random.SeedSequence(
            int(seed), spawn_key=(key & 0xFFFFFFFF, key >> 32)))
        tokens = random_tokens(rng, r.prompt_len, int(vocab_size))
        result.append(dataclasses.replace(r, prompt_tokens=tokens))
    return result
