"""experiments.reproduce.autellix on a tiny configuration: its reading of the curves, the
affinity router's hits, and the command end to end."""

import json

import numpy as np
import pytest

from experiments.reproduce import autellix
from orca_jax.results.sweep_store import Curve

TINY = autellix.AutellixSetup(programs=5, num_requests=40, rates=(0.5, 1.5), pin_requests=40,
                              num_replicas=2)


def _curve(policy, rates, y):
    n = len(rates)
    rates = np.asarray(rates, dtype=float)
    return Curve(policy=policy, rates=rates, x_mean=rates, y_mean=np.asarray(y, dtype=float),
                 y_low=np.asarray(y, dtype=float), y_high=np.asarray(y, dtype=float),
                 num_seeds=np.ones(n, dtype=int))


def test_gain_rows_read_each_policy_s_rate_under_the_bound_against_vllm():
    setup = autellix.AutellixSetup(rates=(1.0, 2.0, 3.0))
    curves = [_curve("vllm (sequential)", [1, 2, 3], [10, 30, 50]),  # crosses 20 at 1.5
              _curve("plas (sequential)", [1, 2, 3], [12, 14, 16]),  # never: >= 3
              _curve("atlas (parallel)", [1, 2, 3], [1, 1, 1])]  # another shape: not here
    rows = {r["policy"]: r for r in autellix.gain_rows(setup, "sequential", curves, 2.0)}
    assert sorted(rows) == ["plas", "vllm"]
    assert rows["vllm"]["bound_s"] == 20.0  # 2 x the best lowest-rate mean (vllm's 10)
    assert rows["vllm"]["rate_at_bound"] == "1.5" and rows["vllm"]["vs_vllm"] == "1.00x"
    assert rows["plas"]["rate_at_bound"] == ">=3" and rows["plas"]["vs_vllm"] == "2.00x"


def test_a_shape_s_rows_count_every_program_and_policies_differ_only_in_order(tmp_path):
    rows, curves = autellix.run_shape(TINY, "parallel", str(tmp_path))
    assert [(r["policy"], r["rate"]) for r in rows] == [
        (p, rate) for p in autellix.POLICIES for rate in TINY.rates]
    # Every policy at every rate finishes the same whole programs (--program_count).
    assert {r["programs_done"] for r in rows} == {TINY.programs}
    assert all(r[autellix.P50] <= r[autellix.P99] for r in rows)
    assert [c.policy for c in curves] == [f"{p} (parallel)" for p in autellix.POLICIES]


def test_the_affinity_router_hits_a_program_s_history_more_than_least_outstanding():
    rows = {(r["router"], r["policy"]): r for r in autellix.cluster_rows(TINY)}
    for policy in ("vllm", "plas"):
        assert (rows["program_affinity", policy]["prefix_hit_rate"]
                > rows["least_outstanding", policy]["prefix_hit_rate"])


def test_the_command_writes_its_tables_and_figure(tmp_path, capsys):
    out = tmp_path / "out"
    autellix.main([f"--out_dir={out}", "--programs=3", "--rates=1", "--nocluster",
                   "--nopins"])
    printed = capsys.readouterr().out
    assert "paper: plas/atlas 4-15x vllm" in printed and autellix.differs(3) in printed
    paper = json.loads((out / "paper.json").read_text())["rows"]
    assert {r["policy"] for r in paper} == set(autellix.POLICIES)
    assert (out / autellix.FIGURE).exists()
    assert not (out / "cluster.txt").exists() and not (out / "pins.txt").exists()


def test_a_bad_rate_is_refused():
    from absl import app
    with pytest.raises(app.UsageError, match="rates"):
        autellix.parse_flags(autellix.FLAGS, ["--rates=0"])
