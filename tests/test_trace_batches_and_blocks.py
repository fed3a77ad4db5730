"""Traces without arrival times (offline batches) or output lengths, and block-hash traces
at block sizes other than Mooncake's 512 mapped onto the run's KV pages."""

import json
from pathlib import Path

import numpy as np
import pytest

from orca_jax.core.kv.prefix_cache import ROOT_HASH, hash_page
from orca_jax.workloads.traces import TraceError, load_trace, prefix_cache_ceiling


def _jsonl(tmp_path: Path, rows: list[dict], name: str = "t.jsonl") -> Path:
    f = tmp_path / name
    f.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return f


def _page_names(tokens: np.ndarray, page_size: int) -> list[bytes]:  # tokens: [prompt_len]
    """The prefix cache's names of the prompt's full pages (a partial page has none)."""
    names, parent = [], ROOT_HASH
    for start in range(0, len(tokens) - page_size + 1, page_size):
        parent = hash_page(parent, tokens[start:start + page_size])
        names.append(parent)
    return names


def _shared_pages(a: np.ndarray, b: np.ndarray, page_size: int) -> int:
    """Leading full pages two prompts share by name: what a prefix cache would reuse."""
    shared = 0
    for x, y in zip(_page_names(a, page_size), _page_names(b, page_size)):
        if x != y:
            break
        shared += 1
    return shared


def test_a_csv_without_arrival_times_is_an_offline_batch_in_file_order(tmp_path):
    f = tmp_path / "batch.csv"
    f.write_text("num_prefill_tokens,num_decode_tokens\n30,3\n10,1\n20,2\n")
    rs = load_trace(f, time_scale=0.5)
    assert [(r.id, r.arrival_s, r.prompt_len, r.output_len) for r in rs] == [
        (0, 0.0, 30, 3), (1, 0.0, 10, 1), (2, 0.0, 20, 2)]
    # The first N are the file's first N, not the shortest or a sorted order.
    assert [r.prompt_len for r in load_trace(f, max_requests=2)] == [30, 10]


def test_a_jsonl_without_arrival_times_keeps_its_ids_and_file_order(tmp_path):
    f = _jsonl(tmp_path, [{"id": 9, "prompt_len": 4, "output_len": 2},
                          {"id": 3, "prompt_tokens": [5, 6], "output_len": 1}])
    rs = load_trace(f)
    assert [(r.id, r.arrival_s, r.prompt_len) for r in rs] == [(9, 0.0, 4), (3, 0.0, 2)]


def test_arrival_times_in_some_records_only_name_the_first_without_one(tmp_path):
    f = _jsonl(tmp_path, [{"prompt_len": 4, "output_len": 2},
                          {"arrival_s": 1.0, "prompt_len": 4, "output_len": 2}])
    with pytest.raises(TraceError, match=rf"^{f}:1: field 'arrival_s': missing .*, but "
                                         rf"{f}:2 has one .*offline batch"):
        load_trace(f)


def test_a_trace_without_output_lengths_asks_for_output_len(tmp_path):
    f = tmp_path / "prompts.csv"
    f.write_text("arrival_s,prompt_len\n0.5,10\n0.0,20\n")
    with pytest.raises(TraceError) as info:
        load_trace(f)
    message = str(info.value)
    assert message.startswith(f"{f}: field 'output_len': in no record")
    assert "--output_len" in message
    assert "\n" not in message
    # Given, the lengths go to the requests in arrival order.
    rs = load_trace(f, output_lens=lambda n: [7, 8][:n])
    assert [(r.prompt_len, r.output_len) for r in rs] == [(20, 7), (10, 8)]
    # A file that has them keeps its own.
    g = tmp_path / "full.csv"
    g.write_text("arrival_s,prompt_len,output_len\n0,10,3\n")
    assert load_trace(g, output_lens=lambda n: [99] * n)[0].output_len == 3


def test_output_lengths_in_some_records_only_name_the_first_without_one(tmp_path):
    f = _jsonl(tmp_path, [{"prompt_len": 4, "output_len": 2}, {"prompt_len": 5}])
    with pytest.raises(TraceError, match=rf"^{f}:2: field 'output_len': missing .*, but "
                                         rf"{f}:1 has one"):
        load_trace(f, output_lens=lambda n: [1] * n)


# Two requests share their first two 16-token blocks (32 tokens); B's last block is partial.
# C shares only the first block with both.
_ROWS_16 = [
    {"timestamp": 0, "input_length": 48, "output_length": 1, "hash_ids": [1, 2, 3]},
    {"timestamp": 1, "input_length": 40, "output_length": 1, "hash_ids": [1, 2, 4]},
    {"timestamp": 2, "input_length": 32, "output_length": 1, "hash_ids": [1, 5]},
]


@pytest.mark.parametrize("page_size, ab_pages, ac_pages", [
    (8, 4, 2),  # a 16-token block is two pages
    (16, 2, 1),  # one page each
    (32, 1, 0),  # a page spans two blocks: C's first page holds block 5 too, so it differs
])
def test_16_token_blocks_share_whole_pages_at_any_page_size(tmp_path, page_size, ab_pages,
                                                            ac_pages):
    stated = _jsonl(tmp_path, [{**row, "block_size": 16} for row in _ROWS_16], "stated.jsonl")
    unstated = _jsonl(tmp_path, _ROWS_16, "unstated.jsonl")
    a, b, c = (r.prompt_tokens for r in load_trace(stated, vocab_size=50_000))
    again = load_trace(unstated, vocab_size=50_000, block_size=16)
    assert all(np.array_equal(x, y.prompt_tokens) for x, y in zip((a, b, c), again))
    assert _shared_pages(a, b, page_size) == ab_pages
    assert _shared_pages(a, c, page_size) == ac_pages
    assert _shared_pages(b, c, page_size) == ac_pages
    # The ceiling, from the ids alone, counts the same pages: B hits A's, C the shared ones.
    cached = (ab_pages + ac_pages) * page_size
    assert prefix_cache_ceiling(stated, page_size=page_size) == pytest.approx(cached / 120)
    assert prefix_cache_ceiling(unstated, page_size=page_size,
                                block_size=16) == pytest.approx(cached / 120)


@pytest.mark.parametrize("page_size, shared_pages", [(8, 3), (16, 1), (4, 6)])
def test_blocks_that_are_no_multiple_of_the_page_share_only_identical_pages(
        tmp_path, page_size, shared_pages):
    # 12-token blocks, 24 tokens shared: at page 16, page 1 (tokens 16-31) holds 8 tokens of
    # the shared block 2 and 8 of the differing third block, so it is not shared.
    f = _jsonl(tmp_path, [
        {"prompt_len": 36, "output_len": 1, "hash_ids": [1, 2, 3], "block_size": 12},
        {"prompt_len": 30, "output_len": 1, "hash_ids": [1, 2, 9], "block_size": 12}])
    a, b = (r.prompt_tokens for r in load_trace(f, vocab_size=50_000))
    assert np.array_equal(a[:24], b[:24]) and not np.array_equal(a[24:30], b[24:30])
    assert _shared_pages(a, b, page_size) == shared_pages
    assert prefix_cache_ceiling(f, page_size=page_size) == pytest.approx(
        shared_pages * page_size / 66)


def test_block_size_is_checked_against_lengths_the_caller_and_the_other_records(tmp_path):
    # Without a stated size the blocks are Mooncake's 512: 3 blocks cannot hold 48 tokens.
    f = _jsonl(tmp_path, _ROWS_16)
    with pytest.raises(TraceError, match=rf"^{f}:1: field 'input_length': expected more than "
                                         r"1024 and at most 1536 tokens \(3 blocks of 512"):
        load_trace(f, vocab_size=100)
    stated = _jsonl(tmp_path, [{**row, "block_size": 16} for row in _ROWS_16], "s.jsonl")
    with pytest.raises(TraceError, match=rf"^{stated}:1: field 'block_size': expected 8 "):
        load_trace(stated, vocab_size=100, block_size=8)
    mixed = _jsonl(tmp_path, [{**_ROWS_16[0], "block_size": 16},
                              {**_ROWS_16[1], "block_size": 14}], "m.jsonl")
    with pytest.raises(TraceError, match=rf"^{mixed}:2: field 'block_size': expected 16 tokens "
                                         rf"per block, as on {mixed}:1"):
        load_trace(mixed, vocab_size=100)
    with pytest.raises(ValueError, match="block_size must be an integer >= 1"):
        load_trace(stated, vocab_size=100, block_size=0)


def test_run_spec_draws_missing_output_lengths_and_reads_the_block_size(tmp_path):
    from orca_jax.runner.build import build_workload
    from orca_jax.runner.spec import RunSpec, WorkloadSpec

    f = _jsonl(tmp_path, [{k: v for k, v in row.items() if k != "output_length"}
                          for row in _ROWS_16])
    spec = RunSpec(workload=WorkloadSpec(arrival="trace", trace=str(f), num_requests=None,
                                         output_len="uniform:3:9", trace_block_size=16))
    requests = build_workload(spec)
    assert [r.prompt_len for r in requests] == [48, 40, 32]
    assert all(3 <= r.output_len <= 9 for r in requests)
    assert [r.output_len for r in build_workload(spec)] == [r.output_len for r in requests]
    assert np.array_equal(requests[0].prompt_tokens[:32], requests[1].prompt_tokens[:32])
    with pytest.raises(TraceError, match="--output_len"):
        build_workload(RunSpec(workload=WorkloadSpec(arrival="trace", trace=str(f),
                                                     output_len=None, trace_block_size=16)))
    with pytest.raises(ValueError, match="workload.output_len: None is only for a trace"):
        WorkloadSpec(arrival="poisson", output_len=None)
    with pytest.raises(ValueError, match="workload.trace_block_size must be >= 1"):
        WorkloadSpec(arrival="trace", trace=str(f), trace_block_size=0)


def test_an_offline_batch_runs_from_time_0_with_output_len_from_the_flag(tmp_path):
    from tests.cli_runner import read_jsonl, run_module

    f = tmp_path / "batch.csv"
    f.write_text("prompt_len\n300\n100\n200\n")
    out = tmp_path / "run"
    result = run_module("experiments.run", "--engine=sim", "--workload=trace", f"--trace={f}",
                        "--output_len=fixed:6", "--policy=vllm", f"--out_dir={out}")
    assert "an offline batch: every request submitted at time 0" in result.stdout
    rows = read_jsonl(out / "requests.jsonl")
    assert [(r["id"], r["arrival_s"], r["prompt_len"], r["output_len"]) for r in rows] == [
        (0, 0.0, 300, 6), (1, 0.0, 100, 6), (2, 0.0, 200, 6)]
    summary = json.loads((out / "summary.json").read_text())
    # The run's span starts at the batch's submission, 0, and ends at its last finish.
    assert summary["duration_s"] == pytest.approx(max(r["finish_s"] for r in rows))
    assert summary["throughput_req_s"] == pytest.approx(3 / summary["duration_s"])


def test_a_trace_sweep_stored_with_an_unread_output_len_still_resumes(tmp_path):
    import dataclasses

    from orca_jax.results.sweep_store import SweepConfigError, SweepStore
    from orca_jax.runner.spec import RunSpec, WorkloadSpec
    from orca_jax.runner.sweep import run_config

    f = tmp_path / "t.csv"
    f.write_text("arrival_s,prompt_len,output_len\n0,5,3\n")
    old = RunSpec(workload=WorkloadSpec(arrival="trace", trace=str(f), output_len="uniform:1:128"))
    now = dataclasses.replace(old, workload=dataclasses.replace(old.workload, output_len=None))
    SweepStore(tmp_path / "sweep", run_config(old), {})  # as the commands stored it before
    SweepStore(tmp_path / "sweep", run_config(now), {})  # resumes: the trace has its lengths
    other = dataclasses.replace(old, workload=dataclasses.replace(old.workload,
                                                                  output_len="fixed:4"))
    with pytest.raises(SweepConfigError, match="output_len"):
        SweepStore(tmp_path / "sweep", run_config(other), {})
