"""Host time per iteration of the scheduler in steady decode.

Measures what the core does around the engine each iteration — the policy's
schedule(), the plan checks, KV allocation, pack_step() and the state update — with
32, 128, 256 and 512 running requests that are all decoding. The engine is a
null engine (its time is excluded from `host_s` anyway). Prints the median µs
per iteration and per running request, with prefix caching off and on (it is
active only for a policy that opts in, such as `vllm`: then every page that
fills is named, and the run keeps its generated token ids).

    python -m benchmarks.scheduler_overhead [--policy=orca] [--steps=400]
    python -m benchmarks.scheduler_overhead --policy=vllm --policy_opts=max_num_seqs=512

Then the same through the path users take, `python -m experiments.run --engine=sim`
(llama3-8b, a burst of 256 requests with 64-token prompts decoding to the context,
`--max_model_len` the context): the median `host_s` of its steady-decode steps from
`steps.jsonl`, at contexts 2,048 and 8,192 (`--cli_contexts`).

For scale: vLLM 0.33's v1 scheduler needs about 11-12 µs per running request
per step on a 2-core machine (../shared/peers/vllm_scheduler/results_all.txt).

With `--old_rev REV`, both measurements also run at revision REV (its files from
`git archive` in a temporary folder), both trees each round, the order alternating
from round to round (`--rounds` rounds; `old_revision.interleaved`), so machine load
hits both alike; each row is the median over the rounds of the per-run figures, and
`new/old` the ratio of the medians (below 1: the current tree spends less host time per
step), summed up at the end by the geometric mean over all rows. The two parts reach
the trees differently:

- the null-engine loop drives the `Scheduler` in process, through the very API the
  mechanism's redesign reshapes, so each tree runs its own copy of this script in a
  child process (`--cli_contexts` left empty, one context and batch per child), and
  the rows of its table are read back; REV's script must print the context column
  (since 89b9383);
- the `experiments.run` measurement uses only the command line, stable across
  revisions, so this script runs it with each tree as the working folder and alone
  on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

import policies
from benchmarks.old_revision import REPO, interleaved, median_ratio, revision_tree, tree_env
from orca_jax import KVConfig, Request, Scheduler, SchedulerConfig, StepLimits, StepOutput

LOOP_COLUMNS = (f"{'context':>8} {'running':>8} {'caching':>8} {'us/iter (median)':>17} "
                f"{'us/iter (p90)':>14} {'us/request':>11}")
CLI_COLUMNS = (f"{'context':>8} {'running':>8} {'steps':>6} {'us/iter (median)':>17} "
               f"{'us/iter (p90)':>14} {'us/request':>11}")
# A row of the null-engine table: context, running, caching, median, p90, per request.
LOOP_ROW = re.compile(r"^\s*(\d+)\s+(\d+)\s+(on|off)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s*$")


class NullEngine:
    """Returns at once: the benchmark measures the host side alone."""

    name = "null"
    needs_token_ids = False

    def warmup(self, buckets) -> None:
        del buckets

    def step(self, inputs) -> StepOutput:
        return StepOutput(sampled_tokens=inputs.kv_lens, step_s=0.01)


def measure(policy: str, num_running: int, num_steps: int, options: dict[str, str],
            prefix_caching: bool = False, context: int = 2048) -> dict[str, float]:
    """Median host µs per iteration with `num_running` requests in steady decode."""
    # A `context`-token context (context / 16 pages per sequence), every request reserving
    # it; distinct prompts, so caching costs its page naming and finds nothing.
    rng = np.random.default_rng(0)
    requests = [Request(id=i, arrival_s=0.0, prompt_len=64, output_len=context - 64,
                        prompt_tokens=rng.integers(1, 32000, size=64, dtype=np.int32))
                for i in range(num_running)]
    config = SchedulerConfig(limits=StepLimits(max_num_seqs=num_running,
                                               max_num_tokens=max(2048, num_running * 64),
                                               max_model_len=context),
                             kv=KVConfig(num_kv_pages=num_running * context // 16, page_size=16,
                                         prefix_caching="policy" if prefix_caching else "off"))
    scheduler = Scheduler(requests, policies.make_policy(policy, options), NullEngine(), config)
    scheduler.engine.warmup(scheduler.bucket_config.buckets())
    everyone = np.arange(num_running)
    while not scheduler.view.requests.prefill_done(everyone).all():  # until all decode
        scheduler.step()
    for _ in range(3):
        scheduler.step()
    first = len(scheduler.record.steps)
    for _ in range(num_steps):
        scheduler.step()
    host = np.array([s.host_s for s in scheduler.record.steps[first:]])
    assert all(s.num_seqs == num_running for s in scheduler.record.steps[first:])
    median_us = float(np.median(host) * 1e6)
    return {"running": num_running, "us_per_iter": median_us,
            "us_per_request": median_us / num_running,
            "p90_us_per_iter": float(np.percentile(host, 90) * 1e6)}


def measure_cli(policy: str, num_running: int, context: int, tree: Path = REPO
                ) -> dict[str, float]:
    """Median host µs per steady-decode iteration of `python -m experiments.run` at `tree`."""
    with tempfile.TemporaryDirectory() as out:
        subprocess.run([sys.executable, "-m", "experiments.run", "--engine=sim",
                        f"--policy={policy}", "--model=llama3-8b", "--workload=burst",
                        f"--num_requests={num_running}", f"--max_num_seqs={num_running}",
                        "--prompt_len=fixed:64", f"--output_len=fixed:{context - 64}",
                        f"--max_model_len={context}",
                        f"--num_kv_pages={num_running * context // 16}", f"--out_dir={out}"],
                       cwd=tree, check=True, capture_output=True,
                       env=tree_env(tree, JAX_PLATFORMS="cpu"))
        steps = [json.loads(line) for line in open(os.path.join(out, "steps.jsonl"))]
    host = np.array([s["host_s"] for s in steps
                     if s["num_seqs"] == num_running and s["num_tokens"] == num_running])
    median_us = float(np.median(host) * 1e6)
    return {"running": num_running, "steps": host.size, "us_per_iter": median_us,
            "us_per_request": median_us / num_running,
            "p90_us_per_iter": float(np.percentile(host, 90) * 1e6)}


def loop_rows_at(tree: Path, policy: str, policy_opts: str, num_steps: int, batch: int,
                 context: int) -> dict[str, dict[str, float]]:
    """Caching "off"/"on" -> median and p90 µs per iteration of `tree`'s own copy of this
    script (the null-engine loop, one batch and context), from a child process on that tree."""
    result = subprocess.run(
        [sys.executable, str(tree / "benchmarks" / "scheduler_overhead.py"),
         f"--policy={policy}", f"--policy_opts={policy_opts}", f"--steps={num_steps}",
         f"--batch={batch}", f"--contexts={context}", "--cli_contexts"],
        cwd=tree, env=tree_env(tree), capture_output=True, text=True)
    rows = {match[3]: {"us_per_iter": float(match[4]), "p90_us_per_iter": float(match[5])}
            for match in map(LOOP_ROW.match, result.stdout.splitlines()) if match}
    if result.returncode != 0 or set(rows) != {"off", "on"}:
        sys.exit(f"scheduler_overhead.py in {tree} printed no table rows:\n"
                 f"{result.stdout[-1000:]}{result.stderr[-2000:]}")
    return rows


def print_tree_rows(lead: str, running: int, runs: dict[str, list[dict[str, float]]]
                    ) -> float:
    """Prints one row per tree (medians over its runs, after the `lead` columns) and
    returns new/old of the median µs per iteration (`runs`: old tree first)."""
    for label, rows in runs.items():
        median_us = statistics.median(r["us_per_iter"] for r in rows)
        p90_us = statistics.median(r["p90_us_per_iter"] for r in rows)
        print(f"{lead} {median_us:>17.1f} {p90_us:>14.1f} {median_us / running:>11.3f}  "
              f"{label}   runs: " + " ".join(f"{r['us_per_iter']:.1f}" for r in rows))
    old, new = runs.values()
    return median_ratio([r["us_per_iter"] for r in new], [r["us_per_iter"] for r in old])


def compare_trees(args: argparse.Namespace, trees: dict[str, Path]) -> None:
    """Both measurements at each tree, interleaved over `args.rounds` rounds, and new/old."""
    print(f"null-engine loop, each tree's own script; medians over {args.rounds} rounds of "
          "each run's median and p90")
    print(f"{LOOP_COLUMNS}  tree")
    ratios = []
    for context in args.contexts:
        for batch in args.batch:
            runs = interleaved(lambda tree: loop_rows_at(tree, args.policy, args.policy_opts,
                                                         args.steps, batch, context),
                               trees, args.rounds)
            for caching in ("off", "on"):
                ratios.append(print_tree_rows(
                    f"{context:>8} {batch:>8} {caching:>8}", batch,
                    {label: [r[caching] for r in rows] for label, rows in runs.items()}))
                print(f"{'':>8} new/old {ratios[-1]:.3f}", flush=True)
    if args.cli_contexts:
        print(f"\npython -m experiments.run --engine=sim --policy={args.policy} "
              f"--model=llama3-8b, burst of {args.cli_running}, steady decode (median host_s "
              f"of steps.jsonl), medians over {args.rounds} rounds")
        print(f"{CLI_COLUMNS}  tree")
    for context in args.cli_contexts:
        runs = interleaved(lambda tree: measure_cli(args.policy, args.cli_running, context,
                                                    tree), trees, args.rounds)
        steps = {label: {r["steps"] for r in rows} for label, rows in runs.items()}
        ratios.append(print_tree_rows(f"{context:>8} {args.cli_running:>8} "
                                      f"{min(min(s) for s in steps.values()):>6}",
                                      args.cli_running, runs))
        same = len({frozenset(s) for s in steps.values()}) == 1
        print(f"{'':>8} new/old {ratios[-1]:.3f}; steady-decode steps "
              f"{'identical' if same else 'DIFFER'}", flush=True)
    print(f"\nnew/old over all {len(ratios)} rows: geometric mean "
          f"{statistics.geometric_mean(ratios):.3f}, range {min(ratios):.3f}-{max(ratios):.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", default="orca")
    parser.add_argument("--steps", type=int, default=400, help="at most 1,900")
    parser.add_argument("--batch", type=int, nargs="+", default=[32, 128, 256, 512])
    parser.add_argument("--policy_opts", default="",
                        help="policy knobs key=value,... (e.g. max_num_seqs=512 for vllm)")
    parser.add_argument("--contexts", type=int, nargs="+", default=[2048],
                        help="contexts (= max_model_len) of the null-engine loop")
    parser.add_argument("--cli_contexts", type=int, nargs="*", default=[2048, 8192],
                        help="contexts of the experiments.run measurement (none: skip it)")
    parser.add_argument("--cli_running", type=int, default=256)
    parser.add_argument("--old_rev", default=None,
                        help="also measure at this git revision, interleaved with this tree")
    parser.add_argument("--rounds", type=int, default=3,
                        help="with --old_rev: runs of each measurement at each tree")
    args = parser.parse_args()
    options = policies.parse_options(args.policy_opts)
    print(f"scheduler host overhead, policy={args.policy}, steady decode, "
          f"{args.steps} iterations each; python {platform.python_version()}, "
          f"numpy {np.__version__}")
    if args.old_rev:
        with revision_tree(args.old_rev) as old_tree:
            compare_trees(args, {args.old_rev: old_tree, "current": REPO})
        return
    print(LOOP_COLUMNS)
    for context in args.contexts:
        for batch in args.batch:
            for caching in (False, True):
                row = measure(args.policy, batch, args.steps, options, prefix_caching=caching,
                              context=context)
                print(f"{context:>8} {row['running']:>8} {'on' if caching else 'off':>8} "
                      f"{row['us_per_iter']:>17.1f} {row['p90_us_per_iter']:>14.1f} "
                      f"{row['us_per_request']:>11.3f}", flush=True)
    if args.cli_contexts:
        print(f"\npython -m experiments.run --engine=sim --policy={args.policy} "
              f"--model=llama3-8b, burst of {args.cli_running}, steady decode (median host_s "
              f"of steps.jsonl)")
        print(CLI_COLUMNS)
        for context in args.cli_contexts:
            row = measure_cli(args.policy, args.cli_running, context)
            print(f"{context:>8} {row['running']:>8} {row['steps']:>6} "
                  f"{row['us_per_iter']:>17.1f} {row['p90_us_per_iter']:>14.1f} "
                  f"{row['us_per_request']:>11.3f}", flush=True)


if __name__ == "__main__":
    main()
