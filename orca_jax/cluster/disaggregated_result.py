"""A disaggregated run as one `RunResult`: the prefill pool's and the decode pool's joined.

Each pool's replicas are joined first (`RunResult.concat`); then each request's
row takes its prompt's story from the prefill pool (first scheduled, first
token, prefix-cache hit) and the rest from the decode pool (its tokens after
the first, its finish, its status), or all from the prefill pool when it never
reached the decode pool (rejected there). Replicas are numbered prefill first:
`0..P-1` prefill, `P..P+D-1` decode; `replica` is a request's decode replica
and `prefill_replica` its prefill replica.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np
from numpy.typing import NDArray

from orca_jax.core.requests.request import RequestState
from orca_jax.core.requests.run_record import StepLogs, TransferLog
from orca_jax.core.requests.run_result import RunResult
from orca_jax.core.requests.token_stats import TokenStats


def _frozen(array: NDArray) -> NDArray:
    copy = np.array(array)
    copy.setflags(write=False)
    return copy


def join_pools(prefill: RunResult, decode: RunResult, *,
               transfers: Sequence[TransferLog]) -> RunResult:
    """One result of a disaggregated run (see the module docstring).

    Args:
      prefill: the prefill pool's replicas joined (each request's output there is its
        first token).
      decode: the decode pool's replicas joined.
      transfers: the run's KV transfers.
    """
    num_prefill = prefill.num_replicas
    at_decode = decode.state != RequestState.ROUTED_AWAY  # [N] received, or rejected up front

    def pick(field: str, prefer_prefill: bool = False) -> NDArray:  # [N]
        ours, theirs = getattr(prefill, field), getattr(decode, field)
        if prefer_prefill:  # the prompt's times, where the prefill pool ran it
            return _frozen(np.where(np.isnan(ours), theirs, ours))
        return _frozen(np.where(at_decode, theirs, ours))

    token_req = np.concatenate([prefill.token_req, decode.token_req])
    token_time = np.concatenate([prefill.token_time_s, decode.token_time_s])
    order = np.argsort(token_time, kind="stable")
    token_req, token_time = token_req[order], token_time[order]
    finish_s = pick("finish_s")
    logged = prefill.step_requests is not None and decode.step_requests is not None

    def steps(field: str):
        return (*getattr(prefill, field), *getattr(decode, field)) if logged else None

    served_decode = at_decode & (decode.replica >= 0)
    return dataclasses.replace(
        decode,
        state=pick("state"),
        first_scheduled_s=pick("first_scheduled_s", prefer_prefill=True),
        first_token_s=pick("first_token_s", prefer_prefill=True),
        last_token_s=pick("last_token_s"), finish_s=finish_s,
        num_generated=pick("num_generated"),
        num_preemptions=_frozen(prefill.num_preemptions + decode.num_preemptions),
        num_cached_tokens=prefill.num_cached_tokens,
        reject_reason=tuple(d if at else p for at, p, d in
                            zip(at_decode, prefill.reject_reason, decode.reject_reason)),
        output_tokens=(None if decode.output_tokens is None else tuple(
            d if at else p for at, p, d in
            zip(at_decode, prefill.output_tokens, decode.output_tokens))),
        token_req=_frozen(token_req), token_time_s=_frozen(token_time),
        token_stats=TokenStats.from_log(token_req, token_time, np.isfinite(finish_s)),
        steps=StepLogs.concat([prefill.steps, decode.steps]),
        step_replica=_frozen(np.concatenate([prefill.step_replica,
                                             decode.step_replica + num_prefill])),
        step_requests=steps("step_requests"), step_tokens=steps("step_tokens"),
        step_held=steps("step_held"), step_preempted=steps("step_preempted"),
        step_rejected=steps("step_rejected"),
        total_preemptions=prefill.total_preemptions + decode.total_preemptions,
        total_recomputed_tokens=(prefill.total_recomputed_tokens
                                 + decode.total_recomputed_tokens),
        virtual_end_s=max(prefill.virtual_end_s, decode.virtual_end_s),
        replica=_frozen(np.where(served_decode, decode.replica + num_prefill, -1)),
        prefill_replica=prefill.replica, num_prefill_replicas=num_prefill,
        num_replicas=num_prefill + decode.num_replicas,
        router=f"{prefill.router}+{decode.router}",
        prefix_caching=prefill.prefix_caching,
        num_evictions=prefill.num_evictions + decode.num_evictions,
        transfers=tuple(sorted(transfers, key=lambda t: (t.start_s, t.request))))
