"""Host time per step of `vllm` against the example plugins, on the Azure conversation trace.

Issue 26 measured an Andes-style plugin planning at 7,058 µs per step against
vllm's 199 µs. This runs each policy through `run_policy` (the path
`experiments.run --engine=sim` takes: llama3-8b on an a100, the scheduler's
default limits but a tight KV pool) on the first `--num_requests` requests of
`../shared/traces/azure_conv_2023.csv` (relative to the repository root), their
arrivals at twice the trace's rate (`--time_scale`), and
prints, per policy, the steps run, the preemptions, the host µs per step (median,
p90, mean of `host_s`: the policy's `schedule()`, the plan checks, KV allocation,
packing and the state update) and the median's ratio to vllm's. Host time is
measured on this machine: run it on an idle one, and compare ratios, not µs
across machines.

    python -m benchmarks.plugin_host_time [--num_requests=1000] [--kv_pages=1024] [--time_scale=0.5]

Without the trace it prints one line saying so and exits 0.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path
from typing import Optional

import numpy as np

from orca_jax.runner.experiment import run_policy
from orca_jax.runner.spec import LimitsSpec, RunSpec, SimEngineSpec, WorkloadSpec

REPO = Path(__file__).resolve().parents[1]
TRACE = REPO.parent / "shared" / "traces" / "azure_conv_2023.csv"

# (label, policy spec, knobs): vllm, then the example plugins, then the one that preempts
# with admissions that preempt too (the thrashing case).
POLICIES = (
    ("vllm", "vllm", None),
    ("las (loop)", str(REPO / "examples/least_attained_service.py") + ":LeastAttainedService",
     None),
    ("slo_admission", str(REPO / "examples/slo_admission.py") + ":SLOAdmission", None),
    ("preemptive_las", str(REPO / "examples/preemptive_las.py") + ":PreemptiveLAS", None),
    ("preemptive_las thrash", str(REPO / "examples/preemptive_las.py") + ":PreemptiveLAS",
     {"admission_preempts": "true"}),
)


def measure(policy: str, options: Optional[dict[str, str]], spec: RunSpec) -> dict[str, float]:
    """One run's host time per step and its counts."""
    start = time.perf_counter()
    summary, result = run_policy(spec, policy, options, progress=False)
    wall = time.perf_counter() - start
    host_us = result.step_array("host_s") * 1e6  # [S]
    return {"steps": result.num_steps, "preemptions": summary["num_preemptions"],
            "recomputed": summary["recomputed_token_fraction"] or 0.0,
            "median": float(np.median(host_us)), "p90": float(np.percentile(host_us, 90)),
            "mean": float(host_us.mean()), "wall": wall,
            "tok_s": summary["output_tok_s"]}


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num_requests", type=int, default=1000)
    # A tight pool at twice the trace's rate: at its own rate and the a100's pool the run is
    # arrival-bound and nothing preempts, so the preempting plugins would show nothing.
    parser.add_argument("--kv_pages", type=int, default=1024,
                        help="KV pool in pages (0: what the a100 holds beside llama3-8b)")
    parser.add_argument("--time_scale", type=float, default=0.5,
                        help="multiplies the trace's arrival times (below 1: a higher rate)")
    args = parser.parse_args(argv)
    if not TRACE.exists():
        print(f"plugin_host_time: skipped: the trace {TRACE} is missing")
        return 0
    spec = RunSpec(workload=WorkloadSpec(arrival="trace", trace=str(TRACE),
                                         num_requests=args.num_requests,
                                         trace_time_scale=args.time_scale),
                   engine=SimEngineSpec(), limits=LimitsSpec(num_kv_pages=args.kv_pages or None))
    print(f"host time per step, {args.num_requests} requests of {TRACE.name}, sim llama3-8b "
          f"a100, kv_pages={args.kv_pages or 'default'}, time_scale={args.time_scale:g}; python "
          f"{platform.python_version()}, numpy {np.__version__}")
    print(f"{'policy':<22} {'steps':>6} {'preempt':>8} {'recomp':>7} {'tok/s':>8} "
          f"{'us med':>8} {'us p90':>8} {'us mean':>8} {'x vllm':>7} {'wall s':>7}")
    base = None
    for label, policy, options in POLICIES:
        row = measure(policy, options, spec)
        base = base if base is not None else row["median"]
        print(f"{label:<22} {row['steps']:>6} {row['preemptions']:>8} "
              f"{row['recomputed']:>7.1%} {row['tok_s']:>8.1f} {row['median']:>8.1f} "
              f"{row['p90']:>8.1f} {row['mean']:>8.1f} {row['median'] / base:>7.2f} "
              f"{row['wall']:>7.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
