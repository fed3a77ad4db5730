"""The simulator's results, frozen: a change made for speed must not move a single bit.

Each case runs `experiments.run --engine=sim` on a small workload and digests what the
run wrote that does not depend on the host's speed: every requests.jsonl row, every
steps.jsonl row but its measured `host_s`, and summary.json but its host-time fields.
The digests were taken before the simulator's per-step work was cut (issue 14); a
change that moves one is a change of results, to be made on purpose (update the digest
and say why in the commit).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from results_digest import results_digest

REPO = Path(__file__).resolve().parents[1]
# The digests are of the powers-of-two ladder, the default before issue 14's fitted one.
COMMON = ["--engine=sim", "--model=llama3-8b", "--hardware=a100", "--num_requests=300",
          "--rate=30", "--bucket_ladder=pow2"]
CASES = {
    "vllm": ["--policy=vllm"],
    "orca": ["--policy=orca"],
    # The ragged pricing (real tokens only), as before issue 26's padding; retaken when the
    # per-op roofline's GEMM waves and rope lanes (issue 26's cost-model fixes) moved it.
    "orca_ragged": ["--policy=orca", "--step_padding=ragged"],
    "sarathi_2_replicas": ["--policy=sarathi", "--num_replicas=2", "--router=least_outstanding"],
}
# Taken at 6b32c3e (before issue 14's changes) with `python tests/test_sim_results_frozen.py`,
# and again once the cost models stopped calling BLAS (`np.dot`): its kernels add in a
# different order on AVX2 and AVX-512 CPUs, so these digests held on one machine only.
# And again when the simulator began pricing a step's padded tokens (issue 26), and when
# the per-op roofline began pricing GEMMs in waves of tiles and rope's idle lanes, with
# refitted presets (issue 26's cost-model fixes): every case, orca_ragged included.
DIGESTS = {
    "orca": "527d45bf6a900151",
    "orca_ragged": "f3f6e4e1ab03ec9c",
    "sarathi_2_replicas": "6923d23c1b3662a9",
    "vllm": "2348b4b10d263728",
}


def run_case(name: str, out: Path) -> str:
    args = CASES[name]
    done = subprocess.run([sys.executable, "-m", "experiments.run", *COMMON, *args,
                           f"--out_dir={out}"], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=120)
    assert done.returncode == 0, done.stderr
    return results_digest(out)


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_simulator_s_results_are_bit_for_bit_those_of_before(name, tmp_path):
    assert run_case(name, tmp_path / name) == DIGESTS[name]


if __name__ == "__main__":  # prints the digests of the code as it is
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        for case in sorted(CASES):
            print(f'    "{case}": "{run_case(case, Path(tmp) / case)}",')
