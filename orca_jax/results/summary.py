"""A run's results: requests.jsonl, steps.jsonl, summary.json and config.json.

Everything here reads a finished run's `RunResult`, of one scheduler or of a
cluster (`Cluster.run()`); a cluster's files say which replica served each
request and ran each step, and its summary each replica's share.

The field names are a contract researchers script against (see the README);
add to them, do not rename them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping, Optional

import numpy as np

from orca_jax.core.json_files import to_json_value, write_json_atomic, write_jsonl_atomic
from orca_jax.core.request import RequestState
from orca_jax.core.run_result import RunResult
from orca_jax.results import metrics


def summarize(result: RunResult, *, ttft_slo_s: Optional[float] = None,
              tpot_slo_s: Optional[float] = None,
              num_gpus: Optional[int] = None) -> dict[str, Any]:
    """The run's summary.json content (metrics of orca_jax.results.metrics plus run facts).

    A run of several replicas also gets `num_replicas`, `router`, and each
    replica's share (`replica_num_requests`, `replica_num_steps`, `load_imbalance`).
    A run with prefix caching active also gets `prefix_hit_rate` (prompt tokens
    taken from the cache over the prompt tokens of admitted requests) and
    `num_evictions` (cached pages evicted); other runs' summaries stay as they were.
    With an SLO, `goodput_req_s_per_gpu` is the goodput over `num_gpus` (default:
    one per replica). A disaggregated run also gets `num_prefill_replicas` and its
    transfers' figures (`num_transfers`, `transfer_bytes_total`, `transfer_s_mean`,
    `transfer_wait_s_mean`: from the first token to the transfer's start).
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
        rejected=result.state == RequestState.REJECTED, tenants=tenants,
        ttft_slo_s=ttft_slo_s, tpot_slo_s=tpot_slo_s))
    steps = result.steps
    real = sum(s.num_tokens for s in steps)
    padded = sum(s.num_padded_tokens for s in steps)
    host = np.asarray([s.host_s for s in steps]) if steps else np.zeros(1)
    summary.update({
        "num_steps": len(steps),
        "virtual_end_s": result.virtual_end_s,
        "padding_fraction": (padded - real) / padded if padded else 0.0,
        "num_preemptions": result.total_preemptions,
        "mean_batch_size": float(np.mean([s.num_seqs for s in steps])) if steps else 0.0,
        "host_us_per_step_median": float(np.median(host) * 1e6),
        "engine_s_total": float(sum(s.step_s for s in steps)),
    })
    if summary.get("goodput_req_s") is not None:
        gpus = num_gpus if num_gpus is not None else result.num_replicas
        summary["num_gpus"] = gpus
        summary["goodput_req_s_per_gpu"] = summary["goodput_req_s"] / gpus
    if result.prefill_replica is not None:
        summary.update(_transfers(result))
    if result.prefix_caching:
        summary.update(_prefix_caching(result))
    if clustered:
        summary.update(_replica_shares(result))
    return {k: to_json_value(v) for k, v in summary.items()}


def _prefix_caching(result: RunResult) -> dict[str, Any]:
    """How much of the admitted prompts the prefix cache served, and what it evicted."""
    admitted = ~np.isnan(result.first_scheduled_s)
    prompt = int(result.prompt_len[admitted].sum())
    # A request's hit is its first admission's (no self-hits after preemption), and
    # never more than its prompt.
    cached = int(np.minimum(result.num_cached_tokens, result.prompt_len)[admitted].sum())
    return {"prefix_hit_rate": cached / prompt if prompt else 0.0,
            "num_evictions": result.num_evictions}


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


def _replica_shares(result: RunResult) -> dict[str, Any]:
    """Each replica's requests and steps, and how unevenly the output tokens were routed."""
    replicas = range(result.num_replicas)
    # Disaggregated: a prefill replica's requests are those whose prompt it ran; the output
    # tokens' balance is the decode pool's.
    prefilled = (result.prefill_replica if result.prefill_replica is not None
                 else np.full(result.num_requests, -1))
    routed_tokens = np.array([result.output_len[result.replica == r].sum()
                              for r in replicas[result.num_prefill_replicas:]], dtype=np.float64)
    return {
        "replica_num_requests": [int(np.count_nonzero(result.replica == r)
                                     + np.count_nonzero(prefilled == r)) for r in replicas],
        "replica_num_steps": [int(np.count_nonzero(result.step_replica == r)) for r in replicas],
        # Most output tokens routed to one replica over the mean: 1.0 is perfect balance.
        "load_imbalance": (float(routed_tokens.max() / routed_tokens.mean())
                           if routed_tokens.sum() else 1.0),
    }


def request_rows(result: RunResult) -> list[dict[str, Any]]:
    """One dict per request (requests.jsonl), in arrival order; with several replicas,
    each row ends with the `replica` that served it (-1: rejected up front). A rejected
    request's `reason` is the core's (up front) or `policy <name>: <its text>`."""
    rows = []
    for i in range(result.num_requests):
        state = RequestState(result.state[i])
        row = {
            "id": result.request_ids[i], "arrival_s": result.arrival_s[i],
            "first_scheduled_s": result.first_scheduled_s[i],
            "first_token_s": result.first_token_s[i], "last_token_s": result.last_token_s[i],
            "finish_s": result.finish_s[i], "prompt_len": int(result.prompt_len[i]),
            "output_len": int(result.output_len[i]),
            "num_generated": int(result.num_generated[i]),
            "num_preemptions": int(result.num_preemptions[i]),
            "priority": int(result.priority[i]),
            "tenant": result.tenant_names[result.tenant[i]],
            "status": "finished" if state == RequestState.FINISHED else (
                "rejected" if state == RequestState.REJECTED else "unfinished"),
        }
        if state == RequestState.REJECTED:
            row["reason"] = result.reject_reason[i]
        if result.prefix_caching:
            row["num_cached_tokens"] = int(result.num_cached_tokens[i])
        if result.output_tokens is not None:
            row["output_tokens"] = result.output_tokens[i].tolist()
        if result.num_replicas > 1:
            row["replica"] = int(result.replica[i])
        if result.prefill_replica is not None:
            row["prefill_replica"] = int(result.prefill_replica[i])
        rows.append({k: to_json_value(v) for k, v in row.items()})
    return rows


def step_rows(result: RunResult) -> list[dict[str, Any]]:
    """One dict per step (steps.jsonl); with several replicas, each row starts with the
    `replica` that ran it; with `log_step_requests`, it also holds the step's
    `request_ids` (the requests' ids, as in requests.jsonl) and `request_tokens`, and
    the ids the plans since the previous step preempted (`preempted_ids`) and
    rejected (`rejected_ids`). `num_cached_tokens` is written only when prefix
    caching was active."""
    dropped = () if result.prefix_caching else ("num_cached_tokens",)
    rows = [{k: to_json_value(v) for k, v in s._asdict().items() if k not in dropped}
            for s in result.steps]
    if result.num_replicas > 1:
        rows = [{"replica": int(r), **row} for r, row in zip(result.step_replica, rows)]
    if result.step_requests is not None and result.step_tokens is not None:
        for row, requests, tokens in zip(rows, result.step_requests, result.step_tokens):
            row["request_ids"] = [result.request_ids[i] for i in requests.tolist()]
            row["request_tokens"] = tokens.tolist()
    if result.step_preempted is not None and result.step_rejected is not None:
        for row, preempted, rejected in zip(rows, result.step_preempted, result.step_rejected):
            row["preempted_ids"] = [result.request_ids[i] for i in preempted.tolist()]
            row["rejected_ids"] = [result.request_ids[i] for i in rejected.tolist()]
    return rows


def transfer_rows(result: RunResult) -> list[dict[str, Any]]:
    """One dict per KV transfer of a disaggregated run (transfers.jsonl), in the order
    they started: the request's id, `from` (prefill) and `to` (decode) replica, `bytes`
    (one TP shard's), and `ready_s` (first token), `start_s`, `end_s`."""
    return [{"request": result.request_ids[t.request], "from": t.from_replica,
             "to": t.to_replica, "bytes": t.num_bytes, "ready_s": t.ready_s,
             "start_s": t.start_s, "end_s": t.end_s} for t in result.transfers]


def write_results(out_dir: os.PathLike, result: RunResult, summary: Mapping[str, Any],
                  config: Mapping[str, Any]) -> Path:
    """Writes config.json, requests.jsonl, steps.jsonl and summary.json into `out_dir`
    (and transfers.jsonl for a disaggregated run)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / "config.json", config)
    write_jsonl_atomic(out / "requests.jsonl", request_rows(result))
    write_jsonl_atomic(out / "steps.jsonl", step_rows(result))
    if result.prefill_replica is not None:
        write_jsonl_atomic(out / "transfers.jsonl",
                           [{k: to_json_value(v) for k, v in row.items()}
                            for row in transfer_rows(result)])
    write_json_atomic(out / "summary.json", summary)
    return out
