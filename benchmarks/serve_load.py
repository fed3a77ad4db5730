"""A bounded load test of `experiments.serve`: clients at about twice its capacity.

Starts `tiny` (vllm, --max_num_seqs=4, --max_queued=4) on a free loopback port, then:

1. capacity: a burst of `--burst` identical requests (prompt `--prompt_len` tokens,
   `--max_tokens` out, ignore_eos) sent at once, after one warm request; capacity =
   burst / the burst's time (requests per second);
2. flood: requests at `--overload` x capacity, evenly spaced, for `--duration_s`;
3. SIGTERM; the server drains and writes its results folder.

Checks, printed as PASS/FAIL lines: every flood request was answered 200 with all its
tokens, 429 or 503 (no timeouts, no other status); the server's peak RSS (VmHWM) after
the flood is within `--rss_slack_mib` of its peak after the burst (a full queue is
refused, not held); requests.jsonl holds exactly one row per request the server
answered 200 (nothing accepted is lost).

    python -m benchmarks.serve_load --duration_s 60 > benchmarks/results/serve_load.txt
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.serve_replay import Server, vm_hwm_kib  # noqa: E402
from experiments import bench_serve  # noqa: E402


def _requests(n: int, gap_s: float, prompt_len: int, max_tokens: int,
              first_id: int = 0) -> list[bench_serve.Planned]:
    return [bench_serve.Planned(first_id + i, i * gap_s, prompt_len, max_tokens)
            for i in range(n)]


def load_test(work: Path, *, duration_s: float = 60.0, overload: float = 2.0,
              burst: int = 8, prompt_len: int = 64, max_tokens: int = 32,
              rss_slack_mib: float = 200.0) -> dict:
    """Runs the three phases; the figures and checks as a dict (`ok`: all passed)."""
    server = Server(work / "server", ["--model=tiny", "--policy=vllm", "--max_num_seqs=4",
                                      "--max_queued=4"], work / "server.log")
    try:
        server.wait_healthy()
        asyncio.run(bench_serve.replay(server.base, "tiny",
                                       _requests(1, 0.0, prompt_len, max_tokens)))
        t0 = time.monotonic()
        first = asyncio.run(bench_serve.replay(server.base, "tiny",
                                               _requests(burst, 0.0, prompt_len, max_tokens)))
        burst_s = time.monotonic() - t0
        capacity = sum(o.status == "200" for o in first) / burst_s
        hwm_before = vm_hwm_kib(server.process.pid)
        rate = overload * capacity
        n = max(1, int(duration_s * rate))
        flood = asyncio.run(bench_serve.replay(server.base, "tiny",
                                               _requests(n, 1.0 / rate, prompt_len,
                                                         max_tokens), timeout_s=120.0))
        hwm_after = vm_hwm_kib(server.process.pid)
    finally:
        code, hwm_final = server.stop()
    statuses: dict = {}
    for o in flood:
        key = o.status if not o.status.startswith("error") else "error"
        statuses[key] = statuses.get(key, 0) + 1
    accepted = 1 + sum(o.status == "200" for o in first) + statuses.get("200", 0)
    rows = [json.loads(line) for line in open(work / "server" / "requests.jsonl")]
    short = sum(o.status == "200" and o.output_tokens != max_tokens for o in flood)
    checks = {
        "every request answered 200, 429 or 503": set(statuses) <= {"200", "429", "503"},
        "every 200 has all its tokens": short == 0,
        "some requests refused (the load was over capacity)":
            statuses.get("429", 0) + statuses.get("503", 0) > 0,
        f"peak RSS grew under {rss_slack_mib:.0f} MiB in the flood":
            hwm_before is not None and hwm_final is not None
            and (hwm_final - hwm_before) / 1024 < rss_slack_mib,
        # uvicorn re-raises the SIGTERM it handled once it has shut down: -15 is clean too.
        "server exited cleanly after SIGTERM": code in (0, -15),
        "requests.jsonl: one row per accepted request": len(rows) == accepted,
    }
    return {"capacity_rps": capacity, "offered_rps": rate, "flood_requests": n,
            "flood_s": max((o.send_s + (o.e2e_s or 0.0) for o in flood), default=0.0),
            "statuses": statuses, "accepted": accepted, "server_rows": len(rows),
            "vm_hwm_mib": {"after_burst": hwm_before and hwm_before / 1024,
                           "after_flood": hwm_after and hwm_after / 1024,
                           "at_exit": hwm_final and hwm_final / 1024},
            "checks": checks, "ok": all(checks.values())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration_s", type=float, default=60.0)
    parser.add_argument("--overload", type=float, default=2.0)
    parser.add_argument("--work_dir", default=None)
    args = parser.parse_args()
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="serve_load_"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"serve_load: tiny, vllm, --max_num_seqs=4 --max_queued=4, prompt 64, max_tokens 32;"
          f" {args.overload}x capacity for {args.duration_s} s; load average "
          f"{os.getloadavg()[0]:.2f}; folders in {work}", flush=True)
    r = load_test(work, duration_s=args.duration_s, overload=args.overload)
    for name, ok in r.pop("checks").items():
        print(f"{'PASS' if ok else 'FAIL'} {name}")
    print(json.dumps(r, indent=1))
    sys.exit(0 if r["ok"] else 1)


if __name__ == "__main__":
    main()
