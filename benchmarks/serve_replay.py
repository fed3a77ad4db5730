"""A trace replayed online against `experiments.serve`, client vs server percentiles.

For each policy: starts `python -m experiments.serve --model=tiny --policy=P` on a free
loopback port, waits for /health, replays the first `--num_requests` of `--trace` with
`experiments.bench_serve` (arrivals times `--trace_time_scale`; prompts of the trace's input
lengths cut to the server's context, `max_tokens` the trace's output length with
`ignore_eos`), SIGTERMs the server (which writes its results folder), and prints the
client's TTFT/TPOT/ITL/E2E percentiles beside the server's summary, and the server's
peak RSS (VmHWM).

    python -m benchmarks.serve_replay --policies vllm orca --num_requests 200 \
        --trace_time_scale 2 > benchmarks/results/serve_replay_azure.txt
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from experiments import bench_serve  # noqa: E402
from orca_jax.workloads.traces import load_trace  # noqa: E402


def free_port() -> int:
    """A loopback port nobody listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vm_hwm_kib(pid: int) -> Optional[int]:
    """The process' peak resident set (VmHWM, KiB) from /proc; None off Linux."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


class Server:
    """`experiments.serve` in a child process on a free loopback port."""

    def __init__(self, out_dir: Path, args: Sequence[str], log: Path) -> None:
        self.port = free_port()
        self.out_dir = out_dir
        self.base = f"http://127.0.0.1:{self.port}"
        self._log = open(log, "w")
        self.log_path = log
        self.process = subprocess.Popen(
            [sys.executable, "-m", "experiments.serve", f"--port={self.port}",
             f"--out_dir={out_dir}", *args],
            cwd=REPO, env=dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO)),
            stdout=self._log, stderr=subprocess.STDOUT)

    def wait_healthy(self, timeout_s: float = 300.0) -> None:
        import httpx

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited: {self.log_path.read_text()[-2000:]}")
            try:
                if httpx.get(f"{self.base}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"server not healthy in {timeout_s} s")

    def stop(self, timeout_s: float = 120.0) -> tuple[int, Optional[int]]:
        """SIGTERM, wait; (exit code, peak RSS KiB read just before it exits)."""
        hwm = vm_hwm_kib(self.process.pid)
        self.process.send_signal(signal.SIGTERM)
        # The peak can still grow while it drains: read it as long as the process lives.
        deadline = time.monotonic() + timeout_s
        while self.process.poll() is None and time.monotonic() < deadline:
            hwm = vm_hwm_kib(self.process.pid) or hwm
            time.sleep(0.1)
        if self.process.poll() is None:
            self.process.kill()
        code = self.process.wait()
        self._log.close()
        return code, hwm


def run_one(policy: str, trace: str, num_requests: int, time_scale: float,
            work: Path, server_args: Sequence[str]) -> dict:
    """Serves `policy`, replays the trace against it; the figures to print."""
    server_dir = work / f"server_{policy}"
    client_dir = work / f"client_{policy}"
    server = Server(server_dir, [f"--policy={policy}", "--model=tiny", *server_args],
                    work / f"server_{policy}.log")
    started = time.monotonic()
    server.wait_healthy()
    ready_s = time.monotonic() - started
    context = bench_serve.served_max_model_len(server.base, "tiny")
    planned = bench_serve.plan(load_trace(trace, max_requests=num_requests), time_scale,
                               context)
    replay_start = time.monotonic()
    outcomes = asyncio.run(bench_serve.replay(server.base, "tiny", planned))
    replay_s = time.monotonic() - replay_start
    code, hwm = server.stop()
    summary = bench_serve.summarize(outcomes, planned)
    bench_serve.write(str(client_dir), outcomes, summary)
    bench_serve.write_sent(str(work / "sent.jsonl"), planned)
    rows = sum(1 for _ in open(server_dir / "requests.jsonl"))
    return {"policy": policy, "exit": code, "ready_s": ready_s, "replay_s": replay_s,
            "server_rows": rows, "vm_hwm_mib": hwm / 1024 if hwm else None,
            "client": summary, "server": bench_serve.server_percentiles(str(server_dir))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policies", nargs="+", default=["vllm", "orca"])
    parser.add_argument("--trace", default="../shared/traces/azure_conv_2023.csv")
    parser.add_argument("--num_requests", type=int, default=200)
    parser.add_argument("--trace_time_scale", type=float, default=2.0)
    parser.add_argument("--server_args", nargs="*", default=[],
                        help="more flags for experiments.serve (as --name=value)")
    parser.add_argument("--work_dir", default=None, help="keep the folders here")
    args = parser.parse_args()
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="serve_replay_"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"serve_replay: trace {args.trace}, first {args.num_requests} requests, arrivals "
          f"x{args.trace_time_scale}, model tiny, server flags {args.server_args}; "
          f"load average {os.getloadavg()[0]:.2f}; folders in {work}", flush=True)
    for policy in args.policies:
        r = run_one(policy, args.trace, args.num_requests, args.trace_time_scale, work,
                    args.server_args)
        c = r["client"]
        print(f"\n== {policy}: server ready in {r['ready_s']:.1f} s, replay {r['replay_s']:.1f}"
              f" s, server exit {r['exit']}, server rows {r['server_rows']}, peak RSS "
              f"{r['vm_hwm_mib']:.0f} MiB", flush=True)
        print(json.dumps({k: c[k] for k in ("num_requests", "statuses", "num_prompts_cut",
                                            "num_short", "output_tokens", "duration_s",
                                            "output_tokens_per_s")}))
        print(bench_serve.table(c, r["server"]), flush=True)


if __name__ == "__main__":
    main()
