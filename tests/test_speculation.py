"""Speculative decoding in the loop and the simulator (docs/speculative.md).

A scripted policy gives decodes k draft tokens; the simulator draws acceptances.
Each request must finish with exactly its output length, advance by accepted + 1 a
step, hold no page past its context after a step, and the draws must be a pure
function of (seed, request, position): the same for any batch.
"""

from typing import Optional

import numpy as np
import pytest

from orca_jax import KVConfig, Request, Scheduler, SchedulerConfig, StepLimits, StepPlan
from orca_jax.core.api.policy import Policy
from orca_jax.sim.cost_model import CostModelConfig
from orca_jax.sim.engine import SimEngine
from orca_jax.sim.speculation import SpecConfig, check_draft, uniform_draws
from policies.vllm import VLLM


class FixedK(Policy):
    """vLLM's plans (pages on demand) with `k` draft tokens on each decode (as many as
    its output allows)."""

    name = "fixed_k_test"
    kv_reservation = "none"

    def __init__(self, k: int) -> None:
        self.inner = VLLM()
        self.k = k
        self.seen: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []

    def schedule(self, view):
        plan = self.inner.schedule(view)
        ids = plan.request_ids
        decoding = view.requests.prefill_done(ids) & (plan.num_tokens == 1)
        k = np.where(decoding, np.minimum(self.k, view.requests.remaining_output(ids) - 1), 0)
        self.seen.append((ids.copy(), view.requests.num_drafted(ids).copy(),
                          view.requests.num_accepted(ids).copy()))
        return StepPlan(ids, plan.num_tokens, spec_tokens=k)


CONFIG = SchedulerConfig(limits=StepLimits(max_num_seqs=4, max_num_tokens=64, max_model_len=96),
                         kv=KVConfig(num_kv_pages=128, page_size=4))


def requests(n: int = 4) -> list[Request]:
    return [Request(id=i, arrival_s=0.01 * i, prompt_len=7 + 3 * i, output_len=20 + 5 * i)
            for i in range(n)]


def engine(acceptance: float = 0.7, draft: Optional[str] = None) -> SimEngine:
    return SimEngine(CostModelConfig(mode="per_op", model="llama2-70b", hardware="a100", tp=4),
                     speculation=SpecConfig(acceptance=acceptance, seed=3, draft=None if draft
                                            is None else CostModelConfig(model=draft,
                                                                         hardware="a100", tp=4)))


class PageWatch(Scheduler):
    """Checks after every update that no request holds a page past its context."""

    def update(self, step, result):
        out = super().update(step, result)
        running = self.running
        if running.size:
            held = self.kv.num_held[running]
            needed = self.kv.pages_for_tokens(self.table.num_computed[running])
            # Pages on demand: only the context's pages, the rejected drafts' freed.
            assert (held == needed).all(), (held, needed)
        return out


@pytest.mark.parametrize("k", [1, 3, 5])
def test_every_request_gets_its_output_and_advances_by_accepted_plus_one(k):
    policy = FixedK(k)
    scheduler = PageWatch(requests(), policy, engine(), CONFIG)
    result = scheduler.run()
    np.testing.assert_array_equal(result.num_generated, [r.output_len for r in requests()])
    counts = scheduler.table.speculation
    assert counts is not None
    # Each request's tokens: 1 from its prefill, then accepted + 1 per decode step.
    decode_steps = np.zeros(4, np.int64)
    for ids, _, _ in policy.seen:
        decode_steps[ids] += 1
    decode_steps -= 1  # its prefill step
    np.testing.assert_array_equal(1 + decode_steps + counts.accepted, result.num_generated)
    assert (counts.accepted <= counts.drafted).all() and counts.accepted.sum() > 0
    assert (counts.drafted <= k * decode_steps).all()
    # The view showed each request's history as it grew (never shrinking).
    last = {}
    for ids, drafted, accepted in policy.seen:
        for request, d, a in zip(ids.tolist(), drafted.tolist(), accepted.tolist()):
            assert (d, a) >= last.get(request, (0, 0))
            last[request] = (d, a)
    assert scheduler.kv.num_free == CONFIG.kv.num_kv_pages
    assert sum(d for d, _, _ in scheduler.record.spec_steps.values()) == counts.drafted.sum()


def test_acceptance_matches_its_rate_and_more_drafts_mean_fewer_steps():
    steps = {}
    for acceptance in (0.2, 0.9):
        scheduler = Scheduler(requests(), FixedK(4), engine(acceptance), CONFIG)
        scheduler.run()
        counts = scheduler.table.speculation
        # Acceptance of a draft token is acceptance^(position); the run's share of accepted
        # drafts sits well below the per-token rate at 0.2 and near it at 0.9.
        rate = counts.accepted.sum() / counts.drafted.sum()
        assert rate < 0.2 if acceptance == 0.2 else rate > 0.6
        steps[acceptance] = scheduler.num_steps
    assert steps[0.9] < steps[0.2]


def test_draws_depend_only_on_seed_request_and_position():
    spec = SpecConfig(acceptance=0.6, seed=11)
    requests_ = np.array([3, 9, 4], np.int64)
    first = np.array([20, 5, 40], np.int64)
    alone = [spec.accepted(requests_[i:i + 1], first[i:i + 1], np.array([6])) for i in range(3)]
    together = spec.accepted(requests_, first, np.array([6, 6, 6]))
    np.testing.assert_array_equal(np.concatenate(alone), together)
    # Fewer drafts accept a prefix of the same run: min(accepted with 6, k).
    fewer = spec.accepted(requests_, first, np.array([2, 2, 2]))
    np.testing.assert_array_equal(fewer, np.minimum(together, 2))
    draws = uniform_draws(11, np.arange(2000, dtype=np.int64), np.zeros((2000, 1), np.int64))
    assert 0.45 < draws.mean() < 0.55 and draws.min() >= 0.0 and draws.max() < 1.0


def test_draft_time_is_on_the_clock_and_priced_from_the_draft_preset():
    free = Scheduler(requests(), FixedK(3), engine(0.7), CONFIG)
    free_result = free.run()
    priced = Scheduler(requests(), FixedK(3), engine(0.7, draft="llama2-7b"), CONFIG)
    priced_result = priced.run()
    # The same draws (same seed, same plans): the same steps, later by the draft's seconds.
    assert free.num_steps == priced.num_steps
    draft_s = sum(s for _, _, s in priced.record.spec_steps.values())
    assert draft_s > 0
    assert priced_result.virtual_end_s == pytest.approx(free_result.virtual_end_s + draft_s)
    assert (priced.table.speculation.draft_s > 0).all()


def test_a_draft_of_another_vocabulary_is_refused_in_one_line():
    with pytest.raises(ValueError, match="draft_model 'llama3-8b' has a vocabulary") as raised:
        check_draft(CostModelConfig(model="llama2-70b"), CostModelConfig(model="llama3-8b"))
    assert "\n" not in str(raised.value)
    with pytest.raises(ValueError, match="vocabulary"):
        engine(draft="llama3-8b")


def test_estimate_counts_the_draft_and_the_verified_tokens():
    eng = engine(0.7, draft="llama2-7b")
    eng.warmup(_buckets())
    one = np.ones(4, np.int64)
    base = eng.estimate_step_s(one, np.full(4, 100, np.int64))
    spec = eng.estimate_step_s(one + 3, np.full(4, 103, np.int64), np.full(4, 3, np.int64))
    draft = eng.speculation.draft_seconds(np.full(4, 99, np.int64), np.full(4, 3, np.int64))
    assert base is not None and spec is not None and draft > 0
    assert spec > base + draft * 0.99


def _buckets():
    from orca_jax.core.step.packing import bucket_config_for
    return bucket_config_for(max_num_tokens=64, max_num_seqs=4, max_model_len=96,
                             page_size=4).buckets()


@pytest.mark.parametrize("policy_name", ["vllm", "orca", "sarathi", "srpt"])
def test_spec_k_drafts_every_decode_of_a_builtin_policy_within_its_limits(policy_name):
    import dataclasses

    from orca_jax.core.api.policy import make_policy
    from orca_jax.core.loop.config import LoopFeatures
    config = dataclasses.replace(CONFIG, features=LoopFeatures(spec_k=3))
    plain = Scheduler(requests(6), make_policy(policy_name), engine(0.8), CONFIG).run()
    scheduler = Scheduler(requests(6), make_policy(policy_name), engine(0.8), config)
    result = scheduler.run()
    np.testing.assert_array_equal(result.num_generated, plain.num_generated)
    counts = scheduler.table.speculation
    assert counts.drafted.sum() > 0 and counts.accepted.sum() > 0
    drafted = np.array([d for d, _, _ in scheduler.record.spec_steps.values()])
    assert drafted.max() <= 3 * CONFIG.limits.max_num_seqs
    # Fewer steps than without drafts: every accepted draft is a step saved for its request.
    assert len(result.steps) < len(plain.steps)


def test_spec_k_needs_an_engine_that_speculates():
    import dataclasses

    from orca_jax.core.loop.config import LoopFeatures
    config = dataclasses.replace(CONFIG, features=LoopFeatures(spec_k=2))
    with pytest.raises(ValueError, match="spec_k=2: engine 'sim' does not speculate"):
        Scheduler(requests(), VLLM(), SimEngine(), config)
    with pytest.raises(ValueError, match="spec_k must be an integer >= 0, got -1"):
        LoopFeatures(spec_k=-1)


@pytest.mark.parametrize("args,flag,words", [
    (["--spec_k=-1"], "--spec_k", "must be >= 0"),
    (["--model=llama2-70b", "--draft_model=llama3-8b"], "--draft_model", "vocabulary"),
    (["--draft_model=nosuch"], "--draft_model", "unknown model 'nosuch'"),
    (["--spec_acceptance=1.5"], "--spec_acceptance", "in [0, 1]"),
    (["--engine=jax", "--spec_k=2"], "--spec_k", "only with a drafter"),
    (["--policy=smartspec"], "smartspec", "must speculate"),
    (["--spec_k=2", "--num_replicas=2"], "speculative decoding", "one replica"),
])
def test_bad_speculation_input_is_one_line_exit_2(args, flag, words, tmp_path):
    from tests.cli_runner import run_module
    result = run_module("experiments.run", "--engine=sim", "--num_requests=4",
                        f"--out_dir={tmp_path}", *args, check=False)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and flag in lines[0] and words in lines[0], lines


def test_a_speculating_run_writes_its_figures(tmp_path):
    import json

    from tests.cli_runner import run_module
    run_module("experiments.run", "--engine=sim", "--policy=smartspec", "--num_requests=12",
               "--rate=4", "--model=llama2-70b", "--tp=4", "--draft_model=llama2-7b",
               f"--out_dir={tmp_path}")
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["num_finished"] == 12
    assert 0 < summary["speculation.accepted_tokens"] <= summary["speculation.drafted_tokens"]
    assert summary["speculation.draft_s_total"] > 0
    assert 0 < summary["speculation.draft_fraction"] < 1
    # requests.jsonl's per-request counts add up to the run's.
    rows = [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
    assert len(rows) == 12
    assert sum(r["drafted_tokens"] for r in rows) == summary["speculation.drafted_tokens"]
    assert sum(r["accepted_tokens"] for r in rows) == summary["speculation.accepted_tokens"]
    assert all(0 <= r["accepted_tokens"] <= r["drafted_tokens"] for r in rows)
    assert any(r["accepted_tokens"] < r["drafted_tokens"] for r in rows)


def test_a_request_of_its_own_rate_draws_at_that_rate():
    own = SpecConfig(acceptance=0.5, per_request=np.array([np.nan, 1.0, 0.0]))
    np.testing.assert_array_equal(own.rates(np.array([0, 1, 2])), [0.5, 1.0, 0.0])
    accepted = own.accepted(np.array([1, 2]), np.array([10, 10]), np.array([4, 4]))
    np.testing.assert_array_equal(accepted, [4, 0])
    with pytest.raises(ValueError, match="in \\[0, 1\\]"):
        SpecConfig(per_request=np.array([1.5]))


def test_a_fixed_k_run_is_never_leaped_and_matches_its_unleaped_twin():
    import dataclasses

    from orca_jax.core.loop.config import LoopFeatures
    results = {}
    for leap in (True, False):
        config = dataclasses.replace(CONFIG, features=LoopFeatures(spec_k=2, leap=leap))
        scheduler = Scheduler(requests(6), VLLM(), engine(0.6), config)
        results[leap] = scheduler.run()
        if leap:
            assert scheduler.executor.leaper is not None
            assert scheduler.executor.leaper.num_leaped_steps == 0
    np.testing.assert_array_equal(results[True].finish_s, results[False].finish_s)
    assert len(results[True].steps) == len(results[False].steps)


def test_a_traces_acceptance_column_sets_each_requests_rate(tmp_path):
    """A trace's `acceptance` column feeds `SpecConfig.per_request`: a request at 1.0
    keeps every draft, one at 0.0 none, one without the column draws at the run's rate."""
    import json

    from tests.cli_runner import run_module
    trace = tmp_path / "trace.jsonl"
    rates = [1.0, 0.0, None, 1.0, 0.0, None]
    trace.write_text("".join(
        json.dumps({"arrival_s": 0.1 * i, "prompt_len": 32, "output_len": 24,
                    **({} if rate is None else {"acceptance": rate})}) + "\n"
        for i, rate in enumerate(rates)))
    out = tmp_path / "out"
    run_module("experiments.run", "--engine=sim", "--workload=trace", f"--trace={trace}",
               "--spec_k=3", "--spec_acceptance=0.5", f"--out_dir={out}")
    rows = {r["id"]: r for r in map(json.loads,
                                    (out / "requests.jsonl").read_text().splitlines())}
    for i, rate in enumerate(rates):
        drafted, accepted = rows[i]["drafted_tokens"], rows[i]["accepted_tokens"]
        assert drafted > 0, i
        if rate == 1.0:
            assert accepted == drafted, i
        elif rate == 0.0:
            assert accepted == 0, i
        else:  # the run's 0.5: some kept, some not
            assert 0 < accepted < drafted, i


def test_an_acceptance_outside_0_1_is_one_line_naming_file_and_line(tmp_path):
    from tests.cli_runner import run_module
    trace = tmp_path / "trace.csv"
    trace.write_text("arrival_s,prompt_len,output_len,acceptance\n0,8,4,0.5\n0.1,8,4,1.5\n")
    result = run_module("experiments.run", "--engine=sim", "--workload=trace",
                        f"--trace={trace}", "--spec_k=2", f"--out_dir={tmp_path / 'out'}",
                        check=False)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "trace.csv:3" in lines[0] and "'acceptance'" in lines[0], lines
    assert "[0, 1]" in lines[0]
    assert not (tmp_path / "out").exists()
