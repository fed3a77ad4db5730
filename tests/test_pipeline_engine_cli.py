"""The real engine in pipeline stages on separate devices, through the command line: TP 2 x
PP 2 on 4 CPU devices forced in a subprocess (`--xla_force_host_platform_device_count=4`)
gives one device's greedy tokens (test_pipeline_engine.py has the runs in this process)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _cli(out_dir, *flags, devices=4):
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} "
               f"--xla_force_host_platform_device_count={devices}")
    return subprocess.run(
        [sys.executable, "-m", "experiments.run", "--engine=jax", "--model=tiny",
         "--policy=orca", "--num_requests=8", "--rate=50", "--prompt_len=uniform:4:30",
         "--output_len=uniform:1:16", "--max_num_seqs=4", "--max_num_tokens=32",
         "--buckets=32", f"--out_dir={out_dir}", *flags],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_tp2_by_pp2_on_four_devices_gives_one_device_s_tokens(tmp_path):
    runs = {}
    for name, flags in {"one": [], "tp2pp2": ["--tp=2", "--pp=2"]}.items():
        result = _cli(tmp_path / name, *flags)
        assert result.returncode == 0, result.stderr[-3000:]
        rows = [json.loads(line) for line in
                (tmp_path / name / "requests.jsonl").read_text().splitlines()]
        runs[name] = ({row["id"]: row["output_tokens"] for row in rows},
                      json.loads((tmp_path / name / "summary.json").read_text()))
    (tokens, one), (split_tokens, split) = runs["one"], runs["tp2pp2"]
    assert sum(map(len, tokens.values())) > 30
    assert split_tokens == tokens  # greedy, fp32: identical tokens
    assert (split["pp"], split["tp"]) == (2, 2)
    assert split["pp_stages.stage0.devices"] == [0, 1]
    assert split["pp_stages.stage1.devices"] == [2, 3]
    assert [split[f"pp_stages.stage{s}.num_compiles"] for s in (0, 1)] == [1, 1]
    # Each device holds half its stage's layer's KV heads: a quarter of the whole cache.
    assert split["kv_cache_bytes_per_device"] * 4 == one["kv_cache_bytes_per_device"]
    assert split["pipeline.stages"] == 2
    too_few = _cli(tmp_path / "few", "--tp=2", "--pp=2", devices=2)
    assert too_few.returncode == 2 and "Traceback" not in too_few.stderr
    assert "pp 2 x tp 2 = 4 devices, JAX sees 2 (cpu)" in too_few.stderr
