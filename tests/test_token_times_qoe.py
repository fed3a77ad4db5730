"""Per-token times (`--log_token_times`) and Andes's QoE computed from them.

The QoE function is checked against cases computed by hand (orca_jax/results/qoe.py has
the formula): tokens on time give 1.0, a burst that arrives early cannot exceed it, and a
stall of known length gives the fraction of the expected area the user digested. Runs
with the flag (one replica, a cluster, disaggregated pools, and the real engine) write
every request's token times, as many as its output tokens, in order, from its first-token
time to its finish, consistent with the metrics' TTFT, TPOT and largest gap; a default run
writes none.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orca_jax.core.requests.request import RequestState
from orca_jax.results import qoe as qoe_module
from orca_jax.results.metrics import request_metrics
from orca_jax.results.qoe import QOE_ACCEPTABLE, QoETargets, andes_qoe, andes_qoe_grouped
from orca_jax.results.row_lines import request_line
from orca_jax.results.summary import request_row
from orca_jax.runner.experiment import run_policy
from orca_jax.runner.spec import (
    ClusterSpec,
    JaxEngineSpec,
    LimitsSpec,
    RunSpec,
    SimEngineSpec,
    WorkloadSpec,
)

REPO = Path(__file__).resolve().parents[1]
ONE_PER_S = QoETargets(ttft_s=1.0, tokens_per_s=1.0)  # token i (from 1) expected at i s


# ------------------------------------------------------------------ the QoE function

def test_tokens_each_at_its_expected_time_give_exactly_one():
    targets = QoETargets(ttft_s=0.5, tokens_per_s=4.0)
    times = 10.0 + 0.5 + np.arange(9) / 4.0  # arrival 10, then every 0.25 s
    assert andes_qoe(times, 10.0, targets) == 1.0


def test_a_burst_that_arrives_early_cannot_exceed_one():
    assert andes_qoe([0.1, 0.1, 0.1, 0.1], 0.0, ONE_PER_S) == 1.0
    # Early then on time: still digested at the expected pace, never ahead of it.
    assert andes_qoe([0.2, 0.3, 3.0], 0.0, ONE_PER_S) == 1.0


def test_a_stall_of_two_seconds_before_the_last_of_three_tokens():
    # Expected at 1, 2, 3 s; the third comes at 5 s. The window closes at 5 s:
    # expected area (5-1)+(5-2)+(5-3) = 9, digested (5-1)+(5-2)+(5-5) = 7.
    assert andes_qoe([1.0, 2.0, 5.0], 0.0, ONE_PER_S) == pytest.approx(7 / 9, rel=1e-12)
    # The same 2 s after an arrival at 100 s (times are on the run's clock).
    assert andes_qoe([101.0, 102.0, 105.0], 100.0, ONE_PER_S) == pytest.approx(7 / 9,
                                                                                rel=1e-12)


def test_a_late_first_token_delays_every_later_one():
    # First token 1 s late, then at the expected pace: digested at 2, 3, 4 s.
    # Window to 4 s: expected (3 + 2 + 1) = 6, digested (2 + 1 + 0) = 3.
    assert andes_qoe([2.0, 3.0, 4.0], 0.0, ONE_PER_S) == pytest.approx(0.5, rel=1e-12)


def test_a_burst_after_a_stall_is_digested_at_the_expected_pace_not_at_once():
    # Tokens 2 and 3 both come at 4 s: token 2 is digested at 4, token 3 at 5 (one per
    # second). Window to 5 s: expected 4 + 3 + 2 = 9, digested 4 + 1 + 0 = 5.
    assert andes_qoe([1.0, 4.0, 4.0], 0.0, ONE_PER_S) == pytest.approx(5 / 9, rel=1e-12)


def test_one_token_answers_and_none():
    assert andes_qoe([0.5], 0.0, ONE_PER_S) == 1.0
    assert andes_qoe([1.5], 0.0, ONE_PER_S) == 0.0  # late: nothing digested in the window
    assert np.isnan(andes_qoe([], 0.0, ONE_PER_S))


def test_times_that_go_backwards_and_bad_targets_are_refused():
    with pytest.raises(ValueError, match="time order"):
        andes_qoe([2.0, 1.0], 0.0, ONE_PER_S)
    with pytest.raises(ValueError, match="tokens_per_s must be a finite number > 0"):
        QoETargets(ttft_s=1.0, tokens_per_s=0.0)


def _digested_by_recurrence(times, arrival, targets):
    """The definition as the paper's timeline reads: token i digested at
    max(arrival, previous + 1/TDS), the first not before the expected TTFT."""
    gap, expected, digested = 1 / targets.tokens_per_s, [], []
    for i, t in enumerate(times):
        expected.append(targets.ttft_s + i * gap)
        floor = expected[0] if i == 0 else digested[-1] + gap
        digested.append(max(t - arrival, floor))
    end = digested[-1]
    area = sum(end - e for e in expected)
    return 1.0 if area == 0 else sum(end - d for d in digested) / area


@settings(max_examples=200, deadline=None)
@given(gaps=st.lists(st.floats(0, 3), min_size=1, max_size=30),
       arrival=st.floats(0, 50), ttft=st.floats(0.05, 3), speed=st.floats(0.5, 20))
def test_the_closed_form_is_the_digestion_timeline_s_areas(gaps, arrival, ttft, speed):
    times = arrival + np.cumsum(gaps)
    targets = QoETargets(ttft_s=ttft, tokens_per_s=speed)
    value = andes_qoe(times, arrival, targets)
    assert 0.0 <= value <= 1.0
    assert value == pytest.approx(_digested_by_recurrence(times, arrival, targets), abs=1e-9)


def test_many_requests_at_once_give_each_one_s_value_across_chunks(monkeypatch):
    monkeypatch.setattr(qoe_module, "CHUNK_TOKENS", 7)  # several chunks, some one request
    rng = np.random.default_rng(3)
    counts = rng.integers(0, 20, 40)
    offsets = np.concatenate([[0], np.cumsum(counts)])
    times = np.concatenate([np.sort(rng.uniform(0, 30, c)) for c in counts])
    arrival = rng.uniform(0, 2, 40)
    targets = QoETargets()
    grouped = andes_qoe_grouped(times, offsets, arrival, targets)
    each = [andes_qoe(times[offsets[i]:offsets[i + 1]], arrival[i], targets) for i in range(40)]
    np.testing.assert_array_equal(grouped, each)
    assert np.isnan(grouped[counts == 0]).all() and (grouped[counts > 0] < 1).any()


@settings(max_examples=100, deadline=None)
@given(times=st.one_of(st.none(), st.lists(st.floats(0, 1e4), max_size=5)),
       qoe=st.one_of(st.none(), st.floats(0, 1)), request_id=st.one_of(st.integers(0, 99),
                                                                       st.text(max_size=3)))
def test_a_request_line_with_token_times_is_the_json_of_its_row(times, qoe, request_id):
    class Columns:
        arrival_s = first_scheduled_s = first_token_s = last_token_s = finish_s = [0.5]
        prompt_len = output_len = num_generated = num_preemptions = priority = [3]
        num_cached_tokens = [0]
        state = [int(RequestState.FINISHED)]
    args = dict(request_id=request_id, tenant="t", reason=None, output_tokens=None,
                prefix_caching=False, token_times=times, qoe=qoe)
    line = request_line(Columns, 0, **args)
    assert line == json.dumps(request_row(Columns, 0, **args))
    assert ("token_times" in json.loads(line)) == (times is not None)


# ------------------------------------------------------------------ runs

def _spec(*, log_token_times: bool, cluster: ClusterSpec = ClusterSpec(),
          engine=None) -> RunSpec:
    # Heavy load on a small KV pool: requests queue past the expected TTFT (QoE < 1) and
    # some are preempted (their tokens must not be logged twice).
    return RunSpec(
        workload=WorkloadSpec(num_requests=60, rate=400.0, prompt_len="uniform:32:256",
                              output_len="uniform:1:48"),
        engine=engine or SimEngineSpec(model="llama3-8b", hardware="a100",
                                       step_time_ms=40.0),
        limits=LimitsSpec(max_num_seqs=8, max_num_tokens=512, num_kv_pages=40,
                          page_size=16, max_model_len=320),
        cluster=cluster, seed=1, log_token_times=log_token_times)


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in open(out / "requests.jsonl")]


def _check_token_times(out: Path, summary: dict, result, *, preempts: bool = True) -> None:
    rows = _rows(out)
    finished = [row for row in rows if row["status"] == "finished"]
    assert finished and len(finished) == summary["num_finished"]
    metrics = request_metrics(result.arrival_s, result.first_scheduled_s,
                              result.first_token_s, result.finish_s, result.output_len,
                              None, None, token_stats=result.token_stats)
    for i, row in enumerate(rows):
        times = np.array(row["token_times"])
        assert times.size == row["num_generated"], row["id"]
        assert (np.diff(times) >= 0).all(), row["id"]
        if times.size:
            assert times[0] == row["first_token_s"] and times[-1] == row["last_token_s"]
            assert times[0] - row["arrival_s"] == metrics["ttft_s"][i]
        if row["status"] == "finished":
            assert times[-1] == row["finish_s"]
            assert row["qoe"] == andes_qoe(times, row["arrival_s"], QoETargets())
            if times.size > 1:
                assert (times[-1] - times[0]) / (times.size - 1) == pytest.approx(
                    metrics["tpot_s"][i], rel=1e-12)
                assert np.diff(times).max() == metrics["max_itl_s"][i]
        else:
            assert row["qoe"] is None
    values = np.array([row["qoe"] for row in finished])
    assert summary["qoe_mean"] == pytest.approx(values.mean(), rel=1e-12)
    assert summary["qoe_p50"] == pytest.approx(np.percentile(values, 50), rel=1e-12)
    assert summary["qoe_p10"] == pytest.approx(np.percentile(values, 10), rel=1e-12)
    assert summary["qoe_attainment"] == pytest.approx((values >= QOE_ACCEPTABLE).mean())
    assert (summary["qoe_ttft_s"], summary["qoe_tokens_per_s"]) == (1.0, 4.8)
    assert values.min() < 1.0 < values.max() + 1e-12  # the load made some late, some not
    if preempts:
        assert summary["num_preemptions"] > 0


def test_a_run_with_the_flag_writes_each_request_s_token_times_and_its_qoe(tmp_path):
    summary, result = run_policy(_spec(log_token_times=True), "vllm",
                                 out_dir=str(tmp_path / "on"), progress=False)
    _check_token_times(tmp_path / "on", summary, result)
    saved = json.loads((tmp_path / "on" / "summary.json").read_text())
    assert saved["qoe_mean"] == summary["qoe_mean"]


def test_a_default_run_writes_no_token_times_and_the_same_rows_otherwise(tmp_path):
    off, _ = run_policy(_spec(log_token_times=False), "vllm", out_dir=str(tmp_path / "off"),
                        progress=False)
    on, _ = run_policy(_spec(log_token_times=True), "vllm", out_dir=str(tmp_path / "on"),
                       progress=False)
    assert not any(key.startswith("qoe") for key in off)
    rows_off, rows_on = _rows(tmp_path / "off"), _rows(tmp_path / "on")
    assert all("token_times" not in row and "qoe" not in row for row in rows_off)
    for row in rows_on:
        del row["token_times"], row["qoe"]
    assert rows_on == rows_off  # the flag only adds: the run itself is the same
    assert {k: v for k, v in on.items() if not k.startswith("qoe") and "host" not in k} == {
        k: v for k, v in off.items() if "host" not in k}


def test_clusters_and_disaggregated_pools_write_token_times_too(tmp_path):
    for name, cluster in (("colocated", ClusterSpec(num_replicas=2)),
                          ("disaggregated", ClusterSpec(num_prefill_replicas=1,
                                                        num_decode_replicas=1))):
        summary, result = run_policy(_spec(log_token_times=True, cluster=cluster), "vllm",
                                     out_dir=str(tmp_path / name), progress=False)
        _check_token_times(tmp_path / name, summary, result, preempts=False)
        off, _ = run_policy(_spec(log_token_times=False, cluster=cluster), "vllm",
                            out_dir=str(tmp_path / f"{name}_off"), progress=False)
        assert all("token_times" not in row for row in _rows(tmp_path / f"{name}_off"))
        assert not any(key.startswith("qoe") for key in off)


def test_the_command_line_flag_and_its_targets(tmp_path):
    out = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "experiments.run", "--engine=sim", "--num_requests=20",
         "--rate=200", "--bucket_ladder=pow2", "--log_token_times", "--qoe_ttft_s=0.05",
         "--qoe_tokens_per_s=100", f"--out_dir={out}"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
        env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr
    assert "qoe_mean" in done.stdout  # the terminal table shows it
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["qoe_ttft_s"], summary["qoe_tokens_per_s"]) == (0.05, 100.0)
    row = _rows(out)[0]
    assert row["qoe"] == andes_qoe(row["token_times"], row["arrival_s"],
                                   QoETargets(ttft_s=0.05, tokens_per_s=100.0))
    bad = subprocess.run(
        [sys.executable, "-m", "experiments.run", "--engine=sim", "--qoe_tokens_per_s=0",
         f"--out_dir={tmp_path / 'bad'}"], cwd=REPO, capture_output=True, text=True,
        timeout=120, env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin",
                          "PYTHONPATH": str(REPO)})
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines()[-1].count("qoe_tokens_per_s") >= 1
    assert "Traceback" not in bad.stderr


@pytest.mark.slow
def test_the_real_engine_s_runs_write_the_same_token_times(tmp_path):
    spec = RunSpec(workload=WorkloadSpec(num_requests=6, rate=40.0, prompt_len="uniform:8:32",
                                         output_len="uniform:2:12"),
                   engine=JaxEngineSpec(model="tiny"),
                   limits=LimitsSpec(max_num_seqs=4, max_num_tokens=64, max_model_len=64,
                                     token_buckets=(64,)),
                   log_token_times=True)
    summary, result = run_policy(spec, "vllm", out_dir=str(tmp_path / "jax"), progress=False)
    rows = _rows(tmp_path / "jax")
    assert all(row["status"] == "finished" for row in rows)
    for row in rows:
        times = row["token_times"]
        assert len(times) == row["num_generated"] == len(row["output_tokens"])
        assert times[0] == row["first_token_s"] and times[-1] == row["finish_s"]
        assert all(a <= b for a, b in zip(times, times[1:]))
        assert row["qoe"] == andes_qoe(times, row["arrival_s"], QoETargets())
    assert summary["qoe_mean"] == pytest.approx(np.mean([row["qoe"] for row in rows]))


def test_the_request_cap_counts_the_logged_token_times(monkeypatch):
    from orca_jax.runner import spec_caps
    monkeypatch.setattr(spec_caps, "physical_memory", lambda: 16 * 2**30)
    workload = dict(output_len="uniform:100:200")
    plain = 16 * 2**30 // 512  # a request alone: 512 B at least
    logged = 16 * 2**30 // (512 + 16 * 100)  # and 16 B for each of its >= 100 token times
    RunSpec(workload=WorkloadSpec(num_requests=plain, **workload))
    RunSpec(workload=WorkloadSpec(num_requests=logged, **workload), log_token_times=True)
    with pytest.raises(ValueError, match=rf"^workload\.num_requests={logged + 1} is above its "
                       rf"cap of {logged:,}: requests \(with their 100 output tokens' logged "
                       r"times\) take at least 2112 B each"):
        RunSpec(workload=WorkloadSpec(num_requests=logged + 1, **workload), log_token_times=True)
    with pytest.raises(ValueError, match=rf"cap of {logged:,}"):  # a cluster logs them too
        RunSpec(workload=WorkloadSpec(num_requests=logged + 1, **workload),
                cluster=ClusterSpec(num_replicas=2))
