"""Simulator calibration: tile counts, the fit, the fit file, the comparison, the command."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from orca_jax.core.step.engine_api import Bucket, StepOutput
from orca_jax.runner.experiment import run_policy
from orca_jax.runner.spec import LimitsSpec, RunSpec, SimEngineSpec, WorkloadSpec
from orca_jax.sim import calibration as cal
from orca_jax.sim import cost_model as cm
from orca_jax.sim import step_profile as prof
from orca_jax.sim.engine import SimEngine

REPO = Path(__file__).resolve().parents[1]


def test_attention_tiles_counts_causal_query_and_kv_tiles():
    # Decode: one query tile, ceil(k / 128) KV tiles each.
    assert cm.attention_tiles(np.array([1, 1, 1]), np.array([1, 128, 129]),
                              q_tile=1, kv_tile=128) == 1 + 1 + 2
    # A 200-token prompt in 16-row tiles: tiles 0..7 end at or below 128 keys (1 KV
    # tile), tiles 8..12 end above it (2 KV tiles).
    assert cm.attention_tiles(np.array([200]), np.array([200]), q_tile=16, kv_tile=128) == 18
    # A 16-token chunk at the end of a 300-token context sees all 3 KV tiles.
    assert cm.attention_tiles(np.array([16]), np.array([300]), q_tile=16, kv_tile=128) == 3


def test_reference_tiles_follow_tokens_per_sequence_of_the_bucket():
    assert prof.reference_tiles(Bucket(16, 16), page_size=16) == (1, 128)
    assert prof.reference_tiles(Bucket(64, 16), page_size=16) == (4, 128)
    assert prof.reference_tiles(Bucket(48, 16), page_size=16) == (4, 128)  # 3 per seq -> 4
    assert prof.reference_tiles(Bucket(1024, 16), page_size=16) == (16, 128)
    assert prof.reference_tiles(Bucket(16, 16), page_size=48) == (1, 96)  # whole pages


class _SyntheticEngine:
    """Reports `base + per_seq * S + per_tile * tiles` (x noise) for each step: a known truth."""

    name, needs_token_ids = "synthetic", False

    def __init__(self, truth, noise=0.0, seed=0):
        self.truth, self.noise = truth, noise
        self.rng = np.random.default_rng(seed)
        self.warmed = None

    def warmup(self, buckets):
        self.warmed = list(buckets)

    def step(self, inputs):
        seconds = cm.step_seconds(self.truth, inputs)
        return StepOutput(np.zeros(inputs.bucket.num_seqs, np.int32),
                          seconds * (1 + self.noise * self.rng.standard_normal()))


def _truth():
    return cm.CostModelConfig(mode="fitted", model="tiny", fitted_step_s={
        16: cm.LinearStepTime(base_s=2e-3, per_seq_s=1e-4, per_tile_s=3e-4, q_tile=1, kv_tile=128),
        64: cm.LinearStepTime(base_s=5e-3, per_seq_s=0.0, per_tile_s=6e-4, q_tile=4, kv_tile=128)})


def _measure(engine, repeats=3):
    return prof.measure_step_times(engine, [Bucket(16, 16), Bucket(64, 16)], max_model_len=1024,
                                  page_size=16, pages_per_seq=64, num_pages=1025,
                                  num_repeats=repeats)


def test_fit_recovers_known_coefficients_from_exact_timings():
    samples = _measure(_SyntheticEngine(_truth()))
    fit = cal.fit_linear(samples, page_size=16)
    for tokens, want in _truth().fitted_step_s.items():
        got = fit[tokens]
        assert (got.q_tile, got.kv_tile) == (want.q_tile, want.kv_tile)
        assert got.base_s == pytest.approx(want.base_s, rel=1e-6)
        assert got.per_seq_s == pytest.approx(want.per_seq_s, rel=1e-6, abs=1e-12)
        assert got.per_tile_s == pytest.approx(want.per_tile_s, rel=1e-6)


def test_fit_of_noisy_timings_takes_medians_and_stays_close():
    samples = _measure(_SyntheticEngine(_truth(), noise=0.05, seed=3), repeats=7)
    assert all(s.spread > 0 and s.mean_s != s.seconds for s in samples)
    assert cal.fit_linear(samples, 16, "mean") != cal.fit_linear(samples, 16, "median")
    fit = cal.fit_linear(samples, page_size=16)
    assert fit[16].per_tile_s == pytest.approx(3e-4, rel=0.1)
    assert fit[64].base_s == pytest.approx(5e-3, rel=0.1)
    assert all(v >= 0 for entry in fit.values()
               for v in (entry.base_s, entry.per_seq_s, entry.per_tile_s))


def test_fit_needs_three_samples_per_bucket():
    sample = prof.StepSample(Bucket(16, 16), (1,), (10,), 1e-3, 0.0, 1e-3, 1e-3)
    with pytest.raises(ValueError, match="bucket Bucket\\(num_tokens=16.*2 samples"):
        cal.fit_linear([sample, sample], page_size=16)
    with pytest.raises(ValueError, match="statistic='p90'"):
        cal.fit_linear([sample] * 3, page_size=16, statistic="p90")


def test_saved_fit_round_trips_and_drives_the_simulator(tmp_path):
    fit = dict(_truth().fitted_step_s)
    path = str(tmp_path / "fit.json")
    cal.save_fit(path, fit, {"model": "tiny"})
    loaded, metadata = cal.load_fit(path)
    assert loaded == fit and metadata == {"model": "tiny"}
    engine = SimEngine(cal.cost_config_from_fit(path, "tiny"))
    engine.warmup([Bucket(16, 16), Bucket(64, 16)])
    inputs = prof.step_inputs(Bucket(16, 16), [1, 1], [100, 300], page_size=16,
                             pages_per_seq=64, num_pages=100)
    # 2 sequences, 1 + 3 KV tiles.
    assert engine.step(inputs).step_s == pytest.approx(2e-3 + 2 * 1e-4 + 4 * 3e-4)
    with pytest.raises(ValueError, match="num_tokens=32 has no fitted step time"):
        engine.warmup([Bucket(32, 16)])
    # The run plumbing: --engine=sim --cost_fit=PATH, buckets as fitted.
    spec = RunSpec(workload=WorkloadSpec(num_requests=20, rate=50.0, prompt_len="uniform:8:40",
                                         output_len="uniform:2:10"),
                   engine=SimEngineSpec(model="tiny", cost_fit=path),
                   limits=LimitsSpec(max_num_seqs=16, max_num_tokens=64, token_buckets=(16, 64),
                                     num_kv_pages=256, max_model_len=256))
    summary, result = run_policy(spec, "orca", progress=False)
    steps = result.steps
    assert summary["num_finished"] == 20
    assert summary["engine_s_total"] == pytest.approx(sum(s.step_s for s in steps))
    assert {s.bucket for s in steps} <= {16, 64} and min(s.step_s for s in steps) >= 2e-3


@pytest.mark.parametrize("text, words", [
    ('{"format": "other"}', "not a cost fit"),
    ('{"format": "orca_jax.cost_fit/1", "buckets": {}}', "no buckets"),
    ('{"format": "orca_jax.cost_fit/1", "buckets": {"16": {"base_s": 1}}}',
     r"buckets\['16'\] must have exactly the fields"),
    ('{"format": "orca_jax.cost_fit/1", "buckets": {"16": {"base_s": -1, "per_seq_s": 0, '
     '"per_tile_s": 0, "q_tile": 1, "kv_tile": 128}}}', r"buckets\['16'\].*base_s"),
    ("not json", "not JSON"),
])
def test_a_bad_fit_file_is_named_with_the_broken_field(tmp_path, text, words):
    path = tmp_path / "fit.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=words):
        cal.load_fit(str(path))


def test_relative_errors_are_signed_fractions_of_the_real_value():
    errors = cal.relative_errors({"duration_s": 2.0, "ttft_mean_s": 0.5, "tpot_mean_s": 0.0},
                                 {"duration_s": 2.2, "ttft_mean_s": 0.4, "tpot_mean_s": 0.1})
    assert errors["duration_s"] == pytest.approx(0.1)
    assert errors["ttft_mean_s"] == pytest.approx(-0.2)
    assert errors["tpot_mean_s"] is None  # a zero reference has no relative error
    assert cal.relative_errors({"x": None}, {"x": 1.0}, keys=("x",)) == {"x": None}


def test_step_inputs_lay_out_positions_slots_and_distinct_pages():
    inputs = prof.step_inputs(Bucket(16, 4), [3, 1], [3, 20], page_size=16, pages_per_seq=4,
                             num_pages=10)
    assert list(inputs.cu_q_lens) == [0, 3, 4, 4, 4]
    assert list(inputs.positions[:4]) == [0, 1, 2, 19]
    assert inputs.page_indices[:2, :2].tolist() == [[1, 0], [2, 3]]
    assert inputs.slot_mapping[3] == 3 * 16 + 3  # position 19: page 3, offset 3
    assert list(inputs.sample_indices[:2]) == [2, 3]
    with pytest.raises(ValueError, match="do not fit bucket"):
        prof.step_inputs(Bucket(4, 4), [3, 3], [3, 3], page_size=16, pages_per_seq=4,
                        num_pages=10)


@pytest.mark.slow
def test_calibrate_command_on_tiny_writes_fit_table_and_runs(tmp_path):
    out = tmp_path / "cal"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    result = subprocess.run(
        [sys.executable, "-m", "experiments.calibrate", "--model=tiny", "--policies=orca",
         "--buckets=16,32", "--max_num_tokens=32", "--max_num_seqs=4", "--max_model_len=128",
         "--num_requests=6", "--rate=100", "--prompt_len=uniform:4:24",
         "--output_len=uniform:2:6", "--num_repeats=1", "--num_real_runs=1", f"--out_dir={out}"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    fit, metadata = cal.load_fit(str(out / "cost_fit.json"))
    assert sorted(fit) == [16, 32] and metadata["model"] == "tiny"
    report = json.loads((out / "calibration.json").read_text())
    assert [row["metric"] for row in report["rows"]] == list(cal.COMPARED_METRICS)
    for row in report["rows"]:
        assert row["error"] == pytest.approx((row["sim"] - row["real"]) / row["real"])
    real = json.loads((out / "real" / "orca" / "run0" / "summary.json").read_text())
    sim = json.loads((out / "sim" / "orca" / "summary.json").read_text())
    assert (real["engine"], sim["engine"]) == ("jax", "sim")
    assert real["num_finished"] == sim["num_finished"] == 6
    assert "ttft_mean_s" in (out / "calibration.txt").read_text()
