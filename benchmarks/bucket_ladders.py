"""Padding against compiled steps for each bucket ladder, on the default simulator workload.

    python benchmarks/bucket_ladders.py > benchmarks/results/bucket_ladders.txt

Runs `experiments.compare --engine=sim --policies=orca,vllm` (its default workload) once
per `--bucket_ladder` and prints each ladder's bucket count (the compiled steps a real
engine warms up) beside each policy's `padding_fraction` (padded tokens over all the
tokens of the padded steps).
"""

import json
import subprocess
import sys
import tempfile
from pathlib import Path

LADDERS = ["pow2", "geometric:1.5", "geometric:1.41", "geometric:1.3", "geometric:1.25",
           "geometric:1.2", "step:128", "step:64"]
POLICIES = ["orca", "vllm"]


def main() -> None:
    repo = Path(__file__).resolve().parents[1]
    print(f"{'ladder':<16} {'buckets':>7} " + " ".join(f"{p + ' padding':>13}" for p in POLICIES))
    with tempfile.TemporaryDirectory() as tmp:
        for ladder in LADDERS:
            out = Path(tmp) / ladder.replace(":", "_")
            subprocess.run([sys.executable, "-m", "experiments.compare", "--engine=sim",
                            f"--policies={','.join(POLICIES)}", f"--bucket_ladder={ladder}",
                            f"--out_dir={out}"], cwd=repo, check=True, capture_output=True)
            config = json.loads((out / POLICIES[0] / "config.json").read_text())
            buckets = config["run"]["limits"]["token_buckets"]
            padding = [json.loads((out / p / "summary.json").read_text())["padding_fraction"]
                       for p in POLICIES]
            print(f"{ladder:<16} {len(buckets):>7} " + " ".join(f"{x:>13.4f}" for x in padding))
            print(f"  {buckets}")


if __name__ == "__main__":
    main()
