"""A plan may reject waiting requests with a reason; plugins read the run's SLOs and seed.

Rejections end a request `rejected` with `policy <name>: <text>` as its reason
(requests.jsonl), count in `num_rejected`, and show in steps.jsonl with
`log_step_requests`. A policy that never preempts refuses `kv_reservation=none`
at load time. Policies and routers see the run's `--seed` and SLOs.
"""

import dataclasses
import json
from typing import ClassVar

import numpy as np
import pytest

from orca_jax import (
    KVConfig,
    Policy,
    PolicyLoadError,
    Request,
    RequestState,
    Scheduler,
    SchedulerConfig,
    StepLimits,
    StepPlan,
    make_policy,
    plan_in_order,
    register,
)
from orca_jax.cluster import routing
from orca_jax.cluster.routing import Router
from orca_jax.runner.experiment import run_policy
from orca_jax.runner.spec import ClusterSpec, LimitsSpec, RunSpec, SimEngineSpec, WorkloadSpec
from orca_jax.sim.cost_model import CostModelConfig
from orca_jax.sim.engine import SimEngine
from orca_jax.workloads.synthetic import synthetic_workload


@register("test_shed")
@dataclasses.dataclass(kw_only=True)
class Shed(Policy):
    """FCFS that rejects the waiting requests past the first `max_waiting` (load shedding),
    and preempts the newest running request at `preempt_step` (test only)."""

    max_waiting: int = 2
    preempt_step: int = -1
    _preempted: bool = dataclasses.field(default=False, init=False)

    def schedule(self, view) -> StepPlan:
        if view.step_index == self.preempt_step and not self._preempted:
            self._preempted = True
            return StepPlan(preempt=view.running[-1:])
        shed = view.waiting[self.max_waiting:]
        plan = plan_in_order(view, np.concatenate([view.running, view.waiting[:self.max_waiting]]))
        return StepPlan(plan.request_ids, plan.num_tokens, preempt=plan.preempt,
                        reject={int(i): "queue full" for i in shed})


@register("test_sees")
@dataclasses.dataclass(kw_only=True)
class Sees(Policy):
    """FCFS that writes down the SLOs and seed its view shows (test only)."""

    seen: list = dataclasses.field(default_factory=list, init=False)

    def schedule(self, view) -> StepPlan:
        self.seen.append((view.ttft_slo_s, view.tpot_slo_s, view.seed))
        return plan_in_order(view, np.concatenate([view.running, view.waiting]))


def sim_engine() -> SimEngine:
    return SimEngine(CostModelConfig(mode="fixed", step_time_s=0.01))


def burst(n: int, prompt: int = 8, output: int = 3) -> list[Request]:
    return [Request(id=100 + i, arrival_s=0.0, prompt_len=prompt, output_len=output)
            for i in range(n)]


CONFIG = SchedulerConfig(limits=StepLimits(max_num_seqs=8, max_num_tokens=64, max_model_len=32),
                         kv=KVConfig(num_kv_pages=64, page_size=4))


def test_rejected_requests_end_rejected_with_the_policys_reason(tmp_path):
    spec = RunSpec(workload=WorkloadSpec(arrival="burst", num_requests=6,
                                         prompt_len="fixed:8", output_len="fixed:3"),
                   engine=SimEngineSpec(step_time_ms=10),
                   limits=LimitsSpec(num_kv_pages=64, max_model_len=32, page_size=4,
                                     log_step_requests=True))
    summary, result = run_policy(spec, "test_shed", {"max_waiting": "2"}, out_dir=tmp_path,
                                 progress=False)
    rows = [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
    assert [row["status"] for row in rows] == ["finished"] * 2 + ["rejected"] * 4
    assert {row["reason"] for row in rows[2:]} == {"policy test_shed: queue full"}
    assert "reason" not in rows[0]
    assert summary["num_rejected"] == 4
    steps = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    ids = [row["id"] for row in rows]
    assert steps[0]["rejected_ids"] == ids[2:] and steps[0]["preempted_ids"] == []
    assert all(step["rejected_ids"] == [] for step in steps[1:])
    assert result.num_steps == 3  # the two admitted: prompt, then two decodes


def test_steps_record_preemptions_including_those_of_iterations_that_run_nothing():
    config = CONFIG.with_knobs(log_step_requests=True)
    scheduler = Scheduler(burst(2), Shed(preempt_step=1), sim_engine(), config)
    result = scheduler.run()
    assert (result.state == RequestState.FINISHED).all()
    # The plan after step 0 only preempts (no step is logged for it): step 1 carries it.
    assert [p.tolist() for p in result.step_preempted] == [[], [1], []]
    assert all(r.size == 0 for r in result.step_rejected)
    assert result.total_preemptions == 1


def test_rejection_changes_the_queues_and_the_done_count():
    scheduler = Scheduler(burst(5), Shed(max_waiting=1), sim_engine(), CONFIG)
    scheduler.step()
    assert scheduler.waiting.size == 0 and scheduler.running.tolist() == [0]
    assert scheduler.num_done == 4
    assert scheduler.table.reject_reason[4] == "policy test_shed: queue full"
    scheduler.run()
    assert scheduler.done


@pytest.mark.parametrize("reason", ["", "   ", None, 3])
def test_a_rejection_needs_a_reason(reason):
    with pytest.raises(TypeError, match="StepPlan.reject: request 2 needs a reason"):
        StepPlan(reject={2: reason})


def test_reject_takes_a_mapping_or_pairs():
    plan = StepPlan(reject={3: "late", 1: "too long"})
    assert plan.reject_ids.tolist() == [3, 1] and plan.reject_reasons == ("late", "too long")
    assert StepPlan(reject=[(5, "x")]).reject_ids.tolist() == [5]
    assert StepPlan().reject_ids.size == 0 and StepPlan().reject_reasons == ()


@pytest.mark.parametrize("name", ["orca", "static"])
def test_a_policy_that_never_preempts_refuses_on_demand_kv_at_load(name):
    with pytest.raises(PolicyLoadError) as raised:
        make_policy(name, {"kv_reservation": "none"})
    message = str(raised.value)
    assert "\n" not in message
    assert f"'{name}'" in message and "kv_reservation 'none'" in message
    assert "never preempts" in message
    make_policy(name, {"kv_reservation": "exact"})  # reserving modes still load


def test_the_rule_is_a_class_attribute_any_plugin_can_set():
    @dataclasses.dataclass(kw_only=True)
    class NoPreempt(Policy):
        name = "test_no_preempt"
        preempts = False
        kv_reservation: str = "none"

        def schedule(self, view) -> StepPlan:
            return StepPlan()

    with pytest.raises(ValueError, match="test_no_preempt.*never preempts"):
        Scheduler(burst(1), NoPreempt(), sim_engine(), CONFIG)
    Scheduler(burst(1), NoPreempt(kv_reservation="max"), sim_engine(), CONFIG)
    assert make_policy("vllm").preempts  # on-demand policies preempt


def slo_spec(**run) -> RunSpec:
    return RunSpec(workload=WorkloadSpec(arrival="burst", num_requests=2, prompt_len="fixed:8",
                                         output_len="fixed:2"),
                   engine=SimEngineSpec(step_time_ms=10),
                   limits=LimitsSpec(num_kv_pages=64, max_model_len=32, page_size=4), **run)


def test_a_policy_sees_the_runs_slos_and_seed(monkeypatch):
    made = []
    original = Sees.__init__

    def keep(self, *args, **kwargs):
        original(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(Sees, "__init__", keep)
    run_policy(slo_spec(ttft_slo_s=0.25, seed=7), "test_sees", progress=False)
    run_policy(slo_spec(tpot_slo_s=0.05), "test_sees", progress=False)
    assert set(made[0].seen) == {(0.25, None, 7)}
    assert set(made[1].seen) == {(None, 0.05, 0)}


@dataclasses.dataclass
class RandomRouter(Router):
    """Sends each request to a replica drawn from a generator seeded by the run (test).
    Registered only while its test runs: a router registered for the whole session would
    show in `--router`'s help, which test_flag_spec_consistency checks against the
    built-in registry."""

    name: ClassVar[str] = "test_random"

    _rng: object = dataclasses.field(default=None, init=False, repr=False)

    def route(self, view, request: int) -> int:
        if self._rng is None:
            self._rng = np.random.default_rng(view.seed)
        return int(self._rng.integers(view.num_replicas))


def test_a_randomized_router_varies_with_the_seed_and_repeats_with_it(monkeypatch):
    monkeypatch.setitem(routing._ROUTERS, RandomRouter.name, RandomRouter)
    def routes(seed: int) -> list[int]:
        spec = RunSpec(workload=WorkloadSpec(arrival="poisson", rate=20.0, num_requests=40,
                                             prompt_len="fixed:8", output_len="fixed:2"),
                       engine=SimEngineSpec(step_time_ms=10),
                       limits=LimitsSpec(num_kv_pages=64, max_model_len=32, page_size=4),
                       cluster=ClusterSpec(num_replicas=4, router="test_random"), seed=seed)
        _, result = run_policy(spec, "vllm", requests=workload, progress=False)
        return result.replica.tolist()

    workload = synthetic_workload(num_requests=40, arrival="poisson", rate=20.0,
                                  prompt_len="fixed:8", output_len="fixed:2", seed=0)
    first, again, other = routes(1), routes(1), routes(2)
    assert first == again
    assert first != other
    assert set(first) == {0, 1, 2, 3}
