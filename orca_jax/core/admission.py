"""Before the run: each request's KV reservation, and the requests no admission can take.

A request is rejected up front, with a reason, when its context exceeds
`max_model_len` or when the KV rule of every plan (`plan_checks.pool_rule_broken`)
refuses it alone in the empty pool with its whole context (prompt + output, or
its reservation if larger). A request admitted on demand may be preempted and
readmitted with all its tokens to recompute, so the watermark counts for every
`kv_reservation` mode. What is not rejected can always be admitted once the
pool drains: a run never strands a request the rules could never let in.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from orca_jax.core.kv_pages import KVPageManager
from orca_jax.core.plan_checks import pool_rule_broken
from orca_jax.core.request import RequestState
from orca_jax.core.request_table import RequestTable
from orca_jax.core.scheduler_state import SchedulerLimits


def reservation_tokens(mode: str, table: RequestTable, max_model_len: int
                       ) -> NDArray[np.int64]:  # [N]
    """`[N]` tokens each request's admission reserves under `kv_reservation` `mode`."""
    total = table.prompt_len + table.output_len
    if mode == "none":
        return np.zeros(len(table), dtype=np.int64)
    if mode == "exact":
        return total
    if mode == "pow2":
        return np.minimum(2 ** np.ceil(np.log2(np.maximum(total, 1))).astype(np.int64),
                          max_model_len)
    return np.full(len(table), max_model_len, dtype=np.int64)  # "max"


def reject_impossible(table: RequestTable, kv: KVPageManager, config: SchedulerLimits,
                      reserve_tokens: NDArray[np.int64]) -> int:  # [N]
    """Marks REJECTED, with a reason, the requests no admission could ever take.

    Args:
      table: the run's requests (their states and reasons are written).
      kv: the empty KV pool.
      config: the limits (context, watermark).
      reserve_tokens: `[N]` from `reservation_tokens`.

    Returns:
      How many requests were rejected.
    """
    total = table.prompt_len + table.output_len  # [N]
    pages = kv.pages_taken(kv.pages_for_tokens(np.maximum(total, reserve_tokens)))  # [N]
    # The rule asked once per distinct page count, not once per request.
    refused: dict[int, str] = {}
    for count in np.unique(pages).tolist():
        broken = pool_rule_broken(count, kv.num_kv_pages, config.watermark_pages,
                                  admitting=True, blocks_fit=count <= kv.largest_block,
                                  block_sizes=[count])
        if broken is not None:
            refused[count] = broken[0]
    too_long = total > config.max_model_len
    bad = np.flatnonzero(too_long | np.isin(pages, list(refused)))
    for i in bad.tolist():
        if too_long[i]:
            reason = (f"prompt {table.prompt_len[i]} + output {table.output_len[i]} tokens "
                      f"exceed the context of {config.max_model_len}")
        elif refused[int(pages[i])] == "kv_watermark":
            reason = (f"needs {pages[i]} KV pages, the pool has "
                      f"{kv.num_kv_pages - config.watermark_pages} beside the watermark of "
                      f"{config.watermark_pages}")
        elif pages[i] > kv.largest_block and kv.largest_block < kv.num_kv_pages:
            reason = (f"needs {pages[i]} KV pages, the pool has {kv.largest_block} in its "
                      "largest buddy block")
        else:
            reason = f"needs {pages[i]} KV pages, the pool has {kv.num_kv_pages}"
        table.state[i] = RequestState.REJECTED
        table.reject_reason[i] = reason
    return int(bad.size)
