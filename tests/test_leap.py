"""Leaping over steady decode steps changes no result (`orca_jax.core.loop.leap`).

Every built-in policy that promises a steady plan (`Policy.stable_steps`) runs each
workload twice, leaping and step by step, and every request's timestamps, token
counts and preemptions, every step's row (but its measured host time), the token log
and the summary must be the same bit for bit; the leaps must have happened, through
finishes and after prefills too where the policy widens its promise
(`Policy.stable_through_finishes`, `stable_after_prefills`). The
pieces a leap stands on (pricing k steps at once, counting k steps' tokens, taking k
steps' pages) are checked against their one-step versions.
"""

import dataclasses
import math
from typing import ClassVar, Optional

import numpy as np
import pytest

import policies  # noqa: F401  (registers the built-in policies)
from orca_jax.core.api.policy import Policy, make_policy, registered_policies
from orca_jax.core.kv.pool import PagedPool
from orca_jax.core.loop.leap import leap_counts, promise_covers_schedule
from orca_jax.core.loop.scheduler import Scheduler
from orca_jax.core.requests.request import Request
from orca_jax.core.requests.run_result import RunResult
from orca_jax.core.requests.token_stats import TokenTally
from orca_jax.core.step.engine_api import Bucket
from orca_jax.results.summary import summarize_run
from orca_jax.runner.build import build_engine, build_workload, scheduler_config
from orca_jax.runner.spec import LimitsSpec, RunSpec, SimEngineSpec, WorkloadSpec
from orca_jax.sim.cost_model import (
    CostModelConfig,
    LinearStepTime,
    bucket_step_seconds,
    decode_span_seconds,
)
from orca_jax.sim.roofline import SHORT_SPAN
from policies._common import STEADY
from policies.vllm import VLLM

# The built-in policies that promise a steady plan (the others are asked every step).
STEADY_POLICIES = sorted(
    name for name, cls in registered_policies().items()
    if cls.__module__.startswith("policies.") and cls.stable_steps is not Policy.stable_steps)
SETTINGS = {
    "plain": RunSpec(workload=WorkloadSpec(num_requests=80, rate=8)),
    # 160 pages of 16 tokens: the on-demand policies preempt, the reserving ones queue.
    "kv_tight": RunSpec(workload=WorkloadSpec(num_requests=80, rate=20),
                        limits=LimitsSpec(num_kv_pages=160, max_model_len=1024)),
    # An overloaded queue: the batch cap is full, arrivals queue behind it.
    "queued": RunSpec(workload=WorkloadSpec(num_requests=120, rate=40),
                      limits=LimitsSpec(max_num_seqs=8)),
    "shared_prefix": RunSpec(
        workload=WorkloadSpec(arrival="shared_prefix", num_requests=80, rate=10,
                              prefix_len="fixed:256"),
        limits=LimitsSpec(num_kv_pages=600, log_step_requests=True)),
}
RESULT_ARRAYS = ("state", "first_scheduled_s", "first_token_s", "last_token_s", "finish_s",
                 "num_generated", "num_preemptions", "num_cached_tokens")


def run(spec: RunSpec, policy: str, *, leap: bool, seed: int, log_tokens: bool = False,
        options: Optional[dict] = None, ranked: bool = False):
    """The finished run and its scheduler, with leaping on or off (`ranked`: the
    requests get random priorities and, one in three, a completion deadline)."""
    spec = dataclasses.replace(spec, seed=seed,
                               engine=dataclasses.replace(spec.engine, leap=leap))
    config = scheduler_config(spec)
    requests = build_workload(spec)
    if ranked:
        rng = np.random.default_rng(seed)
        requests = [dataclasses.replace(
            r, priority=int(rng.integers(0, 4)),
            deadline_s=(r.arrival_s + float(rng.uniform(0.5, 8.0)) if rng.random() < 1 / 3
                        else None)) for r in requests]
    scheduler = Scheduler(requests, make_policy(policy, options), build_engine(spec, config),
                          config, log_tokens=log_tokens)
    return scheduler.run(), scheduler


def assert_same_run(leaped, stepped) -> None:
    """Every result of the two runs but measured host time, bit for bit."""
    for field in RESULT_ARRAYS:
        np.testing.assert_array_equal(getattr(leaped, field), getattr(stepped, field),
                                      err_msg=field)
    assert leaped.reject_reason == stepped.reject_reason
    assert leaped.virtual_end_s == stepped.virtual_end_s
    assert leaped.num_steps == stepped.num_steps
    for field in ("step", "start_s", "num_seqs", "num_tokens", "num_padded_tokens", "bucket",
                  "step_s", "num_running", "num_waiting", "num_free_pages",
                  "num_cached_tokens"):
        np.testing.assert_array_equal(leaped.step_array(field), stepped.step_array(field),
                                      err_msg=field)
    summaries = [{k: v for k, v in summarize_run(r)[0].items() if "host" not in k}
                 for r in (leaped, stepped)]
    assert summaries[0] == summaries[1]


@pytest.mark.parametrize("setting", sorted(SETTINGS))
@pytest.mark.parametrize("policy", STEADY_POLICIES)
def test_a_leaping_run_is_the_step_by_step_run(policy, setting):
    # One random workload per case (each policy in each setting); the seeds alternate
    # over the cases, so the module still runs both workloads of every setting.
    seed = 1 + (STEADY_POLICIES.index(policy) % 2)
    leaped, scheduler = run(SETTINGS[setting], policy, leap=True, seed=seed)
    stepped, plain = run(SETTINGS[setting], policy, leap=False, seed=seed)
    assert plain.executor.leaper is None
    assert_same_run(leaped, stepped)
    leaper = scheduler.executor.leaper
    # else this compares two step-by-step runs
    assert leaper.num_leaped_steps > 0
    # Each widening of the promise was used (KV-tight or queued, who waits may fit once
    # one finishes, and the leaper lets chances go after the policy refuses some).
    cls = registered_policies()[policy]
    if setting == "plain":
        assert (leaper.num_leaps_after_finishes > 0) == cls.stable_through_finishes
        assert (leaper.num_leaps_after_prefills > 0) == cls.stable_after_prefills
    if setting == "queued":  # arrivals queue behind a full batch: leaps run past them
        assert (leaper.num_leaps_past_arrivals > 0) == promise_covers_schedule(
            cls, "arrivals_wait")
    elif not promise_covers_schedule(cls, "arrivals_wait"):
        assert leaper.num_leaps_past_arrivals == 0


# edf_fast: a token costs less than a step, so a running request turns late as it runs.
RANKED = {"priority": {}, "edf": {}, "edf_ignore": {"infeasible": "ignore"},
          "edf_slo": {"ttft_slo_s": "1.5"}, "edf_fast": {"time_per_token_s": "0.001"}}


RANKED_SETTINGS = ["plain", "kv_tight", "queued"]


@pytest.mark.parametrize("setting", RANKED_SETTINGS)
@pytest.mark.parametrize("case", sorted(RANKED))
def test_ranked_policies_leap_exactly_with_priorities_and_deadlines(case, setting):
    policy = case.split("_")[0]
    seed = 1 + (RANKED_SETTINGS.index(setting) % 2)  # alternating, as above
    leaped, scheduler = run(SETTINGS[setting], policy, leap=True, seed=seed,
                            options=RANKED[case], ranked=True)
    stepped, _ = run(SETTINGS[setting], policy, leap=False, seed=seed,
                     options=RANKED[case], ranked=True)
    assert_same_run(leaped, stepped)
    assert scheduler.executor.leaper.num_leaped_steps > 0
    if setting == "plain":  # KV-tight or queued, who waits may fit once one finishes
        assert scheduler.executor.leaper.num_leaps_after_finishes > 0


# Agent programs (docs/programs.md): a finish releases the program's next call after a
# tool pause and, under continuum, pins the call's pages; both are events a leap that
# goes on after the finish must see as `schedule()` would.
PROGRAMS = RunSpec(workload=WorkloadSpec(arrival="programs", num_requests=80, rate=2),
                   limits=LimitsSpec(num_kv_pages=400, max_model_len=4096))


@pytest.mark.parametrize("policy", ["continuum", "vllm"])
def test_agent_programs_leap_through_finishes_exactly(policy):
    leaped, scheduler = run(PROGRAMS, policy, leap=True, seed=1)
    stepped, _ = run(PROGRAMS, policy, leap=False, seed=1)
    assert_same_run(leaped, stepped)
    assert scheduler.executor.leaper.num_leaps_after_finishes > 0


# static pads every step of a batch to its shape (`min_bucket_tokens`), or not; fine
# buckets make the smaller batch after a finish pick a smaller one (above 13, doubling: the
# simulator refuses a ladder with a gap over 2x).
FINE = (1, 2, 3, 5, 8, 13, 26, 52, 104, 208, 416, 832, 1664, 2048)
BUCKETS = {"shape_held": ({}, None), "shape_free": ({"hold_batch_shape": "false"}, None),
           "fine_buckets": ({"hold_batch_shape": "false"}, FINE),
           "fine_buckets_held": ({}, FINE)}


@pytest.mark.parametrize("case", sorted(BUCKETS))
def test_a_leap_after_a_finish_pads_to_the_bucket_packing_would_pick(case):
    options, buckets = BUCKETS[case]
    spec = SETTINGS["plain"]
    spec = dataclasses.replace(spec, limits=dataclasses.replace(spec.limits,
                                                                 token_buckets=buckets))
    for policy in ("static", "vllm"):
        leaped, scheduler = run(spec, policy, leap=True, seed=4,
                                options=options if policy == "static" else None)
        stepped, _ = run(spec, policy, leap=False, seed=4,
                         options=options if policy == "static" else None)
        assert_same_run(leaped, stepped)  # "bucket" and "num_padded_tokens" of every step
        assert scheduler.executor.leaper.num_leaps_after_finishes > 0
    if buckets is not None:  # the buckets in use did change with the batch
        assert np.unique(leaped.step_array("bucket")).size > 3


def test_edf_promises_nothing_while_a_running_request_may_turn_late():
    spec = dataclasses.replace(SETTINGS["plain"], engine=SimEngineSpec(leap=False))
    config = scheduler_config(spec)
    requests = [Request(id=0, arrival_s=0.0, prompt_len=32, output_len=50, deadline_s=30.0),
                Request(id=1, arrival_s=0.0, prompt_len=32, output_len=50)]
    promised = {}
    for infeasible in ("deprioritize", "ignore"):
        policy = make_policy("edf", {"infeasible": infeasible})
        scheduler = Scheduler(requests, policy, build_engine(spec, config), config)
        for _ in range(3):  # the prefill, then decodes of both
            scheduler.step()
        promised[infeasible] = policy.stable_steps(scheduler.view)
    # Request 0's completion deadline has 47 tokens due: its lateness moves with the clock.
    assert promised == {"deprioritize": None, "ignore": STEADY}


def test_the_token_log_and_the_step_requests_are_the_same():
    spec = dataclasses.replace(SETTINGS["kv_tight"],
                               limits=dataclasses.replace(SETTINGS["kv_tight"].limits,
                                                          log_step_requests=True))
    leaped, scheduler = run(spec, "vllm", leap=True, seed=3, log_tokens=True)
    stepped, plain = run(spec, "vllm", leap=False, seed=3, log_tokens=True)
    assert scheduler.executor.leaper.num_leaped_steps > 100
    assert leaped.num_preemptions.sum() > 0  # KV-tight: leaps between preemptions
    assert scheduler.executor.leaper.num_leaps_after_finishes > 0
    assert scheduler.executor.leaper.num_leaps_after_prefills > 0
    assert_same_run(leaped, stepped)
    # The finished requests' pages went back in the same order: the same free stack.
    pools = [s.kv for s in (scheduler, plain)]
    np.testing.assert_array_equal(pools[0]._free, pools[1]._free)
    np.testing.assert_array_equal(leaped.token_req, stepped.token_req)
    np.testing.assert_array_equal(leaped.token_time_s, stepped.token_time_s)
    for a, b in zip(leaped.step_requests, stepped.step_requests):
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)


def test_the_policies_that_promise_a_steady_plan():
    # continuum is vllm's plan with pins; a pin's end is an event that stops a leap.
    assert STEADY_POLICIES == ["continuum", "edf", "lpm", "orca", "priority", "sarathi", "sjf",
                               "srpt", "static", "vllm", "vllm-priority"]


@dataclasses.dataclass(kw_only=True)
class SilentVLLM(VLLM):
    """vLLM's plan, but no promise: a plugin that declares nothing."""

    def stable_steps(self, view):
        return Policy.stable_steps(self, view)


def run_leaping_beside_vllm(setting: str, policy: Policy) -> tuple[Scheduler, RunResult]:
    """`policy` run with leaping on `SETTINGS[setting]`, checked against vLLM's run step by
    step (every policy here plans as vLLM does); its scheduler (for the leaper's counts)
    and result."""
    spec = dataclasses.replace(SETTINGS[setting], engine=SimEngineSpec(leap=True))
    config = scheduler_config(spec)
    scheduler = Scheduler(build_workload(spec), policy, build_engine(spec, config), config)
    result = scheduler.run()
    stepped, _ = run(SETTINGS[setting], "vllm", leap=False, seed=spec.seed)
    assert_same_run(result, stepped)
    return scheduler, result


def test_a_policy_that_promises_nothing_is_never_leaped_over():
    scheduler, _ = run_leaping_beside_vllm("plain", SilentVLLM())
    assert scheduler.executor.leaper.num_leaped_steps == 0


class PromiseOnly(Policy):
    """A plugin written from scratch that promises a steady plan (vLLM's) and declares
    nothing more: it leaps between events as before, never through one."""

    name = "vllm"  # the summary names the policy: the same as vLLM's run
    prefix_caching = True  # as vLLM's default

    def __init__(self) -> None:
        self._vllm = VLLM()

    def schedule(self, view):
        return self._vllm.schedule(view)

    def stable_steps(self, view):
        return self._vllm.stable_steps(view)


def test_a_promise_without_widenings_stops_at_every_finish_and_prefill():
    scheduler, _ = run_leaping_beside_vllm("kv_tight", PromiseOnly())
    leaper = scheduler.executor.leaper
    assert leaper.num_leaped_steps > 0
    assert leaper.num_leaps_after_finishes == leaper.num_leaps_after_prefills == 0


@dataclasses.dataclass(kw_only=True)
class CountingVLLM(VLLM):
    """Overrides vLLM's `schedule` only (as a plugin that changes a built-in's plans
    would): vLLM's promise is not about these plans, so every step asks it."""

    num_calls: int = 0

    def schedule(self, view):
        self.num_calls += 1
        return super().schedule(view)


@dataclasses.dataclass(kw_only=True)
class CountingPromisingVLLM(CountingVLLM):
    """The same, promising again what vLLM promises: it is leaped over."""

    def stable_steps(self, view):
        return super().stable_steps(view)


@dataclasses.dataclass(kw_only=True)
class CountingWideningVLLM(CountingPromisingVLLM):
    """The same, widening its promise again as vLLM does: it leaps through finishes."""

    stable_through_finishes: ClassVar[bool] = True
    stable_after_prefills: ClassVar[bool] = True


def test_which_class_a_promise_covers():
    assert promise_covers_schedule(VLLM, "stable_through_finishes")
    assert promise_covers_schedule(VLLM, "stable_after_prefills")
    # Overriding `schedule`, or `stable_steps` with a promise of its own, drops the
    # widenings set above it; setting them again restores them.
    for cls in (CountingVLLM, CountingPromisingVLLM, SilentVLLM):
        assert not promise_covers_schedule(cls, "stable_through_finishes")
    assert promise_covers_schedule(CountingWideningVLLM, "stable_through_finishes")
    assert not promise_covers_schedule(CountingVLLM)
    assert promise_covers_schedule(CountingPromisingVLLM)
    assert not promise_covers_schedule(registered_policies()["priority"],
                                       "stable_after_prefills")  # not set: False


@pytest.mark.parametrize("cls, leaps", [(CountingVLLM, False), (CountingPromisingVLLM, True),
                                        (CountingWideningVLLM, True)])
def test_a_subclass_that_overrides_schedule_does_not_inherit_the_promise(cls, leaps):
    policy = cls()
    scheduler, result = run_leaping_beside_vllm("plain", policy)
    leaped = scheduler.executor.leaper.num_leaped_steps
    assert (leaped > 0) == leaps
    # Every step not leaped over asked the policy (the idle ones ask nothing).
    assert policy.num_calls <= result.num_steps - leaped
    if not leaps:
        assert policy.num_calls > 0.9 * result.num_steps
    # vLLM's widenings of its promise hold only where set again with `schedule`.
    leaper = scheduler.executor.leaper
    widens = cls is CountingWideningVLLM
    assert (leaper.num_leaps_after_finishes > 0) == widens
    assert (leaper.num_leaps_after_prefills > 0) == widens


def test_srpt_with_a_starvation_clock_is_asked_every_step():
    policy = make_policy("srpt", {"starvation_s": "5"})
    spec = SETTINGS["plain"]
    config = scheduler_config(spec)
    scheduler = Scheduler(build_workload(spec), policy, build_engine(spec, config), config)
    scheduler.run()
    assert scheduler.executor.leaper is None or scheduler.executor.leaper.num_leaped_steps == 0


COST_MODELS = {
    "per_op": CostModelConfig(),
    "per_op_ragged": CostModelConfig(step_padding="ragged"),
    "per_op_tp2": CostModelConfig(tp=2),
    "roofline_max": CostModelConfig(mode="roofline_max"),
    "fixed": CostModelConfig(mode="fixed", step_time_s=0.0123),
    "fitted_linear": CostModelConfig(mode="fitted", fitted_step_s={
        256: LinearStepTime(base_s=1e-3, per_seq_s=2e-6, per_tile_s=3e-7, q_tile=16,
                            kv_tile=64)}),
}


@pytest.mark.parametrize("name", sorted(COST_MODELS))
def test_a_span_is_priced_as_its_steps_one_by_one(name):
    config = COST_MODELS[name]
    rng = np.random.default_rng(7)
    bucket = Bucket(num_tokens=256, num_seqs=256)
    for _ in range(20):
        n = int(rng.integers(1, 257))
        kv_lens = rng.integers(1, 6000, n)  # short ones too: L2-sized attention reads
        # Both ways a span is priced: in Python floats up to SHORT_SPAN steps, in arrays past.
        steps = int(rng.integers(1, 200 if _ % 2 else SHORT_SPAN + 1))
        span = decode_span_seconds(config, bucket, kv_lens, steps)
        ones = np.ones(n, np.int64)
        one_by_one = [bucket_step_seconds(config, bucket, lambda j=j: (ones, kv_lens + j))
                      for j in range(steps)]
        assert span.tolist() == one_by_one  # bit for bit, not approximately


def test_a_tally_of_a_span_is_the_tally_of_its_steps():
    times = np.cumsum(np.random.default_rng(0).random(50))
    spans, single = TokenTally(6), TokenTally(6)
    for tally in (spans, single):
        tally.add(np.array([0, 1, 2]), 0.0)
    spans.add_span(np.array([1, 2, 4]), times[:20])
    spans.add_span(np.array([0, 5]), times[20:])
    for t in times[:20]:
        single.add(np.array([1, 2, 4]), float(t))
    for t in times[20:]:
        single.add(np.array([0, 5]), float(t))
    finished = np.ones(6, bool)
    a, b = spans.stats(finished), single.stats(finished)
    for field in ("num_tokens", "last_token_s", "max_gap_s", "gap_values", "gap_counts"):
        np.testing.assert_array_equal(getattr(a, field), getattr(b, field))


@pytest.mark.parametrize("num_steps", [12, 4])  # several grants a request; one at most
def test_pages_of_a_span_are_the_pages_of_its_steps(num_steps):
    pools = [PagedPool(num_kv_pages=64, page_size=4, max_pages_per_seq=16, num_requests=5)
             for _ in range(2)]
    ids = np.array([3, 0, 4])
    computed = np.array([4, 7, 1])
    for pool in pools:
        pool.allocate(ids, computed)
    steps = np.arange(num_steps + 1)[:, None]
    need = np.diff(pools[0].pages_needed(ids, computed + steps), axis=0)  # [k, 3]
    assert (need.sum(axis=0).max() > 1) == (num_steps > 4)  # each path is taken
    pools[0].allocate_steps(ids, need)
    for j in range(1, num_steps + 1):
        pools[1].allocate(ids, computed + j)
    np.testing.assert_array_equal(pools[0].page_table, pools[1].page_table)
    np.testing.assert_array_equal(pools[0].num_held, pools[1].num_held)
    assert pools[0].num_free == pools[1].num_free
    assert math.isclose(pools[0].num_free, 64 - int(pools[0].num_held.sum()))


def test_one_page_each_in_step_order_are_the_pages_of_a_short_span():
    pools = [PagedPool(num_kv_pages=64, page_size=4, max_pages_per_seq=16, num_requests=6)
             for _ in range(2)]
    ids = np.array([5, 1, 3, 0])
    computed = np.array([4, 3, 6, 1])  # room left in their pages: 0, 1, 2, 3 tokens
    for pool in pools:
        pool.allocate(ids, computed)
    # Three steps: 5 takes its page in the first, 1 in the second, 3 in the third.
    pools[0].allocate_next_pages(np.array([5, 1, 3]))
    for j in range(1, 4):
        pools[1].allocate(ids, computed + j)
    np.testing.assert_array_equal(pools[0].page_table, pools[1].page_table)
    np.testing.assert_array_equal(pools[0].num_held, pools[1].num_held)
    assert pools[0].num_free == pools[1].num_free == 64 - 8
    with pytest.raises(RuntimeError, match="overcommitted"):
        PagedPool(num_kv_pages=1, page_size=4, max_pages_per_seq=4,
                  num_requests=2).allocate_next_pages(np.array([0, 1]))


@dataclasses.dataclass(kw_only=True)
class AnswerCountingVLLM(VLLM):
    """vLLM, counting its `stable_steps` answers (widening its promise again, as vLLM)."""

    stable_through_finishes: ClassVar[bool] = True
    stable_after_prefills: ClassVar[bool] = True
    num_asked: int = 0
    num_refused: int = 0

    def stable_steps(self, view):
        answer = super().stable_steps(view)
        self.num_asked += 1
        self.num_refused += answer is None
        return answer


def test_the_leaper_counts_the_chances_refused_and_let_go():
    # Queued behind the batch cap: after a finish someone waiting fits, so vLLM refuses
    # such chances and the back-off lets the next ones go without asking.
    policy = AnswerCountingVLLM()
    scheduler, _ = run_leaping_beside_vllm("queued", policy)
    leaper = scheduler.executor.leaper
    assert leaper.num_refusals == policy.num_refused > 0
    assert leaper.num_let_go > 0
    # Each leap was promised once (a promise the pool or the next arrival cut to no
    # step starts none).
    assert 0 < leaper.num_leaps <= policy.num_asked - policy.num_refused
    line = leap_counts([leaper], scheduler.num_steps)
    assert line.startswith(f"leaped over {leaper.num_leaped_steps} of {scheduler.num_steps} "
                           f"steps in {leaper.num_leaps} leaps")
    assert line.endswith(f"chances refused {policy.num_refused}, let go {leaper.num_let_go}), "
                         f"{leaper.num_leaps_past_arrivals} of them past arrivals")


class QueueView:
    """What vLLM's `arrivals_wait` reads of a view: the queue, the batch and the limits."""

    def __init__(self, running: int, waiting: int, max_num_seqs: int, max_num_tokens: int):
        self.running = np.arange(running, dtype=np.int64)
        self.waiting = np.arange(running, running + waiting, dtype=np.int64)
        self.max_num_seqs, self.max_num_tokens = max_num_seqs, max_num_tokens


@pytest.mark.parametrize("priority, running, waiting, max_num_tokens, expected", [
    (False, 8, 0, 4096, True),  # every seat taken: an arrival waits
    (False, 3, 0, 4096, False),  # a seat free, nobody waits: an arrival gets in
    (False, 3, 2, 4096, True),  # first come first served: it waits behind the head
    (True, 3, 2, 4096, False),  # by priority it may go to the head, and fit
    (True, 8, 2, 4096, True),
    (True, 3, 0, 3, True),  # the running pass takes the whole budget
])
def test_vllm_says_when_an_arrival_waits(priority, running, waiting, max_num_tokens, expected):
    policy = VLLM(priority=priority, max_num_seqs=8, max_num_tokens=4096)
    assert policy.arrivals_wait(QueueView(running, waiting, 256, max_num_tokens)) is expected


def test_arrivals_cross_leaps_only_where_promised():
    # A decode-heavy load behind a full batch: an arrival comes every ~35 steps and a
    # finish every ~50, the queue a dozen long. vLLM's leaps run past the arrivals; a
    # plugin that promises
    # vLLM's steady plan but says nothing of arrivals (PromiseOnly), or a subclass that
    # replaces vLLM's schedule (CountingPromisingVLLM), ends each leap at an arrival; all
    # give the step-by-step run.
    assert promise_covers_schedule(VLLM, "arrivals_wait")
    assert not promise_covers_schedule(PromiseOnly, "arrivals_wait")
    assert not promise_covers_schedule(CountingPromisingVLLM, "arrivals_wait")
    spec = RunSpec(workload=WorkloadSpec(num_requests=40, rate=2.5, output_len="fixed:300"),
                   limits=LimitsSpec(max_num_seqs=6))
    SETTINGS["decode_heavy"] = spec
    try:
        crossing, _ = run_leaping_beside_vllm("decode_heavy", VLLM())
        stopping, _ = run_leaping_beside_vllm("decode_heavy", PromiseOnly())
    finally:
        del SETTINGS["decode_heavy"]
    crossed, stopped = crossing.executor.leaper, stopping.executor.leaper
    assert crossed.num_leaps_past_arrivals > 5
    assert stopped.num_leaps_past_arrivals == 0
    assert crossed.num_leaped_steps > stopped.num_leaped_steps
    assert crossed.num_leaps < stopped.num_leaps
