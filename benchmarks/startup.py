"""What a simulator process costs before and after its simulation: imports and results files.

    python -m benchmarks.startup --old_rev cd1a431 --rounds 7 \
        > benchmarks/results/startup_vs_cd1a431.txt

Each case is one child process, timed by its own process time (user + system, from
`resource`'s `RUSAGE_CHILDREN`), at this tree and, with `--old_rev`, at that revision
(`old_revision`: its files from `git archive`, each tree alone on PYTHONPATH with its
bytecode cached, rounds interleaved in alternating order so load hits both alike):

- `import orca_jax`, `import policies`, `import experiments.run`: the imports alone;
- `run 1`: `python -m experiments.run --engine=sim --policy=vllm --model=llama3-8b
  --hardware=a100 --num_requests=1` (the default `--bucket_ladder=auto`, so with its
  pilot run): almost all of it is the fixed cost;
- `run 10^4`: issue 34's trace (`sim_speed.ISSUE_TRACE`, 30 req/s, 10,000 requests,
  `--bucket_ladder=pow2` so it is one simulation).

A run case also checks that both trees wrote the same results: the bytes of
requests.jsonl, steps.jsonl and summary.json but for the host's measured times
(`HOST_TIMES`: a step's `host_s`, the summary's `host_us_per_step_median`, which differ
from run to run); config.json names the tree's revision and paths, so it is left
out. The rows are medians over the rounds; `new/old` is the ratio of the medians
(below 1: the current tree costs less).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from benchmarks.old_revision import REPO, interleaved, median_ratio, revision_tree, tree_env
from benchmarks.sim_speed import ISSUE_TRACE

RUN = [sys.executable, "-m", "experiments.run"]
CASES: dict[str, list[str]] = {
    "import orca_jax": [sys.executable, "-c", "import orca_jax"],
    "import policies": [sys.executable, "-c", "import policies"],
    "import experiments.run": [sys.executable, "-c", "import experiments.run"],
    "run 1": [*RUN, "--engine=sim", "--policy=vllm", "--model=llama3-8b", "--hardware=a100",
              "--num_requests=1"],
    "run 10^4": [*RUN, *ISSUE_TRACE, "--num_requests=10000", "--rate=30",
                 "--bucket_ladder=pow2"],
}
RESULT_FILES = ("requests.jsonl", "steps.jsonl", "summary.json")
HOST_TIMES = re.compile(rb'"host_[a-z_]*": [-+0-9.eE]+(, |,\n  )?')  # wall clock: no result


def measure(command: list[str], tree: Path) -> tuple[float, Optional[str]]:
    """One run of `command` on `tree`'s code: its process time in seconds and, for a run,
    a digest of its results files."""
    env = tree_env(tree, JAX_PLATFORMS="cpu")
    with tempfile.TemporaryDirectory() as out:
        is_run = command[:3] == RUN
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        result = subprocess.run(command + ([f"--out_dir={out}/run"] if is_run else []),
                                cwd=tree, env=env, capture_output=True, text=True)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if result.returncode != 0:
            sys.exit(f"{' '.join(command)} failed at {tree}:\n{result.stderr[-2000:]}")
        digest = None
        if is_run:
            digest = hashlib.sha256(b"".join(
                HOST_TIMES.sub(b"", Path(out, "run", name).read_bytes())
                for name in RESULT_FILES)).hexdigest()[:12]
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), digest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old_rev", default=None, help="also measure this git revision")
    parser.add_argument("--rounds", type=int, default=5, help="runs of each case at each tree")
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    args = parser.parse_args()
    print(f"# {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} {os.cpu_count()}-core "
          f"machine, load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}, "
          f"--rounds={args.rounds}" + (f", --old_rev={args.old_rev}" if args.old_rev else ""))
    with (revision_tree(args.old_rev) if args.old_rev else _no_tree()) as old_tree:
        trees = {args.old_rev: old_tree, "current": REPO} if old_tree else {"current": REPO}
        for case in args.cases:
            runs = interleaved(lambda tree, case=case: measure(CASES[case], tree), trees,
                               args.rounds)
            seconds = {label: [s for s, _ in rows] for label, rows in runs.items()}
            digests = {d for rows in runs.values() for _, d in rows}
            line = f"{case:<24}" + "".join(
                f" {label} median {statistics.median(s):.3f} s (min {min(s):.3f}, max "
                f"{max(s):.3f});" for label, s in seconds.items())
            if old_tree:
                line += f" new/old {median_ratio(seconds['current'], seconds[args.old_rev]):.3f}"
            if digests != {None}:
                line += f"; results {'identical' if len(digests) == 1 else 'DIFFER'}"
            print(line, flush=True)
            print("  raw s: " + "; ".join(f"{label} " + " ".join(f"{s:.3f}" for s in rows)
                                          for label, rows in seconds.items()), flush=True)
    print(f"# load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


class _no_tree:
    """A `revision_tree` stand-in without a revision: yields None."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


if __name__ == "__main__":
    main()
