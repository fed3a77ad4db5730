"""Peak memory of a large simulator run: the simulation alone, and with its results.

Runs the same workload twice, each in a fresh process so each peak is its own:

* `simulate`: builds the workload, the engine and the scheduler and runs it to the
  end (`Scheduler.run()`, which also assembles the `RunResult`): the simulation's
  own peak.
* `full`: `run_policy(..., out_dir=...)` as `experiments.run` calls it: the same
  simulation, then the summary and the results folder (config.json,
  requests.jsonl, steps.jsonl, summary.json, status.json).

Prints each process's peak resident set (`ru_maxrss`) and their ratio: what the
summary and the results writing add over the simulation's own peak.

    python benchmarks/memory_at_scale.py [--num_requests=100000] [--policy=vllm]
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# This checkout's orca_jax, wherever the script is run from.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _spec(num_requests: int):
    from orca_jax.runner.spec import RunSpec, WorkloadSpec
    # The simulator's defaults of experiments.run (--engine=sim --workload=poisson).
    return RunSpec(workload=WorkloadSpec(arrival="poisson", num_requests=num_requests,
                                         rate=32.0))


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def child(mode: str, num_requests: int, policy: str) -> dict[str, float]:
    """One measurement in this process: `simulate` or `full`."""
    from orca_jax.core.api.policy import make_policy
    from orca_jax.core.loop.scheduler import Scheduler
    from orca_jax.runner.build import build_engine, build_workload, scheduler_config
    from orca_jax.runner.experiment import run_policy
    spec = _spec(num_requests)
    start = time.perf_counter()
    if mode == "simulate":
        config = scheduler_config(spec)
        workload = build_workload(spec)
        result = Scheduler(workload, make_policy(policy), build_engine(spec, config),
                           config).run(progress=None)
        facts = {"num_steps": result.num_steps, "num_tokens": int(result.token_req.size)}
    else:
        with tempfile.TemporaryDirectory() as out:
            summary, _ = run_policy(spec, policy, out_dir=f"{out}/run", progress=False)
        facts = {"num_steps": summary["num_steps"], "num_finished": summary["num_finished"]}
    return {"peak_mb": _peak_mb(), "wall_s": time.perf_counter() - start, **facts}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num_requests", type=int, default=100_000)
    parser.add_argument("--policy", default="vllm")
    parser.add_argument("--child", choices=["simulate", "full"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.num_requests, args.policy)))
        return
    print(f"# {platform.python_implementation()} {platform.python_version()}, "
          f"{platform.machine()}; --engine=sim --workload=poisson --rate=32 "
          f"--num_requests={args.num_requests} --policy={args.policy}")
    measured = {}
    for mode in ("simulate", "full"):
        out = subprocess.run([sys.executable, __file__, f"--child={mode}",
                              f"--num_requests={args.num_requests}", f"--policy={args.policy}"],
                             check=True, capture_output=True, text=True).stdout
        measured[mode] = json.loads(out.strip().splitlines()[-1])
        print(f"{mode:>9}: peak RSS {measured[mode]['peak_mb']:.1f} MB, "
              f"{measured[mode]['wall_s']:.1f} s, "
              + ", ".join(f"{k} {v}" for k, v in measured[mode].items()
                          if k not in ("peak_mb", "wall_s")))
    ratio = measured["full"]["peak_mb"] / measured["simulate"]["peak_mb"]
    print(f"summary + results writing: peak {ratio:.3f}x the simulation's own peak "
          f"({100 * (ratio - 1):+.1f}%)")


if __name__ == "__main__":
    main()
