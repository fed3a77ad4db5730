"""The README's main job, run twice: the first time with an empty compile cache, then warm.

The README's quick start promises that the second run of its main job,
`python -m experiments.compare`, takes at most half the time of the first,
because JAX's persistent compilation cache (`--compile_cache`) then holds the
compiled steps and the profiled clock's table. Each repeat runs that command twice
in child processes, as a user does, with a fresh temporary `--compile_cache` and
`--profile_store` folder (so the first run compiles everything and times the
profiled clock's grid) and a temporary `--out_dir`, and prints the wall time of
each run (process start to exit), their ratio, the machine's load average
before each run, and from the runs' `summary.json` the compile seconds and
whether every compiled step came from the cache, and how many steps were loaded
whole, untraced (`executable_cache`). On a CPU both runs must give every
request the same output tokens (checked; on a GPU the count is printed), and
their step counts are the same: the second run prices its steps by the table the
first one stored.

    python -m benchmarks.readme_main_job [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
COMMAND = ("-m", "experiments.compare")  # the README's main job, with its defaults


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def run_once(cache: Path, out_dir: Path) -> dict[str, Any]:
    """Runs the main job once; its wall seconds and, per policy, its summary's facts."""
    load = _load()
    start = time.perf_counter()
    result = subprocess.run([sys.executable, *COMMAND, f"--compile_cache={cache}",
                             f"--profile_store={cache.parent / 'profile_store'}",
                             f"--out_dir={out_dir}"], cwd=REPO, capture_output=True, text=True)
    wall_s = time.perf_counter() - start
    if result.returncode != 0:
        sys.exit(f"the main job failed (exit {result.returncode}):\n{result.stderr[-2000:]}")
    policies = json.loads((out_dir / "comparison.json").read_text())
    runs = {}
    for row in policies:
        folder = out_dir / row["policy"]
        summary = json.loads((folder / "summary.json").read_text())
        rows = map(json.loads, (folder / "requests.jsonl").read_text().splitlines())
        tokens = {r["id"]: r["output_tokens"] for r in rows}
        runs[row["policy"]] = {"summary": summary, "tokens": tokens}
    return {"wall_s": wall_s, "load": load, "policies": runs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=1, help="pairs of runs, each pair "
                        "with its own empty cache")
    args = parser.parse_args()
    import jax  # only for the header: which jax, on which device

    print(f"# python -m benchmarks.readme_main_job --repeats {args.repeats}")
    print(f"# {platform.machine()}, {os.cpu_count()} cores, jax {jax.__version__} on "
          f"{jax.default_backend()}; the command: python {' '.join(COMMAND)} "
          "--compile_cache=TMP/cache --profile_store=TMP/profile_store --out_dir=TMP/runK")
    print("rep  run     wall_s  load_before          policy  compile_s  cache_hit  loaded  "
          "num_steps")
    ratios = []
    for rep in range(args.repeats):
        with tempfile.TemporaryDirectory(prefix="readme_main_job_") as tmp:
            cache = Path(tmp) / "cache"
            first = run_once(cache, Path(tmp) / "run1")
            second = run_once(cache, Path(tmp) / "run2")
        for name, run in (("first", first), ("second", second)):
            for policy, facts in run["policies"].items():
                s = facts["summary"]
                print(f"{rep:3d}  {name:6s}  {run['wall_s']:6.2f}  {run['load']:17s}  "
                      f"{policy:>6s}  {s['compile_s']:9.3f}  {str(s['compile_cache_hit']):9s}  "
                      f"{s.get('executables_loaded', 0):6d}  {s['num_steps']:9d}")
        same = []
        for policy, facts in first["policies"].items():
            tokens = second["policies"][policy]["tokens"]
            equal = sum(tokens[r] == t for r, t in facts["tokens"].items())
            same.append(f"{policy} {equal}/{len(tokens)}")
            # On a CPU a step's tokens do not depend on what else it batches (tested), so
            # the two runs agree whatever their schedules; on a GPU they may not (its
            # products' rounding follows the batch), so there the count is reported only.
            if equal != len(tokens) and jax.default_backend() == "cpu":
                sys.exit(f"{policy}: the two runs' output tokens differ")
        ratio = second["wall_s"] / first["wall_s"]
        ratios.append(ratio)
        print(f"{rep:3d}  second/first = {second['wall_s']:.2f} / {first['wall_s']:.2f} s = "
              f"{ratio:.3f}; requests with identical output tokens: {', '.join(same)}")
    if len(ratios) > 1:
        print(f"median second/first over {len(ratios)} repeats: {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
