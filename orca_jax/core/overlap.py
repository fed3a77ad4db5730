"""Overlap scheduling: the host plans step N+1 while step N runs on the device.

With output lengths known (EOS ignored) a plan never depends on the values of
the sampled tokens, only on how many each request has. So the scheduler
updates its counters as soon as step N is dispatched and leaves N's sampled
tokens on the device: step N+1's decodes read their input token from the
device-side buffer of N's tokens (`Engine.step_async(inputs, token_source)`),
and N's tokens come back to the host only after N+1 is dispatched, one step
late. `InFlightTokens` is the scheduler's note of which requests' newest
token is still on the device, and where.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
from numpy.typing import NDArray

from orca_jax.core.engine_api import PendingStep


class InFlightTokens:
    """The newest tokens of the requests that sampled in the last dispatched step.

    Args:
      num_requests: requests of the run (indexed by arrival order).
    """

    def __init__(self, num_requests: int) -> None:
        # Each request's sequence row in the step in flight, or -1: its tokens are on the host.
        self.row = np.full(num_requests, -1, dtype=np.int64)  # [N]
        self._pending: Optional[PendingStep] = None
        self._sampled = np.zeros(0, dtype=np.int64)
        self._rows = np.zeros(0, dtype=np.int64)

    @property
    def holding(self) -> bool:
        """Whether a dispatched step's tokens are not read back yet."""
        return self._pending is not None

    def hold(self, pending: PendingStep,
             sampled: NDArray[np.int64],  # [m] requests that sampled in the step
             rows: NDArray[np.int64]) -> None:  # [m] their sequence rows in its descriptor
        """Notes a dispatched step whose sampled tokens stay on the device for now."""
        if self._pending is not None:
            raise RuntimeError("InFlightTokens.hold: the previous step was not landed")
        self._pending, self._sampled, self._rows = pending, sampled, rows
        self.row[sampled] = rows

    def land(self) -> tuple[NDArray[np.int64], NDArray[np.int32]]:
        """Waits for the step in flight; returns (its sampling requests [m], their tokens [m])."""
        if self._pending is None:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int32)
        tokens = self._pending.output().sampled_tokens[self._rows]
        sampled = self._sampled
        self.row[sampled] = -1
        self._pending, self._sampled, self._rows = None, self._rows[:0], self._rows[:0]
        return sampled, tokens

    def token_source(self, ids: NDArray[np.int64],  # [n] the next step's requests, pack order
                     num_tokens: NDArray[np.int64],  # [n] tokens each computes
                     num_computed: NDArray[np.int64],  # [n] tokens each has cached
                     num_known: NDArray[np.int64],  # [n] prompt + generated tokens of each
                     bucket_tokens: int) -> Optional[NDArray[np.int32]]:  # [T] or None
        """Where each flat token of the next step comes from: a row of the step in
        flight (the request's newest token, still on the device) or -1 (the host's id).

        Returns None when no token of the step is in flight. A request's token in
        flight is always its newest known one, so it is the step's last token of
        the request exactly when the request computes up to all it knows.
        """
        rows = self.row[ids]  # [n]
        takes = (rows >= 0) & (num_computed + num_tokens == num_known)
        if not takes.any():
            return None
        last_flat = np.cumsum(num_tokens) - 1  # [n] flat index of each request's last token
        source = np.full(bucket_tokens, -1, dtype=np.int32)
        source[last_flat[takes]] = rows[takes]
        return source
