"""benchmarks/vllm_bench_serve.py without vLLM: reading vLLM's result JSON, the counts
check, the timed_trace rows, the one line when vLLM is missing, and the byte tokenizer
written as a folder that `tokenizers` loads; and bench_serve's server E2E column."""

import json
import sys

import pytest

from benchmarks import vllm_bench_serve as vbs
from experiments import bench_serve
from orca_jax.serving.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    byte_tokenizer_files,
    write_byte_tokenizer,
)

# A result as vLLM 0.33's `bench serve --save-result --percentile-metrics
# ttft,tpot,itl,e2el --metric-percentiles 50,90,99` writes it (a subset of its keys).
VLLM_RESULT = {
    "date": "20261204-223000", "endpoint_type": "openai", "backend": "openai",
    "label": None, "model_id": "tiny", "tokenizer_id": "/tmp/t", "num_prompts": 3,
    "request_rate": "inf", "burstiness": 1.0, "max_concurrency": None,
    "duration": 2.5, "completed": 3, "failed": 0, "total_input_tokens": 30,
    "total_output_tokens": 12, "request_throughput": 1.2, "request_goodput": None,
    "output_throughput": 4.8, "total_token_throughput": 16.8,
    "mean_ttft_ms": 20.0, "median_ttft_ms": 15.0, "std_ttft_ms": 3.0,
    "p50_ttft_ms": 15.0, "p90_ttft_ms": 30.0, "p99_ttft_ms": 41.5,
    "mean_tpot_ms": 4.0, "median_tpot_ms": 4.0, "std_tpot_ms": 0.5,
    "p50_tpot_ms": 4.0, "p90_tpot_ms": 5.0, "p99_tpot_ms": 6.0,
    "mean_itl_ms": 4.0, "median_itl_ms": 3.5, "std_itl_ms": 1.0,
    "p50_itl_ms": 3.5, "p90_itl_ms": 7.0, "p99_itl_ms": 12.25,
    "mean_e2el_ms": 700.0, "median_e2el_ms": 650.0, "std_e2el_ms": 10.0,
    "p50_e2el_ms": 650.0, "p90_e2el_ms": 900.0, "p99_e2el_ms": 1250.0,
}


def _planned(lengths):
    return [bench_serve.Planned(i, 0.5 * i, prompt, output)
            for i, (prompt, output) in enumerate(lengths)]


def test_vllm_result_json_is_read_as_seconds_with_e2el_as_e2e():
    p = vbs.vllm_percentiles(VLLM_RESULT)
    assert p["ttft_s"] == {"p50": 0.015, "p90": 0.03, "p99": 0.0415}
    assert p["itl_s"]["p99"] == pytest.approx(0.01225)
    assert p["e2e_s"] == {"p50": 0.65, "p90": 0.9, "p99": 1.25}
    # A percentile vLLM did not report (its default is p99 only) is None, not 0.
    only_p99 = {k: v for k, v in VLLM_RESULT.items() if not k.startswith(("p50_", "p90_"))}
    assert vbs.vllm_percentiles(only_p99)["tpot_s"] == {"p50": None, "p90": None, "p99": 0.006}
    table = bench_serve.table(p, None, client_side="vLLM client")
    assert "e2e      vLLM client     650.0     900.0    1250.0" in table


def test_counts_agree_only_when_vllm_the_server_and_the_plan_all_do():
    planned = _planned([(10, 4), (12, 4), (8, 4)])
    server = {"num_finished": 3}
    assert vbs.count_problems(VLLM_RESULT, planned, server, server_rows=3) == []
    failed_one = dict(VLLM_RESULT, completed=2, failed=1, total_output_tokens=8)
    assert vbs.count_problems(failed_one, planned, server, server_rows=3) == [
        "vLLM completed 2 != 3", "vLLM failed 1 != 0", "vLLM output tokens 8 != 12"]
    # The server counted one prompt token fewer than were sent.
    assert vbs.count_problems(dict(VLLM_RESULT, total_input_tokens=29), planned, server,
                              server_rows=3) == ["vLLM input tokens 29 != 30"]
    assert vbs.count_problems(VLLM_RESULT, planned, {"num_finished": 2}, server_rows=4) == [
        "server finished 2 != 3", "server rows 4 != 3"]


def test_timed_trace_rows_give_each_prompt_its_own_blocks():
    rows = vbs.timed_trace_rows(_planned([(16, 3), (17, 5), (1, 2)]))
    assert [r["timestamp"] for r in rows] == [0.0, 0.5, 1.0]
    assert [(r["input_length"], r["output_length"]) for r in rows] == [(16, 3), (17, 5), (1, 2)]
    # ceil(len / 16) ids each, none shared: vLLM samples a block's tokens per id.
    assert [r["hash_ids"] for r in rows] == [[0], [1, 2], [3]]


def test_result_block_is_vllms_last_printed_block():
    log = ("Namespace(...)\n"
           "============ Serving Benchmark Result ============\n"
           "Successful requests:                     3\n"
           "==================================================\n"
           "trailing line\n")
    assert vbs.result_block(log).splitlines() == [
        "============ Serving Benchmark Result ============",
        "Successful requests:                     3",
        "=================================================="]
    assert vbs.result_block("no result here") == ""


def test_missing_vllm_is_one_line_naming_the_flag(tmp_path, capsys):
    gone = str(tmp_path / "no_venv" / "python")
    assert vbs.main([f"--vllm_python={gone}"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert f"--vllm_python={gone}: no such executable" in err
    assert "setup_min_venv.sh" in err


def test_a_python_without_vllm_is_named():
    # This test's own interpreter: the project never depends on vLLM.
    line = vbs.missing_vllm(sys.executable)
    if line is None:
        pytest.skip("vLLM is installed in the test's own environment")
    assert line.startswith(f"vllm_bench_serve: --vllm_python={sys.executable}: vLLM is not "
                           "installed there")


TEXTS = ["Hello, world", "héllo €\x00\n  two  spaces", " leading", "a" * 600]


def test_byte_tokenizer_folder_loads_with_tokenizers_and_matches_the_byte_tokenizer(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    folder = write_byte_tokenizer(str(tmp_path / "tok"))
    loaded = tokenizers.Tokenizer.from_file(f"{folder}/tokenizer.json")
    byte = ByteTokenizer(256)
    assert loaded.get_vocab_size() == 256
    for text in TEXTS:
        ids = loaded.encode(text, add_special_tokens=False).ids
        assert ids == byte.encode(text) == list(text.encode("utf-8"))
        assert loaded.decode(ids) == text
    # Cut characters and ids past the bytes decode as the server's tokenizer does.
    for ids in ([104, 0xC3], [0xE2, 0x82, 104], [0xFF], [300, 104, 511]):
        assert loaded.decode(ids) == byte.decode(ids), ids
    config = json.loads((tmp_path / "tok" / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"


def test_byte_tokenizer_folder_served_with_tokenizer_flag_is_the_byte_tokenizer(tmp_path):
    pytest.importorskip("tokenizers")
    served = HFTokenizer(write_byte_tokenizer(str(tmp_path / "tok")))
    assert served.eos_token_id is None  # as the byte tokenizer: answers run to max_tokens
    for text in TEXTS:
        assert served.encode(text) == ByteTokenizer(256).encode(text)
    vocab = byte_tokenizer_files()["tokenizer.json"]["model"]["vocab"]
    assert sorted(vocab.values()) == list(range(256))


def test_bench_serve_prints_the_servers_e2e_from_its_latency_percentiles(tmp_path):
    summary = {"ttft_p50_s": 0.003, "ttft_p90_s": 0.007, "ttft_p99_s": 0.2,
               "tpot_p50_s": 0.004, "tpot_p90_s": 0.01, "tpot_p99_s": 0.02,
               "latency_p50_s": 0.8, "latency_p90_s": 4.5, "latency_p99_s": 5.75,
               "itl_p99_s": 0.03}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    server = bench_serve.server_percentiles(str(tmp_path))
    assert server["e2e_s"] == {"p50": 0.8, "p90": 4.5, "p99": 5.75}
    assert server["itl_s"] == {"p50": None, "p90": None, "p99": 0.03}
    lines = bench_serve.table(server, server).splitlines()
    assert "e2e      server      800.0    4500.0    5750.0" in lines
