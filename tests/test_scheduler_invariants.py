"""DESIGN.md's invariants, held by every built-in policy and both example plugins on random
workloads (SimEngine).

Every admitted request finishes exactly once with exactly its output length (or
is rejected up front with a reason); after every step the token budget, the
batch cap and the KV pool were respected; the view cannot be written through;
finished requests leave at once; reruns with the same seed are bit-identical;
and a preempting policy loses nothing and recomputes what it dropped.
"""

import dataclasses
import functools
import json
import os
import re
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import policies
from orca_jax import (
    KVConfig,
    Request,
    RequestState,
    Scheduler,
    SchedulerConfig,
    SchedulerView,
    StepLimits,
    StepPlan,
    plan_in_order,
)
from orca_jax.core.api.policy import Policy, make_policy
from orca_jax.runner.experiment import run_policy
from orca_jax.runner.spec import LimitsSpec, RunSpec, SimEngineSpec, WorkloadSpec
from orca_jax.sim.cost_model import CostModelConfig
from orca_jax.sim.engine import SimEngine
from orca_jax.workloads.synthetic import synthetic_workload

STEP_S = 0.01
MAX_STEPS = 20_000  # far above any run here; a stuck scheduler fails instead of hanging

# Every policy shipped in policies/ (plugins and test policies registered elsewhere are not).
BUILTIN_POLICIES = sorted(name for name, cls in policies.registered_policies().items()
                          if cls.__module__.startswith("policies."))
# The plugins of examples/, which the docs show users: held to the same invariants (the
# least-attained-service example once deadlocked under a batch cap of 1, issue 25).
EXAMPLE_PLUGINS = ["examples/least_attained_service.py:LeastAttainedService",
                   "examples/preemptive_las.py:PreemptiveLAS",
                   "examples/slo_admission.py:SLOAdmission"]
POLICIES = BUILTIN_POLICIES + EXAMPLE_PLUGINS
REPO = Path(__file__).resolve().parents[1]


@functools.lru_cache(maxsize=None)
def _ranker_dir() -> str:
    """A small learned ranker for `ltr`, trained once per test session."""
    from orca_jax.learned.ranker import RankerConfig, synthetic_ranking_workload, train_ranker
    directory = os.path.join(tempfile.mkdtemp(prefix="orca_jax_ltr_"), "ranker")
    train_ranker(synthetic_ranking_workload(200, seed=0), RankerConfig(num_steps=30)).save(
        directory)
    return directory


def policy_options(name: str) -> dict[str, str]:
    """What a built-in policy needs beyond its defaults (ltr: a trained ranker)."""
    return {"ranker_dir": _ranker_dir()} if name == "ltr" else {}


def policy_spec(name: str) -> str:
    """What `make_policy` loads for `name`: a registered name, or an example's path here."""
    return str(REPO / name) if name in EXAMPLE_PLUGINS else name


def make_builtin(name: str) -> Policy:
    return make_policy(policy_spec(name), policy_options(name))


def sim_engine() -> SimEngine:
    return SimEngine(CostModelConfig(mode="fixed", step_time_s=STEP_S))


def check_step(scheduler: Scheduler, steps_before: int) -> None:
    """Asserts the per-step invariants after one `scheduler.step()`."""
    config, table, kv = scheduler.config, scheduler.table, scheduler.kv
    for entry in scheduler.record.steps[steps_before:]:
        assert 1 <= entry.num_seqs <= config.limits.max_num_seqs, entry
        assert 1 <= entry.num_tokens <= config.limits.max_num_tokens, entry
        assert entry.num_seqs <= entry.num_tokens, entry
        sizes = scheduler.bucket_config.token_sizes
        smallest = min(t for t in sizes if t >= entry.num_tokens)
        assert entry.bucket == entry.num_padded_tokens == smallest, entry
        assert entry.num_free_pages >= 0
    kv.check_consistency()  # with prefix caching: reference counts too
    assert 0 <= kv.num_free <= config.kv.num_kv_pages
    if scheduler.prefix_caching:  # a shared page counts once
        assert kv.num_free == config.kv.num_kv_pages - int(np.count_nonzero(kv.ref_count))
    else:
        assert kv.num_free == config.kv.num_kv_pages - int(kv.num_held.sum())
    running, waiting = scheduler.running, scheduler.waiting
    # Python sets, not np.intersect1d/np.isin: a few ids a step, every step of every run,
    # where numpy's sorting set operations were a quarter of this check's time.
    running_ids = set(running.tolist())
    assert running_ids.isdisjoint(waiting.tolist())
    assert len(running_ids) == running.size
    assert (table.state[running] == RequestState.RUNNING).all()
    assert (table.state[waiting] == RequestState.WAITING).all()
    # Finished requests left the running set and the KV pool in the step they finished,
    # but the program calls whose pages are pinned for their program (`continuum`).
    finished = np.flatnonzero(table.state == RequestState.FINISHED)
    assert (table.num_generated[finished] == table.output_len[finished]).all()
    pinned = np.zeros(len(table), dtype=bool)
    if table.programs is not None:
        pinned[list(table.programs.pins)] = True
    assert (kv.num_held[~pinned & (table.state == RequestState.FINISHED)] == 0).all()
    not_running = (table.state != RequestState.RUNNING) & ~pinned
    assert (kv.num_held[not_running] == 0).all()
    assert (table.state[pinned] == RequestState.FINISHED).all()
    assert (table.num_generated[~(table.state == RequestState.FINISHED)]
            < table.output_len[~(table.state == RequestState.FINISHED)]).all()
    assert set(scheduler.last_finished.tolist()) <= set(finished.tolist())
    # The pages a running request holds cover every token it has cached.
    assert (kv.num_held[running] * config.kv.page_size >= table.num_computed[running]).all()
    assert (table.num_computed <= table.prompt_len + table.num_generated).all()


def run_checked(scheduler: Scheduler) -> int:
    """Runs `scheduler` to the end step by step, checking the invariants; returns the steps."""
    scheduler.engine.warmup(scheduler.bucket_config.buckets())
    iterations = 0
    while not scheduler.done:
        before = len(scheduler.record.steps)
        scheduler.step()
        check_step(scheduler, before)
        iterations += 1
        assert iterations < MAX_STEPS, "the scheduler made no progress"
    return iterations


def check_outcome(scheduler: Scheduler) -> None:
    """Every request is finished exactly once with its output length, or rejected with a reason."""
    table = scheduler.table
    n = len(table)
    token_req, token_time = scheduler.record.token_log()
    counts = np.bincount(token_req, minlength=n)
    rejected = table.state == RequestState.REJECTED
    assert ((table.state == RequestState.FINISHED) | rejected).all()
    np.testing.assert_array_equal(counts[~rejected], table.output_len[~rejected])
    assert (counts[rejected] == 0).all()
    assert set(table.reject_reason) == set(np.flatnonzero(rejected).tolist())
    assert all(isinstance(r, str) and r for r in table.reject_reason.values())
    done = ~rejected
    assert not np.isnan(table.finish_s[done]).any()
    assert (table.first_token_s[done] >= table.arrival_s[done]).all()
    assert (table.finish_s[done] >= table.last_token_s[done]).all()
    assert np.isnan(table.finish_s[rejected]).all()
    assert np.isnan(table.first_scheduled_s[rejected]).all()
    # Tokens of one request come in time order, one per step at most.
    for request in np.flatnonzero(done)[:50].tolist():
        times = token_time[token_req == request]
        assert (np.diff(times) > 0).all()
    assert scheduler.running.size == 0 and scheduler.waiting.size == 0
    assert scheduler.kv.num_free == scheduler.config.kv.num_kv_pages


@st.composite
def workloads(draw):
    """A small random run: workload, limits and KV pool tight enough to bind."""
    page_size = draw(st.sampled_from([4, 8, 16]))
    max_model_len = draw(st.sampled_from([64, 96, 128]))
    pages_per_seq = -(-max_model_len // page_size)
    config = SchedulerConfig(limits=StepLimits(max_num_seqs=draw(st.integers(1, 6)),
                                               max_num_tokens=draw(
                                                   st.sampled_from([16, 24, 64, 128])),
                                               max_model_len=max_model_len),
                             kv=KVConfig(num_kv_pages=draw(
                                             st.integers(pages_per_seq, 3 * pages_per_seq)),
                                         page_size=page_size,
                                         watermark_pages=draw(st.sampled_from([0, 0, 1]))))
    arrival = draw(st.sampled_from(["burst", "poisson", "gamma"]))
    requests = synthetic_workload(
        num_requests=draw(st.integers(1, 24)), arrival=arrival,
        rate=None if arrival == "burst" else draw(st.sampled_from([5.0, 50.0, 500.0])),
        cv=3.0, prompt_len=draw(st.sampled_from(["uniform:1:80", "lognormal:30:1", "fixed:17"])),
        # Some prompt + output exceed the context: those must be rejected, not crash the run.
        output_len=draw(st.sampled_from(["uniform:1:60", "fixed:1", "zipf:1.5:70"])),
        seed=draw(st.integers(0, 2**16)))
    return requests, config


def build_policy(name: str) -> Policy:
    return PreemptNewest() if name == PreemptNewest.name else make_builtin(name)


@pytest.mark.parametrize("policy_name", POLICIES + ["test_preempt_newest"])
@settings(max_examples=12, deadline=None, derandomize=True)
@given(run=workloads())
def test_invariants_hold_on_random_workloads(policy_name, run):
    requests, config = run
    scheduler = Scheduler(requests, build_policy(policy_name), sim_engine(), config)
    run_checked(scheduler)
    check_outcome(scheduler)


@pytest.mark.parametrize("policy_name", POLICIES)
def test_impossible_requests_are_rejected_with_reasons(policy_name):
    requests = synthetic_workload(num_requests=12, arrival="burst", rate=None,
                                  prompt_len="uniform:1:120", output_len="uniform:1:40", seed=3)
    config = SchedulerConfig(limits=StepLimits(max_num_seqs=4, max_num_tokens=128,
                                               max_model_len=100),
                             kv=KVConfig(num_kv_pages=40, page_size=8))
    scheduler = Scheduler(requests, make_builtin(policy_name), sim_engine(), config)
    too_long = np.array([r.total_len > 100 for r in requests])
    assert too_long.any() and not too_long.all()  # the seed gives both kinds
    rejected = scheduler.table.state == RequestState.REJECTED
    np.testing.assert_array_equal(rejected, too_long)
    for i in np.flatnonzero(too_long).tolist():
        assert "context" in scheduler.table.reject_reason[i]
    run_checked(scheduler)
    check_outcome(scheduler)


@pytest.mark.parametrize("policy_name", POLICIES)
def test_prompts_longer_than_the_token_budget_are_chunked(policy_name):
    # The context (64) is larger than a step (16): a 39-token prompt must be computed in chunks.
    requests = [Request(id=0, arrival_s=0.0, prompt_len=39, output_len=3),
                Request(id=1, arrival_s=0.0, prompt_len=5, output_len=2)]
    config = SchedulerConfig(limits=StepLimits(max_num_seqs=4, max_num_tokens=16, max_model_len=64),
                             kv=KVConfig(num_kv_pages=32, page_size=4))
    scheduler = Scheduler(requests, make_builtin(policy_name), sim_engine(), config)
    run_checked(scheduler)
    check_outcome(scheduler)
    assert (scheduler.table.state == RequestState.FINISHED).all()
    # 39 + 5 prompt tokens and 3 decode steps of request 0: at least ceil(44 / 16) + 2 steps.
    assert len(scheduler.record.steps) >= 5


def test_a_result_is_a_read_only_copy_of_the_run_so_far():
    requests = [Request(id=10 + i, arrival_s=0.0, prompt_len=4, output_len=3) for i in range(3)]
    config = SchedulerConfig(limits=StepLimits(max_num_seqs=4, max_num_tokens=64, max_model_len=64),
                             kv=KVConfig(num_kv_pages=64, page_size=4))
    scheduler = Scheduler(requests, make_builtin("orca"), sim_engine(), config)
    scheduler.engine.warmup(scheduler.bucket_config.buckets())
    scheduler.step()
    early = scheduler.result()
    final = scheduler.run()
    # After one step every request has its first token; stepping on leaves that value alone.
    assert early.num_steps == 1 and early.num_generated.tolist() == [1, 1, 1]
    assert early.token_req.tolist() == [0, 1, 2] and early.token_time_s.tolist() == [STEP_S] * 3
    assert final.num_generated.tolist() == [3, 3, 3] and final.num_steps == 3
    assert final.request_ids == (10, 11, 12) and final.policy == "orca"
    assert final.virtual_end_s == pytest.approx(3 * STEP_S)
    with pytest.raises(ValueError, match="read-only"):
        final.finish_s[0] = 0.0


@pytest.mark.parametrize("policy_name", POLICIES)
def test_watermark_never_strands_a_request(policy_name):
    # Request 0 needs all 16 pages of the pool, but admissions must leave 1 free: it can never
    # be admitted under a reserving policy, so it must be rejected up front (or run, under an
    # on-demand one), never leave the run stuck.
    requests = [Request(id=0, arrival_s=0.0, prompt_len=40, output_len=24),
                Request(id=1, arrival_s=0.0, prompt_len=8, output_len=4)]
    config = SchedulerConfig(limits=StepLimits(max_num_seqs=4, max_num_tokens=64, max_model_len=64),
                             kv=KVConfig(num_kv_pages=16, page_size=4, watermark_pages=1))
    scheduler = Scheduler(requests, make_builtin(policy_name), sim_engine(), config)
    run_checked(scheduler)
    check_outcome(scheduler)
    if scheduler.kv_reservation == "max":
        # Reserving the whole 64-token context is 16 pages for request 1 too.
        assert scheduler.table.state[1] == RequestState.REJECTED
    else:
        assert scheduler.table.state[1] == RequestState.FINISHED


def test_view_arrays_are_read_only():
    requests = synthetic_workload(num_requests=6, arrival="burst", rate=None,
                                  prompt_len="fixed:8", output_len="fixed:4", seed=0)
    config = SchedulerConfig(limits=StepLimits(max_num_seqs=2, max_num_tokens=32, max_model_len=64),
                             kv=KVConfig(num_kv_pages=64, page_size=4))
    scheduler = Scheduler(requests, make_policy("orca"), sim_engine(), config)
    scheduler.step()  # some running, some waiting
    view = scheduler.view
    assert view.running.size and view.waiting.size
    for name in ("state", "num_computed", "num_generated", "prompt_len", "output_len",
                 "arrival_s", "finish_s", "num_preemptions"):
        with pytest.raises(ValueError):
            getattr(view.requests, name)[0] = 1
    # The queues are the scheduler's own state: writing through the view must fail too.
    for name in ("waiting", "running", "unreleased", "last_finished"):
        array = getattr(view, name)
        if array.size:
            try:
                array[0] = 5
            except ValueError:
                continue
            pytest.fail(f"view.{name} is writable: a policy can rewrite the scheduler's "
                        f"{name} array (now {getattr(scheduler, name)})")
    held = view.pages_held(view.running)
    held[:] = 99
    assert (scheduler.kv.num_held[view.running] != 99).all()


@pytest.mark.parametrize("policy_name", POLICIES)
def test_finished_requests_leave_running_in_their_step(policy_name):
    # Output lengths 1..6 in one burst: requests finish on different steps.
    requests = synthetic_workload(num_requests=6, arrival="burst", rate=None,
                                  prompt_len="fixed:4", output_len="uniform:1:6", seed=5)
    config = SchedulerConfig(limits=StepLimits(max_num_seqs=8, max_num_tokens=64, max_model_len=32),
                             kv=KVConfig(num_kv_pages=64, page_size=4))
    scheduler = Scheduler(requests, make_builtin(policy_name), sim_engine(), config)
    scheduler.engine.warmup(scheduler.bucket_config.buckets())
    table = scheduler.table
    while not scheduler.done:
        generated_before = table.num_generated.copy()
        steps_before = scheduler.num_steps
        scheduler.step()
        just_done = np.flatnonzero((table.num_generated == table.output_len)
                                   & (generated_before < table.output_len))
        if scheduler.num_steps > steps_before:  # an iteration that ran an engine step
            np.testing.assert_array_equal(np.sort(scheduler.last_finished), just_done)
        assert not np.isin(just_done, scheduler.running).any()
        assert (scheduler.kv.num_held[just_done] == 0).all()
        assert (table.state[just_done] == RequestState.FINISHED).all()
    check_outcome(scheduler)


_HOST_FIELDS = {"host_s", "host_us_per_step_median"}  # wall-clock, not virtual time


def _results(out: Path) -> dict:
    def rows(name):
        return [{k: v for k, v in json.loads(line).items() if k not in _HOST_FIELDS}
                for line in (out / name).read_text().splitlines()]

    summary = json.loads((out / "summary.json").read_text())
    return {"requests": rows("requests.jsonl"), "steps": rows("steps.jsonl"),
            "summary": {k: v for k, v in summary.items() if k not in _HOST_FIELDS},
            "config": json.loads((out / "config.json").read_text())}


@pytest.mark.parametrize("policy_name", POLICIES)
@pytest.mark.parametrize("step_time_ms", [None, 5.0])  # roofline and fixed clocks
def test_same_seed_reruns_are_bit_identical(policy_name, step_time_ms, tmp_path):
    spec = RunSpec(workload=WorkloadSpec(num_requests=40, rate=30.0, arrival="gamma", cv=2.0,
                                         prompt_len="lognormal:60:0.8",
                                         output_len="uniform:1:50"),
                   engine=SimEngineSpec(step_time_ms=step_time_ms),
                   limits=LimitsSpec(max_num_seqs=8, max_num_tokens=256, num_kv_pages=60,
                                     page_size=8, max_model_len=256), seed=11)
    options = policy_options(policy_name)
    first, _ = run_policy(spec, policy_spec(policy_name), options, out_dir=str(tmp_path / "a"),
                          progress=False)
    second, _ = run_policy(spec, policy_spec(policy_name), options,
                           out_dir=str(tmp_path / "b"), progress=False)
    a, b = _results(tmp_path / "a"), _results(tmp_path / "b")
    assert a == b
    assert a["summary"]["num_finished"] + a["summary"]["num_rejected"] == 40
    assert a["summary"]["num_finished"] > 0
    if step_time_ms is None:  # once per policy: it is about the workload's seed, not the clock
        # A different seed is a different run: the comparison above can fail.
        run_policy(dataclasses.replace(spec, seed=12), policy_spec(policy_name), options,
                   out_dir=str(tmp_path / "c"), progress=False)
        assert _results(tmp_path / "c")["requests"] != a["requests"]


@dataclasses.dataclass(kw_only=True)
class PreemptNewest(Policy):
    """FCFS with on-demand KV (vLLM): when pages run out, preempt the newest running request.

    Test-only (not registered). Keeps a log of what it did, for the assertions.
    """

    name = "test_preempt_newest"
    kv_reservation: str = "none"
    plans: list = dataclasses.field(default_factory=list)
    # (step, request, num_computed, num_generated) of every preemption it ordered.
    preemptions: list = dataclasses.field(default_factory=list)

    def schedule(self, view: SchedulerView) -> StepPlan:
        requests = view.requests
        queue = view.running.tolist()
        budget, free = view.max_num_tokens, view.num_free_pages
        ids, counts, preempt = [], [], []
        while queue and budget > 0 and len(ids) < view.max_num_seqs:
            request = queue.pop(0)
            count = min(int(requests.num_uncomputed([request])[0]), budget)
            need = int(view.pages_needed([request], [count])[0])
            while need > free and queue:
                victim = queue.pop()
                preempt.append(victim)
                free += int(view.pages_held([victim])[0])
            if need > free:
                preempt.append(request)
                free += int(view.pages_held([request])[0])
                continue
            ids.append(request)
            counts.append(count)
            budget, free = budget - count, free - need
        if not preempt:
            for request in view.waiting.tolist():
                count = min(int(requests.num_uncomputed([request])[0]), budget)
                need = int(view.pages_needed([request], [count])[0])
                if len(ids) >= view.max_num_seqs or count < 1 or need > view.kv_room(free):
                    break
                ids.append(request)
                counts.append(count)
                budget, free = budget - count, free - need
        for request in preempt:
            self.preemptions.append((view.step_index, request,
                                     int(requests.num_computed[request]),
                                     int(requests.num_generated[request])))
        plan = StepPlan(ids, counts, preempt=preempt)
        self.plans.append((view.step_index, plan))
        return plan


def _tokens_scheduled(plans, request: int) -> int:
    return sum(plan.as_dict().get(request, 0) for _, plan in plans)


def test_preemption_loses_nothing_and_recomputes():
    requests = synthetic_workload(num_requests=16, arrival="burst", rate=None,
                                  prompt_len="uniform:4:16", output_len="uniform:8:32", seed=2)
    config = SchedulerConfig(limits=StepLimits(max_num_seqs=8, max_num_tokens=64, max_model_len=48),
                             kv=KVConfig(num_kv_pages=12, page_size=4))
    policy = PreemptNewest()
    scheduler = Scheduler(requests, policy, sim_engine(), config)
    table = scheduler.table
    scheduler.engine.warmup(scheduler.bucket_config.buckets())
    recomputing: dict[int, list[int]] = {}  # request -> [generated when preempted, tokens since]
    num_recomputed = 0
    for _ in range(MAX_STEPS):
        if scheduler.done:
            break
        num_plans, num_preempted = len(policy.plans), len(policy.preemptions)
        steps_before = len(scheduler.record.steps)
        generated_before = table.num_generated.copy()
        scheduler.step()
        check_step(scheduler, steps_before)
        for _, request, _, generated in policy.preemptions[num_preempted:]:
            # Recompute preemption: back to waiting, progress reset, pages returned.
            assert table.state[request] == RequestState.WAITING
            assert table.num_computed[request] == 0
            assert scheduler.kv.num_held[request] == 0
            assert request in scheduler.waiting
            recomputing[request] = [generated, 0]
        for _, plan in policy.plans[num_plans:]:
            for request, count in plan.as_dict().items():
                if request in recomputing:
                    recomputing[request][1] += count
        for request in list(recomputing):
            if table.num_generated[request] > generated_before[request]:
                # Its next token came after recomputing its prompt and all it had generated.
                generated, recomputed = recomputing.pop(request)
                assert table.num_generated[request] == generated + 1
                assert recomputed == table.prompt_len[request] + generated
                num_recomputed += 1
    check_outcome(scheduler)

    assert len(policy.preemptions) >= 3  # the pool is small enough to force several
    assert num_recomputed >= 3
    assert scheduler.record.num_preemptions == len(policy.preemptions)
    np.testing.assert_array_equal(
        table.num_preemptions,
        np.bincount([r for _, r, _, _ in policy.preemptions], minlength=len(table)))
    # Over the whole run, each request computed its tokens once plus whatever it lost.
    for request in range(len(table)):
        lost = sum(c for _, r, c, _ in policy.preemptions if r == request)
        total = _tokens_scheduled(policy.plans, request)
        assert total == table.prompt_len[request] + table.output_len[request] - 1 + lost


# ------------------------------------------------------------------ prefix caching
@st.composite
def shared_prefix_workloads(draw):
    """Heavy sharing in a tiny pool: few distinct prefixes, many requests, evictions and
    preemptions forced."""
    page_size = draw(st.sampled_from([2, 4, 8]))
    max_model_len = 64
    pages_per_seq = -(-max_model_len // page_size)
    config = SchedulerConfig(limits=StepLimits(max_num_seqs=draw(st.integers(1, 6)),
                                               max_num_tokens=draw(st.sampled_from([16, 32, 64])),
                                               max_model_len=max_model_len),
                             kv=KVConfig(num_kv_pages=draw(
                                             st.integers(pages_per_seq, 2 * pages_per_seq)),
                                         page_size=page_size,
                                         watermark_pages=draw(st.sampled_from([0, 0, 1]))))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    prefixes = [rng.integers(1, 50, size=draw(st.integers(1, 40)), dtype=np.int32)
                for _ in range(draw(st.integers(1, 3)))]
    requests = []
    for i in range(draw(st.integers(2, 24))):
        prefix = prefixes[int(rng.integers(len(prefixes)))]
        suffix = rng.integers(1, 50, size=int(rng.integers(0, 12)), dtype=np.int32)
        prompt = np.concatenate([prefix, suffix])
        requests.append(Request(id=i, arrival_s=float(rng.exponential(0.02)) * i,
                                prompt_len=prompt.size, output_len=int(rng.integers(1, 24)),
                                prompt_tokens=prompt))
    return requests, config


@dataclasses.dataclass(kw_only=True)
class PreemptNewestCached(PreemptNewest):
    """PreemptNewest opted in to prefix caching: an admission's tokens start past its hit,
    and a victim frees only the pages nobody else holds."""

    name = "test_preempt_newest_cached"
    prefix_caching: bool = True

    def schedule(self, view: SchedulerView) -> StepPlan:
        requests = view.requests
        queue = view.running.tolist()
        budget, free = view.max_num_tokens, view.num_free_pages
        ids, counts, preempt = [], [], []
        while queue and budget > 0 and len(ids) < view.max_num_seqs:
            request = queue.pop(0)
            count = min(int(requests.num_uncomputed([request])[0]), budget)
            need = int(view.pages_needed([request], [count])[0])
            while need > free and queue:
                preempt.append(queue.pop())
                free = view.num_free_pages + view.pages_freed(preempt) - sum(
                    int(view.pages_needed([i], [c])[0]) for i, c in zip(ids, counts))
            if need > free:
                preempt.append(request)
                continue
            ids.append(request)
            counts.append(count)
            budget, free = budget - count, free - need
        if not preempt:
            for request in view.waiting.tolist():
                left = requests.num_uncomputed([request]) - view.cached_tokens([request])
                count = min(int(left[0]), budget)
                need = int(view.pages_needed([request], [count])[0])
                if len(ids) >= view.max_num_seqs or count < 1 or need > view.kv_room(free):
                    break
                ids.append(request)
                counts.append(count)
                budget, free = budget - count, free - need
        return StepPlan(ids, counts, preempt=preempt)


@dataclasses.dataclass(kw_only=True)
class RankedCached(Policy):
    """Shortest prompt first through the public `plan_in_order`, opted in to prefix caching
    (no built-in policy that uses the helper opts in, so a plugin's use of it is covered here).
    """

    name = "test_ranked_cached"
    prefix_caching: bool = True

    def schedule(self, view: SchedulerView) -> StepPlan:
        order = np.concatenate([view.running, view.waiting])
        order = order[np.argsort(view.requests.prompt_len[order], kind="stable")]
        return plan_in_order(view, order)


def check_cache_rejects_nothing_changed(scheduler: Scheduler) -> None:
    """A bad plan (one token too many for the first waiting request) changes nothing."""
    waiting = scheduler.waiting
    if waiting.size == 0 or not scheduler.prefix_caching:
        return
    kv, cache = scheduler.kv, scheduler.kv.cache
    before = (kv.ref_count.copy(), kv.num_free, cache.free_pages(), cache.version,
              scheduler.table.num_computed.copy())
    first = waiting[:1]
    too_many = (scheduler.table.num_uncomputed(first) - scheduler.view.cached_tokens(first) + 1)
    from orca_jax.core.plans.plan_checks import check_plan
    with pytest.raises(Exception, match=r"tokens_over_uncomputed.*give a request at most"):
        check_plan(scheduler, StepPlan(first, too_many))
    after = (kv.ref_count, kv.num_free, cache.free_pages(), cache.version,
             scheduler.table.num_computed)
    # np.array_equal, not np.testing.assert_array_equal: this runs before every step of
    # every cached run, and the testing helper's NaN and broadcast handling (these are
    # integer arrays and counts of the same shapes) was half of this check's time.
    for name, a, b in zip(("ref_count", "num_free", "free_pages", "version", "num_computed"),
                          before, after):
        assert np.array_equal(a, b), (name, a, b)


def run_checked_with_cache(scheduler: Scheduler) -> int:
    scheduler.engine.warmup(scheduler.bucket_config.buckets())
    iterations = 0
    while not scheduler.done:
        before = len(scheduler.record.steps)
        check_cache_rejects_nothing_changed(scheduler)
        scheduler.step()
        check_step(scheduler, before)
        iterations += 1
        assert iterations < MAX_STEPS, "the scheduler made no progress"
    return iterations


def build_cached(name: str, opted_in: bool = True) -> Policy:
    """A built-in policy (or PreemptNewestCached), opted out of prefix caching if asked."""
    test_policies = {PreemptNewestCached.name: PreemptNewestCached, RankedCached.name: RankedCached}
    policy = test_policies[name]() if name in test_policies else make_builtin(name)
    if not opted_in and policy.prefix_caching:
        if hasattr(policy, "enable_prefix_caching"):  # vllm's knob
            policy.enable_prefix_caching = False
        else:
            policy.prefix_caching = False
    return policy


@pytest.mark.parametrize("policy_name",
                         POLICIES + ["test_preempt_newest_cached", "test_ranked_cached"])
@settings(max_examples=8, deadline=None, derandomize=True)
@given(run=shared_prefix_workloads())
def test_invariants_hold_with_prefix_caching(policy_name, run):
    requests, config = run
    scheduler = Scheduler(requests, build_cached(policy_name), sim_engine(), config)
    iterations = run_checked_with_cache(scheduler)
    check_outcome(scheduler)
    off = Scheduler(requests, build_cached(policy_name), sim_engine(),
                    config.with_knobs(prefix_caching="off"))
    if scheduler.prefix_caching:
        assert (scheduler.kv.ref_count == 0).all()
        assert (scheduler.table.num_cached_tokens
                <= scheduler.table.prompt_len + scheduler.table.output_len - 1).all()
        # Caching off in the config or in the policy: the same run.
        opted_out = Scheduler(requests, build_cached(policy_name, opted_in=False),
                              sim_engine(), config)
        assert run_checked(off) == run_checked(opted_out)
        np.testing.assert_array_equal(off.record.token_log()[1],
                                      opted_out.record.token_log()[1])
    else:  # a policy that does not opt in runs as it always did
        assert run_checked(off) == iterations
        np.testing.assert_array_equal(off.record.token_log()[1],
                                      scheduler.record.token_log()[1])


def test_every_example_plugin_is_held_to_the_invariants():
    """A plugin added to examples/ joins EXAMPLE_PLUGINS (and so every test above)."""
    shipped = sorted(f"examples/{path.name}:{match}"
                     for path in (REPO / "examples").glob("*.py")
                     for match in re.findall(r"^class (\w+)\(Policy\)", path.read_text(),
                                             re.MULTILINE))
    assert shipped == sorted(EXAMPLE_PLUGINS)


@pytest.mark.parametrize("num_stages", [2, 4])
@pytest.mark.parametrize("policy_name", POLICIES + ["test_preempt_newest"])
@settings(max_examples=4, deadline=None, derandomize=True)
@given(run=workloads())
def test_invariants_hold_through_pipeline_stages(policy_name, num_stages, run):
    # Up to P micro-batches in flight, a request in one of them at most: every built-in
    # policy runs unchanged (it plans the runnable requests: SchedulerView.running) and
    # drains. Llama-3-8B's 32 layers over P stages, fixed 10 ms steps.
    requests, config = run
    engine = SimEngine(CostModelConfig(mode="fixed", step_time_s=STEP_S,
                                       pp_layers=(32 // num_stages,) * num_stages))
    scheduler = Scheduler(requests, build_policy(policy_name), engine, config)
    run_checked(scheduler)
    check_outcome(scheduler)
    stats = scheduler.result().pipeline
    assert stats is not None and stats["stages"] == num_stages
    for s in range(num_stages):  # a stage is busy or in a bubble while anything is in flight
        stage = stats[f"stage{s}"]
        assert stage["busy_s"] + stage["bubble_s"] == pytest.approx(stats["busy_s"])
