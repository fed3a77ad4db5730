"""The simulator's cost in CPU instructions beside an old revision: a figure load cannot move.

    python -m benchmarks.sim_instructions --old_rev 631e0d7 \\
        > benchmarks/results/sim_instructions_vs_631e0d7.txt

`sim_speed.py --old_rev` times each case in process seconds, which a busy machine (CI
beside it, other jobs) moves by 5-15% from round to round, more than the difference it
is meant to show. This script runs the same command lines (`sim_speed.run_command`) at
both trees under valgrind's callgrind and counts the instructions each process executed
(`Ir`), which do not depend on load: repeat runs of one tree agree to within a few
thousandths (hash seeds pinned, BLAS on one thread).

Each tree is counted twice: the whole run, and the imports alone (`python -c "import
experiments.run, policies"`, with the tree's bytecode cached as `old_revision.tree_env`
does), so that `run - imports`, the workload, the simulation and writing the results,
can be compared per simulated step apart from what the module layout costs at start.

Needs `valgrind` on PATH. Callgrind runs a process about 50x slower: the default cases
(10^4 requests on 1 and 8 replicas) take about 20 minutes per tree on this machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.old_revision import REPO, revision_tree, tree_env
from benchmarks.sim_speed import run_command

IMPORTS = [sys.executable, "-c", "import experiments.run, policies"]
# One BLAS thread and a fixed hash seed: else thread start-up and set/dict orders make the
# count vary by a few percent between repeat runs of one tree.
PINNED = {"JAX_PLATFORMS": "cpu", "PYTHONHASHSEED": "0", "OPENBLAS_NUM_THREADS": "1",
          "OMP_NUM_THREADS": "1"}


def instructions(command: list[str], tree: Path) -> int:
    """The instructions (`Ir`) `command` executes under callgrind, run in `tree`."""
    with tempfile.TemporaryDirectory() as folder:
        profile = os.path.join(folder, "callgrind.out")
        result = subprocess.run(
            ["valgrind", "--tool=callgrind", f"--callgrind-out-file={profile}", *command],
            cwd=tree, env=tree_env(tree, **PINNED), capture_output=True, text=True)
        if result.returncode != 0:
            sys.exit(f"{' '.join(command)} failed in {tree}:\n{result.stderr[-2000:]}")
        with open(profile) as lines:
            for line in lines:
                if line.startswith(("summary:", "totals:")):
                    return int(line.split()[1])
    sys.exit(f"no instruction total in callgrind's output for {' '.join(command)}")


def count_case(num_requests: int, num_replicas: int, bucket_ladder: str,
               tree: Path) -> dict:
    """One case at one tree: instructions of the whole run and of its imports, and steps."""
    with tempfile.TemporaryDirectory() as out:
        run = instructions(run_command(num_requests, num_replicas, bucket_ladder, out), tree)
        with open(os.path.join(out, "steps.jsonl")) as steps:
            num_steps = sum(1 for _ in steps)
    return {"run": run, "imports": instructions(IMPORTS, tree), "steps": num_steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old_rev", required=True, help="the git revision to count beside")
    parser.add_argument("--requests", type=int, nargs="+", default=[10_000])
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--bucket_ladder", default="pow2")
    args = parser.parse_args()
    if shutil.which("valgrind") is None:
        sys.exit("benchmarks.sim_instructions: valgrind is not on PATH")
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True).stdout.strip()
    print(f"# {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} callgrind instruction "
          f"counts (Ir), current tree at {head} (plus uncommitted changes, if any) beside "
          f"--old_rev={args.old_rev}; load average {os.getloadavg()[0]:.2f} (counts do not "
          f"depend on it); --bucket_ladder={args.bucket_ladder}")
    print(f"{'requests':>9} {'replicas':>8} {'steps':>7} {'tree':>8} {'run Ir':>15} "
          f"{'imports Ir':>13} {'run-imports':>15} {'per step':>9}")
    with revision_tree(args.old_rev) as old_tree:
        for num_requests in args.requests:
            for num_replicas in args.replicas:
                rows = {}
                for label, tree in ((args.old_rev, old_tree), ("current", REPO)):
                    row = count_case(num_requests, num_replicas, args.bucket_ladder, tree)
                    rows[label] = row
                    body = row["run"] - row["imports"]
                    print(f"{num_requests:>9} {num_replicas:>8} {row['steps']:>7} "
                          f"{label:>8} {row['run']:>15,} {row['imports']:>13,} "
                          f"{body:>15,} {body / row['steps']:>9,.0f}", flush=True)
                old, new = rows.values()
                ratio = (new["run"] - new["imports"]) / (old["run"] - old["imports"])
                same = "identical" if old["steps"] == new["steps"] else "DIFFER"
                print(f"{'':>9} new/old: whole run {new['run'] / old['run']:.4f}, "
                      f"run without imports {ratio:.4f}; steps {same}", flush=True)
    print(json.dumps({"old_rev": args.old_rev, "policy": "vllm",
                      "bucket_ladder": args.bucket_ladder}))


if __name__ == "__main__":
    main()
