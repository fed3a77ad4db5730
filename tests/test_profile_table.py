"""The profiled clock's table across processes: a rerun with it repeats the run bit for bit."""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# One small bucket, a few short requests: the run is mostly compiling and profiling.
RUN = ("--engine=jax", "--model=tiny", "--num_requests=5", "--max_num_tokens=16",
       "--max_num_seqs=4", "--prompt_len=uniform:4:12", "--output_len=uniform:2:6")


def _run(*args: str) -> None:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    result = subprocess.run([sys.executable, "-m", "experiments.run", *RUN, *args], cwd=REPO,
                            env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr


def test_a_rerun_in_another_process_with_the_table_gives_identical_requests(tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    _run(f"--out_dir={first}")  # measures the table and writes it beside the results
    table = first / "profile.json"
    digest = hashlib.sha256(table.read_bytes()).hexdigest()
    assert json.loads((first / "config.json").read_text())["profile_table"] == {
        "path": str(table), "sha256": digest, "loaded": False}
    _run(f"--out_dir={second}", f"--profile_table={table}")  # reads it: no profiling
    assert json.loads((second / "config.json").read_text())["profile_table"] == {
        "path": str(table), "sha256": digest, "loaded": True}
    assert not (second / "profile.json").exists()
    requests = (first / "requests.jsonl").read_bytes()
    assert requests == (second / "requests.jsonl").read_bytes()
    # The timings are the clock's, not constants: steps of different sizes cost differently.
    steps = [json.loads(line) for line in (first / "steps.jsonl").read_text().splitlines()]
    assert len({round(step["step_s"], 12) for step in steps}) > 1
