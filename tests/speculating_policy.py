"""A test policy that speculates: FCFS, each decoding request verifying a set number of
draft tokens, shared by the real engine's speculation tests (test_spec_engine,
test_spec_sampling)."""

import dataclasses
from typing import Optional

import numpy as np

from orca_jax import StepPlan
from orca_jax.core.api.policy import Policy


@dataclasses.dataclass(kw_only=True)
class Speculating(Policy):
    """FCFS with prompts chunked to `chunk` tokens (None: whole); each decoding request
    verifies `ks[(request + step) % len(ks)]` draft tokens, capped by its remaining output,
    and a step holds at most `budget` tokens and `max_seqs` requests (None: no cap). Mixed
    `ks` make batches that mix k = 0, k > 0 and prefill chunks (tests only)."""

    ks: tuple[int, ...] = (0,)
    chunk: Optional[int] = None
    budget: int
    max_seqs: Optional[int] = None
    kv_reservation: str = "none"

    def schedule(self, view):
        ids, tokens, spec = [], [], []
        used = 0
        for request in view.running.tolist() + view.waiting.tolist():
            one = np.array([request])
            count = int(view.requests.num_uncomputed(one)[0])
            if self.chunk is not None:
                count = min(count, self.chunk)
            k = 0
            if bool(view.requests.prefill_done(one)[0]):
                k = self.ks[(request + view.step_index) % len(self.ks)]
                k = max(0, min(k, int(view.requests.remaining_output(one)[0]) - 1))
            if used + count + k > self.budget or len(ids) == self.max_seqs:
                break
            ids.append(request)
            tokens.append(count)
            spec.append(k)
            used += count + k
        return StepPlan(ids, tokens, spec_tokens=spec)


Speculating.name = "speculating-test"
