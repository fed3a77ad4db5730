"""Trace files: loading JSONL/CSV (ours and Vidur's columns), errors, round trips."""

import json
import time
from pathlib import Path

import numpy as np
import pytest

from orca_jax.core.request import Request
from orca_jax.workloads.traces import TraceError, load_trace, write_trace
from orca_jax.workloads.synthetic import synthetic_workload, with_prompt_tokens

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
    ("t.csv", "arrival_s,prompt_len\n0,5\n", 1, "output_len"),
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
    ("t.jsonl", '{"arrival_s": 0, "prompt_len": 3}\n', 1, "output_len"),
    ("t.jsonl", '\n{"prompt_len": 3, "output_len": 1}\n', 2, "arrival_s"),
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


def test_azure_conv_trace_loads_fast_with_known_statistics():
    path = _shared_trace("azure_conv_2023.csv")
    start = time.perf_counter()
    rs = load_trace(path)
    elapsed = time.perf_counter() - start
    assert len(rs) == 19_366 and elapsed < 2.0
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


def test_lengths_only_file_suggests_empirical():
    path = _shared_trace("arxiv_summarization_lengths.csv")
    with pytest.raises(TraceError, match=r"arxiv_summarization_lengths.csv:1: field "
                                         r"'arrival_s'.*empirical:"):
        load_trace(path)


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
