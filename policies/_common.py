"""Mechanics private to the built-in policies: a starvation clock, cached predictions, knobs.

The helpers a plugin author builds a plan with (`plan_in_order`,
`fit_to_budget`) are public, in `orca_jax.core.api.policy_helpers` and the package
face `orca_jax`; this module holds what only the policies of this package share.
0.1's `policies._common.plan_in_order` still answers, with a DeprecationWarning,
for one release (`__getattr__`).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any, Optional, Sequence

import numpy as np
from numpy.typing import NDArray

import orca_jax
from orca_jax import Policy, SchedulerView, StepPlan
from orca_jax.learned.length_predictor import checked_predictions, get_predictor

# `Policy.stable_steps` of a policy whose plan repeats for as long as nothing happens:
# the executor bounds the leap by the next event itself.
STEADY = 1 << 30


def admits_nobody(view: SchedulerView) -> bool:
    """Whether `plan_in_order` over the running requests (each decoding one token) then
    the waiting ones, in any order, admits nobody now, and so nobody while only decodes
    happen: the queue, the seats and the budget stay, and the free pages only fall.

    A waiting request ranked below every running one has no victims to preempt: it is
    admitted only where its pages fit the room left, which is at most `view.kv_room()`.
    With prefix caching, hits change what fits: False unless nobody waits or no seat
    or budget is left.
    """
    waiting = view.waiting
    num_running = int(view.running.size)
    budget_left = view.max_num_tokens - num_running
    if waiting.size == 0 or num_running >= view.max_num_seqs or budget_left <= 0:
        return True
    if view.prefix_caching:
        return False
    count = np.minimum(view.requests.num_uncomputed(waiting), budget_left)  # [w]
    return bool((view.pages_needed(waiting, count) > view.kv_room()).all())


class LastScheduled:
    """When the policy last scheduled each request (arrival if never): a starvation clock."""

    def __init__(self) -> None:
        self._at_s: Optional[NDArray[np.float64]] = None  # [N]

    def idle_s(self, view: SchedulerView, ids: NDArray[np.int64]) -> NDArray[np.float64]:
        """`[n]` seconds since each request was last scheduled (or arrived)."""
        if self._at_s is None:
            self._at_s = view.requests.arrival_s.copy()
        return view.now_s - self._at_s[ids]

    def mark(self, view: SchedulerView, plan: StepPlan) -> None:
        """Records that `plan`'s requests run now."""
        if self._at_s is None:
            self._at_s = view.requests.arrival_s.copy()
        self._at_s[plan.request_ids] = view.now_s


class PredictionCache:
    """Predicted output lengths, asked of the predictor once per request, when first seen."""

    def __init__(self, predictor: str) -> None:
        self.name = predictor
        self._predictor = get_predictor(predictor)
        self._predicted: Optional[NDArray[np.int64]] = None  # [N], 0 = not yet predicted

    def output_len(self, view: SchedulerView, ids: NDArray[np.int64]) -> NDArray[np.int64]:
        """`[n]` predicted output lengths of `ids` (arrived requests)."""
        if self._predicted is None:
            self._predicted = np.zeros(len(view.requests), dtype=np.int64)
        ids = np.asarray(ids, dtype=np.int64)
        new = ids[self._predicted[ids] == 0]
        if new.size:
            specs: Sequence = [view.requests.spec(int(i)) for i in new]
            self._predicted[new] = checked_predictions(
                self.name, self._predictor.predict_output_len(specs), new.size)
        return self._predicted[ids]


def candidates(view: SchedulerView) -> NDArray[np.int64]:
    """`[k]` every request a policy may schedule now: running, then waiting."""
    return np.concatenate([view.running, view.waiting])


@dataclasses.dataclass(kw_only=True)
class LengthRanked(Policy):
    """The knobs and prediction cache that length-ranking policies (sjf, srpt) share.

    Attributes:
      predictor: name of the output-length predictor (`oracle`, or a registered one).
      prompt_token_weight: work of one prompt token relative to one output token.
      starvation_s: how long a request may wait before it is promoted (inf: never).
    """

    predictor: str = "oracle"
    prompt_token_weight: float = 1.0
    starvation_s: float = math.inf
    _lengths: PredictionCache = dataclasses.field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.prompt_token_weight >= 0:
            raise ValueError(f"prompt_token_weight must be >= 0, got {self.prompt_token_weight}")
        if not self.starvation_s > 0:
            raise ValueError(f"starvation_s must be > 0, got {self.starvation_s}")
        self._lengths = PredictionCache(self.predictor)


def __getattr__(name: str) -> Any:
    """0.1's names here that moved to the package face: the face's, with a warning."""
    if name == "plan_in_order":
        warnings.warn("policies._common.plan_in_order is deprecated and goes in the next "
                      "release; use orca_jax.plan_in_order", DeprecationWarning, stacklevel=2)
        return orca_jax.plan_in_order
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
