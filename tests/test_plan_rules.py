"""Every rule a plan can break: the error names the policy and the rule, and changes nothing.

A scripted test policy runs a valid FCFS plan (Orca's) until a chosen step, then
returns a bad plan once. The scheduler must raise `PlanError` with the policy's
name and the rule, leave its state exactly as the policy saw it, and, given
good plans afterwards, finish the run exactly as a run without the bad plan.
"""

import dataclasses
import math
import re
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import pytest

from orca_jax import KVConfig, PlanError, Request, Scheduler, SchedulerConfig, StepLimits, StepPlan
from orca_jax.core.api.policy import Policy
from orca_jax.sim.cost_model import CostModelConfig
from orca_jax.sim.engine import SimEngine
from orca_jax.sim.speculation import SpecConfig
from policies.orca import Orca

BadPlan = Callable[[Any], Any]  # view -> the bad plan (or a non-plan)


@dataclasses.dataclass(kw_only=True)
class Scripted(Policy):
    """Orca's FCFS plans, except one bad plan at `bad_step` (test-only, not registered)."""

    name = "scripted_test"
    bad_step: int = 0
    bad_plan: Optional[BadPlan] = None
    kv_reservation: str = "max"
    defer_release: bool = False
    state_seen: Optional[dict] = None  # the scheduler's state when the bad plan was made
    _inner: Orca = dataclasses.field(default_factory=Orca, init=False)
    _done_bad: bool = dataclasses.field(default=False, init=False)
    scheduler: Any = None

    def schedule(self, view) -> Any:
        if not self._done_bad and self.bad_plan is not None and view.step_index == self.bad_step:
            self._done_bad = True
            self.state_seen = state_of(self.scheduler)
            return self.bad_plan(view)
        self._inner.kv_reservation = self.kv_reservation
        plan = self._inner.schedule(view)
        if self.defer_release and view.unreleased.size:
            plan = StepPlan(plan.request_ids, plan.num_tokens, release=view.unreleased)
        return plan


def state_of(scheduler: Scheduler) -> dict:
    """Copies of everything a step could change."""
    kv = scheduler.kv
    token_req, token_time = scheduler.record.token_log()
    return {
        "table": scheduler.table.snapshot(), "waiting": scheduler.waiting.copy(),
        "running": scheduler.running.copy(), "unreleased": scheduler.unreleased.copy(),
        "num_free": kv.num_free, "num_held": kv.num_held.copy(), "row_of": kv.row_of.copy(),
        "pages": {int(i): kv.pages_of(int(i)) for i in np.flatnonzero(kv.num_held)},
        "now_s": scheduler.now_s, "num_steps": scheduler.num_steps,
        "num_step_logs": len(scheduler.record.steps),
        "num_preemptions": scheduler.record.num_preemptions,
        "token_req": token_req, "token_time": token_time,
        "reject_reason": dict(scheduler.table.reject_reason), "done": scheduler.done,
    }


def assert_same_state(before: dict, after: dict) -> None:
    assert before.keys() == after.keys()
    for key in before:
        if key == "table":
            for field, values in before["table"].items():
                np.testing.assert_array_equal(values, after["table"][field], err_msg=field)
        elif key == "pages":
            assert before[key].keys() == after[key].keys()
            for request, pages in before[key].items():
                np.testing.assert_array_equal(pages, after[key][request],
                                              err_msg=f"pages of {request}")
        elif isinstance(before[key], np.ndarray):
            np.testing.assert_array_equal(before[key], after[key], err_msg=key)
        else:
            assert before[key] == after[key], key


STEP_S = 0.01


def make_scheduler(requests, config, **policy_args) -> Scheduler:
    # `spec`: an engine that verifies draft tokens (acceptances drawn), for the spec_ rules.
    speculation = SpecConfig(acceptance=0.5) if policy_args.pop("spec", False) else None
    policy = Scripted(**policy_args)
    scheduler = Scheduler(requests, policy, SimEngine(CostModelConfig(mode="fixed",
                                                                      step_time_s=STEP_S),
                                                      speculation=speculation), config)
    policy.scheduler = scheduler
    return scheduler


def run_to_end(scheduler: Scheduler) -> None:
    for _ in range(10_000):
        if scheduler.done:
            return
        scheduler.step()
    raise AssertionError("the run did not finish")


def burst(*lengths, arrival_s=0.0) -> list[Request]:
    """Requests `(prompt_len, output_len)` arriving at once."""
    return [Request(id=i, arrival_s=arrival_s, prompt_len=p, output_len=o)
            for i, (p, o) in enumerate(lengths)]


CONFIG = SchedulerConfig(limits=StepLimits(max_num_seqs=4, max_num_tokens=32, max_model_len=32),
                         kv=KVConfig(num_kv_pages=64, page_size=4))
REQUESTS = burst((10, 3), (12, 5), (6, 2), (9, 4))

# rule -> (requests, config, policy args, step of the bad plan, bad plan from the view)
CASES: dict[str, tuple] = {
    "token_budget": (REQUESTS, CONFIG, {}, 0,
                     lambda v: StepPlan([0, 1, 2, 3], [10, 12, 6, 9])),  # 37 > 32
    "batch_cap": (burst(*[(2, 2)] * 5), CONFIG.with_knobs(max_num_seqs=4), {}, 0,
                  lambda v: StepPlan([0, 1, 2, 3, 4], [2] * 5)),
    # Each request reserves the 8-page context; 20 pages hold two, the plan admits three.
    "kv_pages": (REQUESTS, CONFIG.with_knobs(num_kv_pages=20), {}, 0,
                 lambda v: StepPlan([0, 1, 2], [10, 12, 6])),
    # Step 0 admits 0 and 1 (16 of 20 pages); preempting 0 frees 8, too few for 2 and 3 (16).
    "kv_pages_after_preemption": (
        REQUESTS, CONFIG.with_knobs(num_kv_pages=20), {}, 1,
        lambda v: StepPlan([1, 2, 3], [1, 6, 9], preempt=[0])),
    # 24 pages, watermark 4: two admissions (16 pages) are fine, three leave 0 < 4 free.
    "kv_watermark": (REQUESTS, CONFIG.with_knobs(num_kv_pages=24, watermark_pages=4),
                     {}, 0, lambda v: StepPlan([0, 1, 2], [10, 12, 6])),
    "unknown_request": (REQUESTS, CONFIG, {}, 1, lambda v: StepPlan([0, 4], [1, 1])),
    "unknown_request_negative": (REQUESTS, CONFIG, {}, 1, lambda v: StepPlan([-1], [1])),
    "unknown_preempt": (REQUESTS, CONFIG, {}, 1, lambda v: StepPlan(preempt=[7])),
    "not_arrived": (REQUESTS[:3] + [Request(id=3, arrival_s=5.0, prompt_len=4, output_len=2)],
                    CONFIG, {}, 1, lambda v: StepPlan([3], [4])),
    # Request 2 (output 2) is done after step 1; step 2 schedules it again.
    "finished_request": (REQUESTS, CONFIG, {}, 2, lambda v: StepPlan([2], [1])),
    # Request 1 cannot fit the 32-token context: rejected up front, and not schedulable.
    "finished_request_rejected": (burst((10, 3), (30, 5)), CONFIG, {}, 0,
                                  lambda v: StepPlan([0, 1], [10, 30])),
    "duplicate_request": (REQUESTS, CONFIG, {}, 1, lambda v: StepPlan([0, 1, 0], [1, 1, 1])),
    "duplicate_preempt": (REQUESTS, CONFIG, {}, 1, lambda v: StepPlan(preempt=[1, 1])),
    "nonpositive_tokens": (REQUESTS, CONFIG, {}, 1, lambda v: StepPlan([0, 1], [1, 0])),
    "nonpositive_tokens_negative": (REQUESTS, CONFIG, {}, 0, lambda v: StepPlan([0], [-3])),
    # The running queue itself as the plan's requests (its indices are not checked again).
    "nonpositive_tokens_running_queue": (REQUESTS, CONFIG, {}, 1, lambda v: StepPlan(
        v.running, np.zeros(v.running.size, dtype=np.int64))),
    # After step 0 every prompt is cached and one token sampled: 2 tokens is a decode too many.
    "tokens_over_uncomputed": (REQUESTS, CONFIG, {}, 1, lambda v: StepPlan([0, 1], [1, 2])),
    "tokens_over_uncomputed_running_queue": (REQUESTS, CONFIG, {}, 1, lambda v: StepPlan(
        v.running, np.full(v.running.size, 2, dtype=np.int64))),
    # A waiting request cannot be given more than its prompt.
    "tokens_over_uncomputed_waiting": (REQUESTS, CONFIG, {}, 0,
                                           lambda v: StepPlan([0], [11])),
    "preempt_not_running": (REQUESTS[:2] + [Request(id=2, arrival_s=0.005, prompt_len=4,
                                                    output_len=2)],
                            CONFIG.with_knobs(max_num_seqs=1), {}, 1,
                            lambda v: StepPlan([0], [1], preempt=[1])),  # 1 is waiting
    "preempt_and_schedule": (REQUESTS, CONFIG, {}, 1,
                             lambda v: StepPlan([0, 1], [1, 1], preempt=[1])),
    # Orca does not defer release: releasing anything breaks the rule.
    "release_without_defer": (REQUESTS, CONFIG, {}, 2,
                              lambda v: StepPlan([0], [1], release=[2])),
    # A deferring policy may release only finished, unreleased requests; 0 is still running.
    "release_not_finished_running": (REQUESTS, CONFIG, {"defer_release": True}, 1,
                                     lambda v: StepPlan([1], [1], release=[0])),
    # A plan rejects only waiting requests: 0 runs (cap 1), 2 is finished, 3 is to come.
    "reject_not_waiting": (REQUESTS, CONFIG.with_knobs(max_num_seqs=1), {}, 1,
                           lambda v: StepPlan([0], [1], reject={0: "too slow"})),
    "reject_not_waiting_finished": (REQUESTS, CONFIG, {}, 2,
                                    lambda v: StepPlan([0], [1], reject={2: "too slow"})),
    "reject_not_waiting_not_arrived": (
        REQUESTS[:3] + [Request(id=3, arrival_s=5.0, prompt_len=4, output_len=2)], CONFIG, {},
        1, lambda v: StepPlan(reject={3: "too slow"})),
    "reject_and_schedule": (REQUESTS, CONFIG, {}, 0,
                            lambda v: StepPlan([0, 1], [10, 12], reject={1: "too slow"})),
    "unknown_reject": (REQUESTS, CONFIG, {}, 0, lambda v: StepPlan(reject={9: "too slow"})),
    "duplicate_reject": (REQUESTS, CONFIG, {}, 0,
                         lambda v: StepPlan(reject=[(1, "too slow"), (1, "again")])),
    # With nothing left to arrive, a plan that runs nothing would loop forever.
    "no_progress": (REQUESTS, CONFIG, {}, 1, lambda v: StepPlan()),
    "not_a_plan": (REQUESTS, CONFIG, {}, 1, lambda v: v.running.tolist()),
    "not_a_plan_none": (REQUESTS, CONFIG, {}, 0, lambda v: None),
    # A StepPlan its fields cannot make (issue 25: the framework's traceback, not this rule).
    "not_a_plan_lengths_differ": (REQUESTS, CONFIG, {}, 1, lambda v: StepPlan([], [1])),
    "not_a_plan_nan_tokens": (REQUESTS, CONFIG, {}, 1,
                              lambda v: StepPlan(v.running, [math.nan] * v.running.size)),
    "not_a_plan_fractional_tokens": (REQUESTS, CONFIG, {}, 0,
                                     lambda v: StepPlan([0], [1.5])),
    "not_a_plan_text_ids": (REQUESTS, CONFIG, {}, 0, lambda v: StepPlan(["0"], [1])),
    "not_a_plan_not_iterable": (REQUESTS, CONFIG, {}, 0, lambda v: StepPlan(0, 1)),
    "not_a_plan_ids_2d": (REQUESTS, CONFIG, {}, 0, lambda v: StepPlan([[0]], [[1]])),
    "not_a_plan_nan_bucket": (REQUESTS, CONFIG, {}, 0,
                              lambda v: StepPlan([0], [10], min_bucket_tokens=math.nan)),
    "not_a_plan_reason_not_text": (REQUESTS, CONFIG, {}, 0, lambda v: StepPlan(reject={0: 5})),
    "not_a_plan_spec_length": (REQUESTS, CONFIG, {"spec": True}, 1,
                               lambda v: StepPlan([0, 1], [1, 1], spec_tokens=[1])),
    # Speculative decoding (docs/speculative.md): draft tokens only on an engine that
    # verifies them, only >= 0, only for a decoding request, within its context and output.
    "spec_unsupported": (REQUESTS, CONFIG, {}, 1,
                         lambda v: StepPlan([0, 1], [1, 1], spec_tokens=[0, 1])),
    "spec_negative": (REQUESTS, CONFIG, {"spec": True}, 1,
                      lambda v: StepPlan([0, 1], [1, 1], spec_tokens=[1, -1])),
    "spec_not_decoding": (REQUESTS, CONFIG, {"spec": True}, 0,
                          lambda v: StepPlan([0], [10], spec_tokens=[2])),
    # Request 1 (12 + 5) has 4 output tokens left after step 1: k = 4 is one too many.
    "spec_past_output": (REQUESTS, CONFIG, {"spec": True}, 1,
                         lambda v: StepPlan([0, 1], [1, 1], spec_tokens=[0, 4])),
    # (10 + 6) in a 16-token context: 10 cached + 1 + 6 drafts = 17 > 16.
    "spec_past_context": (burst((10, 6)), CONFIG.with_knobs(max_model_len=16),
                          {"spec": True}, 1, lambda v: StepPlan([0], [1], spec_tokens=[6])),
    # Four decodes of k = 4 verify 4 * 5 = 20 tokens > the 16-token budget (k = 3 fits).
    "token_budget_spec": (burst(*[(4, 12)] * 4), CONFIG.with_knobs(max_num_tokens=16),
                          {"spec": True}, 1,
                          lambda v: StepPlan([0, 1, 2, 3], [1] * 4, spec_tokens=[4] * 4)),
}


def rule_of(case: str) -> str:
    for rule in ("kv_pages", "token_budget", "unknown_request", "finished_request",
                 "duplicate_request", "nonpositive_tokens", "tokens_over_uncomputed",
                 "release_not_finished", "not_a_plan", "reject_not_waiting"):
        if case.startswith(rule):
            return rule
    return {"unknown_preempt": "unknown_request", "duplicate_preempt": "duplicate_request",
            "unknown_reject": "unknown_request", "duplicate_reject": "duplicate_request",
            }.get(case, case)


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_plan_is_rejected_and_changes_nothing(case):
    requests, config, policy_args, bad_step, bad_plan = CASES[case]
    reference = make_scheduler(requests, config, **policy_args)
    run_to_end(reference)

    scheduler = make_scheduler(requests, config, bad_step=bad_step, bad_plan=bad_plan,
                               **policy_args)
    with pytest.raises(PlanError) as raised:
        run_to_end(scheduler)
    error = raised.value
    assert error.policy == "scripted_test"
    assert error.rule == rule_of(case)
    assert "scripted_test" in str(error) and rule_of(case) in str(error)
    assert scheduler.num_steps == bad_step  # raised at the chosen step, not earlier
    assert_same_state(scheduler.policy.state_seen, state_of(scheduler))

    # Good plans from here on finish the run exactly as if the bad plan had never been made.
    run_to_end(scheduler)
    assert_same_state(state_of(reference), state_of(scheduler))


# Rules that need more than one step in flight, with their tests.
TESTED_ELSEWHERE = {"busy_request": "tests/test_two_phase.py"}


def test_every_documented_rule_has_a_case():
    # The docstring is where researchers look the rules up: it must list every rule raised.
    documented = PlanError.__doc__.split("A policy's:")[1].split("A router's:")[0]
    rules = {word for word in documented.split("`")[1::2]}
    assert rules == {rule_of(case) for case in CASES} | set(TESTED_ELSEWHERE)
    # A router's and a rebalancer's rules: each one documented is raised by its code, and
    # each one raised is documented (the names between backquotes that are not rules are
    # the routers' own names).
    others = PlanError.__doc__.split("A router's:")[1].split("detail:")[0]
    named = set(others.split("`")[1::2]) - {"length_buckets", "chain",
                                              "orca_jax.cluster.migration"}
    sources = [Path(__file__).parents[1] / path for path in (
        "orca_jax/cluster/event_loop.py", "orca_jax/cluster/migration.py",
        "policies/gateway_routers.py", "policies/router_chain.py")]
    code = "".join(source.read_text() for source in sources)
    raised = set(re.findall(r'(?:_broke|PlanError)\([^,]*?,?\s*"([a-z_]+)"', code))
    assert named == raised


def test_plan_error_fields_and_message():
    error = PlanError("fcfs", "token_budget", "40 tokens > budget 32")
    assert isinstance(error, ValueError)
    assert (error.policy, error.rule, error.detail) == ("fcfs", "token_budget",
                                                        "40 tokens > budget 32")
    assert str(error) == "policy 'fcfs' broke rule 'token_budget': 40 tokens > budget 32"
    assert error.kind == "policy"


def test_plan_error_names_a_router_as_a_router():
    error = PlanError("tolast", "replica_out_of_range", "returned 3 for request 0", kind="router")
    assert (error.policy, error.rule, error.kind) == ("tolast", "replica_out_of_range", "router")
    assert str(error) == ("router 'tolast' broke rule 'replica_out_of_range': "
                          "returned 3 for request 0")


def test_an_answer_is_released_once_only():
    # Request 2 (output 2) finishes in step 1 and a deferring policy releases it in step 2;
    # releasing it again in step 3 breaks the rule.
    scheduler = make_scheduler(REQUESTS, CONFIG, defer_release=True, bad_step=3,
                               bad_plan=lambda v: StepPlan(v.running, [1] * v.running.size,
                                                           release=[2]))
    for _ in range(3):
        scheduler.step()
    assert scheduler.table.finish_s[2] == pytest.approx(2 * STEP_S)
    assert 2 not in scheduler.unreleased
    with pytest.raises(PlanError) as raised:
        scheduler.step()
    assert raised.value.rule == "release_not_finished"
    assert "request 2" in str(raised.value)


def test_the_running_queue_as_the_plan_counts_as_a_copy_of_it():
    # A plan of the scheduler's own running queue (vllm's decode steps) skips the index
    # rule, which that queue cannot break: its counts are those of an equal copy's.
    from orca_jax.core.plans.plan_checks import checked_counts
    scheduler = make_scheduler(REQUESTS, CONFIG)
    scheduler.step()
    running = scheduler.view.running
    assert running is scheduler.running and running.size
    tokens = np.ones(running.size, dtype=np.int64)
    plan = StepPlan(running, tokens)
    assert plan.request_ids is scheduler.running
    counts, copied = (checked_counts(scheduler, plan),
                      checked_counts(scheduler, StepPlan(running.copy(), tokens)))
    for mine, theirs in zip(counts, copied):
        np.testing.assert_array_equal(mine, theirs)
