"""The fitted ladder end to end: its pilot runs (one per policy, over the whole workload,
priced ragged), the flag's default, one ladder for every policy of a comparison and of a
sweep's point, and ladders with gaps refused."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from orca_jax.core.step.bucket_fit import fit_token_sizes, ladder_gap
from orca_jax.core.step.packing import ladder_token_sizes
from orca_jax.runner import bucket_pilot, sweep
from orca_jax.runner.bucket_pilot import PilotPolicy, pilot_spec, with_fitted_buckets
from orca_jax.runner.build import build_workload
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
ENV = {**os.environ, "JAX_PLATFORMS": "cpu"}
SMALL = ["--engine=sim", "--num_requests=150"]
ORCA, SARATHI = PilotPolicy("orca", "orca"), PilotPolicy("sarathi", "sarathi")


def _spec(**cluster) -> RunSpec:
    return RunSpec(workload=WorkloadSpec(num_requests=150, rate=32.0),
                   limits=LimitsSpec(max_num_tokens=1024, bucket_ladder="fit:6"),
                   cluster=ClusterSpec(**cluster))


@pytest.mark.parametrize("cluster", [{}, {"num_replicas": 2, "router": "least_outstanding"}])
def test_the_ladder_is_fitted_to_every_policy_s_ragged_pilot_over_the_whole_workload(cluster):
    spec = _spec(**cluster)
    requests = build_workload(spec)
    # sarathi twice, under two labels with the same knobs: one pilot for both.
    policies = [ORCA, SARATHI, PilotPolicy("chunked", "sarathi")]
    fitted, fit = with_fitted_buckets(spec, requests, policies=policies)
    # The pilots by hand: each policy on the whole workload, priced ragged, its steps
    # padded to multiples of 8, each policy's steps weighed by its real tokens' inverse.
    pilot = dataclasses.replace(spec, engine=SimEngineSpec(step_padding="ragged"),
                                limits=dataclasses.replace(
                                    spec.limits, bucket_ladder=None,
                                    token_buckets=ladder_token_sizes("step:8", 1024)))
    assert pilot_spec(spec) == pilot
    steps, ragged = [], {}
    for name in ("orca", "sarathi"):
        summary, result = run_policy(pilot, name, requests=requests, progress=False)
        steps.append(result.step_array("num_tokens"))
        ragged[name] = summary
    weights = np.concatenate([np.full(s.size, 1 / s.sum()) for s in steps])
    assert fit.token_sizes == fit_token_sizes(np.concatenate(steps), 6, 1024,
                                              weights=weights) == fitted.limits.token_buckets
    assert len(fit.token_sizes) <= 6 and ladder_gap(fit.token_sizes) is None
    assert fit.pilot_policies == ("orca", "sarathi") and fit.pilot_padding == "ragged"
    assert [p.labels for p in fit.pilots] == [("orca",), ("sarathi", "chunked")]
    assert fit.num_pilot_requests == 150 == len(requests)
    assert fit.num_pilot_steps == sum(s.size for s in steps)
    # Each pilot's figures are its policy's ragged run's.
    for label, name in (("orca", "orca"), ("sarathi", "sarathi"), ("chunked", "sarathi")):
        assert fit.ragged(label)["output_tok_s"] == ragged[name]["output_tok_s"]
        assert fit.ragged(label)["ttft_p50_s"] == ragged[name]["ttft_p50_s"]
    assert fitted.limits.bucket_ladder == "fit:6"
    assert with_fitted_buckets(fitted, requests, policies=policies) == (fitted, None)
    with pytest.raises(ValueError, match="needs the policies it is for"):
        with_fitted_buckets(spec, requests, policies=[])


def test_a_pilot_priced_ragged_is_the_policy_s_ragged_run_on_any_ladder():
    # What lets compare rank the policies without padding from the pilots alone.
    spec = _spec()
    requests = build_workload(spec)
    _, fit = with_fitted_buckets(spec, requests, policies=[SARATHI])
    ragged = dataclasses.replace(spec, engine=SimEngineSpec(step_padding="ragged"),
                                 limits=dataclasses.replace(spec.limits, bucket_ladder=None,
                                                            token_buckets=fit.token_sizes))
    summary, _ = run_policy(ragged, "sarathi", requests=requests, progress=False)
    assert {key: summary[key] for key in bucket_pilot.RAGGED_FIELDS} == fit.ragged("sarathi")


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
    assert ladder_gap(sizes) is None
    assert config["bucket_fit"]["token_sizes"] == sizes
    assert config["bucket_fit"]["pilot_policies"] == ["orca"]  # a run's own policy
    # One line says which ladder and why.
    line = next(line for line in done.stdout.splitlines() if line.startswith("ladder:"))
    assert line.startswith(f"ladder: fit:16: 16 sizes {sizes[0]}-2048, adjacent ones at most ")
    assert "fitted to the ragged pilot run of orca over all 150 requests" in line
    assert line.endswith("(--bucket_ladder=auto: fit:16 on the simulator, the sizes that pad "
                         "the policies' own steps least)")
    assert "16 step sizes" in done.stdout
    again = _cli("experiments.run", *SMALL, "--policy=orca",
                 f"--buckets={','.join(map(str, sizes))}", f"--out_dir={tmp_path / 'b'}")
    assert _steps(tmp_path / "b") == _steps(tmp_path / "a")
    assert all(step["num_padded_tokens"] in sizes for step in _steps(tmp_path / "a"))
    assert (f"ladder: 16 sizes {sizes[0]}-2048, adjacent ones at most "
            in again.stdout and "(--buckets)" in again.stdout)
    pow2 = _cli("experiments.run", *SMALL, "--policy=orca", "--bucket_ladder=pow2",
                f"--out_dir={tmp_path / 'c'}")
    assert "ladder: 8 sizes 16-2048, adjacent ones at most 2x apart (--bucket_ladder=pow2)" \
        in pow2.stdout


def test_every_policy_compared_drives_one_ladder_fitted_to_all_of_them(tmp_path):
    _cli("experiments.compare", *SMALL, "--policies=orca,sarathi", f"--out_dir={tmp_path / 'a'}")
    _cli("experiments.compare", *SMALL, "--policies=orca", f"--out_dir={tmp_path / 'b'}")
    _cli("experiments.run", *SMALL, "--policy=orca", f"--out_dir={tmp_path / 'c'}")
    configs = {label: _read(tmp_path / "a" / label, "config.json")
               for label in ("orca", "sarathi")}
    sizes = configs["orca"]["run"]["limits"]["token_buckets"]
    assert configs["sarathi"]["run"]["limits"]["token_buckets"] == sizes
    assert configs["orca"]["bucket_fit"]["pilot_policies"] == ["orca", "sarathi"]
    # orca compared alone is fitted to orca alone, as its single run is.
    alone = _read(tmp_path / "b" / "orca", "config.json")["run"]["limits"]["token_buckets"]
    assert alone == _read(tmp_path / "c", "config.json")["run"]["limits"]["token_buckets"]
    assert alone != sizes
    assert _steps(tmp_path / "b" / "orca") == _steps(tmp_path / "c")
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


def test_a_sweep_fits_one_ladder_per_point_to_all_its_policies(tmp_path):
    spec = RunSpec(workload=WorkloadSpec(num_requests=60),
                   limits=LimitsSpec(max_num_tokens=512, bucket_ladder="fit:5"))
    runs = [sweep.PolicyRun("orca", "orca"), sweep.PolicyRun("vllm", "vllm")]
    sweep.run_sweep(spec, runs, [8.0, 64.0], [0], str(tmp_path), point_runs=True)
    points = tmp_path / "points"
    for rate in ("8", "64"):
        configs = [_read(points / policy / f"rate_{rate}_seed_0", "config.json")
                   for policy in ("orca", "vllm")]
        sizes = configs[0]["run"]["limits"]["token_buckets"]
        assert len(sizes) <= 5 and sizes[-1] == 512 and ladder_gap(sizes) is None
        assert configs[1]["run"]["limits"]["token_buckets"] == sizes
        assert configs[0]["bucket_fit"] == configs[1]["bucket_fit"] | {
            "pilot_s": configs[0]["bucket_fit"]["pilot_s"]}
        # The point's own pilots: orca and vllm at this rate.
        requests = sweep.workload_at(spec, build_workload(
            sweep.point_spec(spec, 1.0, 0)), float(rate))
        _, fit = with_fitted_buckets(sweep.point_spec(spec, float(rate), 0), requests,
                                     policies=[ORCA, PilotPolicy("vllm", "vllm")])
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
    fitted, fit = with_fitted_buckets(spec, policies=[PilotPolicy("vllm", "vllm")])
    assert fit.pilot_ladder == rule and fit.token_sizes[-1] == 10**7
    assert fitted.limits.token_buckets == fit.token_sizes
    # 16 sizes cannot reach 10^7 from a few tokens by doubling: the smallest is raised
    # rather than a gap left.
    assert ladder_gap(fit.token_sizes) is None and len(fit.token_sizes) == 16


GAP = "16,48,96,192,384,768,1536,2048"  # 16 -> 48: a 3x gap


def test_a_ladder_with_a_3x_gap_is_refused_on_the_simulator_in_one_line(tmp_path):
    for extra, says in [
            ([f"--buckets={GAP}"], "--buckets: limits.token_buckets (16, 48, 96, 192, 384, "
             "768, 1536, 2048): 16 -> 48 is a 3x gap; adjacent sizes may be at most 2x apart "
             "(a step just over 16 tokens would pay for 48) on the simulator"),
            (["--bucket_ladder=geometric:3"], "--bucket_ladder=geometric:3: 16 -> 48 is a 3x "
             "gap; adjacent sizes may be at most 2x apart")]:
        done = subprocess.run([sys.executable, "-m", "experiments.run", *SMALL, *extra,
                               f"--out_dir={tmp_path / 'x'}"], cwd=REPO, env=ENV,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and says in done.stderr, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr
        assert not (tmp_path / "x").exists()
    sizes = tuple(int(s) for s in GAP.split(","))
    with pytest.raises(ValueError, match=r"16 -> 48 is a 3x gap"):
        RunSpec(limits=LimitsSpec(token_buckets=sizes))
    # pow2 is exactly 2x: accepted; so is a gap on the jax engine, where each size is a
    # compile and padding the engine's own cost.
    RunSpec(limits=LimitsSpec(token_buckets=ladder_token_sizes("pow2", 2048)))
    RunSpec(engine=JaxEngineSpec(), limits=LimitsSpec(token_buckets=sizes))
