"""Agent programs (docs/programs.md): the three sources load, bad program files are one
line naming file and line, and a run finishes every call exactly once, in dependency
order, no earlier than its parents' finish plus its tool pause, under every built-in
policy, on one replica and on two."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from test_scheduler_invariants import BUILTIN_POLICIES, make_builtin, run_checked, sim_engine

from orca_jax import KVConfig, Request, RequestState, Scheduler, SchedulerConfig, StepLimits
from orca_jax.cluster.replicas import Cluster
from orca_jax.runner.experiment import run_policy
from orca_jax.runner.spec import ClusterSpec, RunSpec, WorkloadSpec
from orca_jax.workloads.program_traces import load_program_trace
from orca_jax.workloads.programs import ProgramShape, program_workload
from orca_jax.workloads.trace_records import TraceError

SMALL = dict(turns="uniform:1:3", calls_per_turn="uniform:1:4", first_prompt="uniform:40:120",
             prompt_growth="uniform:1:30", completion_len="uniform:1:12",
             tool_ms="uniform:1:400", turn_gap_ms="uniform:1:900")


def small_programs(shape: str, num_requests: int = 60, seed: int = 0) -> list[Request]:
    return program_workload(num_requests=num_requests, rate=4.0, seed=seed, vocab_size=500,
                            shape=ProgramShape(shape=shape, fanout=3, **SMALL), context=1024)


# ------------------------------------------------------------------ the generator
@pytest.mark.parametrize("shape", ["copilot", "parallel"])
def test_generated_programs_wait_for_their_parents_and_extend_their_history(shape):
    requests = small_programs(shape)
    assert len(requests) == 60 and [r.id for r in requests] == list(range(60))
    calls = {(r.program_id, r.call_index): r for r in requests}
    assert len({r.program_id for r in requests}) > 2
    joins = 0
    for r in requests:
        if not r.parents:
            continue
        parents = [calls[(r.program_id, p)] for p in r.parents]  # a cut keeps every parent
        assert r.arrival_s == pytest.approx(max(p.arrival_s for p in parents) + r.tool_s)
        assert r.tool_s > 0
        joins += len(parents) > 1
        if joins and len(parents) > 1:
            continue  # a join's prompt holds each thread's answer, not a thread's prompt
        first = parents[0]
        history = np.concatenate([first.prompt_tokens, first.planned_output_tokens])
        if r.prompt_len >= history.size:  # no compaction: its prompt holds the parent's turn
            assert (r.prompt_tokens[:history.size] == history).all()
    assert (joins > 0) == (shape == "parallel")
    again = small_programs(shape)
    assert [(r.arrival_s, r.prompt_len, r.output_len) for r in again] == [
        (r.arrival_s, r.prompt_len, r.output_len) for r in requests]


def test_copilot_defaults_give_prompts_about_128_times_the_completions():
    requests = program_workload(num_requests=3000, rate=0.2, seed=1, vocab_size=500,
                                shape=ProgramShape(), context=8192)
    prompt = sum(r.prompt_len for r in requests)
    output = sum(r.output_len for r in requests)
    assert 90 < prompt / output < 170
    per_program = np.bincount([r.program_id for r in requests])
    assert 15 < per_program[:-20].mean() < 45  # 3.95 turns of 7.83 calls: 31 a session


# ------------------------------------------------------------------- the loaders
def _write(path, lines):
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_our_program_trace_loads_fan_out_and_join(tmp_path):
    path = _write(tmp_path / "ours.jsonl", [
        {"program_id": 5, "call_index": 0, "prompt_len": 100, "output_len": 10,
         "arrival_s": 2.0},
        {"program_id": 5, "call_index": 3, "parents": [1, 2], "tool_s": 0.5,
         "prompt_len": 300, "output_len": 5},
        {"program_id": 5, "call_index": 1, "parents": [0], "tool_s": 1.0, "prompt_len": 150,
         "output_len": 20},
        {"program_id": 5, "call_index": 2, "parents": [0], "tool_s": 3.0, "prompt_len": 160,
         "output_len": 20},
        {"program_id": 9, "call_index": 0, "prompt_len": 50, "output_len": 4},
    ])
    requests = load_program_trace(path, vocab_size=100)
    by_call = {(r.program_id, r.call_index): r for r in requests}
    assert [r.arrival_s for r in requests] == [0.0, 2.0, 3.0, 5.0, 5.5]
    assert by_call[(5, 3)].parents == (1, 2) and by_call[(5, 3)].arrival_s == 5.5
    # Ids follow the history: call 1 extends call 0's prompt and answer.
    zero, one = by_call[(5, 0)], by_call[(5, 1)]
    assert (one.prompt_tokens[:110] == np.concatenate(
        [zero.prompt_tokens, zero.planned_output_tokens])).all()


def _copilot_session(session_id, start_minute, *, cancelled=False):
    def stamp(seconds):
        return f"2026-06-01T10:{start_minute:02d}:{seconds:06.3f}"
    return {"session_id": session_id, "date": "2026-06-01", "turns": [
        {"turn_id": "t0", "llm_calls": [
            {"message_id": "m0", "timestamp": stamp(0), "duration_ms": 2000.0,
             "initiator_type": "user", "result": "Success",
             "tokens": {"prompt": 4000, "completion": 40, "cached": 0}},
            {"message_id": "m1", "timestamp": stamp(5.5), "duration_ms": 1000.0,
             "initiator_type": "agent", "result": "UserCancel" if cancelled else "Success",
             "tokens": {"prompt": 4300, "completion": 0 if cancelled else 30,
                        "cached": 4000}}],
         "tool_batches": [
            {"timestamp": stamp(2), "duration_ms": 1500.0, "request_id": "m0",
             "function_calls": [{"name": "bash", "status": 1, "duration_ms": 1500.0}]},
            {"timestamp": stamp(3.5), "duration_ms": 2000.0, "request_id": "m0",
             "function_calls": [{"name": "view", "status": 1, "duration_ms": 2000.0}]}]},
        {"turn_id": "t1", "llm_calls": [
            {"message_id": "m2", "timestamp": stamp(30), "duration_ms": 1000.0,
             "initiator_type": "user", "result": "Success",
             "tokens": {"prompt": 4500, "completion": 25, "cached": 4300}}],
         "tool_batches": []}]}


def test_copilot_trace_loads_sessions_as_sequential_programs(tmp_path):
    path = _write(tmp_path / "copilot.jsonl",
                  [_copilot_session("a", 0, cancelled=True), _copilot_session("b", 1)])
    requests = load_program_trace(path)
    assert len(requests) == 6
    a = sorted((r for r in requests if r.program_id == 0), key=lambda r: r.call_index)
    b = sorted((r for r in requests if r.program_id == 1), key=lambda r: r.call_index)
    assert [r.prompt_len for r in a] == [4000, 4300, 4500]
    # The cancelled call is served as counted: its prompt, and at least one token.
    assert [r.output_len for r in a] == [40, 1, 25]
    assert [r.parents for r in a] == [(), (0,), (1,)]
    # Call 1 waits for the two tool batches call 0 asked for; turn 1's first call for
    # the user: 30 s less call 1's end (5.5 + 1 s).
    assert a[1].tool_s == pytest.approx(3.5)
    assert a[2].tool_s == pytest.approx(30 - 6.5)
    assert a[0].arrival_s == 0.0 and b[0].arrival_s == pytest.approx(60.0)
    assert a[2].arrival_s == pytest.approx(3.5 + 23.5)  # the zero-service bound


@pytest.mark.parametrize("lines, line, message", [
    ([{"program_id": 1, "call_index": 0, "parents": [1], "prompt_len": 5, "output_len": 1},
      {"program_id": 1, "call_index": 1, "parents": [0], "prompt_len": 5, "output_len": 1}],
     1, "cycle of parents"),
    ([{"program_id": 1, "call_index": 0, "prompt_len": 5, "output_len": 1},
      {"program_id": 1, "call_index": 1, "parents": [7], "prompt_len": 5, "output_len": 1}],
     2, "names parent call 7"),
    ([{"program_id": 1, "call_index": 0, "prompt_len": 5, "output_len": 1},
      {"program_id": 1, "call_index": 1, "parents": [0], "tool_s": -1, "prompt_len": 5,
       "output_len": 1}],
     2, "field 'tool_s'"),
    ([{"program_id": 1, "call_index": 0, "output_len": 1}], 1, "field 'prompt_len': missing"),
    ([_copilot_session("a", 0),
      {"session_id": "b", "turns": [{"llm_calls": [{"message_id": "x", "tokens": {
          "prompt": 5}}]}]}], 2, "tokens.completion': missing"),
    ([{"session_id": "b", "turns": [{"llm_calls": [{"message_id": "x", "tokens": {
        "prompt": 5, "completion": 1}}], "tool_batches": [
            {"request_id": "x", "duration_ms": -5}]}]}], 1, "duration_ms"),
])
def test_a_bad_program_file_is_one_line_naming_file_and_line(tmp_path, lines, line, message):
    path = _write(tmp_path / "bad.jsonl", lines)
    with pytest.raises(TraceError) as error:
        load_program_trace(path)
    text = str(error.value)
    assert text.startswith(f"{path}:{line}: ") and message in text and "\n" not in text


def test_program_workloads_run_from_the_spec_and_report_program_times(tmp_path):
    path = _write(tmp_path / "ours.jsonl", [
        {"program_id": 1, "call_index": 0, "prompt_len": 100, "output_len": 10},
        {"program_id": 1, "call_index": 1, "parents": [0], "tool_s": 2.0, "prompt_len": 150,
         "output_len": 20}])
    trace, _ = run_policy(RunSpec(workload=WorkloadSpec(arrival="program_trace",
                                                        trace=str(path))),
                          "vllm", out_dir=str(tmp_path / "t"), progress=False)
    assert trace["num_finished"] == 2 and trace["num_programs"] == 1
    assert trace["program_tools_share"] * trace["program_completion_mean_s"] == (
        pytest.approx(2.0))
    generated, _ = run_policy(RunSpec(workload=WorkloadSpec(
        arrival="programs", program_shape="parallel", num_requests=40, rate=2.0,
        program_first_prompt="uniform:50:200"), program_slo_s=1e9), "plas",
        out_dir=str(tmp_path / "g"), progress=False)
    assert generated["num_finished"] == 40
    assert generated["program_slo_attainment"] == 1.0  # no program misses a huge SLO
    assert generated["program_goodput_per_s"] == pytest.approx(
        generated["num_programs"] / generated["virtual_end_s"])
    shares = [generated[f"program_{part}_share"] for part in ("computing", "waiting", "tools")]
    assert sum(shares) == pytest.approx(1.0) and min(shares) >= 0


def test_the_disaggregated_cluster_refuses_programs_in_one_line():
    with pytest.raises(ValueError, match="^--workload=programs: the disaggregated cluster "
                                         "does not run agent programs yet") as error:
        RunSpec(workload=WorkloadSpec(arrival="programs", num_requests=10),
                cluster=ClusterSpec(num_prefill_replicas=1, num_decode_replicas=1))
    assert "\n" not in str(error.value)
    from orca_jax.cluster.disaggregated import DisaggregatedCluster
    with pytest.raises(ValueError, match="^disaggregated cluster: a workload of agent "
                                         "programs"):
        DisaggregatedCluster(small_programs("copilot", 10), prefill=None, decode=None,
                             transfer_cost=None)


# --------------------------------------------------------------- the invariant
def _check_program_order(table, release_s=None):
    """Every call finished once with its output; each started no earlier than its release,
    and was released at max(parents' finish) + tool_s (never before its arrival bound)."""
    book = table.programs
    assert (table.state == RequestState.FINISHED).all()
    assert (table.num_generated == table.output_len).all()
    for row, spec in enumerate(table.specs):
        release = book.release_s[row]
        assert table.first_scheduled_s[row] >= release - 1e-12
        if not spec.parents:
            assert release == table.arrival_s[row]
            continue
        parent_rows = [r for r, s in enumerate(table.specs) if s.program_id == spec.program_id
                       and s.call_index in spec.parents]
        done = max(table.finish_s[r] for r in parent_rows)
        assert release == pytest.approx(max(done + spec.tool_s, table.arrival_s[row]),
                                        abs=1e-9)
        assert release >= done


CONFIG = SchedulerConfig(limits=StepLimits(max_num_seqs=4, max_num_tokens=256,
                                           max_model_len=1024),
                         kv=KVConfig(num_kv_pages=160, page_size=16))


@pytest.mark.parametrize("shape", ["copilot", "parallel"])
@pytest.mark.parametrize("name", BUILTIN_POLICIES)
def test_every_policy_finishes_every_call_once_in_dependency_order(name, shape):
    scheduler = Scheduler(small_programs(shape, 40), make_builtin(name), sim_engine(), CONFIG)
    run_checked(scheduler)
    token_req, _ = scheduler.record.token_log()
    counts = np.bincount(token_req, minlength=len(scheduler.table))
    assert (counts == scheduler.table.output_len).all()  # each token once: no call twice
    _check_program_order(scheduler.table)


@pytest.mark.parametrize("name", ["vllm", "plas", "atlas"])
def test_two_replicas_finish_every_call_in_dependency_order(name):
    cluster = Cluster(small_programs("parallel", 40), num_replicas=2,
                      router="least_outstanding", make_policy=lambda: make_builtin(name),
                      make_engine=sim_engine, config=CONFIG)
    result = cluster.run()
    assert (result.state == RequestState.FINISHED).all()
    _check_program_order(cluster.replicas[0].table)
    assert set(result.replica.tolist()) == {0, 1}


# ------------------------------------------------------ plas and atlas: their rules
def _service(table) -> np.ndarray:  # [N]
    """Tokens each call was served: prompt and output once its first token is out."""
    generated = table.num_generated
    return np.where(generated > 0, table.prompt_len + generated,
                    table.num_computed).astype(np.float64)


def _program_attained(table) -> np.ndarray:  # [N] each row's program's sum
    program = np.array([s.program_id for s in table.specs])
    service = _service(table)
    return np.array([service[program == p].sum() for p in program])


def _critical_path(table) -> np.ndarray:  # [N] each row's program's longest chain
    service = _service(table)
    path = np.zeros(len(table))
    rows = {(s.program_id, s.call_index): i for i, s in enumerate(table.specs)}
    for i, s in enumerate(table.specs):  # parents come first (planned arrival order)
        before = max((path[rows[(s.program_id, p)]] for p in s.parents), default=0.0)
        path[i] = service[i] + before
    program = np.array([s.program_id for s in table.specs])
    return np.array([path[program == p].max() for p in program])


def _levels(service: np.ndarray, base: float) -> np.ndarray:
    """Level k holds [base * 2**(k-1), base * 2**k); level 0 below base."""
    levels = np.zeros(service.size, dtype=np.int64)
    for k in range(1, 16):
        levels[service >= base * 2 ** (k - 1)] = k
    return levels


@pytest.mark.parametrize("name, measure, shape", [
    ("plas", _program_attained, "copilot"), ("atlas", _critical_path, "parallel")])
def test_plas_and_atlas_run_the_calls_of_the_least_served_programs(name, measure, shape):
    """Every step runs a prefix of the candidates ranked by their program's service level
    (plas: all its calls' tokens; atlas: its longest chain's), then arrival; KV is ample,
    so only seats and the token budget cut the prefix."""
    config = SchedulerConfig(limits=StepLimits(max_num_seqs=3, max_num_tokens=512,
                                               max_model_len=1024),
                             kv=KVConfig(num_kv_pages=2000, page_size=16))
    policy = make_builtin(name)
    policy.base_quantum = 64.0
    scheduler = Scheduler(small_programs(shape, 60), policy, sim_engine(), config)
    plans, differs_from_fcfs, differs_between = [], 0, 0
    inner = policy.schedule

    def checked(view):
        plan = inner(view)
        ids = np.concatenate([view.running, view.waiting])
        table = scheduler.table
        expected = ids[np.lexsort((ids, _levels(measure(table)[ids], 64.0)))]
        count = plan.request_ids.size
        assert sorted(plan.request_ids.tolist()) == sorted(expected[:count].tolist())
        plans.append(count)
        nonlocal differs_from_fcfs, differs_between
        differs_from_fcfs += sorted(expected[:count].tolist()) != sorted(ids)[:count]
        differs_between += bool((_critical_path(table)[ids] < _program_attained(table)[ids])
                                .any())
        return plan

    policy.schedule = checked
    run_checked(scheduler)
    _check_program_order(scheduler.table)
    assert len(plans) > 50 and differs_from_fcfs > 5
    if name == "atlas":  # threads side by side: the longest chain is less than the sum
        assert differs_between > 5


# ------------------------------------------------------------------ the view
def test_the_view_tells_a_tool_pause_its_end_and_running_siblings():
    requests = [
        Request(id=0, arrival_s=0.0, prompt_len=20, output_len=3, program_id=4, call_index=0),
        Request(id=1, arrival_s=1.0, prompt_len=30, output_len=300, program_id=4, call_index=1,
                parents=(0,), tool_s=1.0),
        Request(id=2, arrival_s=2.0, prompt_len=40, output_len=300, program_id=4, call_index=2,
                parents=(0,), tool_s=2.0),
        Request(id=3, arrival_s=0.0, prompt_len=10, output_len=500),  # of no program
    ]
    scheduler = Scheduler(requests, make_builtin("vllm"), sim_engine(), CONFIG)
    programs, table = scheduler.view.programs, scheduler.table
    rows = {spec.id: row for row, spec in enumerate(table.specs)}
    while table.state[rows[0]] != RequestState.FINISHED:
        scheduler.step()
    done_s = table.finish_s[rows[0]]
    assert programs.in_tool_pause(scheduler.now_s).tolist() == [True]
    assert programs.pause_ends_s(scheduler.now_s)[0] == pytest.approx(done_s + 1.0)
    assert programs.calls_done([rows[1], rows[3]]).tolist() == [1, 0]
    while scheduler.now_s < done_s + 2.5:
        scheduler.step()
    ids = np.array([rows[1], rows[2], rows[3]])
    assert (table.state[ids] == RequestState.RUNNING).all()
    assert not programs.in_tool_pause(scheduler.now_s).any()
    assert programs.sibling_running(ids).tolist() == [True, True, False]
    one, two = 20 + 3, [30 + table.num_generated[rows[1]], 40 + table.num_generated[rows[2]]]
    assert programs.attained(ids[:1])[0] == one + sum(two)
    assert programs.critical_path(ids[:1])[0] == one + max(two)  # threads count once
    alone = 10 + table.num_generated[rows[3]]
    assert programs.attained(ids[2:])[0] == programs.critical_path(ids[2:])[0] == alone


def test_a_rate_sweep_rescales_program_starts_not_tool_pauses():
    from orca_jax.runner.sweep_point import workload_at
    base = small_programs("parallel", 60)
    spec = RunSpec(workload=WorkloadSpec(arrival="programs"))
    slower = workload_at(spec, base, 0.5)  # built at rate 1: starts twice as far apart
    calls = {(r.program_id, r.call_index): r for r in slower}
    for before, after in zip(base, slower):
        if not before.parents:
            assert after.arrival_s == 2 * before.arrival_s
            continue
        parents = [calls[(after.program_id, p)].arrival_s for p in after.parents]
        assert after.arrival_s == pytest.approx(max(parents) + before.tool_s)
        assert after.tool_s == before.tool_s


def _by_call(requests: list[Request]) -> dict[tuple, Request]:
    return {(r.program_id, r.call_index): r for r in requests}


@pytest.mark.parametrize("shape", ["copilot", "parallel"])
def test_program_count_runs_the_same_whole_programs_at_every_rate(shape):
    def at(rate, **count):
        return program_workload(rate=rate, seed=3, vocab_size=500, context=1024,
                                shape=ProgramShape(shape=shape, fanout=3, **SMALL),
                                **({"num_requests": 40} | count))

    slow, fast = at(1.0, program_count=12), at(8.0, program_count=12)
    assert sorted({r.program_id for r in slow}) == list(range(12))
    for program in range(12):  # whole programs: every call, a parallel one ends in its join
        calls = sorted(r.call_index for r in slow if r.program_id == program)
        assert calls == list(range(len(calls)))
        last = _by_call(slow)[(program, calls[-1])]
        assert (len(last.parents) > 1) == (shape == "parallel")
    slow_calls, fast_calls = _by_call(slow), _by_call(fast)
    assert slow_calls.keys() == fast_calls.keys()
    for key, a in slow_calls.items():
        b = fast_calls[key]
        assert (a.prompt_len, a.output_len, a.parents, a.tool_s) == (
            b.prompt_len, b.output_len, b.parents, b.tool_s)
        assert (a.prompt_tokens == b.prompt_tokens).all()
        if not a.parents:  # only the starts move: 8 times closer
            assert b.arrival_s == pytest.approx(a.arrival_s / 8)
    # Without the knob the first 40 calls are other programs at another rate (the bug).
    cut_slow, cut_fast = at(1.0), at(8.0)
    assert len(cut_slow) == len(cut_fast) == 40
    assert _by_call(cut_slow).keys() != _by_call(cut_fast).keys()


def test_program_count_sets_the_spec_s_workload_and_refuses_a_bad_count():
    from orca_jax.runner.build import build_workload
    spec = RunSpec(workload=WorkloadSpec(arrival="programs", program_count=5, num_requests=1))
    assert len({r.program_id for r in build_workload(spec)}) == 5  # num_requests not read
    from orca_jax.runner.figure_caption import figure_caption
    assert "programs (5 programs," in figure_caption(spec)  # not "1 requests"
    with pytest.raises(ValueError, match=r"^workload.program_count must be >= 1, got 0$"):
        WorkloadSpec(arrival="programs", program_count=0)
    with pytest.raises(ValueError, match=r"^program_count must be an integer >= 1, got 2.5$"):
        program_workload(num_requests=None, program_count=2.5, rate=1.0, seed=0,
                         vocab_size=500, shape=ProgramShape(**SMALL))


def test_a_bad_program_count_flag_is_one_line_and_exit_2(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "experiments.run", "--engine=sim", "--workload=programs",
         "--program_count=0", f"--out_dir={tmp_path / 'out'}"],
        capture_output=True, text=True, check=False, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "--program_count" in lines[0] and "0" in lines[0], lines[0]
    assert not (tmp_path / "out").exists()


def test_a_request_s_program_fields_are_checked_whether_or_not_it_is_a_call():
    """`Request` skips the program checks of a plain request (no program, no parents, no
    tool time): any other value still gets them, and parents become a tuple of ints."""
    plain = Request(id=0, arrival_s=0.0, prompt_len=4, output_len=2, parents=[])
    assert plain.parents == () and type(plain.parents) is tuple
    call = Request(id=1, arrival_s=0.0, prompt_len=4, output_len=2, program_id=3,
                   call_index=2, parents=[np.int64(0), 1], tool_s=0.5)
    assert call.parents == (0, 1) and all(type(p) is int for p in call.parents)
    refused = [
        (dict(parents=(1,)), "parents and tool_s need a program_id"),
        (dict(tool_s=0.5), "parents and tool_s need a program_id"),
        (dict(call_index=0), "program_id and call_index go together"),
        (dict(tool_s=float("nan")), "tool_s must be a finite number >= 0"),
        (dict(tool_s=np.int64(0)), "tool_s must be a finite number >= 0"),
        (dict(tool_s=-0.5, program_id=1, call_index=0), "tool_s must be a finite number"),
        (dict(program_id=1, call_index=0, parents=(0,)), "must be distinct calls"),
    ]
    for fields, message in refused:
        with pytest.raises(ValueError, match=message):
            Request(id=7, arrival_s=0.0, prompt_len=4, output_len=2, **fields)
