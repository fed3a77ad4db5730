"""The request table: every request's progress as a struct of numpy arrays.

Row i is the request with index i (arrival order). The scheduler writes it;
policies read it through `RequestTableView`, whose arrays are read-only views,
so a policy can compute over all running requests with one numpy expression
instead of a Python loop per request.

The replicas of a cluster's pool share one table (`for_replica`): the
workload's facts once, and each request's progress in one row, written only
by the replica holding it (`holder`). A replica holds the requests routed to it
through its queues and KV pages; a request keeps its index, and so its
sampling seed, its place in arrival order and its results row, on every
replica, and moving it between replicas (`Scheduler.export_request`,
`import_request`) moves its holder, not its row.
"""

from __future__ import annotations

import copy
from typing import Optional, Sequence

import numpy as np
from numpy.typing import NDArray

from orca_jax.core.requests.programs import ProgramBook, has_programs
from orca_jax.core.requests.request import Request, RequestState

try:  # numpy's C function itself: `np.count_nonzero`'s Python wrapper, which only calls
    # it (no axis), costs three times as much on a step's short mask (0.65 of 0.9 us).
    from numpy._core.multiarray import count_nonzero
except ImportError:  # a numpy that keeps it elsewhere: the wrapper, same answers
    count_nonzero = np.count_nonzero

_FIELDS = (
    "arrival_s", "prompt_len", "output_len", "priority", "tenant", "deadline_s", "state",
    "num_computed", "num_generated", "num_preemptions", "first_scheduled_s",
    "admitted_s", "first_token_s", "last_token_s", "finish_s", "last_token",
    "num_cached_tokens", "holder",
)

# The columns a run never writes (the workload's description of each request).
_FACTS = ("arrival_s", "prompt_len", "output_len", "priority", "tenant", "deadline_s")


class SpecCounts:
    """Each request's speculative decoding so far (docs/speculative.md): kept only in a run
    whose engine speculates (`RequestTable.spec`), so other runs hold no column for it.

    Attributes:
      drafted: `[N]` draft tokens verified for it so far (the plans' `spec_tokens`).
      accepted: `[N]` of those the engine accepted.
      draft_s: `[N]` seconds of drafting in the steps it drafted in (each such step's
        `StepOutput.draft_s`, counted for every request drafting in it).
      spec_steps: `[N]` steps in which it drafted at least one token.
      rejections: `[N]` of those, the steps that rejected a draft (accepted < drafted):
        with `accepted` the draft positions the target was seen to judge, so
        `accepted / (accepted + rejections)` estimates the per-token acceptance
        (the drafts after a rejection are never judged).
    """

    def __init__(self, n: int) -> None:
        self.drafted = np.zeros(n, dtype=np.int64)  # [N]
        self.accepted = np.zeros(n, dtype=np.int64)  # [N]
        self.draft_s = np.zeros(n, dtype=np.float64)  # [N]
        self.spec_steps = np.zeros(n, dtype=np.int64)  # [N]
        self.rejections = np.zeros(n, dtype=np.int64)  # [N]
        # Every request's accepted and judged draft positions together (running sums, so a
        # policy reads the run's acceptance without a pass over the table).
        self.total_accepted = 0
        self.total_judged = 0

    def count(self, ids: NDArray[np.int64],  # [n] distinct
              drafted: NDArray[np.int64],  # [n]
              accepted: NDArray[np.int64],  # [n]
              draft_s: float) -> None:
        """Adds one step's drafts of `ids` (those with drafted > 0 count a step)."""
        self.drafted[ids] += drafted
        self.accepted[ids] += accepted
        drafting = ids[drafted > 0]
        self.draft_s[drafting] += draft_s
        self.spec_steps[drafting] += 1
        rejected = accepted < drafted
        self.rejections[ids[rejected]] += 1
        self.total_accepted += int(accepted.sum())
        self.total_judged += int(accepted.sum()) + int(rejected.sum())

    def acceptance_rate(self, ids: NDArray[np.int64],  # [n]
                        prior: float = 0.0,
                        prior_weight: float = 0.0) -> NDArray[np.float64]:  # [n]
        """Each request's per-token acceptance so far: accepted / (accepted + rejections),
        the judged draft positions (`prior` where none was judged yet); with
        `prior_weight` > 0, `prior` counts as that many judged positions more (a
        smoothed estimate early on)."""
        accepted = self.accepted[ids].astype(np.float64)
        judged = accepted + self.rejections[ids]
        if prior_weight > 0:
            return (accepted + prior * prior_weight) / (judged + prior_weight)
        return np.where(judged > 0, accepted / np.maximum(judged, 1), prior)

    def pooled_rate(self, prior: float = 0.0, prior_weight: float = 0.0) -> float:
        """The run's per-token acceptance so far, every request's judged drafts together
        (`prior` counted as `prior_weight` judged positions; `prior` before any)."""
        judged = self.total_judged + prior_weight
        return (self.total_accepted + prior * prior_weight) / judged if judged else prior

    def copy(self) -> "SpecCounts":
        """A copy (a run's result keeps the counts as they were at its end)."""
        other = SpecCounts(0)
        for name in ("drafted", "accepted", "draft_s", "spec_steps", "rejections"):
            array = getattr(self, name).copy()
            array.setflags(write=False)
            setattr(other, name, array)
        other.total_accepted, other.total_judged = self.total_accepted, self.total_judged
        return other

    def summary(self) -> dict[str, float]:
        """The run's speculation in figures (`speculation.*` in summary.json): draft
        tokens verified and accepted, the acceptance rate, accepted tokens per
        speculating request-step (and tokens gained per such step, one more), drafting
        seconds in all and per request that drafted (mean, p99)."""
        drafted, accepted = int(self.drafted.sum()), int(self.accepted.sum())
        steps = int(self.spec_steps.sum())
        drafting = self.draft_s[self.spec_steps > 0]
        return {
            "drafted_tokens": drafted, "accepted_tokens": accepted,
            "acceptance_rate": accepted / drafted if drafted else 0.0,
            "request_steps": steps,
            "accepted_per_step": accepted / steps if steps else 0.0,
            "tokens_per_step": 1.0 + accepted / steps if steps else 1.0,
            "requests_drafting": int(drafting.size),
            "draft_s_per_request_mean": float(drafting.mean()) if drafting.size else 0.0,
            "draft_s_per_request_p99": (float(np.percentile(drafting, 99)) if drafting.size
                                        else 0.0),
        }


class RequestTable:
    """Mutable per-request arrays, indexed by request index. Owned by the scheduler."""

    def __init__(self, requests: Sequence[Request]) -> None:
        n = len(requests)
        self.specs: tuple[Request, ...] = tuple(requests)
        self.tenant_names: tuple[str, ...] = tuple(dict.fromkeys(r.tenant for r in requests))
        tenant_index = {name: i for i, name in enumerate(self.tenant_names)}
        nan = np.full(n, np.nan)
        self.arrival_s = np.array([r.arrival_s for r in requests], dtype=np.float64)  # [N]
        self.prompt_len = np.array([r.prompt_len for r in requests], dtype=np.int64)  # [N]
        self.output_len = np.array([r.output_len for r in requests], dtype=np.int64)  # [N]
        self.priority = np.array([r.priority for r in requests], dtype=np.int64)  # [N]
        self.tenant = np.array([tenant_index[r.tenant] for r in requests], dtype=np.int64)  # [N]
        self.deadline_s = np.array(  # [N] inf when none
            [np.inf if r.deadline_s is None else r.deadline_s for r in requests], dtype=np.float64)
        self.state = np.full(n, RequestState.PENDING, dtype=np.int8)  # [N]
        self.num_computed = np.zeros(n, dtype=np.int64)  # [N] tokens whose K/V are cached
        self.num_generated = np.zeros(n, dtype=np.int64)  # [N] output tokens sampled so far
        self.num_preemptions = np.zeros(n, dtype=np.int64)  # [N]
        self.first_scheduled_s = nan.copy()  # [N] start of its first step
        self.admitted_s = nan.copy()  # [N] start of its latest admission
        self.first_token_s = nan.copy()  # [N] end of the step that sampled its first token
        self.last_token_s = nan.copy()  # [N] end of the step that sampled its last token
        self.finish_s = nan.copy()  # [N] when its answer went back to the client
        # [N] newest known token id: the prompt's last until a token is generated, so the
        # token at position `known - 1` is always this one (the decode fast path of packing).
        # int32, as engines sample them (`StepOutput.sampled_tokens`): a step's samples are
        # written without a cast (0.7 against 0.15 us a step at 64 requests).
        self.last_token = np.array([0 if r.prompt_tokens is None else int(r.prompt_tokens[-1])
                                    for r in requests], dtype=np.int32)
        # [N] tokens its latest admission took from the prefix cache (0 without caching).
        self.num_cached_tokens = np.zeros(n, dtype=np.int64)
        # [N] the replica of the pool holding each request (its index), -1 for none:
        # not routed yet, or let go. A table of one scheduler holds every request (0).
        self.holder = np.zeros(n, dtype=np.int32)
        # [N] 0..N-1, read-only: a scheduler's queue of consecutive arrivals is a slice of
        # it (`orca_jax.core.loop.scheduler_loop.appended`), so that a queue of 10^5
        # requests is neither copied when one arrives nor when its head is admitted.
        self.indices = np.arange(n, dtype=np.int64)
        self.indices.setflags(write=False)
        # The workload's facts never change in a run: read-only, so that a run's result
        # shares them instead of copying them (`RunResult.from_log`).
        for fact in _FACTS:
            getattr(self, fact).setflags(write=False)
        self.reject_reason: dict[int, str] = {}
        self.replica = 0  # the replica this table object is the view of (`for_replica`)
        self.shared = False  # whether other replicas share the rows (`for_replica`)
        # The calls of agent programs and their releases (docs/programs.md); None without
        # programs, so that a run without them does no work for them.
        self.programs: Optional[ProgramBook] = (ProgramBook(self) if has_programs(requests)
                                                else None)
        # Drafted and accepted tokens per request: made by a scheduler whose engine
        # speculates (`Engine.speculates`), None otherwise.
        self.speculation: Optional[SpecCounts] = None

    def for_replica(self, replica: int) -> RequestTable:
        """The same rows (the same arrays, not copies) as replica `replica` of a pool sees
        them: its `holder` index is `replica`. Marks both tables shared, so that the
        scheduler checks that a plan names only requests its replica holds."""
        other = copy.copy(self)  # shallow: every array and the reject reasons are shared
        other.replica = replica
        self.shared = other.shared = True
        return other

    def fill(self, index: int, request: Request) -> None:
        """Gives row `index`, a placeholder no scheduler holds yet, the facts of `request`
        (an open workload: a server fills a row as each request arrives, in arrival order).
        Its tenant must be one of `tenant_names`; its progress columns are untouched.

        Raises:
          ValueError: the tenant is not one of the table's; nothing changes.
        """
        if request.tenant not in self.tenant_names:
            raise ValueError(f"fill: tenant {request.tenant!r} is not one of the table's "
                             f"{list(self.tenant_names)}")
        if isinstance(self.specs, tuple):  # a fixed workload's tuple: one list from now on
            self.specs = list(self.specs)  # type: ignore[assignment]
        self.specs[index] = request  # type: ignore[index]
        values = {"arrival_s": request.arrival_s, "prompt_len": request.prompt_len,
                  "output_len": request.output_len, "priority": request.priority,
                  "tenant": self.tenant_names.index(request.tenant),
                  "deadline_s": np.inf if request.deadline_s is None else request.deadline_s}
        for fact, value in values.items():
            self._write_fact(fact, np.asarray([index]), np.asarray([value]))
        if request.prompt_tokens is not None:
            self.last_token[index] = int(request.prompt_tokens[-1])

    def end_output(self, ids: NDArray[np.int64]) -> None:  # [n]
        """Cuts each request's output to the tokens it has generated (a stop string, an
        end-of-sequence token: the answer ends early, and its row says how long it got)."""
        self._write_fact("output_len", ids, self.num_generated[ids])

    def _write_fact(self, fact: str, ids: NDArray[np.int64], values: NDArray) -> None:
        """Writes a fact column, read-only again after (shared with finished results)."""
        column = getattr(self, fact)
        column.setflags(write=True)
        column[ids] = values
        column.setflags(write=False)

    def held_here(self, ids: NDArray[np.int64]) -> NDArray[np.bool_]:  # [n] -> [n]
        """Whether this replica holds each request."""
        return self.holder[ids] == self.replica

    def __len__(self) -> int:
        return len(self.specs)

    def num_known(self, ids: NDArray[np.int64]) -> NDArray[np.int64]:  # [n] -> [n]
        """Tokens each request knows: its prompt and what it generated so far."""
        return self.prompt_len[ids] + self.num_generated[ids]

    def num_uncomputed(self, ids: NDArray[np.int64],  # [n] -> [n]
                       computed: Optional[NDArray[np.int64]] = None  # [n] or None
                       ) -> NDArray[np.int64]:
        """Tokens each request could compute now (1 for a decode); `computed`: their
        `num_computed`, where the caller has read it already."""
        if computed is None:
            computed = self.num_computed[ids]
        return self.prompt_len[ids] + self.num_generated[ids] - computed

    def snapshot(self) -> dict[str, NDArray]:
        """Copies of every array (tests compare these before and after a rejected plan)."""
        return {name: getattr(self, name).copy() for name in _FIELDS}


class RequestTableView:
    """Read-only access to a RequestTable (what policies see).

    Attributes are read-only numpy views `[N]` indexed by request index:
    `arrival_s`, `prompt_len`, `output_len`, `priority`, `tenant` (index into
    `tenant_names`), `deadline_s` (inf when none), `state` (RequestState codes),
    `num_computed`, `num_generated`, `num_preemptions`, `first_scheduled_s`,
    `admitted_s`, `first_token_s`, `last_token_s`, `finish_s` (NaN until set),
    `num_cached_tokens` (tokens its first admission took from the prefix cache),
    `holder` (the replica of the pool holding it, -1 for none: on a cluster's replica,
    rows of requests another replica holds show their progress there — plan over
    `SchedulerView.waiting` and `running`, which list only this replica's).
    Speculative decoding's history reads through `num_drafted`, `num_accepted`,
    `acceptance_rate` (zeros, or the prior, where the engine does not speculate).
    """

    def __init__(self, table: RequestTable) -> None:
        self._table = table
        for name in _FIELDS:
            view = getattr(table, name).view()
            view.flags.writeable = False
            setattr(self, name, view)
        self.tenant_names = table.tenant_names

    def __len__(self) -> int:
        return len(self._table)

    def spec(self, index: int) -> Request:
        """The immutable Request of index `index` (its prompt tokens, tenant name, ...)."""
        return self._table.specs[index]

    def num_known(self, ids: NDArray[np.int64]) -> NDArray[np.int64]:  # [n] -> [n]
        """Tokens each request knows: prompt plus generated so far."""
        return self._table.num_known(ids)

    def num_uncomputed(self, ids: NDArray[np.int64]) -> NDArray[np.int64]:  # [n] -> [n]
        """Tokens each request could compute now: a prompt (or its rest), or 1 to decode."""
        return self._table.num_uncomputed(ids)

    def prefill_done(self, ids: NDArray[np.int64]) -> NDArray[np.bool_]:  # [n] -> [n]
        """Whether each request is decoding: its prompt (and any recomputed output) is cached."""
        return (self._table.num_generated[ids] > 0) & (self._table.num_uncomputed(ids) == 1)

    def remaining_output(self, ids: NDArray[np.int64]) -> NDArray[np.int64]:  # [n] -> [n]
        """Output tokens each request has still to generate."""
        return self._table.output_len[ids] - self._table.num_generated[ids]

    def num_drafted(self, ids: NDArray[np.int64]) -> NDArray[np.int64]:  # [n] -> [n]
        """Draft tokens verified for each request so far (speculative decoding; 0 where
        the engine does not speculate)."""
        counts = self._table.speculation
        return np.zeros(len(ids), np.int64) if counts is None else counts.drafted[ids]

    def num_accepted(self, ids: NDArray[np.int64]) -> NDArray[np.int64]:  # [n] -> [n]
        """Of those, the draft tokens the engine accepted."""
        counts = self._table.speculation
        return np.zeros(len(ids), np.int64) if counts is None else counts.accepted[ids]

    def acceptance_rate(self, ids: NDArray[np.int64],  # [n]
                        prior: float = 0.0,
                        prior_weight: float = 0.0) -> NDArray[np.float64]:  # [n]
        """Each request's per-token acceptance estimate so far
        (`SpecCounts.acceptance_rate`: accepted over the draft positions judged); `prior`
        where none was judged (or, with `prior_weight`, as that many judged positions)."""
        counts = self._table.speculation
        if counts is None:
            return np.full(len(ids), prior, np.float64)
        return counts.acceptance_rate(np.asarray(ids, np.int64), prior, prior_weight)

    def pooled_acceptance_rate(self, prior: float = 0.0, prior_weight: float = 0.0) -> float:
        """The run's per-token acceptance so far over every request's judged drafts
        (`SpecCounts.pooled_rate`); `prior` where the engine does not speculate."""
        counts = self._table.speculation
        return prior if counts is None else counts.pooled_rate(prior, prior_weight)
