"""The DistServe reproduction on a tiny grid: its capacity reading and the orderings it shows."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from experiments.reproduce import distserve


def _azure_like_trace(path, n=60):
    rng = np.random.default_rng(0)
    rows = ["arrived_at,num_prefill_tokens,num_decode_tokens"]
    rows += [f"{0.2 * i:.3f},{int(rng.integers(200, 3000))},{int(rng.integers(20, 300))}"
             for i in range(n)]
    path.write_text("\n".join(rows) + "\n")
    return str(path)


def test_distserve_capacity_is_where_attainment_crosses_ninety_percent():
    assert distserve.capacity_at([1.0, 2.0, 4.0], [1.0, 0.95, 0.75]) == pytest.approx(2.5)
    assert distserve.capacity_at([1.0, 2.0], [0.8, 0.5]) is None
    assert distserve.capacity_at([1.0, 2.0], [1.0, 0.9]) == 2.0  # never below: the last rate


def test_distserve_disaggregation_wins_under_a_tight_tpot_slo_and_loses_under_a_loose_one(
        tmp_path):
    systems = (distserve.SYSTEMS[0], distserve.SYSTEMS[2])  # vllm x2 and disagg 1+1
    setup = distserve.DistServeSetup(num_requests=60, rates=(3.0, 8.0), systems=systems,
                                     trace=_azure_like_trace(tmp_path / "conv.csv"))
    points, capacity = distserve.run(setup, str(tmp_path / "out"))
    goodput = {(p["workload"], p["tpot_slo"], p["system"], p["rate_per_gpu"]):
               p["goodput_per_gpu"] for p in points}
    assert len(goodput) == 2 * 2 * 2 * 2  # workloads x SLOs x systems x rates
    # Prefills stall colocated decodes past a 15 ms TPOT; the decode replica's never are.
    assert goodput["synthetic", "tight", "disagg 1+1", 3.0] > 1.5 * goodput[
        "synthetic", "tight", "vllm x2", 3.0]
    # Loose TPOT: one prefill GPU cannot keep TTFT under 1 s at 8 req/s per GPU; two can.
    assert goodput["synthetic", "loose", "vllm x2", 8.0] > 2 * goodput[
        "synthetic", "loose", "disagg 1+1", 8.0]
    by_key = {(r["workload"], r["tpot_slo"], r["system"]): r for r in capacity}
    assert by_key["synthetic", "loose", "vllm x2"]["past_range"]
    assert by_key["synthetic", "loose", "disagg 1+1"]["over_vllm"] < 1
    assert (tmp_path / "out" / "points.json").exists()


def test_distserve_command_writes_its_table_and_figure(tmp_path):
    trace = _azure_like_trace(tmp_path / "conv.csv", n=20)
    out = subprocess.run(
        [sys.executable, "-m", "experiments.reproduce.distserve", f"--trace={trace}",
         f"--out_dir={tmp_path / 'out'}", "--num_requests=12", "--rates=4"],
        cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "disagg 3+1" in out.stdout and "7.4x" in out.stdout
    table = (tmp_path / "out" / "capacity.txt").read_text()
    assert table.count("disagg") == 2 * 2 * 3  # workloads x SLOs x disaggregated systems
    # No --figure: the figure goes under --out_dir, not into the tracked docs/figures/.
    figure = tmp_path / "out" / "distserve_goodput.png"
    assert f"figure: {figure}" in out.stdout and figure.read_bytes()[:4] == b"\x89PNG"
