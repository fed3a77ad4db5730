"""The prepared GPU call (benchmarks/gpu_check.py) runs end to end on the CPU."""

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args, timeout=900):
    env = {**os.environ, "PYTHONPATH": REPO, "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", *args], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=timeout)


def test_dry_run_of_the_new_parts_writes_their_figures(tmp_path):
    # The parts issue 33 added; the older scripts keep their own CPU tests.
    result = _run("--dry_run", "--out", str(tmp_path), "--parts", "env", "model_scale",
                  "overlap_probe", "batch_invariance")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert sorted(os.listdir(tmp_path)) == ["gpu_check.txt", "gpu_check_logs.tar.gz",
                                            "summary.txt"]
    summary = (tmp_path / "summary.txt").read_text()
    for part in ("env", "model_scale", "overlap_probe", "batch_invariance"):
        assert f"{part}: ok" in summary
    logs = (tmp_path / "gpu_check.txt").read_text()
    for line in ("decode 4 x 64", "prefill 64", "mixed 3 x 64 + 32", "compile T=4 S=4",
                 "vllm ", "orca ", "tokens identical at every depth and clock: True",
                 "requests differ", "splits by occupancy"):
        assert line in logs, line


def test_parts_are_skipped_when_the_budget_runs_out(tmp_path):
    result = _run("--dry_run", "--budget_s", "0.001", "--out", str(tmp_path), timeout=120)
    summary = (tmp_path / "summary.txt").read_text()
    assert result.returncode == 0
    assert summary.count("SKIPPED") == 7, summary


def test_an_unknown_part_is_one_line_and_exit_2(tmp_path):
    result = _run("--parts", "nope", "--out", str(tmp_path), timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "--parts: unknown part 'nope'; choose from env, model_scale, overlap_probe, "
        "batch_invariance, profiled_clock, overlap, attention"]
