"""What a program's user feels: completion times and where a program's time went.

A program's completion time runs from its first call's arrival to its last
call's finish. Its time is split three ways, over the union of its calls'
intervals (threads that overlap count once):

* computing: some call of it is admitted, from its first step to its finish
  (a call paused or preempted in between still counts here);
* waiting: some call of it has been released and none is computing;
* tools: no call of it is released and unfinished: a tool (or the user) holds it.

Only programs whose every call finished count; the shares are of their summed
completion times.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
from numpy.typing import NDArray

from orca_jax.core.requests.run_result import RunResult
from orca_jax.results.metrics import PERCENTILES


def _union_s(starts: NDArray[np.float64], ends: NDArray[np.float64]) -> float:  # [k], [k]
    """Seconds covered by the intervals [start, end) together."""
    order = np.argsort(starts, kind="stable")
    total, reach = 0.0, -np.inf
    for start, end in zip(starts[order].tolist(), ends[order].tolist()):
        start = max(start, reach)
        if end > start:
            total += end - start
            reach = end
    return total


def program_times(result: RunResult) -> dict[str, NDArray[np.float64]]:
    """Per finished program (`[F]` each): `completion_s`, `computing_s`, `waiting_s`,
    `tools_s`; empty without programs."""
    names = ("completion_s", "computing_s", "waiting_s", "tools_s")
    record = result.programs
    if record is None:
        return {name: np.zeros(0) for name in names}
    rows = np.flatnonzero(record.program >= 0)
    programs = record.program[rows]
    order = np.argsort(programs, kind="stable")
    rows, programs = rows[order], programs[order]
    cuts = np.flatnonzero(np.diff(programs)) + 1
    figures: dict[str, list[float]] = {name: [] for name in names}
    for calls in np.split(rows, cuts):
        finish = result.finish_s[calls]
        if not np.isfinite(finish).all():
            continue  # a call rejected, cancelled or cut off: not a completed program
        arrival, scheduled = result.arrival_s[calls], result.first_scheduled_s[calls]
        completion = float(finish.max() - arrival.min())
        live = _union_s(arrival, finish)
        computing = _union_s(scheduled, finish)
        figures["completion_s"].append(completion)
        figures["computing_s"].append(computing)
        figures["waiting_s"].append(live - computing)
        figures["tools_s"].append(completion - live)
    return {name: np.asarray(values, dtype=np.float64) for name, values in figures.items()}


def program_summary(result: RunResult, *, program_slo_s: Optional[float] = None
                    ) -> dict[str, Any]:
    """The summary's program fields (none without programs): `num_programs`,
    `num_programs_completed`, `program_completion_{mean,p50,p90,p99}_s`, and the shares of
    the completed programs' time `program_computing_share`, `program_waiting_share` and
    `program_tools_share`; with `program_slo_s`, `program_slo_attainment` (completed
    programs within it, over all programs) and `program_goodput_per_s` (those per second
    of the run). With KV pinned across tool pauses: `kv_pins` (pins made), `kv_pin_hits`
    (pins a child call was admitted over), `kv_pinned_page_s` (pages times seconds
    pinned) and `kv_pinned_pages_max`."""
    record = result.programs
    if record is None:
        return {}
    times = program_times(result)
    completion = times["completion_s"]
    total = float(completion.sum())
    summary: dict[str, Any] = {
        "num_programs": int(record.program_ids.size),
        "num_programs_completed": int(completion.size),
        "program_completion_mean_s": float(completion.mean()) if completion.size else None,
    }
    for p in PERCENTILES:
        summary[f"program_completion_p{p}_s"] = (float(np.percentile(completion, p))
                                                 if completion.size else None)
    for part in ("computing", "waiting", "tools"):
        summary[f"program_{part}_share"] = (float(times[f"{part}_s"].sum()) / total
                                            if total > 0 else None)
    if record.num_pins:  # KV pinned across tool pauses (`--kv_pin_s`)
        summary.update({"kv_pins": record.num_pins, "kv_pin_hits": record.num_pin_hits,
                        "kv_pinned_page_s": record.pinned_page_s,
                        "kv_pinned_pages_max": record.max_pinned_pages})
    if program_slo_s is not None:
        met = int(np.count_nonzero(completion <= program_slo_s))
        summary["program_slo_attainment"] = met / max(int(record.program_ids.size), 1)
        summary["program_goodput_per_s"] = (met / result.virtual_end_s
                                            if result.virtual_end_s > 0 else None)
    return summary
