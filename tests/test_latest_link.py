"""Without --out_dir each command writes a fresh folder and runs/latest links the newest: no
command silently replaces another's results (issue 51)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from orca_jax.results.latest_link import fresh_out_dir, point_latest

REPO = Path(__file__).resolve().parents[1]


def test_a_fresh_folder_skips_names_taken_by_a_folder_or_a_run_writing_it(tmp_path):
    now = 1_700_000_000.0
    first = fresh_out_dir("run", tmp_path, now)
    assert first.parent == tmp_path and first.name.startswith("run-2023")
    first.mkdir()
    second = fresh_out_dir("run", tmp_path, now)
    assert second.name == f"{first.name}-2"
    Path(f"{second}.lock").write_text("{}")  # a run writing it: taken as well
    assert fresh_out_dir("run", tmp_path, now).name == f"{first.name}-3"
    assert fresh_out_dir("compare", tmp_path, now).name.startswith("compare-")


def test_latest_is_a_relative_link_replaced_and_a_real_folder_left_alone(tmp_path):
    a, b, link = tmp_path / "run-a", tmp_path / "run-b", tmp_path / "latest"
    a.mkdir()
    b.mkdir()
    assert point_latest(a, link) is None and os.readlink(link) == "run-a"
    assert point_latest(b, link) is None and os.readlink(link) == "run-b"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "run-a", "run-b"]
    link.unlink()
    link.mkdir()
    (link / "summary.json").write_text("{}")
    note = point_latest(a, link)
    assert "is a folder of its own" in note and (link / "summary.json").exists()


def _run(cwd: Path, *args: str, module: str = "experiments.run") -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
    result = subprocess.run([sys.executable, "-m", module, "--engine=sim",
                             "--num_requests=4", "--step_time_ms=5", *args], cwd=cwd, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return result


def test_commands_without_out_dir_keep_every_result_and_latest_is_the_newest(tmp_path):
    _run(tmp_path, "--policy=orca")
    _run(tmp_path, "--policy=vllm")
    runs = tmp_path / "runs"
    folders = sorted(p for p in runs.iterdir() if not p.is_symlink())
    assert len(folders) == 2 and all(p.name.startswith("run-") for p in folders)
    policies = {json.loads((p / "summary.json").read_text())["policy"] for p in folders}
    assert policies == {"orca", "vllm"}
    latest = json.loads((runs / "latest" / "summary.json").read_text())
    assert latest["policy"] == "vllm"
    result = _run(tmp_path, "--policies=orca", module="experiments.compare")
    compared = [p for p in runs.iterdir() if p.name.startswith("compare-")]
    assert len(compared) == 1 and f"results in runs/{compared[0].name}" in result.stdout
    assert (runs / "latest" / "comparison.json").exists()
    assert len([p for p in runs.iterdir() if not p.is_symlink()]) == 3  # none replaced
