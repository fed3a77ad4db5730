"""A finished run's requests.jsonl takes each request's streamed line instead of
formatting it again (`row_lines.request_lines_from_streamed`), and is the very file
`iter_request_lines` writes, byte for byte: out of arrival order, rejected, far out
of order, or streamed in arrival order already (the streamed file is kept)."""

import numpy as np
import pytest

from orca_jax.core.requests.request import Request, RequestState
from orca_jax.results import row_lines
from orca_jax.results.row_lines import (
    iter_request_lines,
    request_lines_from_streamed,
    reusable_streamed_rows,
)
from orca_jax.results.run_folder import RunFolder
from orca_jax.runner.experiment import run_policy
from orca_jax.runner.spec import LimitsSpec, RunSpec, SimEngineSpec, WorkloadSpec

SPEC = RunSpec(workload=WorkloadSpec(arrival="poisson", num_requests=80, rate=50.0),
               engine=SimEngineSpec(step_time_ms=10.0),
               limits=LimitsSpec(max_num_seqs=6, max_num_tokens=256, num_kv_pages=512,
                                 max_model_len=200))


def _workload(num: int = 80) -> list[Request]:
    """Mixed lengths (a short request overtakes a long one), tenants and priorities, and
    every 13th too long for the context (rejected: its final row names a reason)."""
    rng = np.random.default_rng(7)
    return [Request(id=1000 + i, arrival_s=0.02 * i,
                    prompt_len=250 if i % 13 == 5 else int(rng.integers(8, 90)),
                    output_len=int(rng.integers(1, 40)), tenant="ab"[i % 2],
                    priority=i % 3) for i in range(num)]


def _expected(result) -> bytes:
    return "".join(line + "\n" for line in iter_request_lines(result)).encode()


def _spy(monkeypatch, name):
    calls = []
    real = getattr(RunFolder, name)
    monkeypatch.setattr(RunFolder, name, lambda self, file, *args: (
        calls.append(file), real(self, file, *args))[1])
    return calls


@pytest.mark.parametrize("policy", ["sjf", "vllm", "static"])  # static defers release
@pytest.mark.parametrize("reach,at_once", [(3, 8), (16384, 4096)])
def test_the_rewritten_requests_file_is_the_formatted_one(tmp_path, monkeypatch, policy,
                                                          reach, at_once):
    # A small reach and chunk make rows finish "far" out of order and the held lines drop.
    monkeypatch.setattr(row_lines, "_STREAMED_REACH", reach)
    monkeypatch.setattr(row_lines, "_LINES_AT_ONCE", at_once)
    rewrites = _spy(monkeypatch, "rewrite_streamed")
    out = tmp_path / "run"
    _, result = run_policy(SPEC, policy, out_dir=str(out), requests=_workload(),
                           progress=False)
    assert rewrites == ["requests.jsonl"]  # out of arrival order, rejected rows
    assert (result.state == RequestState.REJECTED).sum() == 6
    assert (out / "requests.jsonl").read_bytes() == _expected(result)


def test_a_stream_in_arrival_order_is_kept_as_the_file(tmp_path, monkeypatch):
    kept = _spy(monkeypatch, "keep_streamed")
    written = _spy(monkeypatch, "write_lines")
    requests = [Request(id=i, arrival_s=0.05 * i, prompt_len=32, output_len=8, tenant="t")
                for i in range(40)]
    out = tmp_path / "run"
    _, result = run_policy(SPEC, "vllm", out_dir=str(out), requests=requests,
                           progress=False)
    assert "requests.jsonl" in kept and "requests.jsonl" not in written
    assert (out / "requests.jsonl").read_bytes() == _expected(result)


def test_token_times_rows_are_formatted_again(tmp_path, monkeypatch):
    written = _spy(monkeypatch, "write_lines")
    spec = RunSpec(workload=SPEC.workload, engine=SPEC.engine, limits=SPEC.limits,
                   log_token_times=True)
    out = tmp_path / "run"
    run_policy(spec, "vllm", out_dir=str(out), requests=_workload(), progress=False)
    assert "requests.jsonl" in written
    assert '"token_times": ' in (out / "requests.jsonl").read_text()


def test_each_row_takes_its_streamed_line_within_reach_and_is_formatted_else(
        tmp_path, monkeypatch):
    monkeypatch.setattr(row_lines, "_STREAMED_REACH", 4)
    monkeypatch.setattr(row_lines, "_LINES_AT_ONCE", 5)
    _, result = run_policy(SPEC, "vllm", requests=_workload(), progress=False)
    n = result.num_requests
    formatted = list(iter_request_lines(result))
    # Streamed: all but rows 3 and 40, in an order where row 0 comes last (far out of
    # reach) and the rest are shuffled a little (within reach).
    rows = [i for i in range(1, n) if i not in (3, 40)]
    rng = np.random.default_rng(1)
    rows = [rows[k] for k in np.argsort(np.arange(len(rows)) + rng.uniform(0, 3, len(rows)))]
    rows.append(0)
    line_of = np.full(n, -1, dtype=np.int64)
    line_of[rows] = np.arange(len(rows))
    streamed = [f"streamed line of row {i}" for i in rows]
    reusable = reusable_streamed_rows(result, line_of)
    assert not reusable[3] and not reusable[40]  # not streamed
    rejected = result.state == RequestState.REJECTED
    assert (reusable == ((line_of >= 0) & ~rejected)).all()
    lines = list(request_lines_from_streamed(result, streamed, line_of, reusable))
    rank = np.cumsum(line_of >= 0) - (line_of >= 0)
    for i in range(n):
        near = abs(line_of[i] - rank[i]) <= 4
        want = f"streamed line of row {i}" if reusable[i] and near else formatted[i]
        assert lines[i] == want, i
    assert lines[0] == formatted[0]  # streamed last: out of reach
    assert sum(line.startswith("streamed") for line in lines) > n // 2


def test_a_streamed_file_shorter_than_its_rows_is_an_error(monkeypatch):
    _, result = run_policy(SPEC, "vllm", requests=_workload(20), progress=False)
    line_of = np.arange(20)
    reusable = reusable_streamed_rows(result, line_of)
    with pytest.raises(ValueError, match="shorter"):
        list(request_lines_from_streamed(result, ["x"] * 10, line_of, reusable))
