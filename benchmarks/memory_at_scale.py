"""Peak memory and CPU time of a large simulator run, from the command line a user types.

Each measurement is a fresh process, so each peak is its own; the parent reads the
child's peak resident set and CPU seconds from the kernel (`os.wait4`), whatever the
child's code:

* `cli`: `python -m experiments.run --engine=sim --num_requests=N --policy=P
  --out_dir=TMP`, every other flag at its default: the simulation, its summary and
  its results folder (config.json, requests.jsonl, steps.jsonl, summary.json).
* `simulate` (this checkout only): builds the workload, the engine and the scheduler
  as `experiments.run` does of its flags and runs it to the end (`Scheduler.run()`, which also
  assembles the `RunResult`): the simulation's own peak.
* `imports`: `python -c "import experiments.run, policies"`: the interpreter and the
  libraries, what every run starts from; `B/req` is the rest over N.

With `--old_rev REV`, `cli` also runs on revision REV's files (`git archive`,
`benchmarks.old_revision`), interleaved with the current tree round after round, so
both see the same load.

    python -m benchmarks.memory_at_scale [--num_requests=100000 ...] [--policy=orca]
        [--old_rev=REV] [--rounds=1] [--modes=imports,simulate,cli]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# This checkout's orca_jax and benchmarks, wherever the script is run from.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.old_revision import REPO, interleaved, revision_tree, tree_env  # noqa: E402


def _simulate(num_requests: int, policy: str) -> dict[str, int]:
    """The `simulate` child: the run `experiments.run` makes of its flags (the fitted
    step sizes too), without its summary and results."""
    from experiments import flags as run_flags
    from orca_jax.core.api.policy import make_policy
    from orca_jax.core.loop.scheduler import Scheduler
    from orca_jax.runner.bucket_pilot import PilotPolicy, with_fitted_buckets
    from orca_jax.runner.build import build_engine, build_workload, scheduler_config
    run_flags.FLAGS(["run", "--engine=sim", f"--num_requests={num_requests}"])
    spec = run_flags.spec_from_flags()
    requests = build_workload(spec)
    spec, _ = with_fitted_buckets(spec, requests, progress=False,
                                  policies=[PilotPolicy(policy, policy)])
    config = scheduler_config(spec)
    result = Scheduler(requests, make_policy(policy), build_engine(spec, config), config,
                       log_tokens=False).run(progress=None)
    return {"num_steps": result.num_steps,
            "num_tokens": int(result.token_stats.num_tokens.sum())}


def _child_command(mode: str, num_requests: int, policy: str, out_dir: str) -> list[str]:
    if mode == "imports":
        return [sys.executable, "-c", "import experiments.run, policies"]
    if mode == "simulate":
        return [sys.executable, str(Path(__file__).resolve()), "--child",
                f"--num_requests={num_requests}", f"--policy={policy}"]
    return [sys.executable, "-m", "experiments.run", "--engine=sim",
            f"--num_requests={num_requests}", f"--policy={policy}", f"--out_dir={out_dir}"]


def measure(mode: str, num_requests: int, policy: str, tree: Path) -> dict:
    """One child process on `tree`'s code: its peak RSS (MB), CPU and wall seconds, and
    what it reports (`simulate`: steps and tokens; `cli`: from its summary.json)."""
    with tempfile.TemporaryDirectory() as out:
        run_dir = f"{out}/run"
        with open(f"{out}/stdout", "w+") as stdout, open(f"{out}/stderr", "w+") as stderr:
            start = time.perf_counter()
            child = subprocess.Popen(_child_command(mode, num_requests, policy, run_dir),
                                     cwd=tree, env=tree_env(tree, JAX_PLATFORMS="cpu"),
                                     stdout=stdout, stderr=stderr)
            # wait4, not Popen.wait: it gives this child's own peak RSS and CPU time.
            _, status, usage = os.wait4(child.pid, 0)
            child.returncode = os.waitstatus_to_exitcode(status)
            wall = time.perf_counter() - start
            stdout.seek(0), stderr.seek(0)
            printed, errors = stdout.read(), stderr.read()
        if child.returncode != 0:
            raise SystemExit(f"{mode} failed in {tree}:\n{errors[-2000:]}")
        facts: dict = {}
        if mode == "simulate":
            facts = json.loads(printed.strip().splitlines()[-1])
        elif mode == "cli":
            summary = json.loads(Path(run_dir, "summary.json").read_text())
            facts = {k: summary[k] for k in ("num_steps", "num_finished", "itl_p99_s")}
    return {"peak_mb": usage.ru_maxrss / 1024, "cpu_s": usage.ru_utime + usage.ru_stime,
            "wall_s": wall, **facts}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num_requests", type=int, nargs="+", default=[100_000])
    parser.add_argument("--policy", default="orca", help="experiments.run's default: orca")
    parser.add_argument("--modes", default="imports,simulate,cli")
    parser.add_argument("--old_rev", default=None, help="also measure `cli` at this revision")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_simulate(args.num_requests[0], args.policy)))
        return
    modes = args.modes.split(",")
    load = os.getloadavg()
    print(f"# {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} "
          f"{platform.python_implementation()} {platform.python_version()}, "
          f"{platform.machine()}, {os.cpu_count()} cores, load {load[0]:.2f} {load[1]:.2f} "
          f"{load[2]:.2f} at start; --engine=sim --policy={args.policy}, other flags default")
    print(f"{'requests':>9} {'mode':>8} {'peak MB':>8} {'B/req':>6} {'CPU s':>7} "
          f"{'CPU us/req':>10} {'wall s':>7}  tree  facts")
    with (revision_tree(args.old_rev) if args.old_rev else contextlib.nullcontext()) as old:
        trees = {"current": REPO} | ({args.old_rev: old} if old is not None else {})
        base = (interleaved(lambda tree: measure("imports", 1, args.policy, tree), trees, 1)
                if "imports" in modes else None)
        if base is not None:
            for label, rows in base.items():
                print(f"{0:>9} {'imports':>8} {rows[0]['peak_mb']:>8.1f} {'-':>6} "
                      f"{rows[0]['cpu_s']:>7.2f} {'-':>10} {rows[0]['wall_s']:>7.1f}  {label}")
        for num_requests in args.num_requests:
            for mode in [m for m in modes if m != "imports"]:
                mode_trees = trees if mode == "cli" else {"current": REPO}
                rows = interleaved(lambda tree: measure(mode, num_requests, args.policy, tree),
                                   mode_trees, args.rounds)
                for label, measured in rows.items():
                    for row in measured:
                        floor = base[label][0]["peak_mb"] if base is not None else 0.0
                        per_req = (row["peak_mb"] - floor) * 2 ** 20 / num_requests
                        facts = ", ".join(f"{k} {v}" for k, v in row.items()
                                          if k not in ("peak_mb", "cpu_s", "wall_s"))
                        print(f"{num_requests:>9} {mode:>8} {row['peak_mb']:>8.1f} "
                              f"{per_req:>6.0f} {row['cpu_s']:>7.1f} "
                              f"{row['cpu_s'] / num_requests * 1e6:>10.0f} "
                              f"{row['wall_s']:>7.1f}  {label}  {facts}", flush=True)


if __name__ == "__main__":
    main()
