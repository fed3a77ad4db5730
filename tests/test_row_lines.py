"""The fast results lines are exactly `json.dumps` of the rows, for every kind of value."""

import json
import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from orca_jax import (
    KVConfig,
    LoopFeatures,
    Request,
    Scheduler,
    SchedulerConfig,
    StepLimits,
    make_policy,
)
from orca_jax.core.requests.request import RequestState
from orca_jax.core.requests.request_table import SpecCounts
from orca_jax.core.requests.run_record import StepLog
from orca_jax.core.requests.run_result import RunResult
from orca_jax.results.row_lines import (
    iter_request_lines,
    iter_step_lines,
    plain_request_lines,
    request_line,
    step_line,
    step_lines,
)
from orca_jax.results.summary import (
    iter_request_rows,
    iter_step_rows,
    request_row,
    spec_fields,
    step_row,
)
from orca_jax.sim.cost_model import CostModelConfig
from orca_jax.sim.engine import SimEngine

# Floats a row may hold: ordinary, tiny, huge, negative zero, unset (NaN) and infinite.
FLOATS = st.one_of(st.floats(allow_nan=True, allow_infinity=True),
                   st.sampled_from([0.1, 1e-300, 1e300, -0.0, 123456.789]))
INTS = st.integers(min_value=-2**40, max_value=2**40)


def _numpy_or_plain(draw, strategy, numpy_type):
    value = draw(strategy)
    return numpy_type(value) if draw(st.booleans()) else value


@st.composite
def step_logs(draw):
    values = []
    for name in StepLog._fields:
        if name in ("start_s", "host_s", "step_s"):
            values.append(_numpy_or_plain(draw, FLOATS, np.float64))
        else:
            values.append(_numpy_or_plain(draw, INTS, np.int64))
    return StepLog(*values)


@settings(max_examples=300, deadline=None)
@given(step=step_logs(), prefix_caching=st.booleans(),
       replica=st.one_of(st.none(), st.integers(0, 7)))
def test_a_step_line_is_the_json_of_its_row(step, prefix_caching, replica):
    row = step_row(step, prefix_caching=prefix_caching, replica=replica)
    assert step_line(step, prefix_caching=prefix_caching, replica=replica) == json.dumps(row)


@settings(max_examples=200, deadline=None)
@given(steps=st.lists(step_logs(), max_size=6), plain=st.booleans(),
       prefix_caching=st.booleans(), several=st.booleans(), data=st.data())
def test_step_lines_are_each_step_s_line(steps, plain, prefix_caching, several, data):
    """Many steps at once: of plain values (one format a step; a NaN or inf among them,
    or a sum that overflows, sends all the slow way) or numpy values among them."""
    if plain:  # as a run logs them: Python ints and floats
        steps = [StepLog(*[kind(value) if math.isfinite(value) or kind is float else 0
                           for value, kind in zip(step, (int, float, *[int] * 4, float,
                                                         float, *[int] * 4))])
                 for step in steps]
    replicas = (data.draw(st.lists(st.integers(0, 7), min_size=len(steps),
                                   max_size=len(steps))) if several else None)
    assert step_lines(steps, prefix_caching=prefix_caching, replicas=replicas) == [
        json.dumps(step_row(step, prefix_caching=prefix_caching,
                            replica=replicas[k] if several else None))
        for k, step in enumerate(steps)]


def test_a_step_line_of_plain_values_keeps_every_digit():
    step = StepLog(step=7, start_s=0.1 + 0.2, num_seqs=3, num_tokens=40, num_padded_tokens=64,
                   bucket=64, host_s=1e-7, step_s=0.012345678901234567, num_running=3,
                   num_waiting=0, num_free_pages=100, num_cached_tokens=16)
    line = step_line(step, prefix_caching=True)
    assert json.loads(line)["start_s"] == 0.1 + 0.2
    assert line == json.dumps(step_row(step, prefix_caching=True))
    assert "num_cached_tokens" not in step_line(step, prefix_caching=False)


class _Columns:
    """One request's columns, as a RunResult or a live RequestTable names them."""

    def __init__(self, values: dict) -> None:
        for name, value in values.items():
            setattr(self, name, np.asarray([value]))


@st.composite
def request_columns(draw):
    values = {name: draw(FLOATS) for name in ("arrival_s", "first_scheduled_s", "first_token_s",
                                               "last_token_s", "finish_s")}
    values.update({name: draw(INTS) for name in ("prompt_len", "output_len", "num_generated",
                                                 "num_preemptions", "priority",
                                                 "num_cached_tokens")})
    values["state"] = draw(st.sampled_from(list(RequestState)))
    return _Columns(values)


@settings(max_examples=300, deadline=None)
@given(columns=request_columns(),
       request_id=st.one_of(INTS, st.text(max_size=5)),
       tenant=st.text(max_size=8), reason=st.one_of(st.none(), st.text(max_size=8)),
       output_tokens=st.one_of(st.none(), st.lists(st.integers(0, 2**31), max_size=4)),
       prefix_caching=st.booleans(), replica=st.one_of(st.none(), st.integers(-1, 7)),
       prefill_replica=st.one_of(st.none(), st.integers(-1, 7)),
       program=st.one_of(st.none(), st.just((None, None)), st.tuples(INTS, INTS)),
       speculation=st.one_of(st.none(), st.tuples(INTS, INTS)))
def test_a_request_line_is_the_json_of_its_row(columns, request_id, tenant, reason,
                                               output_tokens, prefix_caching, replica,
                                               prefill_replica, program, speculation):
    args = dict(request_id=request_id, tenant=tenant, reason=reason,
                output_tokens=output_tokens, prefix_caching=prefix_caching, replica=replica,
                prefill_replica=prefill_replica, program=program, speculation=speculation)
    assert request_line(columns, 0, **args) == json.dumps(request_row(columns, 0, **args))


@st.composite
def several_requests(draw):
    rows = draw(st.integers(1, 6))
    columns = [draw(request_columns()) for _ in range(rows)]
    merged = _Columns({})
    for name in vars(columns[0]):
        setattr(merged, name, np.concatenate([getattr(c, name) for c in columns]))
    return merged, rows


@settings(max_examples=200, deadline=None)
@given(requests=several_requests(), data=st.data(), prefix_caching=st.booleans())
def test_plain_request_lines_are_the_json_of_their_rows(requests, data, prefix_caching):
    columns, num_rows = requests
    rows = data.draw(st.lists(st.integers(0, num_rows - 1), max_size=8))
    ids = [data.draw(st.one_of(INTS, st.text(max_size=5))) for _ in rows]
    tenants = [data.draw(st.text(max_size=8)) for _ in rows]
    reasons = [data.draw(st.one_of(st.none(), st.text(max_size=8))) for _ in rows]
    programs = data.draw(st.one_of(st.none(), st.lists(
        st.one_of(st.just((None, None)), st.tuples(INTS, INTS)), min_size=len(rows),
        max_size=len(rows))))
    speculation = None
    if data.draw(st.booleans()):  # a speculating run's counts
        speculation = SpecCounts(num_rows)
        speculation.drafted[:] = data.draw(st.lists(INTS, min_size=num_rows,
                                                    max_size=num_rows))
        speculation.accepted[:] = speculation.drafted // 2
    replicas, prefill_replicas = [data.draw(st.one_of(st.none(), st.lists(
        st.integers(-1, 7), min_size=len(rows), max_size=len(rows)))) for _ in range(2)]
    lines = plain_request_lines(columns, rows, request_ids=ids, tenants=tenants,
                                reasons=reasons, prefix_caching=prefix_caching,
                                programs=programs, speculation=speculation,
                                replicas=replicas, prefill_replicas=prefill_replicas)
    assert lines == [json.dumps(request_row(columns, i, request_id=request_id, tenant=tenant,
                                            reason=reason, output_tokens=None,
                                            prefix_caching=prefix_caching,
                                            program=programs[k] if programs else None,
                                            speculation=spec_fields(speculation, i),
                                            replica=replicas[k] if replicas else None,
                                            prefill_replica=(prefill_replicas[k]
                                                             if prefill_replicas else None)))
                     for k, (i, request_id, tenant, reason)
                     in enumerate(zip(rows, ids, tenants, reasons))]


@settings(max_examples=200, deadline=None)
@given(requests=several_requests(), data=st.data(), prefix_caching=st.booleans())
def test_plain_request_lines_of_the_common_rows_are_the_json_of_their_rows(requests, data,
                                                                           prefix_caching):
    """The rows a run without programs or speculation writes (int ids, text tenants: one
    format call each), rejected ones and unset or infinite times among them."""
    columns, num_rows = requests
    rows = data.draw(st.lists(st.integers(0, num_rows - 1), min_size=1, max_size=8))
    ids = data.draw(st.lists(INTS, min_size=len(rows), max_size=len(rows)))
    tenants = data.draw(st.lists(st.text(max_size=8), min_size=len(rows), max_size=len(rows)))
    reasons = data.draw(st.lists(st.one_of(st.none(), st.text(max_size=8)), min_size=len(rows),
                                 max_size=len(rows)))
    lines = plain_request_lines(columns, rows, request_ids=ids, tenants=tenants,
                                reasons=reasons, prefix_caching=prefix_caching)
    assert lines == [json.dumps(request_row(columns, i, request_id=request_id, tenant=tenant,
                                            reason=reason, output_tokens=None,
                                            prefix_caching=prefix_caching))
                     for i, request_id, tenant, reason in zip(rows, ids, tenants, reasons)]


def _run(log_step_requests: bool = False) -> RunResult:
    requests = [Request(id=i, arrival_s=0.05 * i, prompt_len=30 + 11 * i, output_len=4 + i,
                        tenant=f"t{i % 2}") for i in range(6)]
    config = SchedulerConfig(limits=StepLimits(max_num_seqs=4, max_num_tokens=64,
                                               max_model_len=256),
                             kv=KVConfig(num_kv_pages=64, page_size=8),
                             features=LoopFeatures(log_step_requests=log_step_requests))
    engine = SimEngine(CostModelConfig(mode="fixed", step_time_s=0.01))
    return Scheduler(requests, make_policy("vllm"), engine, config).run()


def test_a_finished_run_s_lines_are_the_json_of_its_rows():
    for result in (_run(), _run(log_step_requests=True)):
        assert list(iter_request_lines(result)) == [
            json.dumps(row) for row in iter_request_rows(result)]
        assert list(iter_step_lines(result)) == [json.dumps(row) for row in iter_step_rows(result)]
    finish = [json.loads(line)["finish_s"] for line in iter_request_lines(_run())]
    assert all(isinstance(value, float) and math.isfinite(value) for value in finish)


def test_program_runs_name_each_call_s_program_and_index_and_other_runs_do_not(tmp_path):
    from test_programs import small_programs

    from orca_jax.runner.experiment import run_policy
    from orca_jax.runner.spec import RunSpec, WorkloadSpec
    requests = small_programs("parallel", 30)
    _, result = run_policy(RunSpec(workload=WorkloadSpec(arrival="programs")), "vllm",
                           requests=requests, out_dir=str(tmp_path), progress=False)
    by_id = {r.id: r for r in requests}
    written = [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
    for rows in (written, list(iter_request_rows(result))):
        assert len(rows) == len(requests)
        for row in rows:
            request = by_id[row["id"]]
            assert (row["program_id"], row["call_index"]) == (request.program_id,
                                                              request.call_index)
    assert list(iter_request_lines(result)) == [json.dumps(row) for row in written]
    assert len({row["program_id"] for row in written}) > 1
    assert all("program_id" not in row and "call_index" not in row
               for row in iter_request_rows(_run()))
