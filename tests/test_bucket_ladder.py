"""Bucket ladders: the sizes each rule gives, the padding it bounds, and the flag."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from orca_jax.core.step.packing import (
    MAX_LADDER_SIZES,
    BucketConfig,
    default_token_sizes,
    ladder_token_sizes,
)

REPO = Path(__file__).resolve().parents[1]


def test_each_ladder_gives_its_sizes_topped_by_the_budget():
    assert ladder_token_sizes("pow2", 2048) == default_token_sizes(2048)
    assert ladder_token_sizes("geometric:1.41", 2048) == (
        16, 24, 40, 64, 96, 136, 192, 272, 384, 544, 768, 1088, 1536, 2048)
    assert ladder_token_sizes("step:128", 2048) == tuple(range(128, 2049, 128))
    assert ladder_token_sizes("step:3", 8) == (3, 6, 8)
    assert ladder_token_sizes("geometric:2", 8) == (8,)


@pytest.mark.parametrize("ladder", ["geometric:1", "geometric:x", "step:0", "pow2:3", "fib"])
def test_a_bad_ladder_is_refused_naming_it(ladder):
    with pytest.raises(ValueError, match=f"bucket ladder '{ladder}'"):
        ladder_token_sizes(ladder, 64)


@given(st.floats(1.05, 3.0), st.integers(17, 4096), st.data())
def test_a_geometric_step_is_padded_by_less_than_its_ratio(ratio, budget, data):
    sizes = ladder_token_sizes(f"geometric:{ratio}", budget)
    assert sizes[-1] == budget and list(sizes) == sorted(set(sizes))
    num_tokens = data.draw(st.integers(17, budget))
    bucket = BucketConfig(sizes, 8, 1).select(num_tokens)
    # Each size is R times the last, rounded up to a multiple of 8.
    assert bucket.num_tokens <= max(num_tokens * ratio + 8, 24)


def _run(out: Path, *extra: str) -> dict:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-m", "experiments.run", "--engine=sim",
                           "--num_requests=200", "--policy=vllm", *extra, f"--out_dir={out}"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    config = json.loads((out / "config.json").read_text())
    return {"summary": json.loads((out / "summary.json").read_text()), "steps": steps,
            "buckets": config["run"]["limits"]["token_buckets"]}


def test_a_finer_ladder_pads_less_and_every_step_takes_its_smallest_bucket(tmp_path):
    pow2 = _run(tmp_path / "pow2", "--bucket_ladder=pow2")
    fine = _run(tmp_path / "fine", "--bucket_ladder=geometric:1.41")
    assert pow2["buckets"] == list(default_token_sizes(2048))
    assert len(fine["buckets"]) == 14
    for step in fine["steps"]:
        smaller = [b for b in fine["buckets"] if b < step["num_padded_tokens"]]
        assert step["num_padded_tokens"] in fine["buckets"]
        assert step["num_tokens"] <= step["num_padded_tokens"]
        assert not smaller or smaller[-1] < step["num_tokens"]
    assert fine["summary"]["padding_fraction"] < 0.7 * pow2["summary"]["padding_fraction"]


def test_the_flag_refuses_a_bad_ladder_and_both_ways_of_choosing(tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    for extra, says in [
            (["--bucket_ladder=step:0"], "--bucket_ladder: bucket ladder 'step:0'"),
            (["--bucket_ladder=pow2", "--buckets=16,2048"],
             "--buckets and --bucket_ladder both choose the step sizes"),
            (["--bucket_ladder=fit:0"], "--bucket_ladder: bucket ladder 'fit:0': expected fit:K"),
            (["--bucket_ladder=fit:x"], "--bucket_ladder: bucket ladder 'fit:x': expected fit:K"),
            (["--bucket_ladder=fit:33", "--max_num_tokens=256"],
             "--bucket_ladder: limits.bucket_ladder 'fit:33': at most 32 sizes fit under "
             "max_num_tokens=256"),
            (["--bucket_ladder=fit:4", "--engine=jax"],
             "--bucket_ladder: limits.bucket_ladder 'fit:4' is fitted to a simulator pilot "
             "run, not for engine 'jax'")]:
        done = subprocess.run([sys.executable, "-m", "experiments.run", "--engine=sim",
                               "--num_requests=4", *extra, f"--out_dir={tmp_path / 'x'}"],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and says in done.stderr, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr
        assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("ladder", ["step:8", "step:1", "geometric:1.0001"])
def test_a_rule_ladder_refuses_more_sizes_than_a_ladder_may_have_at_any_budget(ladder):
    # A budget of 10^10 under step:8 once built 1.25e9 sizes before the run (issue 25).
    with pytest.raises(ValueError, match=f"bucket ladder '{ladder}' gives .* sizes up to "
                                         "max_num_tokens=10000000000, over the 8192"):
        ladder_token_sizes(ladder, 10**10)
    assert len(ladder_token_sizes("pow2", 10**10)) == 31  # 16 .. 2^33, and the budget
    assert ladder_token_sizes("step:8", 8 * MAX_LADDER_SIZES)[-2:] == (
        8 * MAX_LADDER_SIZES - 8, 8 * MAX_LADDER_SIZES)


def test_the_default_ladder_serves_a_budget_under_128_tokens(tmp_path):
    # `auto` meant fit:16, which needs a budget of 128: `--max_num_tokens=64` alone was
    # refused with an error about --bucket_ladder, a flag never passed (issue 25).
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "experiments.run", "--engine=sim",
                           "--num_requests=20", "--max_num_tokens=64", f"--out_dir={out}"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    limits = json.loads((out / "config.json").read_text())["run"]["limits"]
    assert limits["bucket_ladder"] == "fit:8"  # every multiple of 8 up to 64 may be a size
    assert limits["token_buckets"][-1] == 64
    assert all(size % 8 == 0 for size in limits["token_buckets"])
