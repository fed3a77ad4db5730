"""How fast the simulator runs: requests and steps simulated per second of process time.

    python benchmarks/sim_speed.py > benchmarks/results/sim_speed.txt

Each case is one `python -m experiments.run --engine=sim --policy=vllm --model=llama3-8b
--hardware=a100 --bucket_ladder=pow2` process on Poisson arrivals at 30 req/s per replica
(with N replicas the rate is 30 N, round robin), timed by the child's own process time
(`resource`'s `RUSAGE_CHILDREN`: imports, workload, the run and writing its results).

`--bucket_ladder` is pinned (pow2 by default) so that a case is one simulation: the
simulator's default `auto` ladder (`fit:16`) first simulates the whole workload once more,
the pilot run it fits the step sizes to (`orca_jax.runner.bucket_pilot`);
`--bucket_ladder=auto` measures the command as it runs by default, pilot included.
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RATE_PER_REPLICA = 30.0


def run_case(num_requests: int, num_replicas: int, bucket_ladder: str) -> dict:
    """Runs one case in a child process; its process time, steps and wall time."""
    repo = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory() as out:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "experiments.run", "--engine=sim", "--policy=vllm",
                        "--model=llama3-8b", "--hardware=a100", f"--num_requests={num_requests}",
                        f"--rate={RATE_PER_REPLICA * num_replicas:g}",
                        f"--num_replicas={num_replicas}", f"--bucket_ladder={bucket_ladder}",
                        f"--out_dir={out}"],
                       cwd=repo, check=True, capture_output=True,
                       env={**os.environ, "JAX_PLATFORMS": "cpu"})
        wall_s = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        num_steps = sum(1 for _ in open(os.path.join(out, "steps.jsonl")))
    cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"requests": num_requests, "replicas": num_replicas, "steps": num_steps,
            "cpu_s": cpu_s, "wall_s": wall_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--bucket_ladder", default="pow2",
                        help="the run's --bucket_ladder (auto: with the fit's pilot run)")
    args = parser.parse_args()
    print(f"# {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} {os.cpu_count()}-core "
          f"machine, load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}, "
          f"--bucket_ladder={args.bucket_ladder}")
    print(f"{'requests':>9} {'replicas':>8} {'steps':>8} {'process s':>10} {'wall s':>8} "
          f"{'requests/s':>11} {'steps/s':>9} {'us/step':>8}")
    for num_requests in args.requests:
        for num_replicas in args.replicas:
            row = run_case(num_requests, num_replicas, args.bucket_ladder)
            print(f"{row['requests']:>9} {row['replicas']:>8} {row['steps']:>8} "
                  f"{row['cpu_s']:>10.2f} {row['wall_s']:>8.2f} "
                  f"{row['requests'] / row['cpu_s']:>11.0f} {row['steps'] / row['cpu_s']:>9.0f} "
                  f"{row['cpu_s'] / row['steps'] * 1e6:>8.1f}", flush=True)
    print(json.dumps({"rate_per_replica": RATE_PER_REPLICA, "policy": "vllm",
                      "bucket_ladder": args.bucket_ladder}))


if __name__ == "__main__":
    main()
