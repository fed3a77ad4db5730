"""The fitted ladder end to end: its pilot run, the flag's default, and one ladder for
every policy of a comparison and of a sweep's point."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from orca_jax.core.step.bucket_fit import fit_token_sizes
from orca_jax.core.step.packing import ladder_token_sizes
from orca_jax.runner import bucket_pilot, sweep
from orca_jax.runner.bucket_pilot import PILOT_POLICY, with_fitted_buckets
from orca_jax.runner.build import build_workload
from orca_jax.runner.experiment import run_policy
from orca_jax.runner.spec import ClusterSpec, LimitsSpec, RunSpec, WorkloadSpec

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "JAX_PLATFORMS": "cpu"}
SMALL = ["--engine=sim", "--num_requests=150"]


def _spec(**cluster) -> RunSpec:
    return RunSpec(workload=WorkloadSpec(num_requests=150, rate=32.0),
                   limits=LimitsSpec(max_num_tokens=1024, bucket_ladder="fit:6"),
                   cluster=ClusterSpec(**cluster))


@pytest.mark.parametrize("cluster", [{}, {"num_replicas": 2, "router": "least_outstanding"}])
def test_the_ladder_is_fitted_to_a_vllm_pilot_on_multiples_of_8(cluster):
    spec = _spec(**cluster)
    requests = build_workload(spec)
    fitted, fit = with_fitted_buckets(spec, requests)
    # The pilot by hand: vllm on the same run, its steps padded to multiples of 8.
    pilot = dataclasses.replace(spec, limits=dataclasses.replace(
        spec.limits, bucket_ladder=None, token_buckets=ladder_token_sizes("step:8", 1024)))
    _, result = run_policy(pilot, "vllm", requests=requests, progress=False)
    steps = result.step_array("num_tokens")
    assert fit.token_sizes == fit_token_sizes(steps, 6, 1024) == fitted.limits.token_buckets
    assert len(fit.token_sizes) == 6 and fit.num_pilot_steps == len(steps)
    assert fit.pilot_policy == PILOT_POLICY == "vllm" and fit.pilot_ladder == "step:8"
    assert fitted.limits.bucket_ladder == "fit:6"
    assert with_fitted_buckets(fitted, requests) == (fitted, None)  # fitted: as it is


def test_the_pilot_plays_only_the_workload_s_first_requests(monkeypatch):
    spec = _spec()
    requests = build_workload(spec)
    monkeypatch.setattr(bucket_pilot, "PILOT_MAX_REQUESTS", 40)
    _, fit = with_fitted_buckets(spec, requests)
    pilot = dataclasses.replace(spec, limits=dataclasses.replace(
        spec.limits, bucket_ladder=None, token_buckets=ladder_token_sizes("step:8", 1024)))
    _, head = run_policy(pilot, "vllm", requests=requests[:40], progress=False)
    _, whole = run_policy(pilot, "vllm", requests=requests, progress=False)
    assert fit.num_pilot_requests == 40 and fit.num_pilot_steps == head.num_steps
    assert fit.num_pilot_steps < whole.num_steps
    assert fit.token_sizes == fit_token_sizes(head.step_array("num_tokens"), 6, 1024)


def _read(out: Path, name: str) -> dict:
    return json.loads((out / name).read_text())


def _steps(out: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if k != "host_s"}
            for line in (out / "steps.jsonl").read_text().splitlines()]


def _cli(module: str, *args: str) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, env=ENV,
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    return done


def test_the_sim_default_fits_16_sizes_and_buckets_from_config_repeat_the_run(tmp_path):
    done = _cli("experiments.run", *SMALL, "--policy=orca", f"--out_dir={tmp_path / 'a'}")
    config = _read(tmp_path / "a", "config.json")
    sizes = config["run"]["limits"]["token_buckets"]
    assert config["run"]["limits"]["bucket_ladder"] == "fit:16"
    assert len(sizes) == 16 and sizes[-1] == 2048 and all(s % 8 == 0 for s in sizes)
    assert config["bucket_fit"]["token_sizes"] == sizes
    assert config["bucket_fit"]["pilot_policy"] == "vllm"
    assert "buckets: 16 sizes fitted (fit:16) to a vllm pilot run" in done.stdout
    assert "16 step sizes" in done.stdout
    _cli("experiments.run", *SMALL, "--policy=orca", f"--buckets={','.join(map(str, sizes))}",
         f"--out_dir={tmp_path / 'b'}")
    assert _steps(tmp_path / "b") == _steps(tmp_path / "a")
    assert all(step["num_padded_tokens"] in sizes for step in _steps(tmp_path / "a"))


def test_every_policy_compared_drives_one_ladder_whoever_else_is_compared(tmp_path):
    _cli("experiments.compare", *SMALL, "--policies=orca,sarathi", f"--out_dir={tmp_path / 'a'}")
    _cli("experiments.compare", *SMALL, "--policies=orca", f"--out_dir={tmp_path / 'b'}")
    sizes = _read(tmp_path / "a" / "orca", "config.json")["run"]["limits"]["token_buckets"]
    assert _read(tmp_path / "a" / "sarathi", "config.json")["run"]["limits"][
        "token_buckets"] == sizes
    assert _read(tmp_path / "b" / "orca", "config.json")["run"]["limits"][
        "token_buckets"] == sizes
    assert _steps(tmp_path / "a" / "orca") == _steps(tmp_path / "b" / "orca")
    rows = _read(tmp_path / "a", "comparison.json")
    assert [row["num_buckets"] for row in rows] == [16, 16]
    assert "num_buckets" in (tmp_path / "a" / "comparison.txt").read_text()


def test_the_jax_default_stays_powers_of_two():
    # The flags parsed in this process, as test_flag_spec_consistency does (a process of
    # its own only imported everything again), and left unparsed for the next test.
    from experiments import flags

    try:
        flags.FLAGS(["x", "--engine=jax"])
        limits = flags.spec_from_flags().limits
    finally:
        flags.FLAGS.unparse_flags()
    assert (limits.token_buckets, limits.bucket_ladder) == (None, None)


def test_a_sweep_fits_one_ladder_per_point_shared_by_its_policies(tmp_path):
    spec = RunSpec(workload=WorkloadSpec(num_requests=60),
                   limits=LimitsSpec(max_num_tokens=512, bucket_ladder="fit:5"))
    runs = [sweep.PolicyRun("orca", "orca"), sweep.PolicyRun("vllm", "vllm")]
    sweep.run_sweep(spec, runs, [8.0, 64.0], [0], str(tmp_path), point_runs=True)
    points = tmp_path / "points"
    for rate in ("8", "64"):
        configs = [_read(points / policy / f"rate_{rate}_seed_0", "config.json")
                   for policy in ("orca", "vllm")]
        sizes = configs[0]["run"]["limits"]["token_buckets"]
        assert len(sizes) <= 5 and sizes[-1] == 512
        assert configs[1]["run"]["limits"]["token_buckets"] == sizes
        assert configs[0]["bucket_fit"] == configs[1]["bucket_fit"] | {
            "pilot_s": configs[0]["bucket_fit"]["pilot_s"]}
        # The point's own pilot: vllm at this rate.
        requests = sweep.workload_at(spec, build_workload(
            sweep.point_spec(spec, 1.0, 0)), float(rate))
        _, fit = with_fitted_buckets(sweep.point_spec(spec, float(rate), 0), requests)
        assert list(fit.token_sizes) == sizes


def test_the_pilot_of_a_huge_budget_has_few_sizes_and_fits_at_once():
    # A budget of 10^10 hung in the pilot's step:8 ladder (issue 25): above 32,768 tokens
    # the pilot pads to powers of two.
    assert bucket_pilot.pilot_token_sizes(1024) == (ladder_token_sizes("step:8", 1024),
                                                    "step:8")
    sizes, rule = bucket_pilot.pilot_token_sizes(10**10)
    assert sizes[:4096] == ladder_token_sizes("step:8", 32768)
    assert sizes[4096:] == tuple(2**k for k in range(16, 34)) + (10**10,)
    assert rule == "step:8 to 32768, pow2 above"
    # A run's budget is capped by the machine's memory (runner.spec_caps: 10^10 is refused
    # on a 24 GiB machine); 10^7 is past the pilot's step:8 range on any machine.
    spec = RunSpec(workload=WorkloadSpec(num_requests=20, rate=32.0),
                   limits=LimitsSpec(max_num_tokens=10**7, bucket_ladder="fit:16"))
    fitted, fit = with_fitted_buckets(spec)
    assert fit.pilot_ladder == rule and fit.token_sizes[-1] == 10**7
    assert fitted.limits.token_buckets == fit.token_sizes
