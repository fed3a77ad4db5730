"""A run's results: requests.jsonl, steps.jsonl, summary.json and config.json.

The field names are a contract researchers script against (see the README);
add to them, do not rename them.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from orca_jax.results import metrics
from orca_jax.core.request import RequestState
from orca_jax.core.scheduler import Scheduler


def json_value(value: Any) -> Any:
    """JSON-ready: numpy scalars to Python, NaN and inf to None."""
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return float(value) if math.isfinite(value) else None
    return value


def summarize(scheduler: Scheduler, *, ttft_slo_s: Optional[float] = None,
              tpot_slo_s: Optional[float] = None) -> dict[str, Any]:
    """The run's summary.json content (metrics of orca_jax.results.metrics plus run facts)."""
    table, record = scheduler.table, scheduler.record
    token_req, token_time = record.token_log()
    rejected = table.state == RequestState.REJECTED
    tenants = ([table.tenant_names[t] for t in table.tenant]
               if len(table.tenant_names) > 1 else None)
    summary: dict[str, Any] = {
        "policy": scheduler.policy.name,
        "engine": scheduler.engine.name,
    }
    summary.update(metrics.run_summary(
        table.arrival_s, table.first_scheduled_s, table.first_token_s, table.finish_s,
        table.output_len, token_req, token_time, rejected=rejected, tenants=tenants,
        ttft_slo_s=ttft_slo_s, tpot_slo_s=tpot_slo_s))
    steps = record.steps
    real = sum(s.num_tokens for s in steps)
    padded = sum(s.num_padded_tokens for s in steps)
    host = np.asarray([s.host_s for s in steps]) if steps else np.zeros(1)
    summary.update({
        "num_steps": len(steps),
        "virtual_end_s": scheduler.now_s,
        "padding_fraction": (padded - real) / padded if padded else 0.0,
        "num_preemptions": record.num_preemptions,
        "mean_batch_size": float(np.mean([s.num_seqs for s in steps])) if steps else 0.0,
        "host_us_per_step_median": float(np.median(host) * 1e6),
        "engine_s_total": float(sum(s.step_s for s in steps)),
    })
    return {k: json_value(v) for k, v in summary.items()}


def request_rows(scheduler: Scheduler,
                 indices: Optional[Sequence[int]] = None) -> list[dict[str, Any]]:
    """One dict per request (requests.jsonl): all in arrival order, or those of `indices`."""
    table = scheduler.table
    rows = []
    with_tokens = scheduler.engine.needs_token_ids
    for i in range(len(table)) if indices is None else indices:
        spec = table.specs[i]
        state = RequestState(table.state[i])
        row = {
            "id": spec.id, "arrival_s": table.arrival_s[i],
            "first_scheduled_s": table.first_scheduled_s[i],
            "first_token_s": table.first_token_s[i], "last_token_s": table.last_token_s[i],
            "finish_s": table.finish_s[i], "prompt_len": int(table.prompt_len[i]),
            "output_len": int(table.output_len[i]),
            "num_generated": int(table.num_generated[i]),
            "num_preemptions": int(table.num_preemptions[i]),
            "priority": int(table.priority[i]), "tenant": spec.tenant,
            "status": "finished" if state == RequestState.FINISHED else (
                "rejected" if state == RequestState.REJECTED else "unfinished"),
        }
        if state == RequestState.REJECTED:
            row["reason"] = table.reject_reason[i]
        if with_tokens:
            row["output_tokens"] = scheduler.generated_tokens(i)
        rows.append({k: json_value(v) for k, v in row.items()})
    return rows


def step_rows(scheduler: Scheduler) -> list[dict[str, Any]]:
    """One dict per step (steps.jsonl); with `log_step_requests`, also the step's
    `request_ids` (the requests' ids, as in requests.jsonl) and `request_tokens`."""
    record, specs = scheduler.record, scheduler.table.specs
    rows = [{k: json_value(v) for k, v in s._asdict().items()} for s in record.steps]
    if record.step_requests:
        for row, (requests, tokens) in zip(rows, record.step_requests):
            row["request_ids"] = [specs[i].id for i in requests.tolist()]
            row["request_tokens"] = tokens.tolist()
    return rows


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    """Writes one JSON object per line, atomically (a reader never sees half a file)."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    os.replace(tmp, path)


def write_json(path: Path, obj: Mapping[str, Any]) -> None:
    """Writes JSON atomically (a reader never sees half a file)."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)


def write_results(out_dir: os.PathLike, scheduler: Scheduler, summary: Mapping[str, Any],
                  config: Mapping[str, Any]) -> Path:
    """Writes config.json, requests.jsonl, steps.jsonl and summary.json into `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "config.json", config)
    write_jsonl(out / "requests.jsonl", request_rows(scheduler))
    write_jsonl(out / "steps.jsonl", step_rows(scheduler))
    write_json(out / "summary.json", summary)
    return out
