"""SmartSpec (Liu et al., arXiv 2406.14066): speculate only as much as goodput pays.

Under continuous batching, speculative decoding trades compute for steps: a
request that verifies k draft tokens gains, in expectation,

    E(a, k) = 1 + a + a^2 + ... + a^k = (1 - a^(k+1)) / (1 - a)

tokens per step (a: its per-token acceptance), but the step grows by k verified
positions and the drafter's k steps. At a small batch a decode step is memory
bound and the extra positions cost little, so speculating pays; at a large batch
the step is compute bound, every draft position costs its share, and rejected
ones are waste. SmartSpec picks, each step, the speculation that maximizes the
estimated goodput: the expected generated tokens of the step over its estimated
seconds.

Here the plan is vLLM's (the same batching and KV decisions; `VLLM`), and each
step weighs candidate speculations of its decodes: every k from 0 to `max_k`
for all of them, and each k for only the decodes whose acceptance is at least
the median (low-acceptance requests stop speculating first). A decode's
acceptance is its history so far (`view.requests.acceptance_rate`: accepted over
the draft positions the target judged), shrunk toward the run's pooled acceptance
(`pooled_acceptance_rate`, which starts at `prior_acceptance`) as `request_weight`
judged positions. The step's seconds come from the engine's own
estimate (`view.estimate_step_s`: the simulator's cost model of the step's bucket
and the draft model's steps); where the engine cannot estimate, it does not
speculate. k = 0 wins whenever no speculation beats it: no speculation that the
cost model says loses is ever chosen. The chosen k is clipped to each request's
output, the context, the token budget and the KV pages (`add_drafts`).

What differs from the paper: SmartSpec estimates acceptance with a moving
average over recent steps and fits its step time to profiled batches; here the
acceptance is the run's and the request's whole history and the time is the
engine's estimate. The paper's prompt-lookup and the per-request search are
replaced by the two families of candidates above (2 max_k + 1 estimates a step).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Optional

import numpy as np
from numpy.typing import NDArray

from orca_jax import Policy, SchedulerView, StepPlan, register
from orca_jax.core.api.policy_helpers import add_drafts
from orca_jax.core.requests.request import RequestState
from policies.vllm import VLLM


def expected_tokens(acceptance: NDArray[np.float64],  # [n]
                    k: NDArray[np.int64]) -> NDArray[np.float64]:  # [n] -> [n]
    """Tokens a decode verifying k drafts gains in expectation: 1 + a + ... + a^k."""
    a = np.clip(acceptance, 0.0, 1.0)
    safe = np.where(a < 1.0, a, 0.0)
    geometric = (1.0 - safe ** (k + 1)) / (1.0 - safe)
    return np.where(a < 1.0, geometric, k + 1.0)


@register("smartspec")
@dataclasses.dataclass(kw_only=True)
class SmartSpec(VLLM):
    """vLLM's plans, each decode's draft tokens chosen for the most goodput (SmartSpec).

    Attributes:
      max_k: the most draft tokens a decode verifies in a step.
      prior_acceptance: the per-token acceptance assumed before any draft was judged.
      prior_weight: how many judged draft positions the prior counts as in the run's
        pooled acceptance (every request's judged drafts together).
      request_weight: how many judged positions the pooled acceptance counts as in a
        request's own estimate (0: its own history alone once it has one; large: the
        pooled rate for everyone, as the paper's moving average of the batch).
      min_gain: speculation must beat k = 0's goodput by this fraction (0: any gain).
    """

    plans_speculation: ClassVar[bool] = True
    # Its plans differ from step to step (k follows the acceptance history): no promise
    # of steady steps (vLLM's), so the simulator never leaps over them.
    stable_steps = Policy.stable_steps
    max_k: int = 8
    prior_acceptance: float = 0.7
    prior_weight: float = 4.0
    request_weight: float = 128.0
    min_gain: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()  # vLLM's knobs
        if self.max_k < 0:
            raise ValueError(f"smartspec: max_k must be >= 0, got {self.max_k}")
        if not 0.0 <= self.prior_acceptance <= 1.0:
            raise ValueError(f"smartspec: prior_acceptance must be in [0, 1], got "
                             f"{self.prior_acceptance}")
        if min(self.prior_weight, self.request_weight, self.min_gain) < 0:
            raise ValueError("smartspec: prior_weight, request_weight and min_gain must be "
                             ">= 0")

    def schedule(self, view: SchedulerView) -> StepPlan:
        plan = super().schedule(view)
        if self.max_k == 0 or not plan.request_ids.size or not view.speculates:
            return plan
        k = self.choose_k(view, plan)
        return plan if k is None else add_drafts(view, plan, k)

    def choose_k(self, view: SchedulerView, plan: StepPlan) -> Optional[NDArray[np.int64]]:
        """`[n]` the draft tokens of each request of `plan` that maximize the step's
        estimated goodput (None: no speculation, k = 0 for all, is best or the engine
        cannot estimate)."""
        ids, tokens = plan.request_ids, plan.num_tokens
        requests = view.requests
        decoding = ((tokens == 1) & requests.prefill_done(ids)
                    & (requests.state[ids] == RequestState.RUNNING))
        if not decoding.any():
            return None
        # Each request's history, shrunk toward the run's pooled acceptance (itself
        # starting at the prior): few judged drafts say little about one request.
        pooled = requests.pooled_acceptance_rate(self.prior_acceptance, self.prior_weight)
        acceptance = requests.acceptance_rate(ids, pooled, self.request_weight)
        # Each decode's cap: its output (k + 1 tokens at most) and the context.
        cap = np.where(decoding, np.minimum(requests.remaining_output(ids) - 1,
                                            view.max_model_len - requests.num_computed[ids] - 1),
                       0)
        cap = np.clip(cap, 0, self.max_k)
        context = requests.num_computed[ids] + tokens  # [n] each one's KV after k = 0
        room = view.max_num_tokens - int(tokens.sum())
        median = float(np.median(acceptance[decoding]))
        families = [decoding, decoding & (acceptance >= median)]
        best_k: Optional[NDArray[np.int64]] = None
        best = self._goodput(view, tokens, context, np.zeros_like(tokens), acceptance, decoding)
        if best is None:
            return None
        floor = best * (1.0 + self.min_gain)
        for chosen in families:
            if chosen is not decoding and chosen.sum() == decoding.sum():
                continue  # the same candidates as the first family
            for k in range(1, self.max_k + 1):
                ks = np.where(chosen, np.minimum(k, cap), 0)
                if int(ks.sum()) > room:
                    break  # wider k only adds tokens the budget does not have
                value = self._goodput(view, tokens, context, ks, acceptance, decoding)
                if value is not None and value > max(best, floor):
                    best, best_k = value, ks
        return best_k

    @staticmethod
    def _goodput(view: SchedulerView, tokens: NDArray[np.int64],  # [n]
                 context: NDArray[np.int64],  # [n]
                 ks: NDArray[np.int64],  # [n]
                 acceptance: NDArray[np.float64],  # [n]
                 decoding: NDArray[np.bool_]) -> Optional[float]:  # [n]
        """Expected decode tokens of the step over the estimated seconds of its decodes
        (None: the engine cannot estimate). The prefill chunks beside them are left out
        of both: their time does not depend on k, and counted in, it would make every
        draft look cheaper than it is against the decodes' own step."""
        tokens, context, ks = tokens[decoding], context[decoding], ks[decoding]
        seconds = view.estimate_step_s(tokens + ks, context + ks, ks if ks.any() else None)
        if seconds is None or seconds <= 0:
            return None
        gained = expected_tokens(acceptance[decoding], ks)
        return float(gained.sum()) / seconds
