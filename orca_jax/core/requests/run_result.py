"""A finished run as a value: what summaries, results files and plots read.

`Scheduler.run()` returns one (and `Scheduler.result()` builds one for a caller
that steps by hand); `Cluster.run()` returns its replicas' results joined by
`RunResult.concat`. A result holds copies, as read-only numpy arrays and
tuples, so it outlives its scheduler and nothing after the run reaches into a
live one; the workload's facts (arrival times, lengths, priorities, tenants),
which no run writes, are the request table's own read-only arrays. Its tokens
are `TokenStats` (what the metrics read), and the log of every token only when
the run kept one (`Scheduler(log_tokens=True)`, the default; `run_policy` does
not: 16 bytes a token).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional, Sequence, TypeVar

import numpy as np
from numpy.typing import NDArray

from orca_jax.core.requests.programs import ProgramRecord
from orca_jax.core.requests.request import RequestState
from orca_jax.core.requests.request_table import RequestTable, SpecCounts
from orca_jax.core.requests.run_record import RunRecord, StepLogs, TransferLog
from orca_jax.core.requests.token_stats import TokenStats

_Array = TypeVar("_Array", bound=np.ndarray)


def _frozen(array: _Array) -> _Array:
    """A read-only copy (a result is a value: no one edits it in place); an array that
    is read-only already (a request table's workload facts) is shared, not copied."""
    if array.flags.owndata and not array.flags.writeable:  # not a view of a writable one
        return array
    copy = np.array(array)
    copy.setflags(write=False)
    return copy


def _own(*arrays: Optional[NDArray]) -> None:
    """Marks arrays made for the result alone (a token log, 16 bytes a token) read-only, so
    that `_frozen` keeps them rather than copying them."""
    for array in arrays:
        if array is not None:
            array.setflags(write=False)


def _zeros(n: int) -> NDArray[np.int64]:
    """`[n]` read-only zeros that take no memory (one replica's `replica`, `step_replica`)."""
    return np.broadcast_to(np.int64(0), (n,))


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class RunResult:
    """One run: a scheduler's, or a cluster's replicas joined (`concat`).

    Per-request arrays are indexed by request index (arrival order), N rows;
    times are virtual seconds, NaN where the event did not happen. K is the
    number of generated tokens, S the number of steps.
    """

    policy: str  # the policy's name
    engine: str  # the engine's name
    # ---------------------------------------------------------- per request
    request_ids: tuple[int, ...]  # [N] each request's `Request.id`
    tenant: NDArray[np.int64]  # [N] index into tenant_names
    tenant_names: tuple[str, ...]  # the tenants, in order of their first request
    priority: NDArray[np.int64]  # [N] smaller is more urgent
    arrival_s: NDArray[np.float64]  # [N]
    prompt_len: NDArray[np.int64]  # [N]
    output_len: NDArray[np.int64]  # [N] tokens the request asked for
    state: NDArray[np.int8]  # [N] RequestState codes at the end
    first_scheduled_s: NDArray[np.float64]  # [N] start of its first step
    first_token_s: NDArray[np.float64]  # [N] end of the step that sampled its first token
    last_token_s: NDArray[np.float64]  # [N] end of the step that sampled its last token
    finish_s: NDArray[np.float64]  # [N] when its answer went back to the client
    num_generated: NDArray[np.int64]  # [N] output tokens sampled
    num_preemptions: NDArray[np.int64]  # [N] times it was preempted
    # [N] why it was rejected (up front by the core, or `policy <name>: ...`); None if not
    reject_reason: tuple[Optional[str], ...]
    num_cached_tokens: NDArray[np.int64]  # [N] tokens its first admission took from the cache
    # [N] of [num_generated[i]] int32 token ids; None when the engine produces no ids.
    output_tokens: Optional[tuple[NDArray[np.int32], ...]]
    # ---------------------------------------------------------- per token
    # [K] request index of every generated token, in time order, and [K] when it was
    # generated (the end of its step); None when the run counted its tokens instead of
    # logging each (`RunRecord.logs_tokens`: a run through `runner.run_policy`).
    token_req: Optional[NDArray[np.int64]]
    token_time_s: Optional[NDArray[np.float64]]
    # What the metrics read of the tokens (counts, last times, gaps; `TokenStats`), its
    # gaps those of the requests with a finite `finish_s`.
    token_stats: TokenStats
    # ---------------------------------------------------------- per step
    steps: StepLogs  # [S] each step (a `StepLog`) as steps.jsonl writes it
    step_replica: NDArray[np.int64]  # [S] the replica that ran each step
    # [S] of [n]: the requests each step computed, and how many positions each (its planned
    # tokens plus the draft tokens it verified, in a speculating step: they sum to the
    # step's `num_tokens`); [S] of [m]: the requests holding a batch place after it
    # (running, or finished and not yet released).
    # None unless the run had `SchedulerConfig.features.log_step_requests`.
    step_requests: Optional[tuple[NDArray[np.int64], ...]]
    step_tokens: Optional[tuple[NDArray[np.int64], ...]]
    step_held: Optional[tuple[NDArray[np.int64], ...]]
    # [S] of [p] and [j]: the requests preempted and rejected by the plans since the
    # previous step (removals after the last step go with it). None as step_requests.
    step_preempted: Optional[tuple[NDArray[np.int64], ...]] = None
    step_rejected: Optional[tuple[NDArray[np.int64], ...]] = None
    # ---------------------------------------------------------- the run
    total_preemptions: int  # preemptions over the run (every request's, summed)
    # Computed tokens the preemptions threw away, to compute again (`RunRecord`), summed.
    total_recomputed_tokens: int = 0
    virtual_end_s: float  # the clock when the run ended (a cluster: its last replica's)
    replica: NDArray[np.int64]  # [N] replica that served it; -1 rejected up front by a cluster
    num_replicas: int  # 1 for one scheduler
    router: Optional[str]  # the router's name; None for one scheduler
    prefix_caching: bool = False  # whether prefix caching was active (on some replica)
    num_evictions: int = 0  # cached KV pages evicted over the run (every replica's, summed)
    # A disaggregated cluster (orca_jax.cluster.disaggregated): [N] the prefill replica that
    # ran each request's prompt (-1: none), `replica` being its decode replica; its KV
    # transfers in the order they started. None and () otherwise.
    prefill_replica: Optional[NDArray[np.int64]] = None
    num_prefill_replicas: int = 0  # replicas 0..num_prefill_replicas - 1 are the prefill pool
    transfers: tuple[TransferLog, ...] = ()
    # Slower KV tiers (host, disk): per tier, its hits, bytes each way, stall seconds,
    # evictions and swapped pages (`LinkedTiers.summary`); None without them. And step
    # index -> seconds it waited for KV moves between tiers (steps that waited only).
    kv_tiers: Optional[Mapping[str, Mapping[str, Any]]] = None
    kv_stall_s: Mapping[int, float] = dataclasses.field(default_factory=dict)
    # A workload of agent programs: each call's program and release (`arrival_s` holds a
    # call's release, when the run let it arrive; docs/programs.md). None otherwise.
    programs: Optional[ProgramRecord] = None
    # Pipeline stages (`orca_jax.core.loop.pipeline.PipelineExecutor.stats`): stages,
    # micro-batches, time with one in flight, each stage's busy and bubble seconds. None
    # without a pipeline.
    pipeline: Optional[Mapping[str, Any]] = None
    # Speculative decoding (docs/speculative.md): each request's drafted and accepted tokens
    # and drafting seconds (`SpecCounts`), and each speculating step's (drafted, accepted,
    # draft seconds) by step index; None and empty for a run whose engine does not speculate.
    speculation: Optional[SpecCounts] = None
    spec_steps: Mapping[int, tuple[int, int, float]] = dataclasses.field(default_factory=dict)

    @property
    def num_requests(self) -> int:
        return len(self.request_ids)

    @property
    def num_steps(self) -> int:
        return len(self.steps)

    def step_array(self, field: str) -> NDArray:
        """One StepLog field over all steps, `[S]` (int64 or float64)."""
        return self.steps.column(field)

    @classmethod
    def from_log(cls, table: RequestTable, record: RunRecord, *, policy: str, engine: str,
                 virtual_end_s: float,
                 output_tokens: Optional[Sequence[Sequence[int]]],
                 prefix_caching: bool = False, num_evictions: int = 0,
                 kv_tiers: Optional[Mapping[str, Mapping[str, Any]]] = None,
                 kv_stall_s: Optional[Mapping[int, float]] = None,
                 pipeline: Optional[Mapping[str, Any]] = None) -> RunResult:
        """One scheduler's run, copied from its request table and log.

        Args:
          table: the scheduler's request table.
          record: the scheduler's log of steps and tokens.
          policy, engine: their names.
          virtual_end_s: the scheduler's clock.
          output_tokens: `[N]` the tokens each request generated, or None when
            the engine produces no token ids.
          prefix_caching: whether prefix caching was active.
          num_evictions: cached KV pages the run evicted.
        """
        token_req, token_time = record.token_log() if record.logs_tokens else (None, None)
        _own(token_req, token_time)
        held = record.step_requests if record.logs_step_requests else None
        finished = np.isfinite(table.finish_s)  # [N] the requests whose gaps the stats count
        n = len(table)
        state = table.state
        if table.shared:  # a replica's own result: another replica's requests are away
            state = np.where((table.holder == table.replica) | (table.holder < 0), state,
                             np.int8(RequestState.ROUTED_AWAY))
        arrival_s, programs = table.arrival_s, None
        if table.programs is not None:  # a call arrived when the run released it
            programs = ProgramRecord.of(table.programs)
            released = table.programs.has_parents & ~np.isnan(programs.release_s)
            arrival_s = np.where(released, programs.release_s, arrival_s)
        return cls(
            policy=policy, engine=engine, programs=programs,
            request_ids=tuple(spec.id for spec in table.specs), tenant=_frozen(table.tenant),
            tenant_names=table.tenant_names, priority=_frozen(table.priority),
            arrival_s=_frozen(arrival_s), prompt_len=_frozen(table.prompt_len),
            output_len=_frozen(table.output_len), state=_frozen(state),
            first_scheduled_s=_frozen(table.first_scheduled_s),
            first_token_s=_frozen(table.first_token_s), last_token_s=_frozen(table.last_token_s),
            finish_s=_frozen(table.finish_s), num_generated=_frozen(table.num_generated),
            num_preemptions=_frozen(table.num_preemptions),
            reject_reason=tuple(table.reject_reason.get(i) for i in range(n)),
            num_cached_tokens=_frozen(table.num_cached_tokens),
            output_tokens=(None if output_tokens is None else
                           tuple(_frozen(np.asarray(t, np.int32)) for t in output_tokens)),
            token_req=None if token_req is None else _frozen(token_req),
            token_time_s=None if token_time is None else _frozen(token_time),
            token_stats=(record.token_stats(finished) if token_req is None
                         else TokenStats.from_log(token_req, token_time, finished)),
            steps=record.steps.frozen(),
            step_replica=_zeros(len(record.steps)),
            step_requests=None if held is None else tuple(_frozen(s[0]) for s in held),
            step_tokens=None if held is None else tuple(_frozen(s[1]) for s in held),
            step_held=None if held is None else tuple(_frozen(s[2]) for s in held),
            step_preempted=None if held is None else tuple(_frozen(s[3]) for s in held),
            step_rejected=None if held is None else tuple(_frozen(s[4]) for s in held),
            total_preemptions=record.num_preemptions,
            total_recomputed_tokens=record.num_recomputed_tokens,
            virtual_end_s=float(virtual_end_s),
            replica=_zeros(n),
            num_replicas=1, router=None, prefix_caching=prefix_caching,
            num_evictions=num_evictions, kv_tiers=kv_tiers, kv_stall_s=dict(kv_stall_s or {}),
            pipeline=pipeline,
            speculation=None if table.speculation is None else table.speculation.copy(),
            spec_steps=dict(record.spec_steps))

    @classmethod
    def concat(cls, results: Sequence[RunResult], *, router: str,
               unrouted_ok: bool = False) -> RunResult:
        """A cluster's run: its replicas' results (replica r's at index r) joined.

        Every replica's result covers the whole workload. A request's row comes
        from the replica that served it, the one where it is not ROUTED_AWAY; a
        request rejected up front is rejected on every replica, and its row is
        replica 0's (its replica -1); one a replica's policy rejected is that
        replica's. Token logs merge in time order (ties keep replica order), and
        results that counted their tokens without a log (`TokenTally`) join their
        counts, where each request's tokens are all in one result; steps follow each
        other replica by replica.

        Args:
          results: one result per replica, each of one scheduler.
          router: the router's name.
          unrouted_ok: a request routed away on every replica is kept, as replica
            0's row with replica -1 (a disaggregated cluster's decode pool never
            receives the requests its prefill pool rejected).

        Raises:
          ValueError: no results, a result of several replicas, results of
            different workloads, some with a token log and some without, results
            without one where a request's tokens are in several, or a request not
            routed to exactly one replica.
        """
        if not results:
            raise ValueError("RunResult.concat: no results to join")
        first = results[0]
        logs = first.token_req is not None
        for index, result in enumerate(results):
            if (result.token_req is not None) != logs:
                raise ValueError(f"RunResult.concat: result {index} "
                                 f"{'has no' if logs else 'has a'} token log and result 0 "
                                 f"{'has' if logs else 'has none'}; join results alike")
            if result.num_replicas != 1:
                raise ValueError(f"RunResult.concat: result {index} already joins "
                                 f"{result.num_replicas} replicas")
            if result.request_ids != first.request_ids:
                raise ValueError(f"RunResult.concat: result {index} is of another workload "
                                 "than result 0")
        state = np.stack([r.state for r in results])  # [R, N]
        kept = state != RequestState.ROUTED_AWAY  # [R, N]
        # Rejected up front: on every replica (a policy's rejection is on its replica only).
        rejected = (state == RequestState.REJECTED).all(axis=0)  # [N]
        missing = (kept.sum(axis=0) == 0) & unrouted_ok  # [N] kept, as replica -1
        unrouted = (kept.sum(axis=0) != 1) & ~rejected & ~missing
        if len(results) > 1 and unrouted.any():
            i = int(np.argmax(unrouted))
            raise ValueError(f"RunResult.concat: request {first.request_ids[i]} is on replicas "
                             f"{np.flatnonzero(kept[:, i]).tolist()}; each request must be "
                             "routed to one (run the cluster to the end)")
        serving = np.where(rejected | missing, 0, np.argmax(kept, axis=0))  # [N]
        # [N] each other replica's rows: one [N] copy a field, not an [R, N] stack of them.
        others = [(index, serving == index) for index in range(1, len(results))]

        def served(field: str) -> NDArray:  # [N]
            joined = np.array(getattr(first, field))
            for index, rows in others:
                joined[rows] = getattr(results[index], field)[rows]
            _own(joined)
            return joined

        token_req = token_time = None
        if logs:
            token_req, token_time = _merged_token_logs(results)
            _own(token_req, token_time)
        logged = all(r.step_requests is not None for r in results)
        finish_s = served("finish_s")
        finished = np.isfinite(finish_s)  # [N]
        token_stats = _joined_token_stats(results, finished)
        if token_stats is None:
            if not logs:  # counted apart: a request's tokens on two replicas cannot be
                raise ValueError("RunResult.concat: a request's tokens are on several "
                                 "results, which counted them without a token log; "
                                 "join results that log them")
            token_stats = TokenStats.from_log(token_req, token_time, finished)
        return dataclasses.replace(
            first,
            state=served("state"), first_scheduled_s=served("first_scheduled_s"),
            first_token_s=served("first_token_s"), last_token_s=served("last_token_s"),
            finish_s=finish_s, num_generated=served("num_generated"),
            num_preemptions=served("num_preemptions"),
            num_cached_tokens=served("num_cached_tokens"),
            reject_reason=tuple(results[r].reject_reason[i] for i, r in enumerate(serving)),
            output_tokens=(None if first.output_tokens is None else
                           tuple(results[r].output_tokens[i] for i, r in enumerate(serving))),
            token_req=None if token_req is None else _frozen(token_req),
            token_time_s=None if token_time is None else _frozen(token_time),
            token_stats=token_stats,
            steps=StepLogs.concat([r.steps for r in results]),
            step_replica=_frozen(np.repeat(np.arange(len(results)),
                                           [r.num_steps for r in results])),
            step_requests=(tuple(a for r in results for a in r.step_requests)
                           if logged else None),
            step_tokens=tuple(a for r in results for a in r.step_tokens) if logged else None,
            step_held=tuple(a for r in results for a in r.step_held) if logged else None,
            step_preempted=(tuple(a for r in results for a in r.step_preempted)
                            if logged else None),
            step_rejected=(tuple(a for r in results for a in r.step_rejected)
                           if logged else None),
            total_preemptions=sum(r.total_preemptions for r in results),
            total_recomputed_tokens=sum(r.total_recomputed_tokens for r in results),
            virtual_end_s=max(r.virtual_end_s for r in results),
            replica=_frozen(np.where(rejected | missing, -1, serving)),
            num_replicas=len(results),
            router=router, prefix_caching=any(r.prefix_caching for r in results),
            num_evictions=sum(r.num_evictions for r in results))


def _merged_token_logs(results: Sequence[RunResult]
                       ) -> tuple[NDArray[np.int64], NDArray[np.float64]]:  # [K], [K]
    """The replicas' token logs merged in time order, ties in replica order: what a stable
    sort of the logs one after another gives, bit for bit, made step by step (a step's
    tokens share its time), each token placed once, without the sort over every token
    nor a copy of the logs joined."""
    logs = [(r.token_req, r.token_time_s) for r in results]
    # Each log's runs of one time (a step's tokens): where each starts, and its time.
    starts = []
    for _, times in logs:
        changes = np.flatnonzero(times[1:] != times[:-1]) + 1  # [u - 1]
        starts.append(np.concatenate([np.zeros(min(times.size, 1), np.int64), changes]))
    run_times = np.concatenate([times[first] for (_, times), first in zip(logs, starts)])
    lengths = np.concatenate([np.diff(first, append=times.size)
                              for (_, times), first in zip(logs, starts)])  # [U]
    order = np.argsort(run_times, kind="stable")  # [U] ties: replica order, then log order
    placed = np.empty_like(lengths)  # [U] where each run starts in the merged log
    placed[order] = np.cumsum(lengths[order]) - lengths[order]
    total = int(lengths.sum())
    token_req = np.empty(total, np.result_type(*(req for req, _ in logs)))
    token_time = np.empty(total, np.result_type(*(times for _, times in logs)))
    done = 0
    for (req, times), first in zip(logs, starts):
        runs = slice(done, done + first.size)
        # [K_r] each token's place: its run's place, plus its own place in its run.
        where = np.repeat(placed[runs] - first, lengths[runs]) + np.arange(times.size)
        token_req[where] = req
        token_time[where] = times
        done += first.size
    return token_req, token_time


def _joined_token_stats(results: Sequence[RunResult],
                        finished: NDArray[np.bool_]) -> Optional[TokenStats]:  # [N]
    """The joined log's `TokenStats` from the replicas' own, where every request's tokens
    are on one replica and each replica counted the gaps of the requests `finished`
    counts (so each request's gaps are those of its replica's log); else None (a
    migrated or disaggregated request's tokens span replicas: the joined log is read)."""
    holders = np.zeros(finished.shape, np.int64)  # [N] replicas holding tokens of each
    for result in results:
        has = result.token_stats.num_tokens > 0  # [N]
        if not np.array_equal(np.isfinite(result.finish_s)[has], finished[has]):
            return None
        holders += has
    if (holders > 1).any():
        return None
    return TokenStats.joined([result.token_stats for result in results])
