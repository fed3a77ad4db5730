"""Every GPU measurement of issue 33, as one call within a time budget (docs/gpu.md).

Runs the parts below in order, each a child process with its own time limit: the
smaller of its budget and what is left of `--budget_s`. A part is skipped (and
says so) when less than its minimum is left, so a slow part costs the later ones
their time, never the whole call. Each part's budget, its exit status and its time
are printed; its raw output goes to `<logs>/<part>.log`. At the end `--out` (the
device tool's $OUT) receives three files, within the tool's eight: `summary.txt`
(one line per part), `gpu_check.txt` (every log, in order) and
`gpu_check_logs.tar.gz` (the logs and JSON figures).

`--dry_run` runs every part on this machine's backend with tiny shapes (a CI test
does), so a GPU session only measures.

    python3 -m benchmarks.gpu_check --out "$OUT"            # on the GPU: at most 8 min
    python -m benchmarks.gpu_check --dry_run --out /tmp/gc  # anywhere: tiny shapes
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from typing import Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass(frozen=True)
class Part:
    name: str
    budget_s: int  # its limit on the GPU
    min_s: int  # skipped when less than this is left
    argv: tuple[str, ...]  # on the GPU
    dry_argv: tuple[str, ...]  # --dry_run


def parts(logs: str) -> list[Part]:
    """The parts, most wanted first (the issue's targets, then the diagnoses)."""
    py = sys.executable
    cache = os.path.join(logs, "compile_cache")  # fresh: first compiles are real ones
    return [
        Part("env", 30, 5, (py, "-m", "benchmarks.gpu_check", "--env"),
             (py, "-m", "benchmarks.gpu_check", "--env")),
        # llama3-8b: ceilings, device init, compile per bucket, roofline cases, Poisson runs.
        Part("model_scale", 240, 90,
             (py, "-m", "benchmarks.model_scale", "--compile_cache", cache,
              "--json", os.path.join(logs, "model_scale.json")),
             (py, "-m", "benchmarks.model_scale", "--dry_run", "--compile_cache", cache,
              "--json", os.path.join(logs, "model_scale.json"))),
        Part("overlap_probe", 60, 30, (py, "-m", "benchmarks.overlap_probe"),
             (py, "-m", "benchmarks.overlap_probe", "--dry_run")),
        Part("batch_invariance", 60, 30, (py, "-m", "benchmarks.batch_invariance"),
             (py, "-m", "benchmarks.batch_invariance", "--dry_run")),
        Part("profiled_clock", 70, 30,
             (py, "benchmarks/profiled_clock.py", "--models", "tiny", "small",
              "--repeats", "3"),
             (py, "benchmarks/profiled_clock.py", "--models", "tiny", "--repeats", "1",
              "--num_requests", "8", "--max_num_seqs", "4", "--max_num_tokens", "32",
              "--prompt_len", "uniform:4:16", "--output_len", "uniform:1:8")),
        Part("overlap", 40, 20,
             (py, "-m", "benchmarks.overlap", "--models", "tiny", "small", "--repeats", "3"),
             (py, "-m", "benchmarks.overlap", "--models", "tiny", "--repeats", "1",
              "--num_requests", "8", "--max_num_seqs", "4", "--max_num_tokens", "32",
              "--prompt_len", "uniform:4:16", "--output_len", "uniform:4:8")),
        # Already measured (docs/attention_kernel.md): whatever time is left.
        Part("attention", 200, 60,
             (py, "-m", "benchmarks.attention_gpu", "--out", os.path.join(logs, "attention.txt")),
             (py, "-m", "benchmarks.attention_gpu", "--tiny",
              "--out", os.path.join(logs, "attention.txt"))),
    ]


def print_env() -> int:
    """The device, its clocks and memory, and jax."""
    if shutil.which("nvidia-smi"):
        subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,"
                        "memory.used,clocks.sm,clocks.max.sm,temperature.gpu",
                        "--format=csv"], check=False)
    import jax

    device = jax.devices()[0]
    stats = None
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 -- a backend without stats raises its own kinds
        pass
    print(f"jax {jax.__version__}, {jax.default_backend()}: {jax.devices()}; memory_stats "
          f"bytes_limit={None if not stats else stats.get('bytes_limit')} "
          f"bytes_in_use={None if not stats else stats.get('bytes_in_use')}; "
          f"XLA_PYTHON_CLIENT_MEM_FRACTION={os.environ.get('XLA_PYTHON_CLIENT_MEM_FRACTION')}")
    return 0


def run_part(part: Part, argv: tuple[str, ...], limit_s: float, log_path: str,
             env: dict[str, str]) -> tuple[int, float]:
    """Runs one part under `limit_s`, teeing its output; (exit status, seconds)."""
    start = time.perf_counter()
    with open(log_path, "w", encoding="utf-8") as log:
        process = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True, bufsize=1,
                                   start_new_session=True)
        deadline = start + limit_s
        assert process.stdout is not None
        os.set_blocking(process.stdout.fileno(), False)
        while True:
            line = process.stdout.readline()
            if line:
                sys.stdout.write(line)
                log.write(line)
                continue
            if process.poll() is not None:
                rest = process.stdout.read() or ""
                sys.stdout.write(rest)
                log.write(rest)
                break
            if time.perf_counter() > deadline:
                os.killpg(process.pid, 9)  # the part's own process group, nothing else
                process.wait()
                log.write(f"\n[killed at its limit of {limit_s:.0f} s]\n")
                return 124, time.perf_counter() - start
            time.sleep(0.05)
    sys.stdout.flush()
    return process.returncode, time.perf_counter() - start


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry_run", action="store_true",
                        help="every part with tiny shapes on this machine's backend")
    parser.add_argument("--budget_s", type=float, default=None,
                        help="the whole call's limit (default 480 on a GPU, 600 dry)")
    parser.add_argument("--out", default=os.environ.get("OUT") or None,
                        help="where the three result files go (default $OUT, else a temp dir)")
    parser.add_argument("--parts", nargs="+", default=None, help="run only these parts")
    parser.add_argument("--env", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.env:
        return print_env()
    budget = args.budget_s if args.budget_s is not None else (600.0 if args.dry_run else 480.0)
    if budget <= 0:
        print(f"--budget_s={args.budget_s}: must be > 0", file=sys.stderr)
        return 2
    out = args.out or tempfile.mkdtemp(prefix="gpu_check_")
    logs = tempfile.mkdtemp(prefix="gpu_check_logs_")
    all_parts = parts(logs)
    names = [p.name for p in all_parts]
    if args.parts is not None:
        unknown = [n for n in args.parts if n not in names]
        if unknown:
            print(f"--parts: unknown part {unknown[0]!r}; choose from {', '.join(names)}",
                  file=sys.stderr)
            return 2
        all_parts = [p for p in all_parts if p.name in args.parts]
    os.makedirs(out, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": REPO, "PYTHONUNBUFFERED": "1"}
    start = time.perf_counter()
    summary = []
    status = 0
    for part in all_parts:
        left = budget - (time.perf_counter() - start)
        limit = min(part.budget_s if not args.dry_run else left, left)
        if left < (part.min_s if not args.dry_run else 1):
            line = f"{part.name}: SKIPPED ({left:.0f} s left, needs {part.min_s} s)"
            print(f"=== {line}", flush=True)
            summary.append(line)
            continue
        print(f"=== {part.name}: budget {limit:.0f} s ({left:.0f} s of {budget:.0f} left) "
              f"{time.strftime('%H:%M:%S')}", flush=True)
        rc, seconds = run_part(part, part.dry_argv if args.dry_run else part.argv, limit,
                               os.path.join(logs, f"{part.name}.log"), env)
        verdict = "ok" if rc == 0 else ("TIMED OUT" if rc == 124 else f"FAILED (exit {rc})")
        line = f"{part.name}: {verdict} in {seconds:.1f} s (budget {limit:.0f} s)"
        print(f"=== {line}", flush=True)
        summary.append(line)
        status = status or (rc != 0)
    total = time.perf_counter() - start
    summary.append(f"total {total:.1f} s of {budget:.0f}; {'dry run' if args.dry_run else 'gpu'}")
    with open(os.path.join(out, "summary.txt"), "w", encoding="utf-8") as f:
        f.write("\n".join(summary) + "\n")
    with open(os.path.join(out, "gpu_check.txt"), "w", encoding="utf-8") as f:
        for part in all_parts:
            path = os.path.join(logs, f"{part.name}.log")
            if os.path.exists(path):
                f.write(f"===== {part.name}\n")
                with open(path, encoding="utf-8") as log:
                    f.write(log.read())
    with tarfile.open(os.path.join(out, "gpu_check_logs.tar.gz"), "w:gz") as tar:
        for name in sorted(os.listdir(logs)):
            if name != "compile_cache":
                tar.add(os.path.join(logs, name), arcname=name)
    print("\n".join(["", "summary:", *summary, f"results in {out}"]), flush=True)
    return 1 if status else 0


if __name__ == "__main__":
    sys.exit(main())
