"""Speculative decoding in the simulator: acceptance draws and the drafter's price.

A speculating step (`PackedStep.spec_tokens`) verifies k_i draft tokens of sequence
i after its decode token. The simulator runs no model, so it draws how many of them
the target accepts: draft position p of request r is accepted with probability
`acceptance` (the request's own rate where one is given, a trace column), i.i.d.
per position, and a step accepts the longest accepted run from the first draft
(greedy verification stops at the first rejection). The draw is a hash of the seed,
the request and the position, not a stream of random numbers, so a request's
acceptances do not depend on the batch, the policy or the other requests: two
policies that speculate the same tokens of a request see the same acceptances.

The drafter's time goes on the clock: a draft model (`draft`, its own cost model:
a smaller preset of the target's vocabulary) runs k = max k_i decode steps before
the verification, step j holding the sequences with k_i > j, each attending to its
context up to that draft token; it is priced as an ideal ragged step of those
sequences (`roofline_seconds`, no bucket padding). Without a draft model (an n-gram
or prompt-lookup drafter) drafting costs nothing. The verification is priced like
any step, by its tokens: each speculating sequence computes k_i + 1 positions.

No jax: the simulator's layer.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import numpy as np
from numpy.typing import NDArray

from orca_jax.sim.cost_model import CostModelConfig, roofline_seconds
from orca_jax.specs.model_config import draft_vocabulary_error

_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)
DEFAULT_SPEC_ACCEPTANCE = 0.7  # a speculating run's per-token acceptance unless given


def _mix(x: NDArray[np.uint64]) -> NDArray[np.uint64]:
    """splitmix64's finalizer, elementwise (integer arithmetic: the same on every CPU)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def uniform_draws(seed: int, requests: NDArray[np.int64],  # [n]
                  positions: NDArray[np.int64]) -> NDArray[np.float64]:  # [n, k] -> [n, k]
    """A uniform number in [0, 1) for each (request, position), from `seed` alone."""
    with np.errstate(over="ignore"):
        key = (np.uint64(seed & 0xFFFFFFFF) * np.uint64(0x9E3779B97F4A7C15)
               + requests.astype(np.uint64)[:, None] * np.uint64(0xD1B54A32D192ED03)
               + positions.astype(np.uint64))
        bits = _mix(_mix(key & _MASK64))
    return (bits >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


@dataclasses.dataclass(frozen=True, kw_only=True)
class SpecConfig:
    """How the simulator speculates (docs/speculative.md).

    Attributes:
      acceptance: the probability that the target accepts a draft token, i.i.d. per
        position (`--spec_acceptance`); in [0, 1].
      draft: the draft model's cost model (`--draft_model`: a preset of the target's
        vocabulary, on the target's hardware and TP); None: drafting costs nothing
        (a model-free drafter).
      seed: the draws' seed (the run's `--seed`).
      per_request: `[N]` each request's own acceptance rate (a trace column), NaN
        where it has none (then `acceptance`); None: every request has `acceptance`.
    """

    acceptance: float = DEFAULT_SPEC_ACCEPTANCE
    draft: Optional[CostModelConfig] = None
    seed: int = 0
    per_request: Optional[NDArray[np.float64]] = None

    def __post_init__(self) -> None:
        if not (isinstance(self.acceptance, (int, float)) and 0.0 <= self.acceptance <= 1.0):
            raise ValueError(f"spec_acceptance must be in [0, 1], got {self.acceptance!r}")
        if self.per_request is not None:
            rates = np.asarray(self.per_request, np.float64)
            known = rates[~np.isnan(rates)]
            if known.size and (known.min() < 0.0 or known.max() > 1.0):
                raise ValueError("spec_acceptance column: every rate must be in [0, 1], got "
                                 f"{float(known.min())}..{float(known.max())}")
            object.__setattr__(self, "per_request", rates)

    def rates(self, requests: NDArray[np.int64]) -> NDArray[np.float64]:  # [n] -> [n]
        """Each request's per-token acceptance probability."""
        if self.per_request is None:
            return np.full(requests.size, float(self.acceptance))
        own = self.per_request[requests]
        return np.where(np.isnan(own), float(self.acceptance), own)

    def accepted(self, requests: NDArray[np.int64],  # [n]
                 first_draft: NDArray[np.int64],  # [n] position of each one's first draft
                 spec_tokens: NDArray[np.int64]) -> NDArray[np.int64]:  # [n] -> [n]
        """How many of each request's `spec_tokens` drafts the target accepts: the
        leading run of positions whose draw falls under the request's rate."""
        k = int(spec_tokens.max()) if spec_tokens.size else 0
        if k == 0:
            return np.zeros(requests.size, np.int64)
        offsets = np.arange(k, dtype=np.int64)
        draws = uniform_draws(self.seed, requests, first_draft[:, None] + offsets[None, :])
        accept = (draws < self.rates(requests)[:, None]) & (offsets[None, :] < spec_tokens[:, None])
        # The leading run: cumulative product of the accept flags along the drafts.
        return np.cumprod(accept, axis=1).sum(axis=1).astype(np.int64)

    def draft_seconds(self, context: NDArray[np.int64],  # [n] tokens before the first draft
                      spec_tokens: NDArray[np.int64]) -> float:  # [n]
        """Seconds the draft model takes to propose `spec_tokens` tokens for each
        sequence: max k decode steps, step j over the sequences still drafting, each
        attending to `context + j + 1` tokens (its new token included)."""
        if self.draft is None or not spec_tokens.size:
            return 0.0
        total = []
        for j in range(int(spec_tokens.max())):
            drafting = spec_tokens > j
            kv = context[drafting] + j + 1
            total.append(roofline_seconds(self.draft, np.ones(kv.size, np.int64), kv))
        return math.fsum(total)


def check_draft(target: CostModelConfig, draft: CostModelConfig) -> None:
    """A draft model proposes tokens of the target's vocabulary.

    Raises:
      ValueError: the vocabularies differ (one line naming both models).
    """
    t, d = target.model_config, draft.model_config
    if t.vocab_size != d.vocab_size:
        raise ValueError(draft_vocabulary_error(d, t))
