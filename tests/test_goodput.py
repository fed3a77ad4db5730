"""Goodput (requests meeting every set SLO, per second) and SLO attainment in what people
read: the compare table, its figure, and a sweep's metric; '-' where no SLO is set."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from experiments.compare import PLOT_METRICS, plotted_metrics

REPO = Path(__file__).resolve().parents[1]
SIM = ("--engine=sim", "--num_requests=60", "--rate=16", "--policies=static,orca")


def _run(module: str, *args: str) -> str:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    result = subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def _table(path: Path) -> list[dict[str, str]]:
    """comparison.txt / sweep.txt as rows of {column: cell} (no cell holds a space); the
    lines above the header (what the comparison held equal) are skipped."""
    lines = path.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("policy "))
    header, _, *rows = lines[start:]
    return [dict(zip(header.split(), row.split())) for row in rows]


def test_compare_table_has_goodput_and_attainment_with_an_slo(tmp_path):
    _run("experiments.compare", *SIM, "--ttft_slo_s=0.05", f"--out_dir={tmp_path}")
    rows = {row["policy"]: row for row in _table(tmp_path / "comparison.txt")}
    for name in ("static", "orca"):
        summary = json.loads((tmp_path / name / "summary.json").read_text())
        assert float(rows[name]["goodput_req_s"]) == pytest.approx(summary["goodput_req_s"],
                                                                   rel=1e-3)
        assert float(rows[name]["slo_attainment"]) == pytest.approx(summary["slo_attainment"],
                                                                    rel=1e-3)
    # Continuous batching gets far more requests their first token within 50 ms.
    assert float(rows["orca"]["goodput_req_s"]) > 3 * float(rows["static"]["goodput_req_s"]) > 0
    assert float(rows["orca"]["slo_attainment"]) > 3 * float(rows["static"]["slo_attainment"])
    saved = json.loads((tmp_path / "comparison.json").read_text())
    assert [row["goodput_req_s"] is not None for row in saved] == [True, True]


def test_compare_table_shows_a_dash_for_goodput_without_an_slo(tmp_path):
    _run("experiments.compare", *SIM, f"--out_dir={tmp_path}")
    rows = _table(tmp_path / "comparison.txt")
    assert [(row["goodput_req_s"], row["slo_attainment"]) for row in rows] == [("-", "-")] * 2


def test_the_figure_has_a_goodput_bar_only_with_an_slo():
    without = [{"policy_label": "a", "throughput_tok_s": 1.0}]
    assert plotted_metrics(without) == list(PLOT_METRICS)
    with_slo = [{"policy_label": "a", "goodput_req_s": 0.0},
                {"policy_label": "b", "goodput_req_s": 2.5}]
    panels = plotted_metrics(with_slo)
    assert panels[:-1] == list(PLOT_METRICS) and panels[-1][0] == "goodput_req_s"


def test_sweep_plots_goodput_over_rates(tmp_path):
    _run("experiments.sweep", *SIM[:2], "--policies=orca", "--rates=4,64", "--tpot_slo_s=0.02",
         "--metric=goodput", f"--out_dir={tmp_path}")
    rows = _table(tmp_path / "sweep.txt")
    points = [json.loads(line) for line in (tmp_path / "points.jsonl").read_text().splitlines()]
    by_rate = {point["rate"]: point["summary"]["goodput_req_s"] for point in points}
    assert [float(row["rate"]) for row in rows] == [4.0, 64.0]
    for row in rows:
        assert float(row["goodput_req_s"]) == pytest.approx(by_rate[float(row["rate"])],
                                                            rel=1e-3)
