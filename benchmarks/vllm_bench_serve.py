"""vLLM's own `bench serve` client against `experiments.serve`, beside the server's summary.

A check of the server with a client we did not write. For each policy: starts
`python -m experiments.serve --model=tiny --policy=P` on a free loopback port (as
`benchmarks.serve_replay`), writes the first `--num_requests` of `--trace` as vLLM's
`timed_trace` dataset (JSON Lines: `timestamp` = arrival times `--trace_time_scale`,
`input_length` / `output_length` as `experiments.bench_serve` plans them, prompts cut to
the server's context; `hash_ids` one fresh id per 16 tokens, so no two prompts share a
block), and runs, with the peer venv's python,

    PY -m vllm.entrypoints.cli.main bench serve --backend openai --base-url URL \\
        --model tiny --tokenizer BYTE_TOKENIZER_FOLDER --dataset-name timed_trace \\
        --dataset-path sent_timed_trace.jsonl --num-prompts N --temperature 0 \\
        --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,90,99 \\
        --save-result --save-detailed ...

vLLM sends each request at its trace time (`timed_trace` is self-timed, `ignore_eos`) as a
streaming `/v1/completions` call whose prompt is token ids it samples from the tokenizer's
vocabulary: the tokenizer is the server's built-in byte tokenizer written as a Hugging Face
folder (`orca_jax.serving.tokenizer.write_byte_tokenizer`), loaded offline. Then the server
gets SIGTERM and writes its results folder. Printed per policy: vLLM's own result block,
its percentiles (from its result JSON) beside the server summary's, and whether the counts
agree (vLLM's completed and failed requests and output tokens, the server's finished
requests and rows, the requests sent). Any disagreement, or a vLLM run that fails or runs
past `--timeout_s`, exits 1; no vLLM at `--vllm_python` is one line and exit 2.

    python -m benchmarks.vllm_bench_serve --vllm_python=/tmp/vllm_peer/venv/bin/python \\
        --policies vllm orca --num_requests 200 --trace_time_scale 2 \\
        > benchmarks/results/vllm_bench_serve.txt

The venv is outside the project (see ../shared/peers/vllm_scheduler/setup_min_venv.sh; the
`timed_trace` dataset also needs pandas). Loopback only: the server binds 127.0.0.1 and
vLLM's client is pointed at it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.serve_replay import Server  # noqa: E402
from experiments import bench_serve  # noqa: E402

DEFAULT_PYTHON = "/tmp/vllm_peer/venv/bin/python"
# timed_trace expands each hash id into this many sampled tokens (vLLM's default).
CHUNK = 16
# vLLM's name for each of bench_serve's METRICS in its result JSON (`p50_ttft_ms`, ...).
VLLM_NAMES = {"ttft_s": "ttft", "tpot_s": "tpot", "itl_s": "itl", "e2e_s": "e2el"}
SETUP_HINT = ("build a venv with vLLM outside the project (see ../shared/peers/vllm_scheduler/"
              "setup_min_venv.sh, plus pandas) and pass its python as --vllm_python")


def missing_vllm(python: str, timeout_s: float = 60.0) -> Optional[str]:
    """None when `python` can import vLLM's bench client; else the one line that says why not."""
    if not os.path.isfile(python) or not os.access(python, os.X_OK):
        return f"vllm_bench_serve: --vllm_python={python}: no such executable; {SETUP_HINT}"
    probe = ("import importlib.util as u, sys; "
             "sys.exit(0 if u.find_spec('vllm') and u.find_spec('aiohttp') else 3)")
    try:
        code = subprocess.run([python, "-c", probe], capture_output=True,
                              timeout=timeout_s).returncode
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"vllm_bench_serve: --vllm_python={python}: did not run ({type(e).__name__}); " \
               f"{SETUP_HINT}"
    if code != 0:
        return f"vllm_bench_serve: --vllm_python={python}: vLLM is not installed there; " \
               f"{SETUP_HINT}"
    return None


def timed_trace_rows(planned: Sequence[bench_serve.Planned], chunk: int = CHUNK) -> list[dict]:
    """The planned requests as vLLM's `timed_trace` rows: send time in seconds, lengths, and
    `ceil(prompt_len / chunk)` hash ids none of which another request has (no shared
    prefixes: the trace has none)."""
    rows, next_id = [], 0
    for p in planned:
        blocks = math.ceil(p.prompt_len / chunk)
        rows.append({"timestamp": p.send_s, "input_length": p.prompt_len,
                     "output_length": p.output_len,
                     "hash_ids": list(range(next_id, next_id + blocks))})
        next_id += blocks
    return rows


def vllm_percentiles(result: dict) -> dict:
    """vLLM's result JSON (`p50_ttft_ms`, ...) as bench_serve's percentiles in seconds
    (None where it reports none)."""
    out = {}
    for metric, name in VLLM_NAMES.items():
        out[metric] = {}
        for q in bench_serve.PERCENTILES:
            value = result.get(f"p{q}_{name}_ms")
            out[metric][f"p{q}"] = None if value is None else float(value) / 1e3
    return out


def count_problems(result: dict, planned: Sequence[bench_serve.Planned], server: dict,
                   server_rows: int) -> list[str]:
    """Where vLLM's counts, the server's and the plan disagree (empty: they agree).

    Every request asks for its whole output with `ignore_eos`, so each one answered has
    exactly its `output_len` tokens; vLLM takes each prompt's length from the usage the
    server reports, so its input tokens are the server's count of the ids it was sent.
    """
    n, tokens = len(planned), sum(p.output_len for p in planned)
    checks = [("vLLM completed", result.get("completed"), n),
              ("vLLM failed", result.get("failed"), 0),
              ("vLLM input tokens", result.get("total_input_tokens"),
               sum(p.prompt_len for p in planned)),
              ("vLLM output tokens", result.get("total_output_tokens"), tokens),
              ("server finished", server.get("num_finished"), n),
              ("server rows", server_rows, n)]
    return [f"{name} {got} != {want}" for name, got, want in checks if got != want]


def result_block(log: str) -> str:
    """vLLM's printed `Serving Benchmark Result` block (its last), or '' if it printed none."""
    lines = log.splitlines()
    starts = [i for i, line in enumerate(lines) if "Serving Benchmark Result" in line]
    if not starts:
        return ""
    block = []
    for line in lines[starts[-1]:]:
        block.append(line)
        if len(block) > 1 and line.startswith("=" * 10):
            break
    return "\n".join(block)


def vllm_command(python: str, base: str, model: str, tokenizer: str, dataset: str, n: int,
                 result_dir: str, result_name: str) -> list[str]:
    """The `vllm bench serve` command line for one run."""
    return [python, "-m", "vllm.entrypoints.cli.main", "bench", "serve",
            "--backend", "openai", "--base-url", base, "--endpoint", "/v1/completions",
            "--model", model, "--tokenizer", tokenizer, "--dataset-name", "timed_trace",
            "--dataset-path", dataset, "--num-prompts", str(n), "--temperature", "0",
            "--seed", "0", "--percentile-metrics", "ttft,tpot,itl,e2el",
            "--metric-percentiles", ",".join(str(q) for q in bench_serve.PERCENTILES),
            "--save-result", "--save-detailed", "--result-dir", result_dir,
            "--result-filename", result_name, "--disable-tqdm"]


def vllm_env() -> dict:
    """vLLM's client offline (no hub look-ups), its prompts fixed from run to run (the
    timed_trace dataset seeds each block from Python's `hash` of a string), no key sent."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "OPENAI_API_KEY", "VIRTUAL_ENV")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONHASHSEED="0",
               NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost")
    return env


def run_one(policy: str, args: argparse.Namespace, work: Path, tokenizer: str) -> dict:
    """Serves `policy`, runs vLLM's client against it; what to print."""
    from orca_jax.workloads.traces import load_trace

    server = Server(work / f"server_{policy}", [f"--policy={policy}", "--model=tiny",
                                                *args.server_args],
                    work / f"server_{policy}.log")
    started = time.monotonic()
    try:
        server.wait_healthy()
        ready_s = time.monotonic() - started
        context = bench_serve.served_max_model_len(server.base, "tiny")
        planned = bench_serve.plan(load_trace(args.trace, max_requests=args.num_requests),
                                   args.trace_time_scale, context)
        dataset = work / f"timed_trace_{policy}.jsonl"
        with open(dataset, "w") as f:
            for row in timed_trace_rows(planned):
                f.write(json.dumps(row) + "\n")
        name = f"vllm_{policy}.json"
        command = vllm_command(args.vllm_python, server.base, "tiny", tokenizer, str(dataset),
                               len(planned), str(work), name)
        log_path = work / f"vllm_{policy}.log"
        run_start = time.monotonic()
        with open(log_path, "w") as log:
            try:
                code = subprocess.run(command, cwd=work, env=vllm_env(), stdout=log,
                                      stderr=subprocess.STDOUT, timeout=args.timeout_s
                                      ).returncode
            except subprocess.TimeoutExpired:
                code = None
        run_s = time.monotonic() - run_start
    finally:
        exit_code, hwm = server.stop()
    log_text = log_path.read_text()
    result_path = work / name
    result = json.loads(result_path.read_text()) if result_path.is_file() else None
    server_dir = work / f"server_{policy}"
    rows = sum(1 for _ in open(server_dir / "requests.jsonl"))
    with open(server_dir / "summary.json") as f:
        server_summary = json.load(f)
    return {"policy": policy, "ready_s": ready_s, "run_s": run_s, "vllm_exit": code,
            "server_exit": exit_code, "vm_hwm_mib": hwm / 1024 if hwm else None,
            "planned": planned, "result": result, "log": log_text, "log_path": log_path,
            "server_rows": rows, "server_summary": server_summary,
            "server": bench_serve.server_percentiles(str(server_dir))}


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm_python", default=os.environ.get("VLLM_PEER_PYTHON",
                                                                 DEFAULT_PYTHON),
                        help="python of a venv with vLLM (default $VLLM_PEER_PYTHON, else "
                        f"{DEFAULT_PYTHON})")
    parser.add_argument("--policies", nargs="+", default=["vllm", "orca"])
    parser.add_argument("--trace", default="../shared/traces/azure_conv_2023.csv")
    parser.add_argument("--num_requests", type=int, default=200)
    parser.add_argument("--trace_time_scale", type=float, default=2.0)
    parser.add_argument("--timeout_s", type=float, default=900.0,
                        help="limit on each vLLM client run")
    parser.add_argument("--server_args", nargs="*", default=[],
                        help="more flags for experiments.serve (as --name=value)")
    parser.add_argument("--work_dir", default=None, help="keep the folders here")
    args = parser.parse_args(argv)
    problem = missing_vllm(args.vllm_python)
    if problem:
        print(problem, file=sys.stderr)
        return 2
    if not os.path.isfile(args.trace):
        print(f"vllm_bench_serve: --trace={args.trace}: no such file", file=sys.stderr)
        return 2
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="vllm_bench_serve_")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    from orca_jax.serving.tokenizer import write_byte_tokenizer

    tokenizer = write_byte_tokenizer(str(work / "byte_tokenizer"))
    version = subprocess.run([args.vllm_python, "-c", "import importlib.metadata as m; "
                              "print(m.version('vllm'))"], capture_output=True, text=True,
                             timeout=60).stdout.strip()
    print(f"vllm_bench_serve: vLLM {version} bench serve (--backend openai, timed_trace) "
          f"against experiments.serve {' '.join(['--model=tiny', *args.server_args])}; trace "
          f"{args.trace}, first {args.num_requests} requests, arrivals x"
          f"{args.trace_time_scale}; load average {os.getloadavg()[0]:.2f}; folders in "
          f"{work}", flush=True)
    failed = False
    for policy in args.policies:
        r = run_one(policy, args, work, tokenizer)
        hwm = f"{r['vm_hwm_mib']:.0f} MiB" if r["vm_hwm_mib"] else "-"
        print(f"\n== {policy}: server ready in {r['ready_s']:.1f} s, vLLM client ran "
              f"{r['run_s']:.1f} s (exit {r['vllm_exit']}), server exit {r['server_exit']}, "
              f"rows {r['server_rows']}, peak RSS {hwm}", flush=True)
        if r["result"] is None:
            tail = " | ".join(r["log"].strip().splitlines()[-3:])
            print(f"vLLM's client wrote no result (log {r['log_path']}): {tail}")
            failed = True
            continue
        print(result_block(r["log"]))
        res = r["result"]
        # vLLM's client takes a gap per chunk with a choice: tokens - 1 per request, plus
        # one for a last chunk that carries only the finish reason.
        gaps = sum(len(g) for g in res.get("itls") or ())
        print(json.dumps({"vllm": {**{k: res.get(k) for k in (
            "completed", "failed", "total_input_tokens", "total_output_tokens", "duration",
            "output_throughput")}, "itl_gaps": gaps,
            "output_tokens_minus_requests": (res.get("total_output_tokens") or 0)
            - (res.get("completed") or 0)},
            "server": {k: r["server_summary"].get(k) for k in (
                "num_requests", "num_finished", "num_rejected", "duration_s",
                "output_tok_s")},
            "sent": {"requests": len(r["planned"]),
                     "prompts_cut": sum(p.cut for p in r["planned"]),
                     "input_tokens": sum(p.prompt_len for p in r["planned"]),
                     "output_tokens": sum(p.output_len for p in r["planned"])}}))
        print(bench_serve.table(vllm_percentiles(res), r["server"], client_side="vLLM client"))
        problems = count_problems(res, r["planned"], r["server_summary"], r["server_rows"])
        failed |= bool(problems) or r["vllm_exit"] != 0
        print("counts agree" if not problems else "COUNTS DISAGREE: " + "; ".join(problems),
              flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
