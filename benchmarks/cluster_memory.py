"""Memory a cluster keeps per request and replica: what sharing a pool's request table saves.

    python -m benchmarks.cluster_memory > benchmarks/results/cluster_memory.txt
    python -m benchmarks.cluster_memory --old_rev 631e0d7   # beside an old revision

Each case builds a colocated `Cluster` of R simulator replicas (vllm, round robin) over N
Poisson requests in a fresh process and reports the bytes Python's allocator holds for it
(`tracemalloc`: the cluster alone, the workload built before tracing starts), then runs it
to the end and reports the traced peak of the run. Divided by N x R, the first figure is
what each replica keeps per request of the workload: with a table per replica it holds
every request's row; sharing the pool's table (`RequestTable.for_replica`) leaves each
replica its own parts' small index arrays.

With `--old_rev REV`, each case also runs at revision REV (its files from `git archive`),
through the same command line (`benchmarks.old_revision`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.old_revision import REPO, revision_tree, tree_env

# Runs in the child, on the tree under test: only names every revision since 0.1 has.
CHILD = """
import gc, json, sys, tracemalloc
import policies
from orca_jax.cluster import Cluster
from orca_jax.sim.cost_model import CostModelConfig
from orca_jax.sim.engine import SimEngine
from orca_jax.workloads.synthetic import synthetic_workload
try:
    from orca_jax.core.loop.config import SchedulerConfig
except ImportError:
    from orca_jax.core.scheduler import SchedulerConfig
n, r, run = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "run"
requests = synthetic_workload(num_requests=n, arrival="poisson", rate=30.0 * r,
                              prompt_len="uniform:8:512", output_len="uniform:1:256", seed=0)
gc.collect()
tracemalloc.start()
cluster = Cluster(requests, num_replicas=r, router="round_robin",
                  make_policy=lambda: policies.make_policy("vllm"),
                  make_engine=lambda: SimEngine(CostModelConfig(mode="fixed", model="tiny",
                                                                step_time_s=0.01)),
                  config=SchedulerConfig())
built = tracemalloc.get_traced_memory()[0]
peak = None
if run:
    tracemalloc.reset_peak()
    cluster.run()
    peak = tracemalloc.get_traced_memory()[1]
print(json.dumps({"built": built, "run_peak": peak}))
"""


def measure(num_requests: int, num_replicas: int, run: bool, tree: Path) -> dict:
    """One case in a child process on `tree`'s code."""
    result = subprocess.run(
        [sys.executable, "-c", CHILD, str(num_requests), str(num_replicas),
         "run" if run else "build"],
        cwd=tree, env=tree_env(tree, JAX_PLATFORMS="cpu"), capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"case failed in {tree}:\n{result.stderr[-2000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--run_requests", type=int, default=10_000,
                        help="cases of at most this many requests also run to the end")
    parser.add_argument("--old_rev", default=None, help="also measure this git revision")
    args = parser.parse_args()
    print(f"# {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} {os.cpu_count()}-core "
          f"machine; vllm, round robin, Poisson at 30 req/s per replica; tracemalloc")
    print(f"{'requests':>9} {'replicas':>8} {'built MB':>9} {'B/req/replica':>13} "
          f"{'run peak MB':>11}  tree")
    with (revision_tree(args.old_rev) if args.old_rev else contextlib.nullcontext()) as old_tree:
        trees = {"current": REPO} | ({args.old_rev: old_tree} if args.old_rev else {})
        for num_requests in args.requests:
            for num_replicas in args.replicas:
                for label, tree in trees.items():
                    row = measure(num_requests, num_replicas,
                                  num_requests <= args.run_requests, tree)
                    peak = ("-" if row["run_peak"] is None
                            else f"{row['run_peak'] / 1e6:.1f}")
                    print(f"{num_requests:>9} {num_replicas:>8} {row['built'] / 1e6:>9.1f} "
                          f"{row['built'] / num_requests / num_replicas:>13.0f} {peak:>11}  "
                          f"{label}", flush=True)


if __name__ == "__main__":
    main()
