"""Before the run: the requests no admission can take.

A request is rejected up front, with a reason, when its context exceeds
`max_model_len` or when the KV rule of every plan (`KVCapacity`) refuses it
alone in the empty pool with its whole context (prompt + output, or its
reservation if larger). A request admitted on demand may be preempted and
readmitted with all its tokens to recompute, so the watermark counts for every
`kv_reservation` mode. What is not rejected can always be admitted once the
pool drains: a run never strands a request the rules could never let in.
"""

from __future__ import annotations

import numpy as np

from orca_jax.core.kv import KVCapacity
from orca_jax.core.requests.request import RequestState
from orca_jax.core.requests.request_table import RequestTable


def reject_impossible(table: RequestTable, capacity: KVCapacity, max_model_len: int) -> int:
    """Marks REJECTED, with a reason, the requests no admission could ever take.

    Args:
      table: the run's requests (their states and reasons are written).
      capacity: the capacity question of the run's (empty) KV pool.
      max_model_len: the context limit.

    Returns:
      How many requests were rejected.
    """
    total = table.prompt_len + table.output_len  # [N]
    pages, refused = capacity.refusals(total)  # [N], {pages: reason}
    too_long = total > max_model_len
    bad = np.flatnonzero(too_long | np.isin(pages, list(refused)))
    for i in bad.tolist():
        if too_long[i]:
            reason = (f"prompt {table.prompt_len[i]} + output {table.output_len[i]} tokens "
                      f"exceed the context of {max_model_len}")
        else:
            reason = refused[int(pages[i])]
        table.state[i] = RequestState.REJECTED
        table.reject_reason[i] = reason
    return int(bad.size)
