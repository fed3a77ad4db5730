"""A run's results: requests.jsonl, steps.jsonl, summary.json, config.json and tables.

Everything here reads a finished run's `RunResult`, of one scheduler or of a
cluster (`Cluster.run()`); a cluster's files say which replica served each
request and ran each step, and its replicas.jsonl each replica's share. Rows
are made one at a time (`iter_request_rows`, `iter_step_rows`), so writing a
run of 10^5 requests holds no list of them; `request_row` and `step_row` also
make a live run's streamed rows (`orca_jax.runner.live_results`).

The field names are a contract researchers script against (see the README);
add to them, do not rename them.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Optional, Sequence

import numpy as np

from orca_jax.core.json_files import to_json_value
from orca_jax.core.requests.programs import ProgramRecord
from orca_jax.core.requests.request import RequestState
from orca_jax.core.requests.request_table import SpecCounts
from orca_jax.core.requests.run_record import StepLog
from orca_jax.core.requests.run_result import RunResult
from orca_jax.results import metrics
from orca_jax.results.programs import program_summary
from orca_jax.results.thrash import thrash_figures

if TYPE_CHECKING:  # a hint only: token times are a --log_token_times run's (`results.qoe`)
    from orca_jax.results.qoe import TokenTimes


def summarize(result: RunResult, *, ttft_slo_s: Optional[float] = None,
              tpot_slo_s: Optional[float] = None,
              num_gpus: Optional[int] = None,
              token_times: Optional[TokenTimes] = None) -> dict[str, Any]:
    """The run's summary.json content: flat, one scalar per field (see `summarize_run`)."""
    return summarize_run(result, ttft_slo_s=ttft_slo_s, tpot_slo_s=tpot_slo_s,
                         num_gpus=num_gpus, token_times=token_times)[0]


def summarize_run(result: RunResult, *, ttft_slo_s: Optional[float] = None,
                  tpot_slo_s: Optional[float] = None, num_gpus: Optional[int] = None,
                  token_times: Optional[TokenTimes] = None,
                  program_slo_s: Optional[float] = None
                  ) -> tuple[dict[str, Any], dict[str, list[dict[str, Any]]]]:
    """The run's summary.json content and the tables written beside it.

    The summary is flat (every value a number, a string, a bool or null), so
    `pandas.read_json(path, typ="series")` reads it as it is: metrics of
    orca_jax.results.metrics plus run facts. A run of several replicas also gets
    `num_replicas`, `router` and `load_imbalance`; a run with prefix caching
    active also gets `prefix_hit_rate` (prompt tokens taken from the cache over
    the prompt tokens of admitted requests) and `num_evictions` (cached pages
    evicted); `preemptions_per_finished`, `recomputed_tokens` and
    `recomputed_token_fraction` say whether the policy thrashed
    (`orca_jax.results.thrash`); `engine_busy_fraction` is `engine_s_total` over
    `duration_s` (and over the replicas; `busy_fraction`); `num_waiting_p50` the waiting
    queue's length after the median step; a run of several tenants,
    `num_tenants` and the fairness indices.
    With an SLO, `goodput_req_s_per_gpu` is the goodput over `num_gpus` (default:
    one per replica). A disaggregated run also gets `num_prefill_replicas` and its
    transfers' figures (`num_transfers`, `transfer_bytes_total`, `transfer_s_mean`,
    `transfer_wait_s_mean`: from the first token to the transfer's start). A run with
    slower KV tiers also gets `kv_stall_s_total` and `kv_stalled_steps` (steps that waited
    for KV moves between tiers) and, per tier, `kv_tiers.TIER.hit_tokens`, `read_bytes`,
    `write_bytes`, `stall_s`, `evictions` and swapped pages (steps.jsonl then says each
    step's `kv_stall_s`).
    A run whose engine speculates (docs/speculative.md) also gets `speculation.steps`
    (steps that verified drafts), `speculation.drafted_tokens`, `accepted_tokens`,
    `acceptance_rate`, `accepted_per_step` (per speculating request-step),
    `tokens_per_step`, `draft_s_total`, `draft_fraction` (of `engine_s_total`), and the
    drafting seconds per request that drafted (`draft_s_per_request_mean`, `_p99`).
    A run through pipeline stages (`--pp`) also gets `pipeline.stages`,
    `pipeline.micro_batches`, `pipeline.in_flight_mean`, `pipeline.busy_s` (time with a
    micro-batch in flight), `pipeline.bubble_fraction` (idle stage time over it, all
    stages), and per stage `pipeline.stageS.busy_s`, `bubble_s` and `bubble_fraction`
    (`orca_jax.core.loop.pipeline`).
    With the run's `token_times` (`--log_token_times`), Andes's QoE over the finished
    requests: `qoe_mean`, `qoe_p10`, `qoe_p50`, `qoe_attainment` and the targets
    (`TokenTimes.summary`, `orca_jax.results.qoe`).
    A workload of agent programs also gets the programs' completion times and the
    shares of their time computing, waiting and in tools (`results.programs`); with
    `program_slo_s`, the programs within it (`program_slo_attainment`,
    `program_goodput_per_s`).

    The parts with one row per something are tables (name -> rows), each written
    as NAME.jsonl: `tenants` (one row per tenant: `tenant`, `num_requests`,
    `num_finished`, `tokens_served`, `normalized_latency_mean_s`) with several
    tenants, `replicas` (`replica`, `num_requests`, `num_steps`) with several
    replicas (a disaggregated run's prefill replicas count the prompts they ran),
    `transfers` (`transfer_rows`) in a disaggregated run.
    """
    tenants = ([result.tenant_names[t] for t in result.tenant]
               if len(result.tenant_names) > 1 else None)
    clustered = result.num_replicas > 1
    summary: dict[str, Any] = {"policy": result.policy, "engine": result.engine}
    if clustered:
        summary.update({"num_replicas": result.num_replicas, "router": result.router})
    summary.update(metrics.run_summary(
        result.arrival_s, result.first_scheduled_s, result.first_token_s, result.finish_s,
        result.output_len, result.token_req, result.token_time_s,
        token_stats=result.token_stats, rejected=result.state == RequestState.REJECTED,
        tenants=tenants, ttft_slo_s=ttft_slo_s, tpot_slo_s=tpot_slo_s,
        prompt_len=result.prompt_len))
    tables: dict[str, list[dict[str, Any]]] = {}
    per_tenant = summary.pop("tenants", None)
    if per_tenant is not None:
        summary["num_tenants"] = len(per_tenant)
        tables["tenants"] = [{"tenant": name, **values} for name, values in per_tenant.items()]
    num_steps = result.num_steps
    real = int(result.step_array("num_tokens").sum())
    padded = int(result.step_array("num_padded_tokens").sum())
    host = result.step_array("host_s") if num_steps else np.zeros(1)
    summary.update({
        "num_steps": num_steps,
        "virtual_end_s": result.virtual_end_s,
        "padding_fraction": (padded - real) / padded if padded else 0.0,
        "num_preemptions": result.total_preemptions,
        "mean_batch_size": (float(result.step_array("num_seqs").astype(np.float64).mean())
                            if num_steps else 0.0),
        "host_us_per_step_median": float(np.median(host) * 1e6),
        # The waiting queue after the median step (each replica's own, in a cluster): 0
        # when the policy admitted everyone waiting at least every other step.
        "num_waiting_p50": (float(np.median(result.step_array("num_waiting")))
                            if num_steps else 0.0),
        "engine_s_total": float(_sum_in_order(result.step_array("step_s"))),
    })
    summary.update(thrash_figures(result.total_preemptions, summary["num_finished"],
                                  result.total_recomputed_tokens, real))
    summary["engine_busy_fraction"] = busy_fraction(
        summary["engine_s_total"], summary.get("duration_s"), result.num_replicas)
    if summary.get("goodput_req_s") is not None:
        gpus = num_gpus if num_gpus is not None else result.num_replicas
        summary["num_gpus"] = gpus
        summary["goodput_req_s_per_gpu"] = summary["goodput_req_s"] / gpus
    if result.prefill_replica is not None:
        summary.update(_transfers(result))
        tables["transfers"] = transfer_rows(result)
    if result.prefix_caching:
        summary.update(_prefix_caching(result))
    if result.kv_tiers is not None:
        summary.update(_kv_tiers(result))
    if result.pipeline is not None:
        summary.update(flatten({"pipeline": dict(result.pipeline)}))
    if result.speculation is not None:
        summary.update(_speculation(result))
    if clustered:
        summary["load_imbalance"] = _load_imbalance(result)
        tables["replicas"] = replica_rows(result)
    if token_times is not None:
        summary.update(token_times.summary())
    # Nothing without agent programs.
    summary.update(program_summary(result, program_slo_s=program_slo_s))
    return ({k: to_json_value(v) for k, v in summary.items()},
            {name: to_json_value(rows) for name, rows in tables.items()})


def busy_fraction(engine_s_total: float, duration_s: Optional[float],
                  num_replicas: int = 1) -> Optional[float]:
    """The share of the run's duration its engines spent in steps (over replicas: their
    mean), or None without a duration. Well below 1, the run waited for arrivals
    (arrival-bound): its throughput is the offered load's, not the policy's capacity."""
    if not duration_s:
        return None
    return engine_s_total / (duration_s * max(num_replicas, 1))


def _sum_in_order(values: np.ndarray) -> float:  # [S]
    """Python's `sum` of the values, left to right (numpy's sums pairwise: other last
    bits), a slice at a time (no list of them all)."""
    total = 0
    for start in range(0, values.size, 1 << 16):
        total = sum(values[start:start + (1 << 16)].tolist(), total)
    return total


def flatten(fields: Mapping[str, Any]) -> dict[str, Any]:
    """`fields` with each nested mapping spread into `parent.child` keys, as
    `pandas.json_normalize` names them (e.g. an engine's `compiled_fingerprints` by
    bucket: `compiled_fingerprints.16`), so summary.json stays flat."""
    flat: dict[str, Any] = {}
    for key, value in fields.items():
        if isinstance(value, Mapping):
            flat.update({f"{key}.{inner}": leaf for inner, leaf in flatten(value).items()})
        else:
            flat[key] = value
    return flat


def _prefix_caching(result: RunResult) -> dict[str, Any]:
    """How much of the admitted prompts the prefix cache served, and what it evicted."""
    admitted = ~np.isnan(result.first_scheduled_s)
    prompt = int(result.prompt_len[admitted].sum())
    # A request's hit is its first admission's (no self-hits after preemption), and
    # never more than its prompt.
    cached = int(np.minimum(result.num_cached_tokens, result.prompt_len)[admitted].sum())
    return {"prefix_hit_rate": cached / prompt if prompt else 0.0,
            "num_evictions": result.num_evictions}


def _kv_tiers(result: RunResult) -> dict[str, Any]:
    """A run with slower KV tiers: each tier's hits, bytes each way, stall seconds,
    evictions and swaps (`kv_tiers.host.hit_tokens`, ...), and the steps' stalls."""
    assert result.kv_tiers is not None
    stalls = list(result.kv_stall_s.values())
    return {"kv_stall_s_total": float(sum(stalls)), "kv_stalled_steps": len(stalls),
            **flatten({"kv_tiers": {name: dict(stats) for name, stats in
                                    result.kv_tiers.items()}})}


def _transfers(result: RunResult) -> dict[str, Any]:
    """A disaggregated run's prefill pool and KV transfers."""
    transfers = result.transfers
    seconds = np.array([t.end_s - t.start_s for t in transfers])
    waits = np.array([t.start_s - t.ready_s for t in transfers])
    return {"num_prefill_replicas": result.num_prefill_replicas,
            "num_transfers": len(transfers),
            "transfer_bytes_total": int(sum(t.num_bytes for t in transfers)),
            "transfer_s_mean": float(seconds.mean()) if transfers else None,
            "transfer_wait_s_mean": float(waits.mean()) if transfers else None}


def transfer_rows(result: RunResult) -> list[dict[str, Any]]:
    """One dict per KV transfer of a disaggregated run (transfers.jsonl), in the order
    they started: the request's id, `from` (prefill) and `to` (decode) replica, `bytes`
    (one TP shard's), and `ready_s` (first token), `start_s`, `end_s`."""
    return [{k: to_json_value(v) for k, v in {
        "request": result.request_ids[t.request], "from": t.from_replica,
        "to": t.to_replica, "bytes": t.num_bytes, "ready_s": t.ready_s,
        "start_s": t.start_s, "end_s": t.end_s}.items()} for t in result.transfers]


def _load_imbalance(result: RunResult) -> float:
    """Most output tokens routed to one replica over the mean: 1.0 is perfect balance
    (in a disaggregated run, over the decode pool, where the output tokens are made)."""
    routed = result.replica >= 0
    routed_tokens = np.bincount(result.replica[routed], weights=result.output_len[routed],
                                minlength=result.num_replicas)[result.num_prefill_replicas:]
    return float(routed_tokens.max() / routed_tokens.mean()) if routed_tokens.sum() else 1.0


def replica_rows(result: RunResult) -> list[dict[str, Any]]:
    """replicas.jsonl: each replica's `num_requests` (routed to it; for a disaggregated
    run's prefill replica, the prompts it ran) and `num_steps`."""
    requests = np.bincount(result.replica[result.replica >= 0], minlength=result.num_replicas)
    if result.prefill_replica is not None:
        prefilled = result.prefill_replica[result.prefill_replica >= 0]
        requests = requests + np.bincount(prefilled, minlength=result.num_replicas)
    steps = np.bincount(result.step_replica, minlength=result.num_replicas)
    return [{"replica": r, "num_requests": int(requests[r]), "num_steps": int(steps[r])}
            for r in range(result.num_replicas)]


def request_row(columns: Any, i: int, *, request_id: int, tenant: str, reason: Optional[str],
                output_tokens: Optional[Sequence[int]], prefix_caching: bool,
                replica: Optional[int] = None,
                prefill_replica: Optional[int] = None,
                token_times: Optional[Sequence[float]] = None,
                qoe: Optional[float] = None,
                program: Optional[ProgramFields] = None,
                speculation: Optional[SpecFields] = None) -> dict[str, Any]:
    """Request `i`'s requests.jsonl row.

    Args:
      columns: the per-request arrays by their `RunResult` names (a `RunResult`, or a
        live run's `RequestTable`, which names them the same).
      i: the request's index (arrival order).
      request_id: its `Request.id`.
      tenant: its tenant's name.
      reason: why it was rejected up front (None if it was not).
      output_tokens: its generated token ids, or None when the engine makes none.
      prefix_caching: whether the run had prefix caching active.
      replica: the replica that served it, in a run of several (-1: rejected up front).
      prefill_replica: the replica that ran its prompt, in a disaggregated run.
      token_times: its output tokens' times (run clock, in order), with
        `--log_token_times`; then `qoe` is its QoE (None unless it finished).
      program: in a run of agent programs, its `program_id` and `call_index` (both None:
        not a call of a program); None in any other run (the row has no such columns).
      speculation: in a run whose engine speculates, its `drafted_tokens` (draft tokens
        verified for it) and `accepted_tokens` (of those, accepted); None in any other
        run (the row has no such columns).
    """
    state = RequestState(columns.state[i])
    row = {
        "id": request_id, "arrival_s": float(columns.arrival_s[i]),
        "first_scheduled_s": float(columns.first_scheduled_s[i]),
        "first_token_s": float(columns.first_token_s[i]),
        "last_token_s": float(columns.last_token_s[i]),
        "finish_s": float(columns.finish_s[i]), "prompt_len": int(columns.prompt_len[i]),
        "output_len": int(columns.output_len[i]),
        "num_generated": int(columns.num_generated[i]),
        "num_preemptions": int(columns.num_preemptions[i]),
        "priority": int(columns.priority[i]),
        "tenant": tenant,
        "status": "finished" if state == RequestState.FINISHED else (
            "rejected" if state == RequestState.REJECTED else "unfinished"),
    }
    if state == RequestState.REJECTED:
        row["reason"] = reason
    if program is not None:
        row["program_id"], row["call_index"] = program
    if prefix_caching:
        row["num_cached_tokens"] = int(columns.num_cached_tokens[i])
    if output_tokens is not None:
        row["output_tokens"] = list(output_tokens)
    if replica is not None:
        row["replica"] = int(replica)
    if prefill_replica is not None:
        row["prefill_replica"] = int(prefill_replica)
    if token_times is not None:
        row["token_times"] = list(token_times)
        row["qoe"] = qoe
    if speculation is not None:
        row["drafted_tokens"], row["accepted_tokens"] = speculation
    return {k: to_json_value(v) for k, v in row.items()}


def iter_request_rows(result: RunResult,
                      token_times: Optional[TokenTimes] = None) -> Iterator[dict[str, Any]]:
    """One dict per request (requests.jsonl), in arrival order, made one at a time; with
    several replicas, each row ends with the `replica` that served it (-1: rejected up
    front). A rejected request's `reason` is the core's (up front) or
    `policy <name>: <its text>`. With `token_times`, each row ends with the request's
    `token_times` and `qoe` (`orca_jax.results.qoe.row_fields`)."""
    # Lazy: a run writes its rows as `row_lines` makes them, and a run without token times
    # (most) never imports `results.qoe` there.
    from orca_jax.results.qoe import row_fields
    for i in range(result.num_requests):
        yield request_row(result, i, **request_row_args(result, i),
                          **row_fields(token_times, i))


def request_row_args(result: RunResult, i: int) -> dict[str, Any]:
    """The keyword arguments of `request_row` (and `row_lines.request_line`) for request
    `i` of a finished run."""
    return dict(request_id=result.request_ids[i], tenant=result.tenant_names[result.tenant[i]],
                reason=result.reject_reason[i],
                output_tokens=(None if result.output_tokens is None
                               else result.output_tokens[i].tolist()),
                prefix_caching=result.prefix_caching,
                replica=int(result.replica[i]) if result.num_replicas > 1 else None,
                prefill_replica=(int(result.prefill_replica[i])
                                 if result.prefill_replica is not None else None),
                program=program_fields(result.programs, i),
                speculation=spec_fields(result.speculation, i))


# A requests.jsonl row's program columns: (program_id, call_index), both None for a
# request of no program in a run of programs.
ProgramFields = tuple[Optional[int], Optional[int]]
# A requests.jsonl row's speculation columns: (drafted_tokens, accepted_tokens).
SpecFields = tuple[int, int]


def spec_fields(speculation: Optional[SpecCounts], i: int) -> Optional[SpecFields]:
    """Request `i`'s speculation columns in a run whose engine speculates (`request_row`'s
    `speculation`); None in any other run."""
    if speculation is None:
        return None
    return int(speculation.drafted[i]), int(speculation.accepted[i])


def program_fields(programs: Optional[ProgramRecord], i: int) -> Optional[ProgramFields]:
    """Request `i`'s program columns in a run of programs (`request_row`'s `program`);
    None in a run without programs."""
    if programs is None:
        return None
    p = int(programs.program[i])
    if p < 0:
        return None, None
    return int(programs.program_ids[p]), int(programs.call_index[i])


def request_rows(result: RunResult) -> list[dict[str, Any]]:
    """`iter_request_rows` as a list (for a small run; files are written row by row)."""
    return list(iter_request_rows(result))


def step_row(step: StepLog, *, prefix_caching: bool, replica: Optional[int] = None,
             request_ids: Optional[Sequence[int]] = None,
             request_tokens: Optional[Sequence[int]] = None,
             preempted_ids: Optional[Sequence[int]] = None,
             rejected_ids: Optional[Sequence[int]] = None) -> dict[str, Any]:
    """One steps.jsonl row: `replica` first in a run of several; `num_cached_tokens` only
    with prefix caching active; with `log_step_requests`, `request_ids`/`request_tokens`
    and the ids the plans since the previous step preempted (`preempted_ids`) and
    rejected (`rejected_ids`)."""
    row = {k: to_json_value(v) for k, v in step._asdict().items()
           if prefix_caching or k != "num_cached_tokens"}
    if replica is not None:
        row = {"replica": int(replica), **row}
    if request_ids is not None and request_tokens is not None:
        row["request_ids"] = list(request_ids)
        row["request_tokens"] = list(request_tokens)
    if preempted_ids is not None and rejected_ids is not None:
        row["preempted_ids"] = list(preempted_ids)
        row["rejected_ids"] = list(rejected_ids)
    return row


def iter_step_rows(result: RunResult) -> Iterator[dict[str, Any]]:
    """One dict per step (steps.jsonl), made one at a time; with several replicas, each
    row starts with the `replica` that ran it; with `log_step_requests`, it also holds
    the step's `request_ids` (the requests' ids, as in requests.jsonl), `request_tokens`,
    `preempted_ids` and `rejected_ids`. `num_cached_tokens` is written only when prefix
    caching was active."""
    logged = result.step_requests is not None and result.step_tokens is not None
    removed = result.step_preempted is not None and result.step_rejected is not None
    ids = result.request_ids
    tiered = result.kv_tiers is not None
    for s, step in enumerate(result.steps):
        row = step_row(
            step, prefix_caching=result.prefix_caching,
            replica=int(result.step_replica[s]) if result.num_replicas > 1 else None,
            request_ids=([result.request_ids[i] for i in result.step_requests[s].tolist()]
                         if logged else None),
            request_tokens=result.step_tokens[s].tolist() if logged else None,
            preempted_ids=([ids[i] for i in result.step_preempted[s].tolist()]
                           if removed else None),
            rejected_ids=([ids[i] for i in result.step_rejected[s].tolist()]
                          if removed else None))
        if tiered:  # the seconds it waited for KV moves between tiers before it started
            row["kv_stall_s"] = float(result.kv_stall_s.get(s, 0.0))
        yield row


def step_rows(result: RunResult) -> list[dict[str, Any]]:
    """`iter_step_rows` as a list (for a small run; files are written row by row)."""
    return list(iter_step_rows(result))


def _speculation(result: RunResult) -> dict[str, Any]:
    """`speculation.*`: the run's drafted and accepted tokens and drafting time."""
    assert result.speculation is not None
    figures: dict[str, Any] = {"steps": len(result.spec_steps)}
    figures.update(result.speculation.summary())
    draft_s = math.fsum(s for _, _, s in result.spec_steps.values())
    engine_s = float(_sum_in_order(result.step_array("step_s"))) if result.num_steps else 0.0
    figures["draft_s_total"] = draft_s
    figures["draft_fraction"] = draft_s / engine_s if engine_s else 0.0
    return flatten({"speculation": figures})
