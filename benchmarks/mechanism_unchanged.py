"""Is the mechanism's behaviour unchanged? The real engine's tokens, and the vLLM peer checks.

1. The real `tiny` model (`--engine=jax`, on the CPU) runs a small mixed workload
   (prefill chunks beside decodes: the workload of tests/test_overlap.py) with
   `--overlap` and `--nooverlap`, at the current tree and, with `--old_rev REV`, at
   revision REV. Each run is `python -m experiments.run` in a child process with its
   tree as the working folder and alone on PYTHONPATH (the command line is stable
   across revisions, so this script drives both trees). Every run is compared with the
   reference run (REV without overlap; the current tree's when no REV is given): each
   request's generated token ids (`output_tokens` of requests.jsonl), and each step of
   steps.jsonl (every field both trees write, but the measured `host_s`). All runs share
   one profiled clock (`--profile_table`, measured by the first run), so their virtual
   times, and so their schedules, are comparable.
2. `benchmarks/vllm_peer_compare.py` and `vllm_peer_prefix.py` at each tree (each tree's
   own copy: they drive the scheduler in process, through the API a redesign reshapes),
   with their default workloads: their step-count lines must read the same. They need
   vLLM's scheduler in a venv of its own (../shared/peers/vllm_scheduler/README.md,
   `setup_min_venv.sh`: about 3 GB); without `--peer_python` there, this part says so
   and is skipped.

    python -m benchmarks.mechanism_unchanged --old_rev 74740d2 [--policies sarathi orca vllm]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.old_revision import REPO, revision_tree, tree_env

# tests/test_overlap.py's workload: 12 requests, 4 running at most, prompts beside decodes.
WORKLOAD = ("--num_requests=12", "--rate=50", "--prompt_len=uniform:4:40",
            "--output_len=uniform:1:24", "--max_num_seqs=4", "--max_num_tokens=64",
            "--buckets=16,64")
# Knobs of a policy's runs: sarathi's 32-token budget (as in tests/test_overlap.py) splits
# prompts of up to 40 tokens into chunks beside decodes; vllm caches prefixes (so overlap
# is inactive: both of its runs take the in-step path).
POLICY_OPTS = {"sarathi": "max_num_tokens=32"}
PEER_SCRIPTS = ("vllm_peer_compare.py", "vllm_peer_prefix.py")
# The lines of the peer scripts' reports that count steps and what they did.
PEER_COUNT_LINES = ("busy steps", "preemptions", "saved tokens", "per-step decisions")
DEFAULT_PEER_DIR = REPO.parent / "shared" / "peers" / "vllm_scheduler"


def run_tiny(tree: Path, policy: str, overlap: bool, profile_table: Path,
             out_dir: Path) -> tuple[dict[int, list[int]], list[dict[str, Any]]]:
    """One `experiments.run --engine=jax --model=tiny` run at `tree`.

    Returns:
      Request id -> its generated token ids, and the step records (without `host_s`).
    """
    result = subprocess.run(
        [sys.executable, "-m", "experiments.run", "--engine=jax", "--model=tiny",
         f"--policy={policy}", f"--policy_opts={POLICY_OPTS.get(policy, '')}", *WORKLOAD,
         "--overlap" if overlap else "--nooverlap", f"--profile_table={profile_table}",
         f"--out_dir={out_dir}"],
        cwd=tree, env=tree_env(tree, JAX_PLATFORMS="cpu"), capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"experiments.run failed in {tree}:\n{result.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out_dir / "requests.jsonl").read_text().splitlines()]
    steps = [json.loads(line) for line in (out_dir / "steps.jsonl").read_text().splitlines()]
    return ({row["id"]: row["output_tokens"] for row in rows},
            [{key: value for key, value in step.items() if key != "host_s"} for step in steps])


def first_token_difference(tokens: dict[int, list[int]], reference: dict[int, list[int]]
                           ) -> str:
    """"identical", or the first request whose token ids differ from the reference's."""
    for request_id in sorted(set(tokens) | set(reference)):
        if tokens.get(request_id) != reference.get(request_id):
            return (f"DIFFER from request {request_id}: {tokens.get(request_id)} vs "
                    f"{reference.get(request_id)}")
    return "identical"


def first_step_difference(steps: list[dict[str, Any]], reference: list[dict[str, Any]]
                          ) -> str:
    """"identical", or the first step whose shared fields differ from the reference's."""
    for index, (step, expected) in enumerate(zip(steps, reference)):
        differing = sorted(key for key in step.keys() & expected.keys()
                           if step[key] != expected[key])
        if differing:
            return f"DIFFER from step {index} ({', '.join(differing)})"
    if len(steps) != len(reference):
        return f"DIFFER: {len(steps)} steps vs {len(reference)}"
    return "identical"


def check_tokens(trees: dict[str, Path], policies: list[str]) -> None:
    """Prints every tree x overlap run of each policy against the reference run."""
    print(f"{'policy':>10} {'tree':>10} {'overlap':>8} {'requests':>9} {'tokens':>7} "
          f"{'steps':>6}  tokens / steps vs the reference")
    with tempfile.TemporaryDirectory(prefix="mechanism_unchanged_") as folder:
        profile_table = Path(folder) / "profile.json"
        for policy in policies:
            reference = None
            for label, tree in trees.items():
                for overlap in (False, True):
                    out_dir = Path(folder) / f"{policy}_{label}_{overlap}"
                    tokens, steps = run_tiny(tree, policy, overlap, profile_table, out_dir)
                    verdict = "(the reference)" if reference is None else (
                        f"{first_token_difference(tokens, reference[0])} / "
                        f"{first_step_difference(steps, reference[1])}")
                    reference = reference or (tokens, steps)
                    print(f"{policy:>10} {label:>10} {'on' if overlap else 'off':>8} "
                          f"{len(tokens):>9} {sum(map(len, tokens.values())):>7} "
                          f"{len(steps):>6}  {verdict}", flush=True)


def peer_counts(tree: Path, script: str, peer_python: Path, peer_dir: Path) -> list[str]:
    """The step-count lines of `tree`'s own copy of a vLLM peer script (default workload)."""
    result = subprocess.run(
        [sys.executable, str(tree / "benchmarks" / script), f"--peer_python={peer_python}",
         f"--peer_dir={peer_dir}"],
        cwd=tree, env=tree_env(tree, JAX_PLATFORMS="cpu"), capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"{script} failed in {tree}:\n{result.stderr[-3000:]}")
    return [line.strip() for line in result.stdout.splitlines()
            if line.strip().startswith(PEER_COUNT_LINES)]


def check_peers(trees: dict[str, Path], peer_python: Path, peer_dir: Path) -> None:
    """Prints the vLLM peer scripts' step counts at each tree, or why they cannot run."""
    missing = [str(path) for path in (peer_python, peer_dir / "drive_vllm_scheduler.py")
               if not path.is_file()]
    if missing:
        print(f"vLLM peer checks skipped: no {' and no '.join(missing)} (the peer scripts need "
              "vLLM 0.33's scheduler in a venv of its own: "
              "../shared/peers/vllm_scheduler/setup_min_venv.sh, about 3 GB)")
        return
    for script in PEER_SCRIPTS:
        counts = {label: peer_counts(tree, script, peer_python, peer_dir)
                  for label, tree in trees.items()}
        for label, lines in counts.items():
            print(f"{script} at {label}:" + "".join(f"\n  {line}" for line in lines))
        same = len({tuple(lines) for lines in counts.values()}) == 1
        print(f"{script}: step counts {'identical' if same else 'DIFFER'} across trees",
              flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old_rev", default=None,
                        help="also run at this git revision (the reference)")
    parser.add_argument("--policies", nargs="+", default=["sarathi", "orca", "vllm"],
                        help="policies of the tiny-engine runs")
    parser.add_argument("--peer_python", type=Path,
                        default=Path("/tmp/vllm_peer/venv/bin/python"))
    parser.add_argument("--peer_dir", type=Path, default=DEFAULT_PEER_DIR)
    args = parser.parse_args()
    print(f"# mechanism unchanged: tiny engine (jax, cpu), {' '.join(WORKLOAD)}, policy knobs "
          f"{POLICY_OPTS}; {os.cpu_count()} cpus"
          + (f"; --old_rev={args.old_rev}" if args.old_rev else ""))
    with (revision_tree(args.old_rev) if args.old_rev else contextlib.nullcontext()
          ) as old_tree:
        trees = ({args.old_rev: old_tree} if args.old_rev else {}) | {"current": REPO}
        check_tokens(trees, args.policies)
        check_peers(trees, args.peer_python.absolute(), args.peer_dir.resolve())


if __name__ == "__main__":
    main()
