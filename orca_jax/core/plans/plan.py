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
import operator
from typing import Iterable, Mapping, Optional, Union

import numpy as np
from numpy.typing import NDArray

_EMPTY = np.zeros(0, dtype=np.int64)
_EMPTY.setflags(write=False)
# numpy's int64 descriptor (one object): an int64 array's `dtype` is it, so `is` answers
# at half the cost of `== np.int64`, which converts the type on every call; any other
# descriptor equal to it takes the general path, which returns the same array (the plan's
# fields here, the view's questions in `view`).
INT64 = _EMPTY.dtype


class MalformedPlan(TypeError, ValueError):
    """A `StepPlan` built from fields that are not what a plan holds: lengths that differ,
    counts that are not integers (NaN, 1.5, text), arrays of another shape.

    The scheduler reports it as the policy's rule `not_a_plan` (`PlanError`): a plugin's
    malformed plan is its error, not a crash of the framework. A TypeError and a
    ValueError both, as the constructor raised before it had its own class.
    """


def _as_index_array(values: Optional[Iterable[int]], field: str) -> NDArray[np.int64]:
    # The two common cases first, without numpy's dtype checks: a plan is made every step.
    kind = type(values)
    if kind is np.ndarray and values.dtype is INT64 and values.ndim == 1:
        return values if values.size else _EMPTY
    if values is None or ((kind is tuple or kind is list) and not values):
        return _EMPTY
    try:
        array = np.asarray(values if isinstance(values, np.ndarray) else list(values))
    except (TypeError, ValueError) as e:  # not iterable, or ragged
        raise MalformedPlan(f"StepPlan.{field} must be a 1-D sequence of integers, got "
                            f"{type(values).__name__} ({e})") from None
    if array.size == 0:
        return _EMPTY
    if array.ndim != 1 or not np.issubdtype(array.dtype, np.integer):
        raise MalformedPlan(f"StepPlan.{field} must be a 1-D sequence of integers, got "
                            f"{array.dtype} with shape {array.shape}"
                            + (" (NaN among them)" if array.dtype.kind == "f"
                               and np.isnan(array).any() else ""))
    return array.astype(np.int64, copy=False)


def _as_rejections(reject: Union[Mapping[int, str], Iterable[tuple[int, str]], None]
                   ) -> tuple[NDArray[np.int64], tuple[str, ...]]:
    """`([j] request indices, [j] reasons)` from `{index: reason}` or `(index, reason)` pairs."""
    if not reject:
        return _EMPTY, ()
    try:
        pairs = [(request, reason) for request, reason in
                 (reject.items() if isinstance(reject, Mapping) else reject)]
    except (TypeError, ValueError) as e:
        raise MalformedPlan(f"StepPlan.reject must map request indices to reasons, got "
                            f"{type(reject).__name__} ({e})") from None
    for request, reason in pairs:
        if not isinstance(reason, str) or not reason.strip():
            raise MalformedPlan(f"StepPlan.reject: request {request} needs a reason (a "
                                f"non-empty str), got {reason!r}")
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
      spec_tokens: `[n]` draft tokens to verify after each request's one decode
        token this step (speculative decoding, docs/speculative.md), parallel to
        `request_ids`; empty (the default, and what a plan of all zeros becomes)
        means none: every request computes exactly its `num_tokens`. A request
        given k > 0 must be decoding (`num_tokens` 1, its prompt done); the step
        computes its k + 1 positions, and it advances by the engine's accepted
        count + 1 (`StepOutput.num_accepted`).
    """

    request_ids: NDArray[np.int64]  # [n]
    num_tokens: NDArray[np.int64]  # [n]
    preempt: NDArray[np.int64]  # [m]
    release: NDArray[np.int64]  # [r]
    min_bucket_tokens: int
    reject_ids: NDArray[np.int64]  # [j]
    reject_reasons: tuple[str, ...]  # [j]
    spec_tokens: NDArray[np.int64]  # [n] or [0] (none)

    def __init__(self, request_ids: Iterable[int] = (), num_tokens: Iterable[int] = (),
                 preempt: Iterable[int] = (), release: Iterable[int] = (),
                 min_bucket_tokens: int = 0,
                 reject: Union[Mapping[int, str], Iterable[tuple[int, str]], None] = None,
                 spec_tokens: Iterable[int] = ()) -> None:
        ids = _as_index_array(request_ids, "request_ids")
        tokens = _as_index_array(num_tokens, "num_tokens")
        if ids.shape != tokens.shape:
            raise MalformedPlan(f"StepPlan: {ids.size} request_ids but {tokens.size} "
                                "num_tokens")
        # The defaults (most plans: nothing to preempt, release, reject or draft) without
        # a call each; a plan is made every step.
        preempt = (_EMPTY if preempt.__class__ is tuple and not preempt
                   else _as_index_array(preempt, "preempt"))
        release = (_EMPTY if release.__class__ is tuple and not release
                   else _as_index_array(release, "release"))
        if min_bucket_tokens.__class__ is int and min_bucket_tokens >= 0:
            min_bucket = min_bucket_tokens
        else:
            try:  # an integer, not a float that int() would cut (nor NaN)
                min_bucket = operator.index(min_bucket_tokens)
            except TypeError:
                min_bucket = -1
            if min_bucket < 0:
                raise MalformedPlan(f"StepPlan.min_bucket_tokens must be an integer >= 0, "
                                    f"got {min_bucket_tokens!r}")
        reject_ids, reasons = (_EMPTY, ()) if reject is None else _as_rejections(reject)
        spec = (_EMPTY if spec_tokens.__class__ is tuple and not spec_tokens
                else _as_index_array(spec_tokens, "spec_tokens"))
        if spec.size and spec.shape != ids.shape:
            raise MalformedPlan(f"StepPlan: {ids.size} request_ids but {spec.size} "
                                "spec_tokens")
        # Frozen: the fields go into the instance's dict at once (one call, not one
        # `object.__setattr__` each). All zeros is no speculation: one empty array, so the
        # loop asks `.size` only.
        self.__dict__.update(
            request_ids=ids, num_tokens=tokens, preempt=preempt, release=release,
            min_bucket_tokens=min_bucket, reject_ids=reject_ids, reject_reasons=reasons,
            spec_tokens=spec if spec.size and spec.any() else _EMPTY)

    @property
    def speculates(self) -> bool:
        """Whether any request verifies draft tokens this step (`spec_tokens`)."""
        return bool(self.spec_tokens.size)

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
        `tokens_over_uncomputed`, `preempt_not_running`, `preempt_and_schedule`,
        `release_without_defer`, `release_not_finished`, `reject_not_waiting`,
        `reject_and_schedule`, `spec_negative` (a spec_tokens entry < 0),
        `spec_unsupported` (draft tokens for an engine that does not speculate:
        Engine.speculates), `spec_not_decoding` (draft tokens for a request that is
        not decoding one token after its prompt), `spec_past_context` (its k + 1
        positions past max_model_len), `spec_past_output` (k + 1 tokens past the
        request's remaining output; the verified tokens, k + 1 each, count in
        `token_budget` too), `busy_request` (a request in a step in flight that the
        next step cannot follow: SchedulerView.busy), `no_progress` (the plan runs
        nothing and nothing can change, or no request has gained a computed token or
        finished for SchedulerConfig.limits.no_progress_steps iterations), `not_a_plan`
        (schedule() returned no StepPlan, or built one from fields it cannot hold:
        a MalformedPlan).
        A router's: `replica_out_of_range`; `bucket_replicas` (`length_buckets`' groups
        do not fit the pool); the `chain` router's `filter_shape`, `score_shape`,
        `score_not_finite` (a scorer gave NaN or inf), `pick_not_candidate`.
        A rebalancer's (`orca_jax.cluster.migration`): `not_migrations`,
        `replica_out_of_range`, `unknown_request`, `already_migrating`, `not_on_source`,
        `no_room`.
      detail: what exactly was wrong, with the numbers.
      kind: what broke the rule: `policy`, `router` or `rebalancer`.
    """

    def __init__(self, policy: str, rule: str, detail: str, *, kind: str = "policy") -> None:
        self.policy = policy
        self.rule = rule
        self.detail = detail
        self.kind = kind
        super().__init__(f"{kind} '{policy}' broke rule '{rule}': {detail}")
