"""Steps in flight: dispatched steps whose sampled tokens are still on the device.

With output lengths known (EOS ignored) a plan never depends on the values of
the sampled tokens, only on how many each request has. So the scheduler counts
a step's tokens as soon as the step is dispatched (`Scheduler.update`) and
leaves their values on the device: the next step's decodes read their input
token from the device-side buffer of the step before
(`Engine.step_async(inputs, token_source)`), and a step's tokens come back to
the host (`Scheduler.record_tokens`) once the queue is deeper than the
executor's depth: at depth 2 (overlap), one step late.

Which requests a plan may take follows from that. A request whose newest token
is in the last dispatched step may be scheduled again: its decode reads the
token on the device, after that step, on the same device queue. A request whose
newest token is in an older step in flight may not (`busy`): an engine feeds
only the previous step's tokens. At depth 2 only the last dispatched step is
in flight while the next is planned, so no request is ever busy and every plan
accepted without overlap is accepted with it.
"""

from __future__ import annotations

import collections
from typing import Optional

import numpy as np
from numpy.typing import NDArray

from orca_jax.core.loop.scheduled_step import ScheduledStep
from orca_jax.core.step.engine_api import PendingStep

_NONE = np.zeros(0, dtype=np.int64)
_NONE.setflags(write=False)


class StepsInFlight:
    """The queue of dispatched steps whose tokens have not been read back, oldest first.

    Args:
      num_requests: N, the requests of the run (indexed by arrival order).
    """

    def __init__(self, num_requests: int) -> None:
        self._queue: collections.deque[tuple[PendingStep, ScheduledStep]] = collections.deque()
        # Each request's row in the last dispatched step, where it sampled there (its newest
        # token is that row of the step's output, on the device); else -1.
        self._row_in_last = np.full(num_requests, -1, dtype=np.int64)  # [N]
        self.busy: NDArray[np.int64] = _NONE  # [b] see the module's doc; sorted, read-only

    def __len__(self) -> int:
        return len(self._queue)

    def token_source(self, step: ScheduledStep) -> Optional[NDArray[np.int32]]:  # [T] or None
        """Where each flat token of `step` comes from: a row of the last dispatched step
        (the request's newest token, still on the device) or -1 (the host's id).

        Returns None when no token of the step is in flight. A request's token in
        flight is its newest known one, so the step reads it exactly when the step
        computes all the request knows: where it samples, at its last flat token.
        """
        if not self._queue:
            return None
        rows = self._row_in_last[step.sampled]  # [m]
        takes = rows >= 0
        if not takes.any():
            return None
        last_flat = (np.cumsum(step.num_tokens) - 1)[step.samples][takes]
        source = np.full(step.packed.bucket.num_tokens, -1, dtype=np.int32)
        source[last_flat] = rows[takes]
        return source

    def push(self, pending: PendingStep, step: ScheduledStep) -> None:
        """Notes a dispatched step whose sampled tokens stay on the device for now."""
        if self._queue:
            self._row_in_last[self._queue[-1][1].sampled] = -1
        self._row_in_last[step.sampled] = np.flatnonzero(step.samples)
        self._queue.append((pending, step))

    def land(self, keep: int) -> list[tuple[NDArray[np.int64], NDArray[np.int32]]]:
        """Waits for the oldest steps until at most `keep` are in flight.

        Returns:
          `(requests that sampled [m], their tokens [m])` of each step landed, oldest
          first: those tokens are the host's now.
        """
        landed = []
        while len(self._queue) > keep:
            pending, step = self._queue.popleft()
            tokens = pending.output().sampled_tokens[:step.request_ids.size][step.samples]
            landed.append((step.sampled, tokens))
            if not self._queue:  # it was the last dispatched step too
                self._row_in_last[step.sampled] = -1
        self._find_busy()
        return landed

    def _find_busy(self) -> None:
        """Requests that sampled in a step before the last one and not in the last one."""
        if len(self._queue) < 2:  # at depth <= 2, always
            self.busy = _NONE
            return
        older = np.concatenate([step.sampled for _, step in list(self._queue)[:-1]])
        busy = np.unique(older[self._row_in_last[older] < 0])
        busy.setflags(write=False)
        self.busy = busy
