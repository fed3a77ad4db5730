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

With `--cli_requests N`, it also runs the command line a user types, `python -m
experiments.run --engine=sim --num_requests=N --num_replicas=R --rate=30R` (every other
flag at its default, its results folder in a temporary one) for each R of `--replicas`,
and reports the process's peak resident set (the kernel's, `os.wait4`): what a cluster
keeps as a run goes, its summary and results included. Each replica counts its tokens
as one replica does (`TokenTally`), so 8 replicas over 10^6 requests peak near what one
does, where every token's time kept (16 bytes a token) took 4.5 GiB.

    python -m benchmarks.cluster_memory --requests 10000 --replicas 8 \
        --cli_requests 1000000 > benchmarks/results/cluster_memory_cli_1e6.txt
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


def measure_cli(num_requests: int, num_replicas: int, tree: Path) -> dict:
    """`experiments.run` on `tree`'s code in a child process: its peak RSS (MiB), CPU and
    wall seconds, and its summary's finished count."""
    import tempfile

    with tempfile.TemporaryDirectory() as out:
        command = [sys.executable, "-m", "experiments.run", "--engine=sim",
                   f"--num_requests={num_requests}", f"--num_replicas={num_replicas}",
                   f"--rate={30 * num_replicas}", f"--out_dir={out}/run"]
        with open(f"{out}/stderr", "w+") as stderr:
            start = time.perf_counter()
            child = subprocess.Popen(command, cwd=tree, env=tree_env(tree, JAX_PLATFORMS="cpu"),
                                     stdout=subprocess.DEVNULL, stderr=stderr)
            _, status, usage = os.wait4(child.pid, 0)  # this child's own peak and CPU
            wall = time.perf_counter() - start
            if os.waitstatus_to_exitcode(status) != 0:
                stderr.seek(0)
                sys.exit(f"{' '.join(command[1:])} failed in {tree}:\n{stderr.read()[-2000:]}")
        summary = json.loads(Path(out, "run", "summary.json").read_text())
    return {"peak_mib": usage.ru_maxrss / 1024, "cpu_s": usage.ru_utime + usage.ru_stime,
            "wall_s": wall, "num_finished": summary["num_finished"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--run_requests", type=int, default=10_000,
                        help="cases of at most this many requests also run to the end")
    parser.add_argument("--old_rev", default=None, help="also measure this git revision")
    parser.add_argument("--cli_requests", type=int, default=0,
                        help="also run experiments.run over this many requests on each "
                             "number of --replicas and report its peak RSS (0: not)")
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
        if args.cli_requests:
            print(f"# python -m experiments.run --engine=sim --num_requests={args.cli_requests}"
                  " --num_replicas=R --rate=30R (other flags default); peak RSS from wait4")
            print(f"{'requests':>9} {'replicas':>8} {'peak MiB':>9} {'CPU s':>7} "
                  f"{'wall s':>7} {'finished':>9}  tree")
            for num_replicas in args.replicas:
                for label, tree in trees.items():
                    row = measure_cli(args.cli_requests, num_replicas, tree)
                    print(f"{args.cli_requests:>9} {num_replicas:>8} {row['peak_mib']:>9.1f} "
                          f"{row['cpu_s']:>7.1f} {row['wall_s']:>7.1f} "
                          f"{row['num_finished']:>9}  {label}", flush=True)


if __name__ == "__main__":
    main()
