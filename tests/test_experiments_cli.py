"""The command lines researchers script against: flags, output files and their fields."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SUMMARY_KEYS = {"policy", "engine", "num_requests", "num_finished", "num_rejected", "num_steps",
                "duration_s", "throughput_req_s", "throughput_tok_s", "ttft_p50_s", "ttft_p99_s",
                "tpot_p50_s", "tpot_p99_s", "latency_p50_s", "latency_p99_s",
                "normalized_latency_mean_s", "padding_fraction", "num_preemptions"}
REQUEST_KEYS = {"id", "arrival_s", "first_scheduled_s", "first_token_s", "finish_s", "prompt_len",
                "output_len", "num_preemptions", "status"}
STEP_KEYS = {"step", "start_s", "num_seqs", "num_tokens", "num_padded_tokens", "bucket", "host_s",
             "step_s"}


def _run(*args, check=True):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    result = subprocess.run([sys.executable, "-m", *args], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=300)
    if check and result.returncode != 0:
        raise AssertionError(result.stderr[-3000:])
    return result


def _jsonl(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def test_run_writes_the_result_contract(tmp_path):
    out = tmp_path / "run"
    result = _run("experiments.run", "--policy=orca", "--engine=sim", "--num_requests=30",
                  "--rate=50", "--max_model_len=700", "--max_batch_size=8", "--num_kv_pages=200",
                  f"--out_dir={out}")
    assert "orca" in result.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert SUMMARY_KEYS <= set(summary)
    assert summary["num_requests"] == 30 and summary["engine"] == "sim"
    requests = _jsonl(out / "requests.jsonl")
    assert len(requests) == 30 and all(REQUEST_KEYS <= set(r) for r in requests)
    steps = _jsonl(out / "steps.jsonl")
    assert len(steps) == summary["num_steps"] and all(STEP_KEYS <= set(s) for s in steps)
    assert all(s["num_seqs"] <= 8 for s in steps)
    config = json.loads((out / "config.json").read_text())
    assert config["scheduler"]["num_kv_pages"] == 200 and config["policy"]["name"] == "orca"
    assert sum(r["status"] == "finished" for r in requests) == summary["num_finished"]


def test_step_requests_log_accounts_for_every_token_computed(tmp_path):
    out = tmp_path / "run"
    _run("experiments.run", "--policy=sarathi", "--engine=sim", "--num_requests=30", "--rate=80",
         "--max_batch_size=8", "--token_budget=128", "--log_step_requests", f"--out_dir={out}")
    requests = {r["id"]: r for r in _jsonl(out / "requests.jsonl")}
    steps = _jsonl(out / "steps.jsonl")
    computed = dict.fromkeys(requests, 0)
    for step in steps:
        assert len(step["request_ids"]) == step["num_seqs"]
        assert sum(step["request_tokens"]) == step["num_tokens"]
        for request, tokens in zip(step["request_ids"], step["request_tokens"]):
            computed[request] += tokens
    # Chunked prefills and decodes add up to the prompt and every output token but
    # the last (sampled, never fed back); no preemption here.
    assert all(r["num_preemptions"] == 0 for r in requests.values())
    assert computed == {i: r["prompt_len"] + r["output_len"] - 1 for i, r in requests.items()}
    # Prefill chunks shared steps with other requests.
    assert any(len(s["request_ids"]) > 1 and max(s["request_tokens"]) > 1 for s in steps)


def test_compare_writes_one_folder_per_policy_on_the_same_workload(tmp_path):
    out = tmp_path / "cmp"
    _run("experiments.compare", "--policies=static,orca", "--engine=sim", "--num_requests=40",
         "--rate=100", "--policy_opts=static.max_batch_size=4", f"--out_dir={out}")
    arrivals = {}
    for name in ("static", "orca"):
        requests = _jsonl(out / name / "requests.jsonl")
        arrivals[name] = [(r["id"], r["arrival_s"], r["prompt_len"], r["output_len"])
                          for r in requests]
    assert arrivals["static"] == arrivals["orca"]
    assert json.loads((out / "static" / "config.json").read_text())["policy"]["max_batch_size"] == 4
    table = (out / "comparison.txt").read_text()
    assert "static" in table and "orca" in table


def test_jax_engine_run_records_tokens_and_compiles(tmp_path):
    out = tmp_path / "jax"
    _run("experiments.run", "--policy=orca", "--engine=jax", "--num_requests=6",
         "--prompt_len=uniform:4:20", "--output_len=fixed:5", "--token_budget=32",
         f"--out_dir={out}")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["engine"] == "jax"
    assert sorted(summary["compiled_fingerprints"], key=int) == ["16", "32"]
    assert summary["num_compiles"] == 2
    requests = _jsonl(out / "requests.jsonl")
    assert all(len(r["output_tokens"]) == 5 for r in requests)


@pytest.mark.parametrize("flag, words", [
    ("--prompt_len=uniform:9", "uniform"),
    ("--rate=-3", "--rate"),
    ("--policy=nope", "unknown policy 'nope'"),
    ("--policy=tests/plugins/missing.py:Foo", "does not exist"),
])
def test_bad_flags_fail_with_a_clear_message(flag, words):
    result = _run("experiments.run", "--engine=sim", "--num_requests=5", flag, check=False)
    assert result.returncode != 0
    assert words in result.stderr
    assert "Traceback" not in result.stderr


def test_pallas_attention_runs_end_to_end_with_the_reference_tokens(tmp_path):
    # Off a GPU, --attention=pallas runs the same kernel in interpret mode.
    tokens = {}
    for attention in ("pallas", "reference"):
        out = tmp_path / attention
        _run("experiments.run", "--policy=orca", "--engine=jax", f"--attention={attention}",
             "--num_requests=4", "--prompt_len=uniform:3:9", "--output_len=fixed:4",
             "--token_budget=16", "--max_model_len=64", f"--out_dir={out}")
        config = json.loads((out / "config.json").read_text())
        assert config["run"]["attention"] == attention
        tokens[attention] = [r["output_tokens"] for r in _jsonl(out / "requests.jsonl")]
    assert tokens["pallas"] == tokens["reference"]
    assert all(len(t) == 4 for t in tokens["pallas"])
