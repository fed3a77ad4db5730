"""The command lines researchers script against: flags, output files and their fields."""

import json

import pytest
from cli_runner import read_jsonl as _jsonl
from cli_runner import run_module as _run

SUMMARY_KEYS = {"policy", "engine", "num_requests", "num_finished", "num_rejected", "num_steps",
                "duration_s", "throughput_req_s", "throughput_tok_s", "ttft_p50_s", "ttft_p99_s",
                "tpot_p50_s", "tpot_p99_s", "latency_p50_s", "latency_p99_s",
                "normalized_latency_mean_s", "padding_fraction", "num_preemptions"}
REQUEST_KEYS = {"id", "arrival_s", "first_scheduled_s", "first_token_s", "finish_s", "prompt_len",
                "output_len", "num_preemptions", "status"}
STEP_KEYS = {"step", "start_s", "num_seqs", "num_tokens", "num_padded_tokens", "bucket", "host_s",
             "step_s"}


def test_run_writes_the_result_contract(tmp_path):
    out = tmp_path / "run"
    result = _run("experiments.run", "--policy=orca", "--engine=sim", "--num_requests=30",
                  "--rate=50", "--max_model_len=700", "--max_num_seqs=8", "--num_kv_pages=200",
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
    assert config["scheduler"]["kv"]["num_kv_pages"] == 200 and config["policy"]["name"] == "orca"
    assert sum(r["status"] == "finished" for r in requests) == summary["num_finished"]


def test_rate_with_a_trace_rescales_it_to_that_mean_rate_as_a_sweep_point_does(tmp_path):
    from orca_jax.runner.build import build_workload
    from orca_jax.runner.spec import RunSpec, WorkloadSpec
    from orca_jax.runner.sweep_point import workload_at
    trace = tmp_path / "t.csv"
    trace.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n"
                     "1.0,10,4\n3.0,12,5\n9.0,8,3\n11.0,9,2\n")
    out = tmp_path / "run"
    result = _run("experiments.run", "--policy=orca", "--engine=sim", "--workload=trace",
                  f"--trace={trace}", "--rate=0.6", f"--out_dir={out}")
    assert "arrivals rescaled to a mean 0.6 req/s (--rate)" in result.stdout
    arrivals = sorted(r["arrival_s"] for r in _jsonl(out / "requests.jsonl"))
    # 3 gaps over a 10 s span is 0.3/s: times x0.5 make it 0.6/s, the pattern kept.
    assert arrivals == pytest.approx([0.5, 1.5, 4.5, 5.5])
    config = json.loads((out / "config.json").read_text())
    assert config["run"]["workload"]["trace_at_rate"] is True
    # The same requests as a sweep's point at that rate.
    spec = RunSpec(workload=WorkloadSpec(arrival="trace", trace=str(trace), num_requests=None,
                                         output_len=None))
    assert [r.arrival_s for r in workload_at(spec, build_workload(spec), 0.6)] == (
        pytest.approx(arrivals))
    # Unset, the file's own times; both knobs of pace at once are refused in one line.
    _run("experiments.run", "--policy=orca", "--engine=sim", "--workload=trace",
         f"--trace={trace}", f"--out_dir={tmp_path / 'own'}")
    assert sorted(r["arrival_s"] for r in _jsonl(tmp_path / "own" / "requests.jsonl")) == [
        1.0, 3.0, 9.0, 11.0]
    both = _run("experiments.run", "--engine=sim", "--workload=trace", f"--trace={trace}",
                "--rate=2", "--trace_time_scale=0.5", f"--out_dir={tmp_path / 'both'}",
                check=False)
    assert both.returncode == 2 and "give one" in both.stderr
    assert both.stderr.strip().count("\n") == 0 and not (tmp_path / "both").exists()


def test_old_limit_flags_still_work_with_one_warning_line_each(tmp_path):
    out = tmp_path / "run"
    result = _run("experiments.run", "--policy=orca", "--engine=sim", "--num_requests=10",
                  "--max_batch_size=8", "--token_budget=128", "--max_num_tokens=128",
                  f"--out_dir={out}")
    lines = result.stderr.splitlines()
    assert lines.count("--max_batch_size is deprecated; use --max_num_seqs") == 1
    assert lines.count("--token_budget is deprecated; use --max_num_tokens") == 1
    config = json.loads((out / "config.json").read_text())
    assert config["scheduler"]["limits"]["max_num_seqs"] == 8
    assert config["scheduler"]["limits"]["max_num_tokens"] == 128
    assert all(s["num_seqs"] <= 8 for s in _jsonl(out / "steps.jsonl"))


def test_an_old_and_a_new_flag_that_disagree_are_refused():
    result = _run("experiments.run", "--engine=sim", "--num_requests=5", "--token_budget=64",
                  "--max_num_tokens=128", check=False)
    assert result.returncode != 0
    assert "--token_budget=64 and --max_num_tokens=128 disagree" in result.stderr
    assert "Traceback" not in result.stderr


def test_config_run_section_is_the_spec_grouped_in_its_parts(tmp_path):
    out = tmp_path / "run"
    _run("experiments.run", "--policy=orca", "--engine=sim", "--num_requests=10",
         "--max_num_seqs=8", "--workload=gamma", "--cv=2", "--step_time_ms=5",
         f"--out_dir={out}")
    run = json.loads((out / "config.json").read_text())["run"]
    assert set(run) == {"workload", "engine", "limits", "cluster", "seed", "ttft_slo_s",
                        "tpot_slo_s", "log_token_times", "qoe_ttft_s", "qoe_tokens_per_s",
                        "program_slo_s"}
    assert run["workload"]["arrival"] == "gamma" and run["workload"]["cv"] == 2.0
    assert run["engine"] == {"kind": "sim", "model": "llama3-8b", "hardware": "a100", "tp": 1,
                             "pp": 1, "pp_layers": None, "pp_balance": False,
                             "step_time_ms": 5.0, "cost_fit": None,
                             "step_padding": "bucket", "leap": True,
                             "engine_profile": "orca_jax",  # the roofline's own profile
                             # speculative decoding off (docs/speculative.md)
                             "spec_acceptance": None, "draft_model": None}  # no jax-only
    assert run["limits"]["max_num_seqs"] == 8 and run["limits"]["max_num_tokens"] == 2048
    assert run["cluster"] == {"num_replicas": 1, "router": "round_robin", "router_opts": "",
                              # colocated: the disaggregated pools' settings at their defaults
                              "num_prefill_replicas": 0, "num_decode_replicas": 0,
                              "prefill_policy": None, "decode_policy": None,
                              "prefill_policy_opts": None, "decode_policy_opts": None,
                              "prefill_router": "least_outstanding",
                              "decode_router": "least_outstanding",
                              "prefill_router_opts": "", "decode_router_opts": "",
                              "kv_link": "ib200",
                              "kv_link_max_concurrent": 1,
                              # no live migration unless a rebalancer is named
                              "rebalancer": None, "rebalancer_opts": "",
                              "rebalance_interval_s": 0.5, "migration": "live",
                              # a fixed replica count unless a planner is named
                              "planner": None, "planner_opts": "",
                              "planner_interval_s": None, "min_replicas": None,
                              "max_replicas": None, "replica_startup_s": None,
                              "replica_load_link": None}


def test_step_requests_log_accounts_for_every_token_computed(tmp_path):
    out = tmp_path / "run"
    _run("experiments.run", "--policy=sarathi", "--engine=sim", "--num_requests=30", "--rate=80",
         "--max_num_seqs=8", "--max_num_tokens=128", "--log_step_requests", f"--out_dir={out}")
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
         "--rate=100", "--policy_opts=static.max_num_seqs=4", f"--out_dir={out}")
    arrivals = {}
    for name in ("static", "orca"):
        requests = _jsonl(out / name / "requests.jsonl")
        arrivals[name] = [(r["id"], r["arrival_s"], r["prompt_len"], r["output_len"])
                          for r in requests]
    assert arrivals["static"] == arrivals["orca"]
    assert json.loads((out / "static" / "config.json").read_text())["policy"]["max_num_seqs"] == 4
    table = (out / "comparison.txt").read_text()
    assert "static" in table and "orca" in table


def test_compare_says_each_policys_kv_reservation_and_whether_host_time_was_counted(tmp_path):
    out = tmp_path / "cmp"
    _run("experiments.compare", "--policies=static,orca,vllm", "--engine=sim",
         "--num_requests=20", "--rate=100", "--step_time_ms=5", "--count_host_time",
         "--policy_opts=orca.kv_reservation=pow2", f"--out_dir={out}")
    rows = {row["policy"]: row for row in
            json.loads((out / "comparison.json").read_text())}
    assert {name: row["kv_reservation"] for name, row in rows.items()} == {
        "static": "max", "orca": "pow2", "vllm": "none"}
    assert all(row["count_host_time"] is True for row in rows.values())
    header = next(line for line in (out / "comparison.txt").read_text().splitlines()
                  if line.startswith("policy ")).split()
    assert header[:6] == ["policy", "token_budget", "batch_cap", "kv_reservation",
                          "prefix_caching", "count_host_time"]
    config = json.loads((out / "vllm" / "config.json").read_text())
    assert config["run"]["limits"]["count_host_time"] is True
    assert config["scheduler"]["features"]["count_host_time"] is True
    # Counted host time moves the clock past the engine's own step time.
    summary = json.loads((out / "vllm" / "summary.json").read_text())
    assert summary["virtual_end_s"] > summary["engine_s_total"]


def test_compare_repeats_alternate_the_order_and_are_identical_on_a_deterministic_clock(
        tmp_path):
    out = tmp_path / "cmp"
    result = _run("experiments.compare", "--policies=static,orca", "--engine=sim",
                  "--num_requests=20", "--rate=100", "--step_time_ms=5", "--repeats=3",
                  f"--out_dir={out}")
    lines = result.stdout.splitlines()
    assert sum("deterministic clock (the simulator)" in line for line in lines) == 1
    assert [line for line in lines if line.startswith("repeat ")] == [
        "repeat 0: static, orca", "repeat 1: orca, static", "repeat 2: static, orca"]
    for name in ("static", "orca"):
        runs = [(out / name / f"repeat_{k}" / "requests.jsonl").read_text() for k in range(3)]
        assert runs[0] == runs[1] == runs[2]
        # Each repeat's folder is a run's folder: staged, then moved in finished.
        assert {json.loads((out / name / f"repeat_{k}" / "status.json").read_text())["status"]
                for k in range(3)} == {"finished"}
    assert not [p for p in out.rglob("*") if ".running-" in p.name or ".old-" in p.name]
    rows = json.loads((out / "comparison.json").read_text())
    for row in rows:
        assert row["num_repeats"] == 3
        # Only the measured host time differs between the repeats.
        assert "spread" not in row  # flat: each metric's min and max beside it
        spread = {key[:-len("_min")] for key in row if key.endswith("_min")} - {
            "host_us_per_step_median"}
        assert SUMMARY_KEYS - {"policy", "engine"} <= spread
        assert all(row[f"{key}_min"] == row[f"{key}_max"] == row[key] for key in spread)


def test_compare_repeats_on_the_wall_clock_do_not_claim_to_be_identical(tmp_path):
    # Host time on the clock makes even the simulator's runs measured ones.
    result = _run("experiments.compare", "--policies=orca", "--engine=sim", "--num_requests=5",
                  "--step_time_ms=5", "--repeats=2", "--count_host_time",
                  f"--out_dir={tmp_path / 'cmp'}")
    assert "deterministic" not in result.stdout
    assert (tmp_path / "cmp" / "orca" / "repeat_1" / "summary.json").exists()


@pytest.mark.slow
def test_jax_engine_run_records_tokens_and_compiles(tmp_path):
    out = tmp_path / "jax"
    args = ("experiments.run", "--policy=orca", "--engine=jax", "--num_requests=6",
            "--prompt_len=uniform:4:20", "--output_len=fixed:5", "--max_num_tokens=32",
            f"--compile_cache={tmp_path / 'cache'}")
    result = _run(*args, f"--out_dir={out}")
    # The compile phase says so, in log lines (stderr is a pipe here): never a \r frame.
    assert "jax engine: compiling 2 step buckets (16,32 tokens)" in result.stderr
    assert "\r" not in result.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["engine"] == "jax"
    # Flat: one key per compiled bucket, named as pandas.json_normalize would.
    assert sorted(k for k in summary if k.startswith("compiled_fingerprints")) == [
        "compiled_fingerprints.16", "compiled_fingerprints.32"]
    assert all(isinstance(v, (str, int, float, bool, type(None))) for v in summary.values())
    assert summary["num_compiles"] == 2
    assert summary["compile_s"] > 0 and summary["compile_cache_hit"] is False
    requests = _jsonl(out / "requests.jsonl")
    assert all(len(r["output_tokens"]) == 5 for r in requests)
    # Again: the steps come from the persistent cache, the same programs, the same tokens.
    _run(*args, f"--out_dir={tmp_path / 'again'}")
    again = json.loads((tmp_path / "again" / "summary.json").read_text())
    assert again["compile_cache_hit"] is True and again["compile_cache_hits"] == 2
    assert again["num_compiles"] == 2
    assert {k: v for k, v in again.items() if k.startswith("compiled_fingerprints")} == {
        k: v for k, v in summary.items() if k.startswith("compiled_fingerprints")}
    assert [r["output_tokens"] for r in _jsonl(tmp_path / "again" / "requests.jsonl")] == [
        r["output_tokens"] for r in requests]


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


@pytest.mark.slow
def test_pallas_attention_runs_end_to_end_with_the_reference_tokens(tmp_path):
    # Off a GPU, --attention=pallas runs the same kernel in interpret mode.
    tokens = {}
    for attention in ("pallas", "reference", "bucketed"):
        out = tmp_path / attention
        _run("experiments.run", "--policy=orca", "--engine=jax", f"--attention={attention}",
             "--num_requests=4", "--prompt_len=uniform:3:9", "--output_len=fixed:4",
             "--max_num_tokens=16", "--max_model_len=64", f"--out_dir={out}")
        config = json.loads((out / "config.json").read_text())
        assert config["run"]["engine"]["attention"] == attention
        tokens[attention] = [r["output_tokens"] for r in _jsonl(out / "requests.jsonl")]
    assert tokens["pallas"] == tokens["reference"] == tokens["bucketed"]
    assert all(len(t) == 4 for t in tokens["pallas"])
