"""Padding against compiled steps for each bucket ladder, on the default simulator workload.

    python -m benchmarks.bucket_ladders > benchmarks/results/bucket_ladders.txt

Runs `experiments.compare --engine=sim --policies=orca,vllm` (its default workload) once
per `--bucket_ladder` (`default`: the flag unset, i.e. `auto`, fit:16 on the simulator)
and prints each ladder's bucket count (the compiled steps a real engine warms up) beside
each policy's `padding_fraction` (padded tokens over all the tokens of the padded
steps) and, for a fitted ladder, the pilots' cost in seconds (`pilot_s`: one pilot
per compared policy and the fit, wall clock, once per comparison). Then the same fits
with the pilot's policy varied (the library, not the command line, which since issue 50
pilots every compared policy): fitted to orca's steps, or to both policies' steps
together. `benchmarks/results/bucket_ladders.txt` was made before issue 50 (one vllm
pilot, no 2x rule).
"""

import dataclasses
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from orca_jax.core.step.bucket_fit import fit_token_sizes
from orca_jax.core.step.packing import ladder_token_sizes
from orca_jax.runner.build import build_workload
from orca_jax.runner.experiment import run_policy
from orca_jax.runner.spec import LimitsSpec, RunSpec, SimEngineSpec, WorkloadSpec

LADDERS = ["pow2", "geometric:1.5", "geometric:1.41", "geometric:1.3", "geometric:1.25",
           "geometric:1.2", "step:128", "step:64", "fit:8", "fit:12", "fit:16", "default"]
POLICIES = ["orca", "vllm"]
# The command line's sim defaults (orca_jax.runner.spec.COMMAND_DEFAULTS["sim"]).
SPEC = RunSpec(workload=WorkloadSpec(num_requests=1000, rate=32.0, prompt_len="uniform:32:512",
                                     output_len="uniform:1:128"),
               engine=SimEngineSpec(model="llama3-8b", hardware="a100"),
               limits=LimitsSpec(max_num_seqs=64, max_num_tokens=2048))


def compare_ladders(repo: Path) -> None:
    print(f"{'ladder':<16} {'buckets':>7} " + " ".join(f"{p + ' padding':>13}" for p in POLICIES)
          + f" {'pilot_s':>8}")
    with tempfile.TemporaryDirectory() as tmp:
        for ladder in LADDERS:
            out = Path(tmp) / ladder.replace(":", "_")
            flag = [] if ladder == "default" else [f"--bucket_ladder={ladder}"]
            subprocess.run([sys.executable, "-m", "experiments.compare", "--engine=sim",
                            f"--policies={','.join(POLICIES)}", *flag,
                            f"--out_dir={out}"], cwd=repo, check=True, capture_output=True)
            config = json.loads((out / POLICIES[0] / "config.json").read_text())
            buckets = config["run"]["limits"]["token_buckets"]
            padding = [json.loads((out / p / "summary.json").read_text())["padding_fraction"]
                       for p in POLICIES]
            fit = config.get("bucket_fit")
            pilot = f"{fit['pilot_s']:>8.2f}" if fit else f"{'-':>8}"
            print(f"{ladder:<16} {len(buckets):>7} " + " ".join(f"{x:>13.4f}" for x in padding)
                  + f" {pilot}")
            print(f"  {buckets}")


def _steps(spec: RunSpec, policy: str, requests: list) -> np.ndarray:
    return run_policy(spec, policy, requests=requests, progress=False)[1].step_array("num_tokens")


def compare_pilots(num_sizes: int = 16) -> None:
    """fit:K fitted to each pilot's steps (step:8), then each policy run on that ladder."""
    requests = build_workload(SPEC)
    fine = dataclasses.replace(SPEC, limits=dataclasses.replace(
        SPEC.limits, token_buckets=ladder_token_sizes("step:8", 2048)))
    steps = {p: _steps(fine, p, requests) for p in POLICIES}
    print(f"\nfit:{num_sizes} by pilot policy (the command line's pilot: vllm)")
    print(f"{'pilot':<16} " + " ".join(f"{p + ' padding':>13}" for p in POLICIES))
    for pilot in [*POLICIES, "+".join(POLICIES)]:
        pilot_steps = np.concatenate([steps[p] for p in pilot.split("+")])
        sizes = fit_token_sizes(pilot_steps, num_sizes, 2048)
        fitted = dataclasses.replace(SPEC, limits=dataclasses.replace(SPEC.limits,
                                                                      token_buckets=sizes))
        padding = [run_policy(fitted, p, requests=requests, progress=False)[0]
                   ["padding_fraction"] for p in POLICIES]
        print(f"{pilot:<16} " + " ".join(f"{x:>13.4f}" for x in padding))
        print(f"  {list(sizes)}")


def main() -> None:
    compare_ladders(Path(__file__).resolve().parents[1])
    compare_pilots()


if __name__ == "__main__":
    main()
