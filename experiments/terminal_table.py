"""The summary table as the terminal shows it: the key columns that fit 120 characters.

The files (summary.json, comparison.txt, comparison.json) keep every column; the
terminal gets the most telling ones, dropped from the right until the table fits.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from orca_jax.results.metrics import format_table

# Most telling first: a column that does not fit is dropped from the right.
# Goodput and SLO attainment only show where an SLO was set (the rows have them then), the
# QoE only with --log_token_times.
KEY_COLUMNS = ("policy", "kv_reservation", "num_finished", "num_rejected", "num_unfinished",
               "goodput_req_s", "slo_attainment",
               "qoe_mean", "output_tok_s", "arrival_bound", "ttft_p50_s", "ttft_p99_s",
               "tpot_p99_s", "latency_p99_s",
               "num_preemptions", "num_steps", "normalized_latency_mean_s", "throughput_req_s")
WIDTH = 120
# Shown only where some run has one (then beside num_finished, so nothing is dropped first).
NONZERO_COLUMNS = ("num_rejected", "num_unfinished")


def fit_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str] = KEY_COLUMNS,
              width: int = WIDTH) -> str:
    """`format_table` of the `columns` the rows have, less those on the right that overflow
    `width` (the first two always stay)."""
    shown = [c for c in columns if any(c in row for row in rows)
             and (c not in NONZERO_COLUMNS or any(row.get(c) not in (None, 0, "0")
                                                  for row in rows))]
    while True:
        table = format_table(list(rows), shown)
        if len(shown) <= 2 or max(len(line) for line in table.splitlines()) <= width:
            return table
        shown.pop()
