"""benchmarks/vs_vidur.py without Vidur: the two command lines of a rate, Vidur's local
datasets as its offline lookup reads them, the results read back, the medians and ratios,
and the one line when the interpreter is missing."""

import csv
import io
import json
import lzma
import sys

import pytest

from benchmarks import sim_speed
from benchmarks import vs_vidur as vv


def _flag(command, name):
    return command[command.index(name) + 1]


def test_vidur_command_runs_the_issue_trace_at_the_rate(tmp_path):
    command = vv.vidur_command("/venv/bin/python", 10_000, 15.0, tmp_path, ("c/d", "n/d"),
                               "/tmp/out")
    assert command[:3] == ["/venv/bin/python", "-m", "vidur.main"]
    expected = {
        "--poisson_request_interval_generator_config_qps": "15",
        "--synthetic_request_generator_config_num_requests": "10000",
        "--interval_generator_config_type": "poisson",
        "--length_generator_config_type": "fixed",
        "--fixed_request_length_generator_config_prefill_tokens": "300",
        "--fixed_request_length_generator_config_decode_tokens": "100",
        "--replica_scheduler_config_type": "vllm",
        "--vllm_scheduler_config_batch_size_cap": "256",
        "--vllm_scheduler_config_max_tokens_in_batch": "4096",
        "--replica_config_model_name": "meta-llama/Llama-3-8B",
        "--replica_config_device": "a100",
        "--replica_config_tensor_parallel_size": "1",
        "--cluster_config_num_replicas": "1",
        "--seed": "42",
        f"{vv.PREDICTOR}model_profiling_dataset": "c/d",
        f"{vv.PREDICTOR}network_profiling_dataset": "n/d",
        f"{vv.PREDICTOR}cache_dir": str(tmp_path),
        f"{vv.PREDICTOR}prediction_max_batch_size": "256",
        "--metrics_config_output_dir": "/tmp/out",
    }
    assert {name: _flag(command, name) for name in expected} == expected
    assert "--no-metrics_config_store_plots" in command
    assert "--no-metrics_config_enable_chrome_trace" in command
    # Ours is sim_speed's command for the trace, in the default (leaping) mode.
    ours = sim_speed.trace_command(10_000, 15.0, None, "pow2", "/tmp/out")
    assert ours[:3] == [sys.executable, "-m", "experiments.run"]
    assert ours[3:3 + len(sim_speed.ISSUE_TRACE)] == sim_speed.ISSUE_TRACE
    assert ours[-4:] == ["--num_requests=10000", "--rate=15", "--bucket_ladder=pow2",
                         "--out_dir=/tmp/out"]


def test_vidur_inputs_are_a_local_snapshot_named_by_their_contents(tmp_path):
    profiles = tmp_path / "profiles"
    profiles.mkdir()
    for name in [*vv.COMPUTE_FILES.values(), *vv.NETWORK_FILES.values()]:
        (profiles / name).write_text(f"a,b\n1,{name}\n")
    compute, network = vv.write_vidur_inputs(tmp_path / "cache", profiles)
    assert vv.write_vidur_inputs(tmp_path / "cache", profiles) == (compute, network)
    root = tmp_path / "cache" / "profiling_data" / "compute" / (
        "datasets--" + compute.replace("/", "--"))
    # What huggingface_hub's offline lookup reads: refs/main names the snapshot.
    snapshot = root / "snapshots" / (root / "refs" / "main").read_text()
    assert json.loads((snapshot / "config.json").read_text()) == {
        "model": "meta-llama/Llama-3-8B", "device_sku": "a100"}
    assert lzma.open(snapshot / "mlp.csv.xz", "rt").read() == (
        f"a,b\n1,{vv.COMPUTE_FILES['mlp.csv.xz']}\n")
    attention = list(csv.DictReader(io.StringIO(
        lzma.open(snapshot / "attention.csv.xz", "rt").read())))
    assert len(attention) == (len(vv.DECODE_BATCHES) * len(vv.DECODE_KV)
                              + len(vv.PREFILL_CHUNKS) * len(vv.PREFILL_KV))
    decode = [r for r in attention if r["prefill_chunk_size"] == "0"]
    assert {(r["n_embd"], r["n_q_head"], r["n_kv_head"], r["block_size"],
             r["num_tensor_parallel_workers"]) for r in attention} == {
        ("4096", "32", "8", "16", "1")}
    # More KV read costs more: the roofline's decode attention, per layer.
    times = [float(r["time_stats.attn_decode.median"]) for r in decode
             if r["batch_size"] == "256"]
    assert times == sorted(times) and times[-1] > times[0] > 0
    network_root = tmp_path / "cache" / "profiling_data" / "network" / (
        "datasets--" + network.replace("/", "--"))
    assert json.loads((network_root / "snapshots" / vv.SNAPSHOT / "config.json")
                      .read_text()) == {"sku": "a100_dgx"}
    # Other inputs, another name: Vidur's cached predictions hash the name.
    (profiles / vv.COMPUTE_FILES["mlp.csv.xz"]).write_text("a,b\n2,3\n")
    assert vv.write_vidur_inputs(tmp_path / "cache", profiles)[0] != compute


def test_results_read_back_and_the_medians_and_ratios(tmp_path):
    (tmp_path / "ours").mkdir()
    (tmp_path / "ours" / "requests.jsonl").write_text("".join(json.dumps(
        {"arrival_s": a, "first_token_s": a + 1.0, "finish_s": a + e}) + "\n"
        for a, e in ((0.0, 2.0), (1.0, 4.0), (2.0, 9.0))))
    assert vv.our_results(tmp_path / "ours") == (3, {"e2e_mean": 5.0, "e2e_p50": 4.0,
                                                     "ttft_mean": 1.0, "ttft_p50": 1.0})
    (tmp_path / "vidur" / "2026-12-05_00").mkdir(parents=True)
    (tmp_path / "vidur" / "2026-12-05_00" / "request_metrics.csv").write_text(
        "Request Id,request_e2e_time,prefill_e2e_time\n0,2.0,0.5\n1,6.0,1.5\n")
    assert vv.vidur_results(tmp_path / "vidur") == (2, {"e2e_mean": 4.0, "e2e_p50": 4.0,
                                                        "ttft_mean": 1.0, "ttft_p50": 1.0})
    (tmp_path / "vidur" / "2026-12-05_00" / "batch_metrics.csv").write_text(
        "Batch Id,batch_num_tokens,batch_size\n0,300,1\n1,600,2\n2,2,2\n")
    assert vv.vidur_batches(tmp_path / "vidur") == 3

    def row(cpu_s, peak_mib=10.0):
        return {"cpu_s": cpu_s, "wall_s": cpu_s + 0.5, "peak_mib": peak_mib,
                "ms_per_request": cpu_s / 1000 * 1e3}
    runs = {"ours": [row(1.0), row(3.0), row(2.0)],
            "vidur": [row(10.0, 400.0), row(12.0, 500.0), row(30.0, 450.0)]}
    start_ups = {"ours": [row(0.5), row(0.4), row(0.6)], "vidur": [row(2.0), row(2.5), row(3.0)]}
    table = vv.summarize(runs, start_ups, num_requests=1000,
                         steps={"ours": 500, "vidur": 750})
    assert table["ours"]["cpu_s"] == 2.0 and table["vidur"]["cpu_s"] == 12.0
    assert table["ours"]["net_ms_per_request"] == pytest.approx(1.5)
    assert table["vidur"]["net_ms_per_request"] == pytest.approx(9.5)
    assert table["vidur/ours"]["cpu_s"] == pytest.approx(6.0)
    assert table["vidur/ours"]["net_ms_per_request"] == pytest.approx(9.5 / 1.5)
    assert table["vidur/ours"]["peak_mib"] == pytest.approx(45.0)
    assert table["vidur/ours"]["start_cpu_s"] == pytest.approx(5.0)
    assert table["ours"]["net_us_per_step"] == pytest.approx(3000.0)  # 1.5 s over 500
    assert table["vidur"]["net_us_per_step"] == pytest.approx(9.5 / 750 * 1e6)
    assert table["vidur/ours"]["steps"] == pytest.approx(1.5)
    lines = vv.format_summary(30.0, table).splitlines()
    assert [line.split()[3] for line in lines[1:]] == ["2.000", "12.000", "6.00x"]


def test_a_missing_interpreter_stops_with_one_line(tmp_path):
    with pytest.raises(SystemExit, match=r"^--vidur_python .*: no such file"):
        vv.check_vidur(str(tmp_path / "python"))
    with pytest.raises(SystemExit, match=r"^--vidur_python .*: vidur does not import "
                                         r"\(ModuleNotFoundError: No module named 'vidur'\)"):
        vv.check_vidur(sys.executable)
