"""A digest of what a run wrote that does not depend on the host's speed (the frozen tests)."""

import hashlib
import json
from pathlib import Path

# Summary fields added after the digests were taken, each a function of fields the digest
# covers (issue 26): `output_tok_s` is `throughput_tok_s` renamed, `total_tok_s` adds the
# requests' prompt lengths over `duration_s`, `engine_busy_fraction` is `engine_s_total`
# over `duration_s`; `preemptions_per_finished` is `num_preemptions` over `num_finished`;
# `recomputed_tokens` (and `recomputed_token_fraction`, over the steps' `num_tokens`) is
# fixed by the decisions the steps' and requests' rows record (the tokens the steps computed
# beyond each request's own); `offered_req_s` and `served_req_s` (issue 50) are rates over
# the spans of the requests' `arrival_s` and `finish_s`, `num_waiting_p50` the median of the
# steps' `num_waiting`. Left out, so adding them moves no digest and every bit stays
# checked.
DERIVED_SUMMARY_FIELDS = ("output_tok_s", "total_tok_s", "engine_busy_fraction",
                          "preemptions_per_finished", "recomputed_tokens",
                          "recomputed_token_fraction", "offered_req_s", "served_req_s",
                          "num_waiting_p50")
# Request columns added after the digests were taken: a program call's `program_id` and
# `call_index` (issue 28) are the workload's facts about the row's request (its `id` names
# it), not decisions; left out so the programs setting's digests stay as taken.
WORKLOAD_REQUEST_FIELDS = ("program_id", "call_index")


def results_digest(out: Path) -> str:
    """16 hex digits over every requests.jsonl row, every steps.jsonl row but its measured
    `host_s`, and summary.json but its host-time fields (and `DERIVED_SUMMARY_FIELDS`)."""
    h = hashlib.sha256()
    for line in (out / "requests.jsonl").read_text().splitlines():
        row = {k: v for k, v in json.loads(line).items() if k not in WORKLOAD_REQUEST_FIELDS}
        h.update(json.dumps(row, sort_keys=True).encode())
    for line in (out / "steps.jsonl").read_text().splitlines():
        row = {k: v for k, v in json.loads(line).items() if k != "host_s"}
        h.update(json.dumps(row, sort_keys=True).encode())
    summary = json.loads((out / "summary.json").read_text())
    h.update(json.dumps({k: v for k, v in summary.items()
                         if "host" not in k and k not in DERIVED_SUMMARY_FIELDS},
                        sort_keys=True).encode())
    return h.hexdigest()[:16]
