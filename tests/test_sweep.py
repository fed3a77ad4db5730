"""The sweep: resumable after a kill, refuses a changed workload, aggregates seeds right."""

import dataclasses
import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
from cli_runner import run_sweep

from orca_jax.results.sweep_store import PointKey, SweepConfigError, SweepStore, aggregate, grid
from orca_jax.runner import sweep
from orca_jax.runner.build import build_workload
from orca_jax.runner.spec import ClusterSpec, LimitsSpec, RunSpec, SimEngineSpec, WorkloadSpec

# 2 policies x 2 rates x 2 seeds = 8 points of 12 requests at a fixed 5 ms step.
ARGS = ["--engine=sim", "--policies=static,orca", "--rates=2,8", "--seeds=0,1", "--num_requests=12",
        "--model=tiny", "--step_time_ms=5", "--max_num_seqs=4", "--prompt_len=uniform:8:64",
        "--output_len=uniform:1:24"]


def _sweep(out_dir: Path, *extra: str, exit_after: int = 0) -> subprocess.CompletedProcess:
    return run_sweep(out_dir, *ARGS, *extra, exit_after=exit_after)


def _lines(out_dir: Path) -> list[bytes]:
    return (out_dir / "points.jsonl").read_bytes().splitlines(keepends=True)


def test_killed_sweep_reruns_only_the_missing_points(tmp_path):
    out = tmp_path / "sweep"
    killed = _sweep(out, exit_after=3)
    assert killed.returncode == 3, killed.stderr
    before = _lines(out)
    assert len(before) == 3
    assert not (out / "sweep.png").exists()
    # A kill in the middle of a write leaves a line without its newline.
    with open(out / "points.jsonl", "ab") as f:
        f.write(b'{"policy": "orca", "rate": 8.0, "seed": 1, "sess')

    rerun = _sweep(out)
    assert rerun.returncode == 0, rerun.stderr
    after = _lines(out)
    assert after[:3] == before  # finished points untouched, byte for byte
    assert all(line.endswith(b"\n") for line in after)
    points = [json.loads(line) for line in after]
    keys = [(p["policy"], p["rate"], p["seed"]) for p in points]
    # (A PointKey's fourth field, its variant, is None here: the lines have none.)
    assert sorted(keys) == sorted(k[:3] for k in grid(["static", "orca"], [2.0, 8.0], [0, 1]))
    assert not any("variant" in p for p in points)
    assert len(set(keys)) == 8  # nothing ran twice
    first_session = {p["session"] for p in points[:3]}
    second_session = {p["session"] for p in points[3:]}
    assert len(first_session) == 1 and len(second_session) == 1
    assert first_session != second_session  # exactly the 5 missing points ran in the rerun
    # The grid order: the killed run did static's first three points.
    assert keys[:3] == [("static", 2.0, 0), ("static", 2.0, 1), ("static", 8.0, 0)]
    assert "3 resumed" in rerun.stderr
    png = (out / "sweep.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"

    again = _sweep(out)  # everything done: nothing runs, nothing is appended
    assert again.returncode == 0, again.stderr
    assert _lines(out) == after


def test_rerun_with_another_workload_is_refused(tmp_path):
    out = tmp_path / "sweep"
    assert _sweep(out, exit_after=1).returncode == 3
    before = _lines(out)
    refused = _sweep(out, "--output_len=uniform:1:25")
    assert refused.returncode != 0
    assert "run.output_len: stored 'uniform:1:24', now 'uniform:1:25'" in refused.stderr
    assert _lines(out) == before


def test_store_refuses_changed_policy_options_but_accepts_a_new_policy(tmp_path):
    run = {"num_requests": 10}
    SweepStore(tmp_path, run, {"orca": {"spec": "orca", "options": {}}})
    with pytest.raises(SweepConfigError, match=r"policies\.orca\.options\.max_num_seqs"):
        SweepStore(tmp_path, run, {"orca": {"spec": "orca", "options": {"max_num_seqs": "2"}}})
    SweepStore(tmp_path, run, {"static": {"spec": "static", "options": {}}})
    stored = json.loads((tmp_path / "sweep.json").read_text())
    assert sorted(stored["policies"]) == ["orca", "static"]


def test_store_drops_a_trailing_partial_line_and_rejects_a_corrupt_middle_line(tmp_path):
    store = SweepStore(tmp_path, {}, {})
    store.append(PointKey("orca", 2.0, 0), {"ttft_p99_s": 0.5})
    with open(store.points_path, "ab") as f:
        f.write(b'{"policy": "orca", "ra')
    assert [p["summary"] for p in store.load()] == [{"ttft_p99_s": 0.5}]
    store.append(PointKey("orca", 4.0, 0), {"ttft_p99_s": 0.7})
    assert store.finished_keys() == {PointKey("orca", 2.0, 0), PointKey("orca", 4.0, 0)}
    lines = store.points_path.read_bytes().splitlines(keepends=True)
    store.points_path.write_bytes(lines[0] + b"{not json}\n" + lines[1])
    with pytest.raises(ValueError, match=r"points\.jsonl:2: not a sweep point"):
        store.load()


def test_aggregate_means_and_bands_over_seeds():
    points = [{"policy": "orca", "rate": 2.0, "seed": s,
               "summary": {"throughput_req_s": x, "ttft_p99_s": y}}
              for s, x, y in [(0, 1.0, 0.1), (1, 3.0, 0.4), (2, 2.0, 0.4), (3, 9.0, None)]]
    points.append({"policy": "orca", "rate": 4.0, "seed": 0,
                   "summary": {"throughput_req_s": 4.0, "ttft_p99_s": 0.9}})
    points.append({"policy": "orca", "rate": 4.0, "seed": 7,  # outside the grid: ignored
                   "summary": {"throughput_req_s": 99.0, "ttft_p99_s": 99.0}})
    keys = grid(["orca"], [2.0, 4.0], [0, 1, 2, 3])
    (curve,) = aggregate(points, keys, "throughput_req_s", "ttft_p99_s")
    np.testing.assert_allclose(curve.rates, [2.0, 4.0])
    np.testing.assert_allclose(curve.x_mean, [2.0, 4.0])  # seed 3 has no TTFT: left out
    np.testing.assert_allclose(curve.y_mean, [0.3, 0.9])
    np.testing.assert_allclose(curve.y_low, [0.1, 0.9])
    np.testing.assert_allclose(curve.y_high, [0.4, 0.9])
    np.testing.assert_array_equal(curve.num_seeds, [3, 1])
    (std,) = aggregate(points, keys, "throughput_req_s", "ttft_p99_s", band="std")
    spread = np.sqrt((0.2**2 + 0.1**2 + 0.1**2) / 3)  # population std of 0.1, 0.4, 0.4
    np.testing.assert_allclose(std.y_low, [0.3 - spread, 0.9])
    np.testing.assert_allclose(std.y_high, [0.3 + spread, 0.9])


def test_a_rate_only_rescales_the_seed_workload():
    spec = RunSpec(workload=WorkloadSpec(num_requests=20, prompt_len="uniform:8:64",
                                         output_len="uniform:1:24"),
                   engine=SimEngineSpec(model="tiny"), seed=3)
    base = build_workload(sweep.point_spec(spec, 1.0, 3))
    scaled = sweep.workload_at(spec, base, 8.0)
    direct = build_workload(sweep.point_spec(spec, 8.0, 3))
    assert [(r.prompt_len, r.output_len) for r in scaled] == \
        [(r.prompt_len, r.output_len) for r in direct]
    np.testing.assert_allclose([r.arrival_s for r in scaled], [r.arrival_s for r in direct],
                               rtol=1e-12)
    assert direct[-1].arrival_s < base[-1].arrival_s / 4


def test_a_sweep_recorded_before_a_setting_existed_resumes_at_its_default(tmp_path):
    policies = {"orca": {"spec": "orca", "options": {}}}
    SweepStore(tmp_path, {"engine": "sim", "num_requests": 50}, policies)  # the older sweep
    defaults = {"engine": "jax", "num_requests": 200, "num_replicas": 1}
    SweepStore(tmp_path, {"engine": "sim", "num_requests": 50, "num_replicas": 1}, policies,
               run_defaults=defaults)
    with pytest.raises(SweepConfigError, match="run.num_replicas: stored 1, now 2"):
        SweepStore(tmp_path, {"engine": "sim", "num_requests": 50, "num_replicas": 2}, policies,
                   run_defaults=defaults)
    # Without defaults a missing setting is a difference, as before.
    with pytest.raises(SweepConfigError, match="run.num_replicas: stored None, now 1"):
        SweepStore(tmp_path, {"engine": "sim", "num_requests": 50, "num_replicas": 1}, policies)


# sweep.json's "run" as the flat RunSpec of before the split wrote it (a sim sweep of ARGS'
# workload): every setting under its old name, the jax engine's among them.
FLAT_RUN_BEFORE_THE_SPLIT = {
    "engine": "sim", "model": "tiny", "checkpoint": None, "dtype": "float32",
    "attention": "auto", "sampling": "greedy", "clock": "profiled", "hardware": "a100",
    "tp": 1, "step_time_ms": 5.0, "cost_fit": None, "workload": "poisson", "trace": None,
    "trace_time_scale": 1.0, "num_requests": 12, "cv": 1.0, "prompt_len": "uniform:8:64",
    "output_len": "uniform:1:24", "max_batch_size": 4, "token_budget": 2048,
    "num_kv_pages": None, "kv_memory_gb": None, "page_size": 16, "max_model_len": None,
    "token_buckets": None, "ttft_slo_s": None, "tpot_slo_s": None, "num_replicas": 1,
    "router": "round_robin", "router_opts": "", "log_step_requests": False}


def test_a_sweep_json_with_the_flat_field_names_of_before_resumes(tmp_path):
    old = SweepStore(tmp_path, FLAT_RUN_BEFORE_THE_SPLIT,
                     {"orca": {"spec": "orca", "options": {"max_batch_size": "2"}}})
    old.append(PointKey("orca", 2.0, 0), {"throughput_req_s": 1.5})
    before = _lines(tmp_path)
    spec = RunSpec(workload=WorkloadSpec(num_requests=12, prompt_len="uniform:8:64",
                                         output_len="uniform:1:24"),
                   engine=SimEngineSpec(model="tiny", step_time_ms=5.0),
                   limits=LimitsSpec(max_num_seqs=4))
    runs = [sweep.PolicyRun("orca", "orca", {"max_num_seqs": "2"})]
    store, keys = sweep.run_sweep(spec, runs, [2.0], [0], str(tmp_path))
    assert keys == [PointKey("orca", 2.0, 0)] and _lines(tmp_path) == before  # nothing ran
    assert [p["summary"] for p in store.load()] == [{"throughput_req_s": 1.5}]
    # A renamed setting still counts: another token budget is another sweep.
    other = dataclasses.replace(spec, limits=LimitsSpec(max_num_seqs=4, max_num_tokens=1024))
    with pytest.raises(SweepConfigError, match="run.max_num_tokens: stored 2048, now 1024"):
        sweep.run_sweep(other, runs, [2.0], [0], str(tmp_path))


def test_a_conversation_sweep_builds_each_rate_keeping_its_think_times(tmp_path):
    # Conversations start at the rate, but a turn follows the previous one 2 s later
    # whatever the rate: a point is the workload built at its rate, not a rate-1 one rescaled
    # (which would shrink the think times to 2 s / rate).
    spec = RunSpec(workload=WorkloadSpec(arrival="conversation", num_requests=12,
                                         prompt_len="fixed:8", output_len="fixed:2",
                                         num_turns="fixed:3", think_time_ms="fixed:2000",
                                         suffix_len="fixed:4"),
                   engine=SimEngineSpec(model="tiny", step_time_ms=1.0), seed=1)
    sweep.run_sweep(spec, [sweep.PolicyRun("vllm", "vllm")], [0.5, 4.0], [1],
                    str(tmp_path), point_runs=True)
    for rate in (0.5, 4.0):
        rows = (tmp_path / "points" / "vllm" / f"rate_{rate:g}_seed_1" / "requests.jsonl")
        arrivals = sorted(json.loads(line)["arrival_s"] for line in rows.read_text().splitlines())
        built = build_workload(sweep.point_spec(spec, rate, 1))
        np.testing.assert_allclose(arrivals, sorted(r.arrival_s for r in built))
        gaps = {round(b - a, 9) for a in arrivals for b in arrivals}
        assert 2.0 in gaps, (rate, arrivals)  # some conversation's next turn, 2 s on


def test_a_cluster_point_builds_no_engine_beside_its_replicas(tmp_path, monkeypatch):
    built = []
    real = sweep.build_engine
    monkeypatch.setattr(sweep, "build_engine", lambda *a, **k: built.append(1) or real(*a, **k))
    base = RunSpec(workload=WorkloadSpec(num_requests=12, prompt_len="uniform:8:64",
                                         output_len="uniform:1:24"),
                   engine=SimEngineSpec(model="tiny", step_time_ms=5.0))
    runs = [sweep.PolicyRun("vllm", "vllm")]
    cluster = dataclasses.replace(base, cluster=ClusterSpec(num_replicas=2))
    store, _ = sweep.run_sweep(cluster, runs, [4.0], [0], str(tmp_path / "cluster"))
    assert built == [] and store.load()[0]["summary"]["num_finished"] == 12
    sweep.run_sweep(base, runs, [4.0], [0], str(tmp_path / "one"))
    assert built == [1]  # one replica: the seed's engine, built by the sweep
