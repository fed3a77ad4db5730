"""A digest of what a run wrote that does not depend on the host's speed (the frozen tests)."""

import hashlib
import json
from pathlib import Path


def results_digest(out: Path) -> str:
    """16 hex digits over every requests.jsonl row, every steps.jsonl row but its measured
    `host_s`, and summary.json but its host-time fields."""
    h = hashlib.sha256()
    for line in (out / "requests.jsonl").read_text().splitlines():
        h.update(json.dumps(json.loads(line), sort_keys=True).encode())
    for line in (out / "steps.jsonl").read_text().splitlines():
        row = {k: v for k, v in json.loads(line).items() if k != "host_s"}
        h.update(json.dumps(row, sort_keys=True).encode())
    summary = json.loads((out / "summary.json").read_text())
    h.update(json.dumps({k: v for k, v in summary.items() if "host" not in k},
                        sort_keys=True).encode())
    return h.hexdigest()[:16]
