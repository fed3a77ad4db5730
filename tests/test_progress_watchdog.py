"""The progress watchdog: a run that stops getting anywhere fails with `no_progress`.

A livelock computes tokens every step and throws them away by preempting, so
the plan check's `no_progress` (a plan that runs nothing with nothing to come)
never fires. The watchdog counts iterations in which no request computed a
token past the most it ever had, finished, or was rejected; after
`SchedulerConfig.limits.no_progress_steps` of them the run fails, naming the policy,
the step and the virtual time.
"""

import dataclasses

import numpy as np
import pytest

from orca_jax import (
    KVConfig,
    PlanError,
    Policy,
    Request,
    Scheduler,
    SchedulerConfig,
    StepLimits,
    StepPlan,
)
from orca_jax.core.requests.request import RequestState
from orca_jax.runner.build import scheduler_config
from orca_jax.runner.experiment import run_policy
from orca_jax.runner.spec import LimitsSpec, RunSpec, SimEngineSpec, WorkloadSpec
from orca_jax.sim.cost_model import CostModelConfig
from orca_jax.sim.engine import SimEngine


@dataclasses.dataclass(kw_only=True)
class Livelock(Policy):
    """Admits one token of request 0, preempts it the next iteration, forever (test only)."""

    name = "test_livelock"

    def schedule(self, view) -> StepPlan:
        if view.running.size:
            return StepPlan(preempt=view.running)
        return StepPlan([0], [1])


@dataclasses.dataclass(kw_only=True)
class Crawl(Policy):
    """Like Livelock, but each admission computes one token more than the last: slow
    progress, which is no livelock (test only)."""

    name = "test_crawl"
    _tokens: int = dataclasses.field(default=0, init=False)

    def schedule(self, view) -> StepPlan:
        if view.running.size:
            return StepPlan(preempt=view.running)
        self._tokens += 1
        left = int(view.requests.num_uncomputed(np.array([0]))[0])
        return StepPlan([0], [min(self._tokens, left)])


def sim_engine() -> SimEngine:
    return SimEngine(CostModelConfig(mode="fixed", step_time_s=0.01))


REQUEST = [Request(id=0, arrival_s=0.0, prompt_len=8, output_len=2)]
CONFIG = SchedulerConfig(limits=StepLimits(max_num_seqs=2, max_num_tokens=16, max_model_len=16),
                         kv=KVConfig(num_kv_pages=8, page_size=4))


def run_until_error(scheduler: Scheduler, max_iterations: int) -> tuple[PlanError, int]:
    for iteration in range(max_iterations):
        try:
            scheduler.step()
        except PlanError as error:
            return error, iteration
    raise AssertionError(f"no PlanError in {max_iterations} iterations")


@pytest.mark.parametrize("limit", [5, 50])
def test_a_planted_livelock_fails_with_no_progress_at_the_limit(limit):
    scheduler = Scheduler(REQUEST, Livelock(), sim_engine(),
                          CONFIG.with_knobs(no_progress_steps=limit))
    error, iteration = run_until_error(scheduler, 10 * limit)
    assert (error.policy, error.rule) == ("test_livelock", "no_progress")
    # Iteration 0 computes the first token (progress); then each pair (preempt, readmit
    # one token) gains nothing, and the limit-th such iteration fails.
    assert iteration == limit
    steps = scheduler.num_steps
    assert f"step {steps}," in str(error) and f"{scheduler.now_s:.6f} s" in str(error)
    assert steps == 1 + limit // 2  # the runs of one token, not the preemptions
    assert scheduler.record.num_preemptions == (limit + 1) // 2


def test_the_default_limit_stops_a_livelock():
    scheduler = Scheduler(REQUEST, Livelock(), sim_engine(), CONFIG)
    error, iteration = run_until_error(scheduler, 20_000)
    assert error.rule == "no_progress" and iteration == 10_000
    assert "10000 iterations" in str(error)


def test_slow_progress_is_not_a_livelock():
    # Every readmission computes a token more than the request ever had: it finishes.
    scheduler = Scheduler(REQUEST, Crawl(), sim_engine(),
                          CONFIG.with_knobs(no_progress_steps=2))
    scheduler.run()
    assert scheduler.table.state[0] == RequestState.FINISHED
    assert scheduler.record.num_preemptions >= 7


def test_the_limit_is_a_run_spec_knob():
    spec = RunSpec(limits=LimitsSpec(num_kv_pages=64, max_model_len=128, no_progress_steps=7))
    assert scheduler_config(spec).limits.no_progress_steps == 7
    assert scheduler_config(RunSpec(limits=LimitsSpec(num_kv_pages=64, max_model_len=128))
                            ).limits.no_progress_steps == 10_000
    with pytest.raises(ValueError, match="no_progress_steps"):
        LimitsSpec(no_progress_steps=0)
    with pytest.raises(ValueError, match="no_progress_steps"):
        SchedulerConfig(limits=StepLimits(no_progress_steps=0))


def mlfq_issue_spec() -> RunSpec:
    """The issue's command: mlfq with a short starvation_s on a pool of two prompts."""
    return RunSpec(
        workload=WorkloadSpec(arrival="burst", num_requests=12, prompt_len="fixed:120",
                              output_len="fixed:4"),
        engine=SimEngineSpec(step_time_ms=10),
        limits=LimitsSpec(max_num_tokens=3, max_num_seqs=3, num_kv_pages=16, page_size=16,
                          max_model_len=128))


def test_the_mlfq_starvation_livelock_finishes():
    # Before the fix: 400,000 steps, 0 of 12 finished, 43,000 preemptions.
    options = {"num_queues": "2", "base_quantum": "0.5", "starvation_s": "0.1"}
    summary, result = run_policy(mlfq_issue_spec(), "mlfq", options, progress=False)
    assert (result.state == RequestState.FINISHED).all()
    np.testing.assert_array_equal(result.num_generated, 4)
    # 12 x 124 tokens at 3 a step, a little more for recompute: no thrash.
    assert result.num_steps <= 600
    assert result.total_preemptions <= 12
    _, without = run_policy(mlfq_issue_spec(), "mlfq",
                            {"num_queues": "2", "base_quantum": "0.5"}, progress=False)
    assert (without.state == RequestState.FINISHED).all()
    assert without.num_steps == 494  # the issue's figure without starvation_s


def test_a_leaps_counts_are_computeds_counts():
    """`gains` counts what `computed` would count as progress, reading nothing into the
    watchdog, and `all_computed`, where every request gains, leaves it as `computed`."""
    from orca_jax.core.loop.watchdog import ProgressWatchdog
    rng = np.random.default_rng(3)
    one_way, other = ProgressWatchdog(limit=5, num_requests=50), ProgressWatchdog(
        limit=5, num_requests=50)
    for _ in range(30):
        ids = rng.choice(50, size=int(rng.integers(1, 20)), replace=False)
        counts = rng.integers(0, 100, ids.size)
        gains = one_way.gains(ids, counts)
        assert gains == other.gains(ids, counts)
        assert gains == int(np.count_nonzero(counts > one_way._most_computed[ids]))
        if gains == ids.size:
            one_way.all_computed(ids, counts)
        else:
            one_way.computed(ids, counts)
        assert other.computed(ids, counts) == (gains > 0)
        np.testing.assert_array_equal(one_way._most_computed, other._most_computed)
