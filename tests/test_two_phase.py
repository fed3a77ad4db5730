"""Two-phase scheduling through the public API: `schedule()`, `update()` and the executor.

`schedule()` changes what it says (admissions, pages) and nothing else; `update()`
counts exactly the step it is given. An executor of depth 1, 2 and 3 gives the
same plans, steps and tokens, on an engine whose tokens are arithmetic a test can
predict (JetStream's mock engine): each sequence samples
`(its last input token * 31 + its context) % 997 + 1`, so a token fed from the
wrong step or row, or a placeholder left in place, shows. At depth 3 a request
that sampled in an older step in flight is busy: a policy that reads
`SchedulerView.busy` runs on, and a plan that schedules a busy request breaks the
rule `busy_request`.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Union

import numpy as np
import pytest

from orca_jax import (
    KVConfig,
    LoopFeatures,
    PlanError,
    Policy,
    Request,
    Scheduler,
    SchedulerConfig,
    StepLimits,
    StepPlan,
)
from orca_jax.core.api.policy import make_policy
from orca_jax.core.loop.executor import Executor
from orca_jax.core.loop.scheduled_step import IdleStep, ScheduledStep, StepResult
from orca_jax.core.requests.request import RequestState, sort_by_arrival
from orca_jax.core.step.engine_api import Engine, PendingStep, StepInputs, StepOutput
from orca_jax.sim.cost_model import CostModelConfig
from orca_jax.sim.engine import SimEngine
from orca_jax.workloads.synthetic import synthetic_workload

VOCAB = 997
IntOrArray = Union[int, np.ndarray]  # `next_token` takes ints or [S] arrays


def next_token(last_input: IntOrArray, context: IntOrArray) -> IntOrArray:
    """The arithmetic engine's sampled token after `last_input` at `context` tokens."""
    return (last_input * 31 + context) % VOCAB + 1


def predicted_tokens(request: Request) -> list[int]:
    """The arithmetic engine's answer to `request`, however it is scheduled."""
    token, answer = int(request.prompt_tokens[-1]), []
    for k in range(request.output_len):
        token = int(next_token(token, request.prompt_len + k))
        answer.append(token)
    return answer


class _Pending(PendingStep):
    def __init__(self, engine: "ArithmeticEngine", inputs: StepInputs, token_ids) -> None:
        self._engine, self._inputs, self._token_ids = engine, inputs, token_ids
        self._tokens: Optional[np.ndarray] = None
        self.read_back = False

    @property
    def step_s(self) -> float:
        return 1e-3 * (1 + self._inputs.num_real_tokens)  # priced from the descriptor

    def tokens(self) -> np.ndarray:
        """The step's sampled tokens "on the device" (computed once)."""
        if self._tokens is None:
            inputs = self._inputs
            last = inputs.cu_q_lens[1:] - 1  # [S] each sequence's last flat token
            tokens = next_token(self._token_ids[np.maximum(last, 0)].astype(np.int64),
                                inputs.kv_lens.astype(np.int64)).astype(np.int32)
            tokens[inputs.num_real_seqs:] = 0
            self._tokens = tokens
        return self._tokens

    def output(self) -> StepOutput:
        if not self.read_back:  # the host waits for the step: it leaves the device
            self.read_back = True
            self._engine.num_in_flight -= 1
        return StepOutput(sampled_tokens=self.tokens(), step_s=self.step_s)


class ArithmeticEngine(Engine):
    """Feeds the previous step's tokens on the "device"; counts the steps in flight."""

    name = "arithmetic"
    needs_token_ids = True

    def __init__(self, feeds: bool = True) -> None:
        self._feeds = feeds
        self._last: Optional[_Pending] = None
        self.num_in_flight = self.most_in_flight = self.num_fed = 0

    @property
    def feeds_tokens(self) -> bool:
        return self._feeds

    def _prepare(self, buckets) -> None:
        pass

    def step(self, inputs: StepInputs) -> StepOutput:
        return self.step_async(inputs).output()

    def step_async(self, inputs: StepInputs, token_source=None) -> PendingStep:
        token_ids = inputs.token_ids.copy()
        if token_source is not None:
            fed = token_source >= 0
            token_ids[fed] = self._last.tokens()[token_source[fed]]
            self.num_fed += int(fed.sum())
        self._last = _Pending(self, inputs, token_ids)
        self.num_in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.num_in_flight)
        return self._last


@dataclasses.dataclass(kw_only=True)
class TakeTurns(Policy):
    """At most `max_per_step` requests a step (as the token budget allows), those that ran
    longest ago first; never a busy one, except once at `schedule_busy_at` (test only)."""

    name = "test_take_turns"
    kv_reservation: str = "max"
    max_per_step: int = 2
    schedule_busy_at: Optional[int] = None
    busy_seen: list = dataclasses.field(default_factory=list)
    num_empty_plans: int = 0
    _last_run: dict = dataclasses.field(default_factory=dict)

    def schedule(self, view) -> StepPlan:
        self.busy_seen.append(view.busy.tolist())
        if view.step_index == self.schedule_busy_at and view.busy.size:
            return StepPlan(view.busy[:1], [1])
        candidates = np.concatenate([view.running, view.waiting])
        candidates = candidates[~np.isin(candidates, view.busy)]
        chosen, tokens = [], []
        for request in sorted(candidates.tolist(), key=lambda r: (self._last_run.get(r, -1), r)):
            count = int(view.requests.num_uncomputed(np.array([request]))[0])
            if len(chosen) == self.max_per_step or sum(tokens) + count > view.max_num_tokens:
                break
            chosen.append(request)
            tokens.append(count)
            self._last_run[request] = view.step_index
        self.num_empty_plans += not chosen
        return StepPlan(chosen, tokens)


CONFIG = SchedulerConfig(limits=StepLimits(max_num_seqs=6, max_num_tokens=64, max_model_len=128),
                         kv=KVConfig(page_size=8, num_kv_pages=128),
                         features=LoopFeatures(log_step_requests=True))


def workload(num_requests: int = 24) -> list[Request]:
    return synthetic_workload(num_requests=num_requests, arrival="poisson", rate=200.0,
                              prompt_len="uniform:4:60", output_len="uniform:1:30", seed=3,
                              vocab_size=VOCAB)


def run(policy: Policy, depth: int, requests: list[Request], config=CONFIG):
    engine = ArithmeticEngine()
    scheduler = Scheduler(requests, policy, engine, config)
    scheduler.executor = Executor(scheduler, depth=depth)
    return scheduler.run(), engine, scheduler


# ------------------------------------------------------------------ the two phases
def test_schedule_changes_only_what_it_says_and_update_counts_the_step():
    requests = [Request(id=i, arrival_s=0.0, prompt_len=p, output_len=o,
                        prompt_tokens=np.arange(1, p + 1, dtype=np.int32))
                for i, (p, o) in enumerate([(10, 3), (12, 1), (6, 2)])]
    scheduler = Scheduler(requests, make_policy("orca"), ArithmeticEngine(feeds=False), CONFIG)
    table = scheduler.table
    step = scheduler.schedule()
    assert isinstance(step, ScheduledStep) and step.index == 0
    # What it says: all three admitted, their reservations allocated (orca reserves
    # max_model_len: 128 tokens, 16 pages of 8), the prompts packed.
    np.testing.assert_array_equal(step.request_ids, [0, 1, 2])
    np.testing.assert_array_equal(step.num_tokens, [10, 12, 6])
    np.testing.assert_array_equal(step.kv_lens, [10, 12, 6])
    np.testing.assert_array_equal(step.sampled, [0, 1, 2])  # each prompt ends: a token
    assert step.num_real_tokens == 28 and step.packed.bucket.num_tokens == 32
    np.testing.assert_array_equal(scheduler.running, [0, 1, 2])
    assert scheduler.waiting.size == 0
    np.testing.assert_array_equal(scheduler.kv.num_held[:3], [16, 16, 16])
    # Nothing else: no token counted, no step logged, the clock where it was.
    np.testing.assert_array_equal(table.num_computed, 0)
    np.testing.assert_array_equal(table.num_generated, 0)
    assert np.isnan(table.first_token_s).all()
    assert scheduler.num_steps == 0 and scheduler.now_s == 0.0
    assert scheduler.record.steps == []

    scheduler.now_s = 0.25  # an executor moves the clock to the step's end
    update_s = scheduler.update(step, StepResult(start_s=0.0, end_s=0.25, step_s=0.2,
                                                 host_s=0.05,
                                                 sampled_tokens=np.array([7, 8, 9], np.int32)))
    assert update_s >= 0.0
    np.testing.assert_array_equal(table.num_computed, [10, 12, 6])
    np.testing.assert_array_equal(table.num_generated, [1, 1, 1])
    np.testing.assert_array_equal(table.last_token, [7, 8, 9])
    np.testing.assert_array_equal(table.first_token_s, [0.25, 0.25, 0.25])
    # Request 1 wanted one token: it finished, its pages are free, it left the batch.
    assert table.state[1] == RequestState.FINISHED and table.finish_s[1] == 0.25
    np.testing.assert_array_equal(scheduler.running, [0, 2])
    np.testing.assert_array_equal(scheduler.last_finished, [1])
    assert scheduler.kv.num_held[1] == 0 and scheduler.num_done == 1
    assert scheduler.num_steps == 1
    (log,) = scheduler.record.steps
    assert (log.step, log.start_s, log.step_s, log.num_seqs, log.num_tokens) == (
        0, 0.0, 0.2, 3, 28)
    assert log.host_s == pytest.approx(0.05 + update_s)
    assert scheduler.result().output_tokens[1].tolist() == [8]

    with pytest.raises(ValueError, match="update: step 0 .* the next step to update is 1"):
        scheduler.update(step, StepResult(start_s=0.0, end_s=0.25, step_s=0.2, host_s=0.0,
                                          sampled_tokens=None))


def test_an_idle_schedule_says_when_the_next_arrival_comes_and_changes_nothing():
    requests = [Request(id=0, arrival_s=1.5, prompt_len=4, output_len=2)]
    scheduler = Scheduler(requests, make_policy("orca"),
                          SimEngine(CostModelConfig(mode="fixed", step_time_s=0.01)), CONFIG)
    idle = scheduler.schedule()
    assert idle == IdleStep(resume_s=1.5, waits=True, progressed=False)
    assert scheduler.now_s == 0.0 and scheduler.waiting.size == 0
    assert scheduler.update(idle, None) == 0.0 and scheduler.num_steps == 0
    assert scheduler.step()  # the executor jumps the gap, then runs the prompt
    assert scheduler.now_s == pytest.approx(1.51) and scheduler.num_steps == 1


# ------------------------------------------------------------------ depth
@pytest.mark.parametrize("policy,options", [("orca", {}), ("sarathi", {"max_num_tokens": "32"})])
def test_depths_one_two_and_three_give_the_same_plans_steps_and_tokens(policy, options):
    requests = workload()
    runs = {depth: run(make_policy(policy, options), depth, requests) for depth in (1, 2, 3)}
    reference, engine, _ = runs[1]
    assert engine.most_in_flight == 1 and engine.num_fed == 0
    assert [list(t) for t in reference.output_tokens] == [predicted_tokens(r)
                                                          for r in sort_by_arrival(requests)]
    for depth in (2, 3):
        result, engine, scheduler = runs[depth]
        assert engine.most_in_flight == depth  # really that many steps on the device at once
        assert engine.num_fed > 50  # decodes took their input token on the device
        assert scheduler.executor.num_in_flight == 0 and engine.num_in_flight == 0
        assert [list(t) for t in result.output_tokens] == [list(t)
                                                           for t in reference.output_tokens]
        assert len(result.step_requests) == len(reference.step_requests) > 20
        for ours, theirs in zip(result.step_requests, reference.step_requests):
            for a, b in zip(ours, theirs):
                np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(result.first_token_s, reference.first_token_s)
        np.testing.assert_array_equal(result.finish_s, reference.finish_s)


def test_at_depth_three_a_policy_that_reads_busy_gets_every_token_right():
    requests = workload(8)
    answers = [predicted_tokens(r) for r in sort_by_arrival(requests)]
    for depth in (1, 2, 3):
        policy = TakeTurns()
        result, _, _ = run(policy, depth, requests)
        assert [list(t) for t in result.output_tokens] == answers
        most_busy = max(map(len, policy.busy_seen))
        # Only a queue deeper than overlap's leaves a request behind in an older step.
        assert most_busy == 0 if depth < 3 else most_busy >= 2


def test_when_every_request_left_is_busy_the_executor_lands_a_step_and_the_run_goes_on():
    # One request a step: 0, 1 (finishes), 2, 0, 0, 2 (finishes); then only 0 is left,
    # busy (it sampled two steps back): the plan is empty, which waits for a landing.
    requests = [Request(id=i, arrival_s=0.0, prompt_len=p, output_len=o,
                        prompt_tokens=np.arange(3, p + 3, dtype=np.int32))
                for i, (p, o) in enumerate([(5, 6), (7, 1), (4, 2)])]
    policy = TakeTurns(max_per_step=1)
    result, engine, scheduler = run(policy, 3, requests)
    assert [list(t) for t in result.output_tokens] == [predicted_tokens(r) for r in requests]
    assert policy.num_empty_plans == 1 and policy.busy_seen[6] == [0]
    assert engine.most_in_flight == 3
    assert result.num_steps == 1 + 1 + 2 + 5  # prompts, then each decode of 0 and 2


def test_a_plan_that_schedules_a_busy_request_breaks_busy_request():
    requests = workload(8)
    scheduler = Scheduler(requests, TakeTurns(schedule_busy_at=2), ArithmeticEngine(), CONFIG)
    scheduler.executor = Executor(scheduler, depth=3)
    for _ in range(2):
        scheduler.step()
    table = scheduler.table.snapshot()
    busy = scheduler.view.busy.copy()
    assert busy.size and scheduler.executor.num_in_flight == 2
    with pytest.raises(PlanError) as raised:
        scheduler.step()
    error = raised.value
    assert (error.policy, error.rule) == ("test_take_turns", "busy_request")
    assert str(error).startswith(f"policy 'test_take_turns' broke rule 'busy_request': "
                                 f"request {busy[0]} is busy")
    assert scheduler.num_steps == 2
    for field, values in table.items():
        np.testing.assert_array_equal(scheduler.table.snapshot()[field], values, err_msg=field)


def test_an_executor_refuses_what_it_cannot_run():
    requests = workload(4)
    sim = Scheduler(requests, make_policy("orca"),
                    SimEngine(CostModelConfig(mode="fixed", step_time_s=0.01)), CONFIG)
    with pytest.raises(ValueError, match="Executor: depth 3 leaves tokens on the device, and "
                                         "engine 'sim' does not feed them"):
        Executor(sim, depth=3)
    caching = Scheduler(requests, make_policy("vllm"), ArithmeticEngine(), CONFIG)
    with pytest.raises(ValueError, match="depth 2 reads tokens back late, but prefix caching"):
        Executor(caching, depth=2)
    with pytest.raises(ValueError, match="depth must be an int >= 1, got 0"):
        Executor(sim, depth=0)
    sim.step()
    with pytest.raises(ValueError, match="has run 1 steps; give it an executor before"):
        Executor(sim, depth=1)
