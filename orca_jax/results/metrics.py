"""Serving metrics from a run's timestamps: per request, per run, and a text table.

Pure numpy over arrays, so any run (simulated or real, any policy) is measured
the same way. Inputs, for N requests and K generated tokens:

* `arrival_s`, `first_scheduled_s`, `first_token_s`, `finish_s`: `[N]` seconds,
  NaN where the event did not happen (a rejected request, an unfinished one).
* `output_len`: `[N]` tokens the request generates (its target length).
* `token_req`, `token_time_s`: `[K]` the request index (0..N-1) and the time of
  every generated token, in time order; or, for a run summary, the same tokens
  counted as `TokenStats` (`orca_jax.core.requests.token_stats`: a few bytes a
  request instead of 16 a token).

Per-request values that need the request's end (latency, TPOT, normalized
latency, max inter-token gap) are NaN until it finishes; run summaries use
finished requests only.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import numpy as np
from numpy.typing import ArrayLike, NDArray

from orca_jax.core.requests.token_stats import TokenStats, check_token_log

PERCENTILES = (50, 90, 99)


def _token_log(token_req: ArrayLike,
               token_time_s: ArrayLike) -> tuple[NDArray[np.int64], NDArray[np.float64]]:
    """The token log as arrays (no copy of arrays already so), checked chunk by chunk."""
    return check_token_log(np.asarray(token_req), np.asarray(token_time_s))


def _gaps_by_request(token_req: ArrayLike,
                     token_time_s: ArrayLike) -> tuple[NDArray[np.int64], NDArray[np.float64]]:
    req, times = _token_log(token_req, token_time_s)
    # A stable sort by request keeps each request's tokens in time order.
    order = np.argsort(req, kind="stable")
    req, times = req[order], times[order]
    same = req[1:] == req[:-1]
    return req[1:][same], np.diff(times)[same]


def inter_token_gaps(token_req: ArrayLike, token_time_s: ArrayLike) -> NDArray[np.float64]:
    """All gaps between consecutive tokens of the same request, grouped by request.

    Args:
      token_req: `[K]` request index of each generated token.
      token_time_s: `[K]` time each token was produced, non-decreasing.

    Returns:
      `[K - number of requests with tokens]` gaps, request by request (index
      order), each request's gaps in time order.
    """
    return _gaps_by_request(token_req, token_time_s)[1]


def inter_token_gaps_by_request(
        token_req: ArrayLike,
        token_time_s: ArrayLike) -> tuple[NDArray[np.int64], NDArray[np.float64]]:
    """Like `inter_token_gaps`, with the request index of each gap: `([G], [G])`."""
    return _gaps_by_request(token_req, token_time_s)


def request_metrics(arrival_s: ArrayLike, first_scheduled_s: ArrayLike, first_token_s: ArrayLike,
                    finish_s: ArrayLike, output_len: ArrayLike, token_req: Optional[ArrayLike],
                    token_time_s: Optional[ArrayLike], *,
                    token_stats: Optional[TokenStats] = None) -> dict[str, NDArray[np.float64]]:
    """Per-request latencies, each `[N]` float64 (NaN where not applicable).

    Args:
      arrival_s: `[N]` arrival times.
      first_scheduled_s: `[N]` time of the request's first step (NaN if never run).
      first_token_s: `[N]` time of its first generated token.
      finish_s: `[N]` time of its last token (NaN if rejected or unfinished).
      output_len: `[N]` output tokens.
      token_req: `[K]` request index of every generated token.
      token_time_s: `[K]` time of every generated token, in time order.
      token_stats: the run's tokens as `TokenStats`, instead of the token log (then
        None: a run that counted its tokens, `RunResult.token_stats`).

    Returns:
      `queueing_delay_s` (first scheduled - arrival), `ttft_s` (first token -
      arrival), `latency_s` (finish - arrival), `tpot_s` ((last token - first
      token) / (output_len - 1); NaN for one-token outputs), `normalized_latency_s`
      (latency / output_len), `max_itl_s` (largest gap between consecutive tokens;
      NaN with fewer than two tokens), `num_tokens` (tokens in the log).
    """
    arrays = _request_arrays(arrival_s, first_scheduled_s, first_token_s, finish_s, output_len)
    return _request_metrics(arrays, _stats(arrays, token_req, token_time_s, token_stats,
                                           gaps=False))


def _stats(arrays: dict[str, NDArray[np.float64]], token_req: Optional[ArrayLike],
           token_time_s: Optional[ArrayLike], token_stats: Optional[TokenStats], *,
           gaps: bool) -> TokenStats:
    """`token_stats`, or those of the token log (`gaps`: with the finished requests' gaps)."""
    if token_stats is not None:
        n = arrays["arrival_s"].shape[0]
        if token_stats.num_tokens.shape != (n,):
            raise ValueError(f"token_stats are of {token_stats.num_tokens.shape[0]} requests, "
                             f"arrival_s of {n}")
        return token_stats
    if token_req is None or token_time_s is None:
        raise ValueError("the metrics need the token log (token_req, token_time_s) or "
                         "token_stats")
    return TokenStats.from_log(np.asarray(token_req), np.asarray(token_time_s),
                               np.isfinite(arrays["finish_s"]), gaps=gaps)


def _request_arrays(arrival_s: ArrayLike, first_scheduled_s: ArrayLike,
                    first_token_s: ArrayLike, finish_s: ArrayLike,
                    output_len: ArrayLike) -> dict[str, NDArray[np.float64]]:
    """The `[N]` per-request inputs as float64 arrays by name, checked for shape."""
    arrays = {name: np.asarray(value, dtype=np.float64) for name, value in
              (("arrival_s", arrival_s), ("first_scheduled_s", first_scheduled_s),
               ("first_token_s", first_token_s), ("finish_s", finish_s),
               ("output_len", output_len))}
    n = arrays["arrival_s"].shape[0]
    for name, value in arrays.items():
        if value.shape != (n,):
            raise ValueError(f"{name} has shape {value.shape}, expected ({n},) like arrival_s")
    return arrays


def _request_metrics(arrays: dict[str, NDArray[np.float64]],
                     stats: TokenStats) -> dict[str, NDArray[np.float64]]:
    """`request_metrics` of checked `[N]` arrays (by their argument names) and the run's
    token stats."""
    arrival, finish, out_len = arrays["arrival_s"], arrays["finish_s"], arrays["output_len"]
    finished = np.isfinite(finish)
    last_token = stats.last_token_s
    max_itl = stats.max_gap_s.copy()
    with np.errstate(invalid="ignore", divide="ignore"):
        tpot = (last_token - arrays["first_token_s"]) / (out_len - 1)
        latency = finish - arrival
        normalized = latency / out_len
    tpot[~finished | (out_len <= 1) | ~np.isfinite(last_token)] = np.nan
    max_itl[~finished | ~np.isfinite(max_itl)] = np.nan
    return {
        "queueing_delay_s": arrays["first_scheduled_s"] - arrival,
        "ttft_s": arrays["first_token_s"] - arrival,
        "latency_s": latency,
        "tpot_s": tpot,
        "normalized_latency_s": normalized,
        "max_itl_s": max_itl,
        "num_tokens": stats.num_tokens.astype(np.float64),
    }


def _finite(values: NDArray[np.float64]) -> NDArray[np.float64]:
    return values[np.isfinite(values)]


def _float_or_none(value: float) -> Optional[float]:
    value = float(value)
    return value if math.isfinite(value) else None


def _percentile(values: NDArray[np.float64], p: float) -> Optional[float]:
    values = _finite(values)
    return float(np.percentile(values, p)) if values.size else None


def _percentiles(prefix: str, values: NDArray[np.float64]) -> dict[str, Optional[float]]:
    return {f"{prefix}_p{p}_s": _percentile(values, p) for p in PERCENTILES}


def _mean(values: NDArray[np.float64]) -> Optional[float]:
    values = _finite(values)
    return float(values.mean()) if values.size else None


def jain_index(values: ArrayLike) -> Optional[float]:
    """Jain's fairness index `(sum x)^2 / (n sum x^2)`: 1 when all equal, 1/n at worst.

    Args:
      values: `[n]` non-negative amounts (one per tenant).

    Returns:
      The index, or None when there are no values or all are zero.
    """
    x = np.asarray(values, dtype=np.float64)
    denominator = x.size * float(np.sum(x * x))
    return float(np.sum(x)) ** 2 / denominator if denominator > 0 else None


def run_summary(arrival_s: ArrayLike, first_scheduled_s: ArrayLike, first_token_s: ArrayLike,
                finish_s: ArrayLike, output_len: ArrayLike, token_req: Optional[ArrayLike],
                token_time_s: Optional[ArrayLike], *, token_stats: Optional[TokenStats] = None,
                rejected: Optional[ArrayLike] = None,
                tenants: Optional[Sequence[Any]] = None, ttft_slo_s: Optional[float] = None,
                tpot_slo_s: Optional[float] = None,
                prompt_len: Optional[ArrayLike] = None) -> dict[str, Any]:
    """One run's summary, JSON-ready (plain floats and ints; None where undefined).

    The run's duration is the span from the first arrival (of any request) to
    the last finish; throughput is finished requests (`throughput_req_s`), their
    output tokens (`output_tok_s`) and their prompt and output tokens together
    (`total_tok_s`, with `prompt_len`; None without it) per second of it.
    `offered_req_s` is the rate the requests arrived at, (N - 1) over the span of their
    arrivals; `served_req_s` the rate they finished at, (finished - 1) over the span of
    their finishes (None with fewer than two, or a span of 0). An engine that keeps up
    finishes requests at the rate they come: its finish span is the arrival span give or
    take the difference of two requests' latencies, where `throughput_req_s` would also
    count the first request's latency and the last one's drain.
    `throughput_tok_s` is `output_tok_s` under its old name, kept for one release.
    Percentiles (linear interpolation) and means are over finished requests; TPOT
    skips one-token outputs. `itl_p99_s` is the p99 of every inter-token gap of
    finished requests, `max_itl_p99_s` the p99 of each finished request's largest
    gap.

    Goodput (when an SLO is given): finished requests whose TTFT <= `ttft_slo_s`
    and TPOT <= `tpot_slo_s` (each if given; a one-token output meets any TPOT
    SLO), per second; `slo_attainment` is their share of all requests.

    Fairness (when `tenants` is given): per tenant, requests, finished requests,
    tokens served (generated tokens, finished or not) and mean normalized
    latency; `fairness_jain_tokens` is Jain's index over tenants' tokens served
    (the service share that fair schedulers such as VTC equalise between
    backlogged tenants), `fairness_jain_normalized_latency` over their mean
    normalized latency (equal slowdown).

    Args:
      arrival_s, first_scheduled_s, first_token_s, finish_s, output_len,
        token_req, token_time_s: as in `request_metrics`; the token log may be None
        when `token_stats` is given.
      token_stats: the run's tokens as `TokenStats` (its gaps those of the requests with
        a finite `finish_s`), instead of the token log (a run that counted its tokens).
      rejected: `[N]` bool, requests rejected up front (default: none).
      tenants: `[N]` tenant of each request (any hashable; written as str).
      ttft_slo_s: TTFT SLO in seconds, or None.
      tpot_slo_s: TPOT SLO in seconds, or None.
      prompt_len: `[N]` prompt tokens of each request, for `total_tok_s`.
    """
    arrays = _request_arrays(arrival_s, first_scheduled_s, first_token_s, finish_s, output_len)
    token_stats = _stats(arrays, token_req, token_time_s, token_stats, gaps=True)
    per_request = _request_metrics(arrays, token_stats)
    arrival = np.asarray(arrival_s, dtype=np.float64)
    finish = np.asarray(finish_s, dtype=np.float64)
    out_len = np.asarray(output_len, dtype=np.float64)
    n = arrival.shape[0]
    finished = np.isfinite(finish)
    if rejected is None:
        rejected_mask = np.zeros(n, dtype=bool)
    else:
        rejected_mask = np.asarray(rejected, dtype=bool)
        if rejected_mask.shape != (n,):
            raise ValueError(f"rejected has shape {rejected_mask.shape}, expected ({n},)")
    num_finished = int(finished.sum())
    duration = (float(finish[finished].max() - np.nanmin(arrival)) if num_finished else math.nan)
    has_duration = math.isfinite(duration) and duration > 0

    def rate(count: float) -> Optional[float]:
        return count / duration if has_duration else None

    done = {name: values[finished] for name, values in per_request.items()}
    summary: dict[str, Any] = {
        "num_requests": int(n),
        "num_finished": num_finished,
        "num_rejected": int(rejected_mask.sum()),
        "num_unfinished": int(n - num_finished - int((rejected_mask & ~finished).sum())),
        "duration_s": _float_or_none(duration),
        "throughput_req_s": rate(num_finished),
        "output_tok_s": rate(float(out_len[finished].sum())),
        "offered_req_s": _rate_over_span(arrival),
        "served_req_s": _rate_over_span(finish[finished]),
        "total_tok_s": (None if prompt_len is None else rate(float(
            out_len[finished].sum() + np.asarray(prompt_len, np.float64)[finished].sum()))),
        # The old name of `output_tok_s` (deprecated: one release, then gone).
        "throughput_tok_s": rate(float(out_len[finished].sum())),
        **_percentiles("ttft", done["ttft_s"]),
        **_percentiles("tpot", done["tpot_s"]),
        **_percentiles("latency", done["latency_s"]),
        "normalized_latency_mean_s": _mean(done["normalized_latency_s"]),
        "queueing_delay_mean_s": _mean(done["queueing_delay_s"]),
    }
    summary["itl_p99_s"] = _float_or_none(token_stats.gap_percentile(99))
    summary["max_itl_p99_s"] = _percentile(done["max_itl_s"], 99)

    if ttft_slo_s is not None or tpot_slo_s is not None:
        meets = finished.copy()
        if ttft_slo_s is not None:
            meets &= per_request["ttft_s"] <= ttft_slo_s
        if tpot_slo_s is not None:
            tpot = per_request["tpot_s"]
            meets &= np.isnan(tpot) | (tpot <= tpot_slo_s)
        summary["goodput_req_s"] = rate(int(meets.sum()))
        summary["slo_attainment"] = float(meets.sum()) / n if n else None

    if tenants is not None:
        summary.update(_tenant_summary(tenants, finished, per_request))
    return summary


def _rate_over_span(times: NDArray[np.float64]) -> Optional[float]:  # times: [N]
    """Events per second over the span of their times: (N - 1) / (last - first); None with
    fewer than two events or a span of 0."""
    if times.size < 2:
        return None
    span = float(times.max() - times.min())
    return (times.size - 1) / span if span > 0 else None


def _tenant_summary(tenants: Sequence[Any], finished: NDArray[np.bool_],
                    per_request: dict[str, NDArray[np.float64]]) -> dict[str, Any]:
    names = np.asarray([str(t) for t in tenants])
    if names.shape != finished.shape:
        raise ValueError(f"tenants has {names.shape[0]} entries, expected {finished.shape[0]}")
    tenant_names, tenant_of = np.unique(names, return_inverse=True)
    tokens = np.bincount(tenant_of, weights=per_request["num_tokens"],
                         minlength=tenant_names.size)
    per_tenant: dict[str, dict[str, Any]] = {}
    for t, name in enumerate(tenant_names):
        mine = tenant_of == t
        per_tenant[str(name)] = {
            "num_requests": int(mine.sum()),
            "num_finished": int((mine & finished).sum()),
            "tokens_served": int(tokens[t]),
            "normalized_latency_mean_s": _mean(
                per_request["normalized_latency_s"][mine & finished]),
        }
    latencies = [v["normalized_latency_mean_s"] for v in per_tenant.values()]
    return {
        "tenants": per_tenant,
        "fairness_jain_tokens": jain_index(tokens),
        "fairness_jain_normalized_latency": (
            jain_index(latencies) if all(v is not None for v in latencies) else None),
    }


def static_batching_ceiling(output_len: ArrayLike, batch_size: int) -> float:
    """The most any scheduler's decode throughput can exceed static batching's, at saturation.

    Static (request-level) batching runs batches of `batch_size` requests in
    arrival order, each for as many decode steps as its longest member; iteration-
    level scheduling at best keeps all `batch_size` slots busy, so it needs
    `sum(output_len) / batch_size` steps. Their ratio bounds the saturated
    throughput ratio when steps cost the same (prefill ignored). For outputs
    uniform on [1, L] it is about 2B / (B + 1), under 2 for every B.

    Args:
      output_len: `[N]` output tokens of each request, in arrival order (all >= 1).
      batch_size: requests per static batch, >= 1.

    Returns:
      Static's decode steps over the fully packed continuous-batching steps.
    """
    lens = np.asarray(output_len, dtype=np.int64)
    if lens.ndim != 1 or lens.size == 0 or (lens < 1).any():
        raise ValueError(f"output_len must be a non-empty 1-D array of lengths >= 1, got "
                         f"shape {lens.shape}" + (f" with min {lens.min()}" if lens.size else ""))
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    padded = np.pad(lens, (0, -lens.size % batch_size))  # zeros never set a batch's max
    static_steps = padded.reshape(-1, batch_size).max(axis=1).sum()
    return float(static_steps * batch_size / lens.sum())


def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    """A plain aligned text table, one row per dict (e.g. per policy).

    Numbers are right-aligned (floats with 4 significant digits), text
    left-aligned; a missing key or None prints as `-`.
    """
    def cell(value: Any) -> str:
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return "-"
        if isinstance(value, (float, np.floating)):
            return f"{float(value):.4g}"
        return str(value)

    cells = [[cell(row.get(column)) for column in columns] for row in rows]
    numeric = [all(isinstance(row.get(c), (int, float, np.number, type(None))) for row in rows)
               for c in columns]
    widths = [max([len(c)] + [len(r[j]) for r in cells]) for j, c in enumerate(columns)]

    def line(values: Sequence[str]) -> str:
        parts = [v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric)]
        return "  ".join(parts).rstrip()

    return "\n".join([line(columns), line(["-" * w for w in widths]), *map(line, cells)])
