"""Sweeps on Ray: killed mid-way and resumed, the store is a serial sweep's; a point that
raises is stored failed with its error, on either executor, and the sweep goes on."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from cli_runner import REPO, run_sweep

from orca_jax.results.sweep_store import PointKey, SweepStore
from orca_jax.runner import sweep
from orca_jax.runner.spec import LimitsSpec, RunSpec, SimEngineSpec, WorkloadSpec

pytest.importorskip("ray")

# 3 policies x 2 rates x 2 seeds = 12 points of 12 requests at a fixed 5 ms step; `boom`
# raises at its third step, so its 4 points fail.
ARGS = ["--engine=sim", "--policies=static,orca,boom=tests/plugins/raising_policy.py:RaisesAtStep",
        "--policy_opts=boom.fail_at_step=3", "--rates=2,8", "--seeds=0,1", "--num_requests=12",
        "--model=tiny", "--step_time_ms=5", "--max_num_seqs=4", "--prompt_len=uniform:8:64",
        "--output_len=uniform:1:24"]
RAY = ["--executor=ray", "--ray_num_cpus=2"]
# Where and when a point ran, and the host's own timings: the rest must match exactly.
VARIES = ("session", "finished_at", "wall_s")


@pytest.fixture(scope="module")
def ray_session():
    """One local Ray of 2 CPUs for the module's in-process sweeps: a sweep that finds Ray
    running uses it and leaves it running (`run_rows_on_ray`), so they share its start-up
    (most of such a sweep's time) instead of starting and stopping one each. Starting and
    stopping it inside a sweep is the command-line tests' part (each runs its own)."""
    import ray

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RAY_AUTH_MODE", "disabled")
        with pytest.MonkeyPatch.context() as at_repo:
            # The driver's folder at start-up is on the workers' import path: the
            # reproduction's metrics are imported from the repository there.
            at_repo.chdir(REPO)
            ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING",
                     log_to_driver=False)
        try:
            yield
        finally:
            ray.shutdown()


def _sweep(out_dir: Path, *extra: str, exit_after: int = 0) -> subprocess.CompletedProcess:
    return run_sweep(out_dir, *ARGS, *extra, exit_after=exit_after,
                     env={"RAY_AUTH_MODE": "disabled"})


def _store(out_dir: Path) -> dict[tuple, dict]:
    """The store's points by key, less what varies from run to run."""
    points = {}
    for line in (out_dir / "points.jsonl").read_text().splitlines():
        point = json.loads(line)
        key = (point["policy"], point["rate"], point["seed"])
        assert key not in points, f"{key} stored twice"
        point = {k: v for k, v in point.items() if k not in VARIES}
        point["summary"] = {k: v for k, v in point["summary"].items() if "host" not in k}
        points[key] = point
    return points


@pytest.fixture(scope="module")
def serial_sweep(tmp_path_factory) -> Path:
    """The folder of one serial command-line sweep of ARGS, for the tests that read it (the
    rerun test copies it before sweeping into it again)."""
    out = tmp_path_factory.mktemp("serial") / "sweep"
    serial = _sweep(out)
    assert serial.returncode == 1, serial.stderr  # boom's points failed; the rest ran
    assert "4 of 12 points failed (first: boom rate=2 seed=0: RuntimeError: planted failure " \
           "at step 3)" in serial.stderr
    return out


def test_a_ray_sweep_killed_and_resumed_stores_what_a_serial_sweep_stores(tmp_path,
                                                                          serial_sweep):
    killed = _sweep(tmp_path / "ray", *RAY, exit_after=5)
    assert killed.returncode == 3, killed.stderr
    stored = _store(tmp_path / "ray")
    assert len(stored) == 5
    resumed = _sweep(tmp_path / "ray", *RAY)
    assert resumed.returncode == 1, resumed.stderr
    num_finished = sum("error" not in p for p in stored.values())
    assert f"{num_finished} resumed" in resumed.stderr  # failed points run again

    expected = _store(serial_sweep)
    assert len(expected) == 12
    failed = {key for key, p in expected.items() if "error" in p}
    assert failed == {("boom", r, s) for r in (2.0, 8.0) for s in (0, 1)}
    assert all(expected[k]["summary"] == {} for k in failed)
    assert all(expected[k]["summary"]["num_finished"] == 12 for k in expected.keys() - failed)
    assert _store(tmp_path / "ray") == expected


def test_a_rerun_runs_only_the_failed_points_again_and_their_new_lines_stand(tmp_path,
                                                                           serial_sweep):
    out = tmp_path / "sweep"
    shutil.copytree(serial_sweep, out)  # the serial sweep's 12 points, boom's 4 failed
    first = (out / "points.jsonl").read_text().splitlines()
    assert len(first) == 12
    again = _sweep(out)
    assert again.returncode == 1, again.stderr
    assert "8 resumed" in again.stderr  # the finished points count as done, the failed not
    lines = (out / "points.jsonl").read_text().splitlines()
    assert lines[:12] == first
    rerun = [json.loads(line) for line in lines[12:]]
    assert sorted((p["policy"], p["rate"], p["seed"]) for p in rerun) == [
        ("boom", r, s) for r in (2.0, 8.0) for s in (0, 1)]
    store = SweepStore(out, json.loads((out / "sweep.json").read_text())["run"],
                       json.loads((out / "sweep.json").read_text())["policies"])
    loaded = store.load()
    assert len(loaded) == 12  # one point per key: the rerun's line stands for the failed one
    sessions = {p["session"] for p in loaded if p["policy"] == "boom"}
    assert sessions == {rerun[0]["session"]}
    assert store.finished_keys() == {PointKey(p, r, s) for p in ("static", "orca")
                                     for r in (2.0, 8.0) for s in (0, 1)}


def _saturated_past_4(rate: float, summary) -> bool:
    return rate >= 4.0


def test_on_ray_a_policy_s_rates_still_stop_after_its_first_saturated_row(tmp_path,
                                                                          ray_session):
    spec = RunSpec(workload=WorkloadSpec(num_requests=8, prompt_len="uniform:8:64",
                                         output_len="uniform:1:16"),
                   engine=SimEngineSpec(model="tiny", step_time_ms=5.0),
                   limits=LimitsSpec(max_num_seqs=4))
    runs = [sweep.PolicyRun("orca", "orca"), sweep.PolicyRun("vllm", "vllm")]
    rates, seeds = [16.0, 2.0, 4.0, 8.0], [0, 1]
    serial_store, serial_keys = sweep.run_sweep(spec, runs, rates, seeds, str(tmp_path / "s"),
                                                saturated=_saturated_past_4)
    ray_store, ray_keys = sweep.run_sweep(spec, runs, rates, seeds, str(tmp_path / "r"),
                                          saturated=_saturated_past_4,
                                          executor=sweep.SweepExecutor("ray", num_cpus=2))
    assert ray_keys == serial_keys
    assert {k.rate for k in ray_keys} == {2.0, 4.0}  # 8 and 16 never ran
    assert _store(tmp_path / "r") == _store(tmp_path / "s")


def test_without_ray_installed_the_ray_executor_says_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    spec = RunSpec(workload=WorkloadSpec(num_requests=4), engine=SimEngineSpec(model="tiny"))
    with pytest.raises(sweep.SweepError, match=r'needs Ray: pip install -e "\.\[ray\]"'):
        sweep.run_sweep(spec, [sweep.PolicyRun("orca", "orca")], [2.0], [0], str(tmp_path),
                        executor=sweep.SweepExecutor("ray"))
    assert list(tmp_path.iterdir()) == []  # refused before the folder was touched



def test_a_reproduction_on_ray_stores_and_tabulates_what_a_serial_one_does(tmp_path,
                                                                           monkeypatch,
                                                                           ray_session):
    from experiments.reproduce import orca
    from orca_jax.runner import ray_sweep

    executors = []
    run_rows_on_ray = ray_sweep.run_rows_on_ray

    def spy(executor, *args, **kwargs):
        executors.append(executor)
        return run_rows_on_ray(executor, *args, **kwargs)

    monkeypatch.setattr(ray_sweep, "run_rows_on_ray", spy)
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    monkeypatch.chdir(REPO)  # where the Ray workers import the reproduction's metrics from

    def reproduce(out_dir: Path, *extra: str) -> None:
        orca.main([f"--out_dir={out_dir}", f"--figure={out_dir / 'fig.png'}",
                   "--num_requests=12", "--rates=0.1,0.5", *extra])

    reproduce(tmp_path / "serial")
    assert executors == []
    reproduce(tmp_path / "ray", *RAY)
    assert executors == [sweep.SweepExecutor("ray", num_cpus=2)]
    expected = _store(tmp_path / "serial")
    # 4 static and 3 orca batch sizes, each to its first saturated rate.
    assert {key[0] for key in expected} == ({f"static bs={b}" for b in (1, 8, 16, 32)}
                                            | {f"orca bs={b}" for b in (8, 16, 32)})
    assert len(expected) > 7 and all(p["summary"]["num_finished"] == 12
                                     for p in expected.values())
    assert _store(tmp_path / "ray") == expected
    for table in ("curves.json", "ratios.json"):
        assert (json.loads((tmp_path / "ray" / table).read_text())
                == json.loads((tmp_path / "serial" / table).read_text())), table


def test_a_fitted_ladder_is_fitted_once_per_rate_and_seed_in_the_driver(tmp_path, monkeypatch,
                                                                         ray_session):
    # Two policies share each (rate, seed)'s fit: the driver fits 2 ladders for 4 points,
    # and every point stores the fit a serial sweep stores.
    from orca_jax.runner import sweep_point
    from orca_jax.runner.sweep_point import PolicyRun, SweepExecutor

    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    spec = RunSpec(workload=WorkloadSpec(num_requests=16, prompt_len="uniform:8:64",
                                         output_len="uniform:1:24"),
                   engine=SimEngineSpec(model="tiny", step_time_ms=5.0),
                   limits=LimitsSpec(max_num_seqs=4, bucket_ladder="fit:3"))
    policies = [PolicyRun("static", "static"), PolicyRun("orca", "orca")]
    fitted = []
    fit = sweep_point.with_fitted_buckets

    def counting(point, requests, **kwargs):
        fitted.append(point.workload.rate)
        return fit(point, requests, **kwargs)

    monkeypatch.setattr(sweep_point, "with_fitted_buckets", counting)
    sweep.run_sweep(spec, policies, [2.0, 8.0], [0], str(tmp_path / "ray"),
                    executor=SweepExecutor("ray", num_cpus=2))
    assert sorted(fitted) == [2.0, 8.0]
    sweep.run_sweep(spec, policies, [2.0, 8.0], [0], str(tmp_path / "serial"))

    ray_points, serial_points = _store(tmp_path / "ray"), _store(tmp_path / "serial")
    assert len(ray_points) == 4 and ray_points == serial_points  # padding follows the fit
