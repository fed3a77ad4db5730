"""A workload's arrivals rescaled to a mean request rate.

One rule for every command: a trace given a rate (`run`/`compare --rate` with
`--workload=trace`, each point of `sweep --rates`) keeps its arrival pattern, its
times multiplied so its mean rate over its span is the rate. Agent programs: the
rate is of program starts, rescaled as `programs.rescale_starts` does (tool pauses
kept).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from orca_jax.core.requests.request import Request
from orca_jax.workloads.programs import rescale_starts


def mean_rate_scale(requests: Sequence[Request], rate: float, *, programs: bool = False
                    ) -> float:
    """The factor on arrival times that makes `requests`' mean rate `rate`: N - 1 gaps
    over the span from the first arrival to the last (of starts, for programs).

    Raises:
      ValueError: fewer than two arrivals, or all at one time (an offline batch has no
        rate to rescale).
    """
    starts = [r for r in requests if not r.parents] if programs else list(requests)
    span = (max(r.arrival_s for r in starts) - min(r.arrival_s for r in starts)
            if len(starts) >= 2 else 0.0)
    if span <= 0:
        raise ValueError("all arrivals at one time (an offline batch has no rate); "
                         "rescaling to a rate needs arrivals spread in time")
    return (len(starts) - 1) / span / rate


def rescaled_to_rate(requests: Sequence[Request], rate: float, *, programs: bool = False
                     ) -> list[Request]:
    """`requests` with arrivals rescaled so their mean rate is `rate` (`mean_rate_scale`).

    Raises:
      ValueError: as `mean_rate_scale`.
    """
    scale = mean_rate_scale(requests, rate, programs=programs)
    if programs:
        return rescale_starts(requests, scale)
    return [dataclasses.replace(r, arrival_s=r.arrival_s * scale) for r in requests]
