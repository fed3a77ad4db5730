"""A request's KV handed from a prefill replica to a decode replica (disaggregation).

A prefill replica (`SchedulerConfig.features.kv_handoff`) runs each request up to its
first token; the request then finishes there but keeps its KV pages, listed in
`Scheduler.in_transfer`, until the transfer that carries them ends (`release`).
The decode replica takes the request in two moves: when the transfer starts,
`reserve` gives it the pages its prompt's KV (and its first decode) will fill,
so the pool cannot be overcommitted while the bytes travel; when the transfer
ends, `deliver` exports the request from the prefill replica and imports it
into the decode replica (`Scheduler.export_request`, `import_request`): a
waiting request whose prompt is computed and whose first token is known. Its
policy admits it like any waiting request: it has one uncomputed token (a
decode) and already holds the pages for it.

A decode replica holds no request until one is delivered (`submitted_only`).
`orca_jax.cluster.disaggregated` drives these calls.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from orca_jax.core.loop.scheduler import Scheduler


def reserve(scheduler: Scheduler, request: int) -> bool:
    """Takes the pages for `request`'s transfer, if the pool has them beside its
    watermark; False leaves all unchanged (the transfer waits)."""
    return scheduler.reserve_pages(request, int(_tokens_to_receive(scheduler, request)[0]))


def deliver(source: Scheduler, target: Scheduler, request: int, at_s: float) -> None:
    """The transfer of `request` (reserved on `target`) ended at `at_s`: `target` holds
    it, waiting with its prompt computed and its first token known."""
    export = source.export_request(request)
    # A disaggregated result takes the prompt's story (its first step, preemptions and
    # prefix-cache hit) from the prefill pool: the decode replica starts its own.
    target.import_request(dataclasses.replace(
        export, num_preemptions=0, num_cached_tokens=0, first_scheduled_s=math.nan,
        admitted_s=math.nan), at_s)


def release(scheduler: Scheduler, request: int, at_s: float) -> None:
    """The transfer of this finished request ended at `at_s`: its pages go back."""
    scheduler.release_request(request, at_s)


def _tokens_to_receive(scheduler: Scheduler, request: int) -> np.ndarray:  # [1]
    return np.array([scheduler.table.prompt_len[request] + 1], dtype=np.int64)
