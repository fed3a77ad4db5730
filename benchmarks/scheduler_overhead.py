"""Host time per iteration of the scheduler in steady decode.

Measures what the core does around the engine each iteration — the policy's
schedule(), the plan checks, KV allocation, pack_step() and the state update — with
32, 128, 256 and 512 running requests that are all decoding. The engine is a
null engine (its time is excluded from `host_s` anyway). Prints the median µs
per iteration and per running request, with prefix caching off and on (it is
active only for a policy that opts in, such as `vllm`: then every page that
fills is named, and the run keeps its generated token ids).

    python benchmarks/scheduler_overhead.py [--policy=orca] [--steps=400]
    python benchmarks/scheduler_overhead.py --policy=vllm --policy_opts=max_num_seqs=512

Then the same through the path users take, `python -m experiments.run --engine=sim`
(llama3-8b, a burst of 256 requests with 64-token prompts decoding to the context,
`--max_model_len` the context): the median `host_s` of its steady-decode steps from
`steps.jsonl`, at contexts 2,048 and 8,192 (`--cli_contexts`).

For scale: vLLM 0.33's v1 scheduler needs about 11-12 µs per running request
per step on a 2-core machine (../shared/peers/vllm_scheduler/results_all.txt).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

import policies
from orca_jax import Request, Scheduler, SchedulerConfig, StepOutput


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
    config = SchedulerConfig(max_num_seqs=num_running,
                             max_num_tokens=max(2048, num_running * 64),
                             num_kv_pages=num_running * context // 16, page_size=16,
                             max_model_len=context, enable_prefix_caching=prefix_caching)
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


def measure_cli(policy: str, num_running: int, context: int) -> dict[str, float]:
    """Median host µs per steady-decode iteration of `python -m experiments.run`."""
    repo = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory() as out:
        subprocess.run([sys.executable, "-m", "experiments.run", "--engine=sim",
                        f"--policy={policy}", "--model=llama3-8b", "--workload=burst",
                        f"--num_requests={num_running}", f"--max_num_seqs={num_running}",
                        "--prompt_len=fixed:64", f"--output_len=fixed:{context - 64}",
                        f"--max_model_len={context}",
                        f"--num_kv_pages={num_running * context // 16}", f"--out_dir={out}"],
                       cwd=repo, check=True, capture_output=True,
                       env={**os.environ, "JAX_PLATFORMS": "cpu"})
        steps = [json.loads(line) for line in open(os.path.join(out, "steps.jsonl"))]
    host = np.array([s["host_s"] for s in steps
                     if s["num_seqs"] == num_running and s["num_tokens"] == num_running])
    median_us = float(np.median(host) * 1e6)
    return {"running": num_running, "steps": host.size, "us_per_iter": median_us,
            "us_per_request": median_us / num_running,
            "p90_us_per_iter": float(np.percentile(host, 90) * 1e6)}


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
    args = parser.parse_args()
    options = policies.parse_options(args.policy_opts)
    print(f"scheduler host overhead, policy={args.policy}, steady decode, "
          f"{args.steps} iterations each; python {platform.python_version()}, "
          f"numpy {np.__version__}")
    print(f"{'context':>8} {'running':>8} {'caching':>8} {'us/iter (median)':>17} "
          f"{'us/iter (p90)':>14} {'us/request':>11}")
    for context in args.contexts:
        for batch in args.batch:
            for caching in (False, True):
                row = measure(args.policy, batch, args.steps, options, prefix_caching=caching,
                              context=context)
                print(f"{context:>8} {row['running']:>8} {'on' if caching else 'off':>8} "
                      f"{row['us_per_iter']:>17.1f} {row['p90_us_per_iter']:>14.1f} "
                      f"{row['us_per_request']:>11.3f}")
    if args.cli_contexts:
        print(f"\npython -m experiments.run --engine=sim --policy={args.policy} "
              f"--model=llama3-8b, burst of {args.cli_running}, steady decode (median host_s "
              f"of steps.jsonl)")
        print(f"{'context':>8} {'running':>8} {'steps':>6} {'us/iter (median)':>17} "
              f"{'us/iter (p90)':>14} {'us/request':>11}")
        for context in args.cli_contexts:
            row = measure_cli(args.policy, args.cli_running, context)
            print(f"{context:>8} {row['running']:>8} {row['steps']:>6} "
                  f"{row['us_per_iter']:>17.1f} {row['p90_us_per_iter']:>14.1f} "
                  f"{row['us_per_request']:>11.3f}")


if __name__ == "__main__":
    main()
