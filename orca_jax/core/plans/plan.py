"""StepPlan: what a policy says for one iteration, and the error a bad plan gets.

A plan names, per request, how many tokens to compute this step (a whole
prompt, a prefill chunk, or one decode token: the core does not distinguish),
which running requests to preempt (by recompute) before the step, which
waiting requests to reject (with a reason: load shedding, SLO-aware admission),
and which finished requests to hand back to their clients (only for policies
that hold answers until a batch is done, like request-level static batching).
Nothing else: admission is implied by scheduling a waiting request, and KV
pages are the core's business.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Mapping, Optional, Union

import numpy as np
from numpy.typing import NDArray

_EMPTY = np.zeros(0, dtype=np.int64)
_EMPTY.setflags(write=False)


def _as_index_array(values: Optional[Iterable[int]], field: str) -> NDArray[np.int64]:
    # The two common cases first, without numpy's dtype checks: a plan is made every step.
    kind = type(values)
    if kind is np.ndarray and values.dtype == np.int64 and values.ndim == 1:
        return values if values.size else _EMPTY
    if values is None or ((kind is tuple or kind is list) and not values):
        return _EMPTY
    array = np.asarray(values if isinstance(values, np.ndarray) else list(values))
    if array.size == 0:
        return _EMPTY
    if array.ndim != 1 or not np.issubdtype(array.dtype, np.integer):
        raise TypeError(f"StepPlan.{field} must be a 1-D sequence of integers, got {array.dtype} "
                        f"with shape {array.shape}")
    return array.astype(np.int64, copy=False)


def _as_rejections(reject: Union[Mapping[int, str], Iterable[tuple[int, str]], None]
                   ) -> tuple[NDArray[np.int64], tuple[str, ...]]:
    """`([j] request indices, [j] reasons)` from `{index: reason}` or `(index, reason)` pairs."""
    if not reject:
        return _EMPTY, ()
    pairs = list(reject.items() if isinstance(reject, Mapping) else reject)
    for request, reason in pairs:
        if not isinstance(reason, str) or not reason.strip():
            raise TypeError(f"StepPlan.reject: request {request} needs a reason (a non-empty "
                            f"str), got {reason!r}")
    ids = _as_index_array([request for request, _ in pairs], "reject")
    return ids, tuple(reason.strip() for _, reason in pairs)


@dataclasses.dataclass(frozen=True, init=False)
class StepPlan:
    """One iteration's decision.

    Attributes:
      request_ids: `[n]` request indices to run this step, in the order their
        tokens are packed. A waiting request listed here is admitted.
      num_tokens: `[n]` tokens to compute for each, >= 1 and at most the
        request's uncomputed tokens (its prompt or chunk, or 1 to decode).
      preempt: `[m]` running request indices to preempt by recompute before
        the step (their KV pages are freed and they go back to waiting).
      release: `[r]` finished request indices whose answers go back to their
        clients now (only for policies with `defer_release = True`).
      reject_ids: `[j]` waiting request indices the policy rejects now; each ends
        `rejected` with the reason `policy <name>: <text>` (requests.jsonl) and
        counts in `num_rejected`. Given to the constructor as
        `reject={index: "why"}` (or `(index, why)` pairs).
      reject_reasons: `[j]` the reason of each, in `reject_ids` order.
      min_bucket_tokens: pad the step to a bucket of at least this many tokens
        (0: the smallest that fits). Request-level batching keeps its batch's
        shape until the batch is done, finished members included, as
        FasterTransformer does; this is how such a policy pays for it.
    """

    request_ids: NDArray[np.int64]  # [n]
    num_tokens: NDArray[np.int64]  # [n]
    preempt: NDArray[np.int64]  # [m]
    release: NDArray[np.int64]  # [r]
    min_bucket_tokens: int
    reject_ids: NDArray[np.int64]  # [j]
    reject_reasons: tuple[str, ...]  # [j]

    def __init__(self, request_ids: Iterable[int] = (), num_tokens: Iterable[int] = (),
                 preempt: Iterable[int] = (), release: Iterable[int] = (),
                 min_bucket_tokens: int = 0,
                 reject: Union[Mapping[int, str], Iterable[tuple[int, str]], None] = None
                 ) -> None:
        ids = _as_index_array(request_ids, "request_ids")
        tokens = _as_index_array(num_tokens, "num_tokens")
        if ids.shape != tokens.shape:
            raise ValueError(f"StepPlan: {ids.size} request_ids but {tokens.size} num_tokens")
        object.__setattr__(self, "request_ids", ids)
        object.__setattr__(self, "num_tokens", tokens)
        object.__setattr__(self, "preempt", _as_index_array(preempt, "preempt"))
        object.__setattr__(self, "release", _as_index_array(release, "release"))
        object.__setattr__(self, "min_bucket_tokens", int(min_bucket_tokens))
        reject_ids, reasons = _as_rejections(reject)
        object.__setattr__(self, "reject_ids", reject_ids)
        object.__setattr__(self, "reject_reasons", reasons)

    def as_dict(self) -> dict[int, int]:
        """`{request index: num tokens}`, for tests and debugging."""
        return dict(zip(self.request_ids.tolist(), self.num_tokens.tolist()))


class PlanError(ValueError):
    """A plan broke a rule. Names the policy (or router) and the rule; state is unchanged.

    Attributes:
      policy: the registered name of the policy (or router) whose plan broke the rule.
      rule: a short stable name of the broken rule. A policy's: `token_budget`,
        `batch_cap`, `kv_pages`, `kv_watermark`, `unknown_request`, `not_arrived`,
        `finished_request`, `duplicate_request`, `nonpositive_tokens`,
        `decode_before_prefill_done`, `preempt_not_running`, `preempt_and_schedule`,
        `release_without_defer`, `release_not_finished`, `reject_not_waiting`,
        `reject_and_schedule`, `busy_request` (a request in a step in flight that the
        next step cannot follow: SchedulerView.busy), `no_progress` (the plan runs
        nothing and nothing can change, or no request has gained a computed token or
        finished for SchedulerConfig.limits.no_progress_steps iterations), `not_a_plan`.
        A router's: `replica_out_of_range`.
      detail: what exactly was wrong, with the numbers.
      kind: what broke the rule: `policy` or `router`.
    """

    def __init__(self, policy: str, rule: str, detail: str, *, kind: str = "policy") -> None:
        self.policy = policy
        self.rule = rule
        self.detail = detail
        self.kind = kind
        super().__init__(f"{kind} '{policy}' broke rule '{rule}': {detail}")
