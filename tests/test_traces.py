"""Trace files: loading JSONL/CSV (ours, Vidur's and Mooncake's columns), errors, round
trips, the prefix-cache ceiling of hashed blocks."""

import ast
import json
from pathlib import Path

import numpy as np
import pytest

from orca_jax.core.requests.request import Request
from orca_jax.workloads.prefix_workloads import conversation_workload
from orca_jax.workloads.synthetic import synthetic_workload, with_prompt_tokens
from orca_jax.workloads.traces import TraceError, load_trace, prefix_cache_ceiling, write_trace

TRACES = Path(__file__).resolve().parents[1].parent / "shared" / "traces"


def _fields(r: Request) -> tuple:
    tokens = None if r.prompt_tokens is None else r.prompt_tokens.tolist()
    return (r.id, r.arrival_s, r.prompt_len, r.output_len, tokens, r.priority, r.tenant,
            r.deadline_s)


def _shared_trace(name: str) -> Path:
    path = TRACES / name
    if not path.is_file():
        pytest.skip(f"shared traces are absent ({TRACES}); they live beside the repository")
    return path


def test_csv_sorts_by_arrival_keeps_ties_in_file_order_and_ignores_extra_columns(tmp_path):
    f = tmp_path / "t.csv"
    f.write_text("index,arrival_s,prompt_len,output_len,tenant,priority,deadline_s,note\n"
                 "0,2.5,10,3,b,1,9.0,x\n"
                 "1,0.5,20,4,a,,,y\n"
                 "2,2.5,30,5,,,,z\n")
    rs = load_trace(f)
    assert [(r.id, r.arrival_s, r.prompt_len, r.output_len) for r in rs] == [
        (0, 0.5, 20, 4), (1, 2.5, 10, 3), (2, 2.5, 30, 5)]
    assert [(r.tenant, r.priority, r.deadline_s) for r in rs] == [
        ("a", 0, None), ("b", 1, 9.0), ("default", 0, None)]


def test_jsonl_with_tokens_ids_and_vidur_names(tmp_path):
    f = tmp_path / "t.jsonl"
    lines = [{"id": 17, "arrived_at": 1.0, "prompt_tokens": [5, 6, 7], "num_decode_tokens": 2},
             {"id": 4, "arrival_s": 0.25, "num_prefill_tokens": 2, "prompt_tokens": [1, 2],
              "output_len": 9, "extra": {"nested": True}}]
    f.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    rs = load_trace(f)
    assert [(r.id, r.arrival_s, r.prompt_len, r.output_len) for r in rs] == [
        (4, 0.25, 2, 9), (17, 1.0, 3, 2)]
    assert rs[1].prompt_tokens.tolist() == [5, 6, 7]


def test_csv_space_separated_prompt_tokens(tmp_path):
    f = tmp_path / "t.csv"
    f.write_text("arrival_s,prompt_tokens,output_len\n0,3 1 4 1 5,2\n")
    (r,) = load_trace(f)
    assert r.prompt_len == 5 and r.prompt_tokens.tolist() == [3, 1, 4, 1, 5]


def test_time_scale_and_max_requests(tmp_path):
    f = tmp_path / "t.csv"
    f.write_text("arrival_s,prompt_len,output_len,deadline_s\n3,1,1,4\n1,2,2,\n2,3,3,5\n")
    rs = load_trace(f, time_scale=0.5, max_requests=2)
    assert [(r.id, r.arrival_s, r.prompt_len, r.deadline_s) for r in rs] == [
        (0, 0.5, 2, None), (1, 1.0, 3, 2.5)]
    with pytest.raises(ValueError, match="time_scale"):
        load_trace(f, time_scale=0.0)
    with pytest.raises(ValueError, match="max_requests"):
        load_trace(f, max_requests=0)


@pytest.mark.parametrize("name, text, line, field", [
    ("t.csv", "arrival_s,prompt_len,output_len\n0,5,3\n1,5,abc\n", 3, "output_len"),
    ("t.csv", "arrival_s,prompt_len,output_len\n0,5,3\n1,-2,3\n", 3, "prompt_len"),
    ("t.csv", "arrival_s,num_prefill_tokens,num_decode_tokens\n0,5,0\n", 2, "num_decode_tokens"),
    ("t.csv", "arrival_s,prompt_len,output_len\n0,5,3\n1,5\n", 3, "output_len"),
    ("t.csv", "arrival_s,prompt_len,output_len\n0,5,3\nsoon,5,3\n", 3, "arrival_s"),
    ("t.csv", "arrival_s,prompt_len,output_len\n-1,5,3\n", 2, "arrival_s"),
    ("t.csv", "arrival_s,prompt_len,output_len\nnan,5,3\n", 2, "arrival_s"),
    ("t.csv", "arrival_s,prompt_len,output_len\n0,2.5,3\n", 2, "prompt_len"),
    ("t.csv", "arrival_s,prompt_len,prompt_tokens,output_len\n0,3,1 2,3\n", 2, "prompt_tokens"),
    ("t.csv", "arrival_s,prompt_tokens,output_len\n0,1 x 2,3\n", 2, "prompt_tokens"),
    ("t.csv", "arrival_s,prompt_len,output_len,priority\n0,3,3,high\n", 2, "priority"),
    ("t.csv", "arrival_s,prompt_len,output_len,id\n0,3,3,1\n1,3,3,1\n", 3, "id"),
    ("t.csv", "arrival_s,output_len\n0,3\n", 1, "prompt_len"),
    ("t.jsonl", '{"arrival_s": 0, "prompt_len": 3, "output_len": 1}\n{"arrival_s": 1,\n', 2,
     None),
    ("t.jsonl", '{"arrival_s": 0, "prompt_len": 3, "output_len": 1}\n[1, 2]\n', 2, None),
    # Arrival times in some records only: neither a replay nor an offline batch.
    ("t.jsonl", '{"arrival_s": 0, "prompt_len": 3, "output_len": 1}\n\n'
     '{"prompt_len": 3, "output_len": 1}\n', 3, "arrival_s"),
    ("t.csv", "arrival_s,prompt_len,output_len\n0,5,3\n,5,3\n", 3, "arrival_s"),
    ("t.jsonl", '{"arrival_s": 0, "prompt_len": 3, "output_len": true}\n', 1, "output_len"),
    ("t.jsonl", '{"arrival_s": 0, "prompt_len": 2, "prompt_tokens": [1, 2, 3], '
     '"output_len": 1}\n', 1, "prompt_tokens"),
    ("t.jsonl", '{"arrival_s": 0, "prompt_tokens": [1, -2], "output_len": 1}\n', 1,
     "prompt_tokens"),
    ("t.jsonl", '{"arrival_s": 0, "prompt_len": 3, "output_len": 1, "tenant": 5}\n', 1,
     "tenant"),
    ("t.jsonl", '{"arrival_s": 0, "prompt_len": 3, "output_len": 1, "deadline_s": "x"}\n', 1,
     "deadline_s"),
])
def test_malformed_files_name_file_line_and_field(tmp_path, name, text, line, field):
    f = tmp_path / name
    f.write_text(text)
    with pytest.raises(TraceError) as info:
        load_trace(f)
    message = str(info.value)
    assert message.startswith(f"{f}:{line}: "), message
    if field is not None:
        assert f"field '{field}'" in message, message


def test_error_message_shows_the_bad_value(tmp_path):
    f = tmp_path / "trace.csv"
    f.write_text("arrival_s,prompt_len,output_len\n" + "0,1,1\n" * 5 + "0,1,abc\n")
    with pytest.raises(TraceError, match=r"^.*trace\.csv:7: field 'output_len': expected an "
                                         r"integer >= 1, got 'abc'$"):
        load_trace(f)


def test_a_csv_row_with_a_cell_no_column_names_is_refused_naming_file_and_line(tmp_path):
    f = tmp_path / "trace.csv"
    f.write_text("arrival_s,prompt_len,output_len\n0,5,3\n0.1,6,5,99\n")
    with pytest.raises(TraceError, match=(
            rf"^{f}:3: 4 cells under a header of 3 columns \(arrival_s,prompt_len,output_len\); "
            r"cell 4 \('99'\) has no column$")):
        load_trace(f)
    # A trailing comma is an empty cell: nothing in it to lose.
    f.write_text("arrival_s,prompt_len,output_len\n0,5,3,\n0.1,6,5\n")
    assert [r.prompt_len for r in load_trace(f)] == [5, 6]


@pytest.mark.parametrize("name, text, message", [
    ("t.txt", "x", "unsupported trace format '.txt'"),
    ("t.csv", "", "empty file"),
    ("t.csv", "arrival_s,prompt_len,output_len\n", "no requests"),
    ("t.jsonl", "\n\n", "no requests"),
])
def test_unusable_files_are_named(tmp_path, name, text, message):
    f = tmp_path / name
    f.write_text(text)
    with pytest.raises(TraceError, match=message) as info:
        load_trace(f)
    assert str(f) in str(info.value)


def test_missing_file_is_named(tmp_path):
    with pytest.raises(TraceError, match="no such trace file"):
        load_trace(tmp_path / "absent.jsonl")


def test_a_missing_public_trace_says_where_to_get_it(tmp_path):
    with pytest.raises(TraceError, match=r"azure_conv_2023\.csv: no such trace file \(it is "
                       r"data/processed_traces/splitwise_conv\.csv of github\.com/microsoft/vidur"):
        load_trace(tmp_path / "azure_conv_2023.csv")


def test_write_then_load_gives_the_same_requests(tmp_path):
    w = synthetic_workload(num_requests=50, arrival="gamma", rate=3.0, cv=2.0,
                           prompt_len="zipf:1.3:300", output_len="uniform:1:40", seed=11,
                           vocab_size=32_000)
    extra = [Request(id=50, arrival_s=w[-1].arrival_s + 0.1, prompt_len=3, output_len=2,
                     priority=-2, tenant="team-b", deadline_s=1e9 + 0.123456789)]
    f = tmp_path / "w.jsonl"
    write_trace(f, w + extra)
    again = load_trace(f)
    assert [_fields(r) for r in again] == [_fields(r) for r in w + extra]
    with pytest.raises(TraceError, match="JSON Lines"):
        write_trace(tmp_path / "w.csv", w)


def test_azure_conv_trace_loads_with_known_statistics():
    # How fast it loads is benchmarks/trace_load.py's to measure, not a test's to assert.
    rs = load_trace(_shared_trace("azure_conv_2023.csv"))
    assert len(rs) == 19_366
    assert [r.id for r in rs[:3]] == [0, 1, 2] and rs[1].arrival_s == pytest.approx(4.314579)
    assert np.mean([r.prompt_len for r in rs]) == pytest.approx(1155, abs=1)
    assert np.mean([r.output_len for r in rs]) == pytest.approx(211, abs=1)
    assert max(r.prompt_len for r in rs) == 14_050 and max(r.output_len for r in rs) == 1_000
    tokens = with_prompt_tokens(rs[:5], vocab_size=100, seed=0)
    assert [len(r.prompt_tokens) for r in tokens] == [r.prompt_len for r in rs[:5]]


def test_azure_code_trace_row_count_and_means():
    rs = load_trace(_shared_trace("azure_code_2023.csv"), max_requests=10_000)
    assert len(rs) == 8_819
    assert np.mean([r.prompt_len for r in rs]) == pytest.approx(2048, abs=1)
    assert np.mean([r.output_len for r in rs]) == pytest.approx(28, abs=0.5)


def test_lengths_only_file_loads_as_an_offline_batch_in_file_order():
    path = _shared_trace("arxiv_summarization_lengths.csv")
    rows = path.read_text().splitlines()[1:4]
    rs = load_trace(path)
    assert len(rs) == 28_257 and {r.arrival_s for r in rs} == {0.0}
    assert [(r.id, r.prompt_len, r.output_len) for r in rs[:3]] == [
        (i, int(row.split(",")[0]), int(row.split(",")[1])) for i, row in enumerate(rows)]


def test_run_spec_replays_a_trace_at_a_scaled_rate(tmp_path):
    from orca_jax.runner.build import build_workload
    from orca_jax.runner.spec import RunSpec, WorkloadSpec
    path = tmp_path / "t.csv"
    path.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n"
                    "0.0,10,4\n4.0,12,5\n10.0,8,3\n")
    spec = RunSpec(workload=WorkloadSpec(arrival="trace", trace=str(path), num_requests=3,
                                         trace_time_scale=0.25))
    assert [r.arrival_s for r in build_workload(spec)] == [0.0, 1.0, 2.5]
    with pytest.raises(ValueError, match="trace_time_scale must be a finite number > 0"):
        WorkloadSpec(arrival="trace", trace=str(path), trace_time_scale=0.0)


def _block_trace(tmp_path: Path, rows: list[dict]) -> Path:
    f = tmp_path / "blocks.jsonl"
    f.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return f


def test_hash_ids_become_fixed_token_runs_shared_where_the_ids_are(tmp_path):
    f = _block_trace(tmp_path, [
        {"timestamp": 1500, "input_length": 1100, "output_length": 7, "hash_ids": [0, 1, 2]},
        {"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [0, 3]},
        {"timestamp": 2250, "input_length": 1024, "output_length": 5, "hash_ids": [0, 1]}])
    rs = load_trace(f, vocab_size=1000)
    assert [(r.arrival_s, r.prompt_len, r.output_len) for r in rs] == [
        (0.0, 600, 3), (1.5, 1100, 7), (2.25, 1024, 5)]
    first, second, third = (r.prompt_tokens for r in rs)
    assert all(1 <= int(t) < 1000 for t in np.concatenate([first, second, third]))
    assert np.array_equal(first[:512], second[:512])  # block 0
    assert np.array_equal(second[:1024], third)  # blocks 0, 1
    assert not np.array_equal(first[512:600], second[512:600])  # block 3 is not block 1
    # A block's run depends on its id alone, not on the vocabulary's draw order or the file.
    again = load_trace(_block_trace(tmp_path, [
        {"timestamp": 0, "input_length": 88, "output_length": 1, "hash_ids": [1]}]),
        vocab_size=1000)
    assert np.array_equal(again[0].prompt_tokens, second[512:600])


@pytest.mark.parametrize("length, blocks", [(1025, [0, 1]), (512, [0, 1]), (3, [])])
def test_input_length_that_disagrees_with_the_blocks_names_file_and_line(tmp_path, length,
                                                                          blocks):
    f = _block_trace(tmp_path, [
        {"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [7]},
        {"timestamp": 5, "input_length": length, "output_length": 1, "hash_ids": blocks}])
    with pytest.raises(TraceError, match=rf"^{f}:2: field '(input_length|hash_ids)'"):
        load_trace(f, vocab_size=100)


def test_hash_ids_need_a_vocabulary_and_exclude_prompt_tokens(tmp_path):
    f = _block_trace(tmp_path, [
        {"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [7]}])
    with pytest.raises(TraceError, match=rf"^{f}:1: field 'hash_ids': .*vocab"):
        load_trace(f)
    g = _block_trace(tmp_path, [{"arrival_s": 0, "prompt_tokens": [1, 2], "output_len": 1,
                                 "hash_ids": [7]}])
    with pytest.raises(TraceError, match=rf"^{g}:1: field 'hash_ids': expected either"):
        load_trace(g, vocab_size=100)


def test_prefix_cache_ceiling_of_a_hand_built_trace(tmp_path):
    f = _block_trace(tmp_path, [
        {"timestamp": 0, "input_length": 1000, "output_length": 1, "hash_ids": [0, 1]},
        # Blocks 0 and 1 seen, but request 0 held only 488 tokens of block 1 (its last):
        # 1,000 tokens cached, 992 in whole 16-token pages.
        {"timestamp": 10, "input_length": 1024, "output_length": 1, "hash_ids": [0, 1]},
        # Block 0 seen, block 5 not: block 1 after it is no prefix hit.
        {"timestamp": 20, "input_length": 1500, "output_length": 1, "hash_ids": [0, 5, 1]}])
    expected = (0 + 992 + 512) / (1000 + 1024 + 1500)
    assert prefix_cache_ceiling(f, page_size=16) == pytest.approx(expected)
    # Pages of 100 tokens: 1,000 -> 1,000 and 512 -> 500.
    assert prefix_cache_ceiling(f, page_size=100) == pytest.approx(1500 / 3524)
    assert prefix_cache_ceiling(f, page_size=16, max_requests=1) == 0.0
    plain = tmp_path / "plain.csv"
    plain.write_text("arrival_s,prompt_len,output_len\n0,5,1\n")
    with pytest.raises(TraceError, match="field 'hash_ids': missing"):
        prefix_cache_ceiling(plain, page_size=16)


def test_mooncake_trace_loads_with_its_lengths_and_shared_blocks():
    path = _shared_trace("mooncake_conversation_2025.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines()[:200]]
    rs = load_trace(path, max_requests=200, vocab_size=128_256)
    assert [r.prompt_len for r in rs] == [row["input_length"] for row in rows]
    assert [r.output_len for r in rs] == [row["output_length"] for row in rows]
    assert [r.arrival_s for r in rs] == [row["timestamp"] / 1000 for row in rows]
    # Every pair of requests shares exactly its common leading blocks' tokens.
    for (a, row_a), (b, row_b) in zip(zip(rs, rows), zip(rs[1:], rows[1:])):
        same = 0
        while (same < min(len(row_a["hash_ids"]), len(row_b["hash_ids"]))
               and row_a["hash_ids"][same] == row_b["hash_ids"][same]):
            same += 1
        n = min(same * 512, a.prompt_len, b.prompt_len)
        assert np.array_equal(a.prompt_tokens[:n], b.prompt_tokens[:n])
        if n < min(a.prompt_len, b.prompt_len):
            assert not np.array_equal(a.prompt_tokens[n:n + 16], b.prompt_tokens[n:n + 16])
    # The README's "about 36% of blocks": in tokens, whole pages, 37%.
    assert prefix_cache_ceiling(path, page_size=16) == pytest.approx(0.3736, abs=5e-4)


def test_peer_vllm_driver_traces_load_and_it_reads_what_we_write(tmp_path):
    driver = TRACES.parent / "peers" / "vllm_scheduler" / "drive_vllm_scheduler.py"
    if not driver.is_file():
        pytest.skip(f"the peer vLLM driver is absent ({driver}); it lives beside the repository")
    # The driver imports vllm; take its trace reader alone.
    tree = ast.parse(driver.read_text())
    reader = next(node for node in tree.body
                  if isinstance(node, ast.FunctionDef) and node.name == "read_trace")
    scope: dict = {"json": json}
    exec(compile(ast.Module(body=[reader], type_ignores=[]), str(driver), "exec"), scope)
    # Its format loads as is.
    theirs = tmp_path / "theirs.jsonl"
    theirs.write_text('{"arrival_s": 0.5, "prompt_tokens": [4, 5, 6], "output_len": 2}\n'
                      '{"arrival_s": 0.75, "prompt_len": 9, "output_len": 3}\n')
    rs = load_trace(theirs)
    assert [(r.arrival_s, r.prompt_len, r.output_len) for r in rs] == [(0.5, 3, 2), (0.75, 9, 3)]
    assert rs[0].prompt_tokens.tolist() == [4, 5, 6]
    # It reads what write_trace writes: lengths, arrivals (1 ms steps) and the prompt ids.
    ours = conversation_workload(num_requests=12, rate=2.0, num_turns="fixed:3",
                                 think_time_ms="fixed:250", message_len="uniform:2:9",
                                 output_len="uniform:1:5", seed=1, vocab_size=500)
    write_trace(tmp_path / "ours.jsonl", ours)
    lengths, arrivals, prompts = scope["read_trace"](str(tmp_path / "ours.jsonl"), 1.0)
    assert lengths == [(r.prompt_len, r.output_len) for r in ours]
    assert arrivals == pytest.approx([r.arrival_s * 1000 for r in ours])
    assert prompts == [r.prompt_tokens.tolist() for r in ours]


def test_conversation_fields_round_trip_and_are_checked(tmp_path):
    ours = conversation_workload(num_requests=10, rate=2.0, num_turns="fixed:2",
                                 think_time_ms="fixed:100", message_len="fixed:3",
                                 output_len="fixed:2", seed=0, vocab_size=50)
    f = tmp_path / "c.jsonl"
    write_trace(f, ours)
    assert load_trace(f) == ours
    assert {r.turn for r in load_trace(f)} == {0, 1}
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"arrival_s": 0, "prompt_len": 3, "output_len": 2, "turn": 1}\n')
    with pytest.raises(TraceError, match=rf"^{bad}:1: field 'conversation_id': missing"):
        load_trace(bad)
    bad.write_text('{"arrival_s": 0, "prompt_len": 3, "output_len": 2, '
                   '"planned_output_tokens": [1, 2, 3]}\n')
    with pytest.raises(TraceError, match=rf"^{bad}:1: field 'planned_output_tokens': expected 2"):
        load_trace(bad)


def test_the_simulator_replays_a_hash_ids_trace_end_to_end(tmp_path):
    from orca_jax.runner.experiment import run_policy
    from orca_jax.runner.spec import LimitsSpec, RunSpec, SimEngineSpec, WorkloadSpec
    lengths = [300 + 400 * (i % 4) for i in range(30)]  # 1, 2, 3 and 3 blocks
    rows = [{"timestamp": 100 * i, "input_length": n, "output_length": 4,
             "hash_ids": [0] + [1 + 10 * i + k for k in range(-(-n // 512) - 1)]}
            for i, n in enumerate(lengths)]
    spec = RunSpec(workload=WorkloadSpec(arrival="trace",
                                         trace=str(_block_trace(tmp_path, rows)),
                                         num_requests=30),
                   engine=SimEngineSpec(step_time_ms=5.0),
                   limits=LimitsSpec(max_num_seqs=8, max_num_tokens=512))
    summary, result = run_policy(spec, "sarathi", progress=False)
    assert summary["num_finished"] == 30 and result.num_generated.tolist() == [4] * 30
