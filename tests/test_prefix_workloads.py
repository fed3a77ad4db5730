"""Workloads whose prompts share prefixes: shared system prompts, multi-turn conversations."""

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from orca_jax.core.requests.request import Request, RequestState
from orca_jax.runner.build import build_workload
from orca_jax.runner.experiment import run_policy
from orca_jax.runner.spec import LimitsSpec, RunSpec, SimEngineSpec, WorkloadSpec
from orca_jax.workloads.prefix_workloads import conversation_workload, shared_prefix_workload

VOCAB = 32_000


def _common_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


def _shared(**overrides) -> list[Request]:
    kwargs = dict(num_requests=300, rate=5.0, num_prefixes=4, prefix_len="uniform:40:90",
                  prefix_zipf=1.1, suffix_len="uniform:5:30", output_len="uniform:1:20",
                  seed=3, vocab_size=VOCAB)
    kwargs.update(overrides)
    return shared_prefix_workload(**kwargs)


def _conversations(**overrides) -> list[Request]:
    kwargs = dict(num_requests=200, rate=2.0, num_turns="uniform:1:6",
                  think_time_ms="uniform:500:3000", message_len="uniform:5:40",
                  output_len="uniform:1:30", seed=5, vocab_size=VOCAB)
    kwargs.update(overrides)
    return conversation_workload(**kwargs)


def test_shared_prefix_requests_share_exactly_their_system_prompt():
    w = _shared(prefix_len="fixed:64")
    groups: dict[bytes, list[Request]] = {}
    for r in w:
        groups.setdefault(r.prompt_tokens[:64].tobytes(), []).append(r)
    assert len(groups) == 4
    for members in groups.values():
        first = members[0]
        # Requests with one system prompt share it, and no token after it.
        assert all(_common_prefix_len(first.prompt_tokens, r.prompt_tokens) == 64
                   for r in members[1:])
        assert all(64 + 5 <= r.prompt_len <= 64 + 30 for r in members)
    heads = [members[0].prompt_tokens for members in groups.values()]
    assert all(_common_prefix_len(a, b) < 64 for i, a in enumerate(heads) for b in heads[i + 1:])
    assert [r.id for r in w] == list(range(300))
    assert all(1 <= int(t) < VOCAB for r in w for t in r.prompt_tokens)


def test_shared_prefix_lengths_vary_per_system_prompt_and_the_seed_fixes_everything():
    a, b = _shared(), _shared()
    assert all(x == y for x, y in zip(a, b))
    assert not all(x == y for x, y in zip(a, _shared(seed=4)))
    # Each system prompt has its own length, drawn once.
    lens = {_common_prefix_len(x.prompt_tokens, y.prompt_tokens)
            for x in a[:40] for y in a[:40] if x.id < y.id}
    assert len({n for n in lens if n >= 40}) >= 2
    # The rate moves the arrivals only.
    fast = _shared(rate=20.0)
    assert all(np.array_equal(x.prompt_tokens, y.prompt_tokens) for x, y in zip(a, fast))
    np.testing.assert_allclose([r.arrival_s for r in fast], [r.arrival_s / 4 for r in a])


def test_shared_prefix_popularity_follows_zipf():
    w = _shared(num_requests=20_000, num_prefixes=5, prefix_len="fixed:32", prefix_zipf=1.1)
    counts = sorted(Counter(r.prompt_tokens[:32].tobytes() for r in w).values(), reverse=True)
    weights = np.arange(1, 6, dtype=np.float64) ** -1.1
    np.testing.assert_allclose(np.array(counts) / 20_000, weights / weights.sum(), atol=0.012)
    flat = _shared(num_requests=20_000, num_prefixes=5, prefix_len="fixed:32", prefix_zipf=0.0)
    flat_counts = Counter(r.prompt_tokens[:32].tobytes() for r in flat).values()
    assert max(flat_counts) / min(flat_counts) < 1.15


def test_conversation_turn_prompt_is_the_previous_prompt_and_answer_then_a_message():
    w = _conversations()
    by_conversation: dict[int, list[Request]] = {}
    for r in w:
        by_conversation.setdefault(r.conversation_id, []).append(r)
    num_followed = 0
    for turns in by_conversation.values():
        turns.sort(key=lambda r: r.turn)
        assert [r.turn for r in turns] == list(range(len(turns)))
        for before, after in zip(turns, turns[1:]):
            history = np.concatenate([before.prompt_tokens, before.planned_output_tokens])
            assert np.array_equal(after.prompt_tokens[:len(history)], history)
            assert 5 <= after.prompt_len - len(history) <= 40  # the new message
            num_followed += 1
    assert num_followed > 50
    assert all(len(r.planned_output_tokens) == r.output_len for r in w)
    assert all(5 <= r.prompt_len <= 40 for r in w if r.turn == 0)


def test_conversation_think_times_arrival_order_and_truncation():
    w = _conversations()
    assert [r.id for r in w] == list(range(200))
    arrivals = [r.arrival_s for r in w]
    assert arrivals == sorted(arrivals) and arrivals[0] == 0.0
    turns = {(r.conversation_id, r.turn): r.arrival_s for r in w}
    gaps = [turns[c, k] - turns[c, k - 1] for c, k in turns if k > 0]
    assert gaps and all(0.5 <= g <= 3.0 for g in gaps)
    # Fixed think times: every gap is exactly that.
    fixed = _conversations(think_time_ms="fixed:1500")
    fixed_turns = {(r.conversation_id, r.turn): r.arrival_s for r in fixed}
    assert all(fixed_turns[c, k] - fixed_turns[c, k - 1] == pytest.approx(1.5)
               for c, k in fixed_turns if k > 0)
    # More requests extend the workload: the first 200 turns stay the same requests.
    longer = _conversations(num_requests=400)
    assert longer[:200] == w
    # A conversation keeps its earlier turns: each one's turns are 0..k.
    for c in {r.conversation_id for r in w}:
        ks = sorted(k for (cc, k) in turns if cc == c)
        assert ks == list(range(len(ks)))


@pytest.mark.parametrize("overrides, message", [
    (dict(num_prefixes=0), "num_prefixes must be"),
    (dict(prefix_zipf=-1.0), "prefix_zipf must be"),
    (dict(rate=0.0), "rate must be"),
    (dict(vocab_size=1), "vocab_size must be"),
    (dict(suffix_len="uniform:9"), "uniform:9"),
])
def test_shared_prefix_bad_knobs_are_named(overrides, message):
    with pytest.raises(ValueError, match=message):
        _shared(**overrides)


@pytest.mark.parametrize("overrides, message", [
    (dict(prefix_zipf=float("nan")), "workload.prefix_zipf"),
    (dict(num_prefixes=0), "workload.num_prefixes"),
    (dict(prefix_len="fixed:0"), "workload.prefix_len"),
    (dict(suffix_len="nope"), "workload.suffix_len"),
    (dict(num_turns="uniform:3:1"), "workload.num_turns"),
    (dict(think_time_ms="lognormal:x:1"), "workload.think_time_ms"),
])
def test_workload_spec_names_the_bad_field(overrides, message):
    with pytest.raises(ValueError, match=message):
        WorkloadSpec(**overrides)


def _sim_spec(**workload) -> RunSpec:
    return RunSpec(workload=WorkloadSpec(num_requests=60, rate=20.0, output_len="uniform:1:16",
                                         **workload),
                   engine=SimEngineSpec(model="llama3-8b", step_time_ms=5.0),
                   limits=LimitsSpec(max_num_seqs=16, max_num_tokens=512))


@pytest.mark.parametrize("workload", [
    dict(arrival="shared_prefix", num_prefixes=3, prefix_len="fixed:256",
         suffix_len="uniform:8:64"),
    dict(arrival="conversation", num_turns="uniform:1:4", think_time_ms="fixed:200",
         suffix_len="uniform:8:64"),
])
def test_the_simulator_serves_each_prefix_workload_end_to_end(workload):
    spec = _sim_spec(**workload)
    requests = build_workload(spec)
    assert len(requests) == 60 and all(r.prompt_tokens is not None for r in requests)
    assert all(1 <= int(r.prompt_tokens.max()) < 128_256 for r in requests)  # llama3's vocab
    summary, result = run_policy(spec, "sarathi", progress=False)
    assert summary["num_finished"] == 60
    assert (result.state == RequestState.FINISHED).all()
    assert result.num_generated.tolist() == [r.output_len for r in requests]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "experiments.run", "--policy=orca",
                           "--engine=sim", "--step_time_ms=5", *args],
                          cwd=Path(__file__).resolve().parents[1],
                          env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True,
                          text=True, timeout=300)


def test_the_flags_choose_a_prefix_workload_with_the_engines_defaults(tmp_path):
    result = _cli("--workload=conversation", "--num_requests=20", "--think_time_ms=fixed:400",
                  f"--out_dir={tmp_path}")
    assert result.returncode == 0, result.stderr[-3000:]
    workload = json.loads((tmp_path / "config.json").read_text())["run"]["workload"]
    assert workload["arrival"] == "conversation" and workload["think_time_ms"] == "fixed:400"
    assert (workload["suffix_len"], workload["num_turns"], workload["prefix_len"]) == (
        "uniform:16:256", "uniform:1:8", "fixed:1024")  # the simulator's defaults
    bad = _cli("--workload=shared_prefix", "--num_requests=5", "--prefix_len=fixed:0",
               f"--out_dir={tmp_path / 'bad'}")
    assert bad.returncode != 0 and "prefix_len" in bad.stderr and "fixed:0" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_requests_beyond_the_context_get_ids_that_take_no_memory():
    shared = shared_prefix_workload(num_requests=4, rate=1.0, num_prefixes=2,
                                    prefix_len="fixed:2000000000", prefix_zipf=0.0,
                                    suffix_len="fixed:8", output_len="fixed:2", seed=0,
                                    vocab_size=512, context=1024)
    assert all(r.prompt_len == 2_000_000_008 and r.prompt_tokens.strides == (0,) for r in shared)
    # A conversation's turns fit until its history outgrows the context; then none does.
    turns = conversation_workload(num_requests=6, rate=0.01, num_turns="fixed:6",
                                  think_time_ms="fixed:1", message_len="fixed:10",
                                  output_len="fixed:10", seed=0, vocab_size=512, context=45)
    fits = [r.prompt_len + r.output_len <= 45 for r in turns]
    assert fits == [True, True, False, False, False, False]
    assert [r.prompt_tokens.strides == (0,) for r in turns] == [not f for f in fits]
    assert [r.planned_output_tokens.strides == (0,) for r in turns] == [not f for f in fits]
    assert np.array_equal(turns[1].prompt_tokens[:20],
                          np.concatenate([turns[0].prompt_tokens, turns[0].planned_output_tokens]))
