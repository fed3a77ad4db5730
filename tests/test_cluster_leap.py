"""A colocated cluster's replicas leap over steady decode steps up to the loop's next
event of another kind (through their own finishes and after their prefills too): the
same results, bit for bit, as one step at a time."""

import dataclasses

import numpy as np
import pytest

import policies
from orca_jax import KVConfig, Request, SchedulerConfig, StepLimits
from orca_jax.cluster.elastic import ScalingSpec
from orca_jax.cluster.migration import MigrationSpec
from orca_jax.cluster.replicas import Cluster
from orca_jax.cluster.routing import ClusterView, Router, make_router, routes_blind
from orca_jax.cluster.transfers import KVTransferCost
from orca_jax.core.loop.leap import Leaper
from orca_jax.sim.cost_model import CostModelConfig
from orca_jax.sim.engine import SimEngine
from orca_jax.specs.hardware import KVLinkSpec
from orca_jax.workloads.synthetic import synthetic_workload
from policies.routers import RoundRobin

CONFIG = SchedulerConfig(limits=StepLimits(max_num_seqs=16, max_num_tokens=256,
                                           max_model_len=1024),
                         kv=KVConfig(num_kv_pages=200, page_size=16))
COST = KVTransferCost(link=KVLinkSpec(name="test", latency_s=0.001, bytes_per_s=5e6),
                      bytes_per_token=1000)


def _engine():
    # The roofline: steps grow with their context, so a leap prices each step's own.
    return SimEngine(CostModelConfig(model="llama3-8b", hardware="a100"))


def _run(requests, leap, router="least_outstanding", **extra):
    cluster = Cluster(requests, num_replicas=3, router=router,
                      make_policy=lambda: policies.make_policy("vllm"), make_engine=_engine,
                      config=CONFIG.with_knobs(leap=leap), **extra)
    return cluster, cluster.run()


@pytest.mark.parametrize("setup", ["static", "rebalancer", "planner"])
@pytest.mark.parametrize("seed", [0, 1])
def test_leaping_replicas_give_the_results_of_single_steps(setup, seed):
    requests = synthetic_workload(num_requests=120, arrival="poisson", rate=12.0,
                                  prompt_len="uniform:16:300", output_len="uniform:1:300",
                                  seed=seed)
    extra = {"static": {},
             "rebalancer": {"rebalancer": "load_balance", "rebalancer_options": {"gap": "0.05"},
                            "migration": MigrationSpec(cost=COST, interval_s=0.3)},
             "planner": {"planner": "threshold",
                         "planner_options": {"scale_up_load": "3", "scale_down_load": "1"},
                         "scaling": ScalingSpec(interval_s=0.4, startup_s=0.5,
                                                max_replicas=5)}}[setup]
    one, single = _run(requests, False, **extra)
    other, leaped = _run(requests, True, **extra)
    np.testing.assert_array_equal(leaped.finish_s, single.finish_s)
    np.testing.assert_array_equal(leaped.first_token_s, single.first_token_s)
    np.testing.assert_array_equal(other.replica, one.replica)
    assert leaped.num_steps == single.num_steps  # every step recorded, leaped or not
    assert sum(r.executor.leaper.num_leaps for r in other.replicas) > 0  # it did leap
    # and went on through finishes and after prefills where one by one it would plan
    assert sum(r.executor.leaper.num_leaps_after_finishes for r in other.replicas) > 0
    assert sum(r.executor.leaper.num_leaps_after_prefills for r in other.replicas) > 0
    if setup == "rebalancer":
        assert other.migrator.log == one.migrator.log and one.migrator.log
    if setup == "planner":
        assert other.elastic.timeline() == one.elastic.timeline()
        assert any(row["event"] == "start" for row in one.elastic.timeline())


@dataclasses.dataclass
class SeededHash(Router):
    """A plugin router that reads nothing of the run: a request's replica is a hash of its
    index and the run's seed, and it says so."""

    state_blind = True

    def route(self, view: ClusterView, request: int) -> int:
        return (request * 2654435761 + view.seed) % 7919 % view.num_replicas


@dataclasses.dataclass
class Quiet(RoundRobin):
    """Round robin's choices from a plugin that overrides `route` and declares nothing:
    its parent's promise does not cover it."""

    def route(self, view: ClusterView, request: int) -> int:
        return super().route(view, request)


def test_a_router_promises_blindness_only_for_its_own_route():
    assert routes_blind(RoundRobin()) and routes_blind(SeededHash())
    assert not routes_blind(Quiet())  # inherits the flag, overrides route
    assert not routes_blind(make_router("least_outstanding"))


def _leaps_crossing_others(cluster, result):
    """Leaps (replica, first step, last step) recorded by `_record_leaps`, those whose
    steps started on both sides of an arrival routed to another replica."""
    arrival_s = np.asarray(result.arrival_s)
    crossing = []
    for index, first, last in cluster.leaps:
        rows = np.flatnonzero(np.asarray(result.step_replica) == index)
        starts = result.steps.column("start_s")[rows[first:last + 1]]
        others = arrival_s[(np.asarray(result.replica) != index)
                           & (np.asarray(result.replica) >= 0)]
        if ((others > starts[0]) & (others <= starts[-1])).any():
            crossing.append((index, first, last))
    return crossing


def _record_leaps(monkeypatch):
    """Notes each leap's replica and step range on `Cluster.leaps`."""
    leaps = []
    original = Leaper.leap

    def leap(self):
        before = self.scheduler.num_steps
        leaped = original(self)
        if leaped:
            leaps.append((self.scheduler.table.replica, before, self.scheduler.num_steps - 1))
        return leaped
    monkeypatch.setattr(Leaper, "leap", leap)
    return leaps


@pytest.mark.parametrize("router", ["round_robin", "seeded_hash", "quiet"])
@pytest.mark.parametrize("seed", [0, 1])
def test_replicas_behind_a_blind_router_leap_over_other_replicas_arrivals(
        router, seed, monkeypatch):
    requests = synthetic_workload(num_requests=150, arrival="poisson", rate=15.0,
                                  prompt_len="uniform:16:300", output_len="uniform:1:300",
                                  seed=seed)
    make = {"round_robin": RoundRobin, "seeded_hash": SeededHash, "quiet": Quiet}[router]
    one, single = _run(requests, False, router=make())
    leaps = _record_leaps(monkeypatch)
    other, leaped = _run(requests, True, router=make())
    other.leaps = leaps
    np.testing.assert_array_equal(leaped.finish_s, single.finish_s)
    np.testing.assert_array_equal(leaped.first_token_s, single.first_token_s)
    np.testing.assert_array_equal(leaped.steps.column("start_s"), single.steps.column("start_s"))
    np.testing.assert_array_equal(other.replica, one.replica)
    assert leaped.num_steps == single.num_steps
    assert leaps  # it did leap
    crossing = _leaps_crossing_others(other, leaped)
    if router == "quiet":  # asked at each arrival: every arrival cuts every leap
        assert not crossing
    else:
        assert crossing  # a leap ran past an arrival routed elsewhere


def test_a_blind_router_leaps_in_fewer_leaps_with_the_same_results_as_one_that_is_not():
    requests = synthetic_workload(num_requests=150, arrival="poisson", rate=15.0,
                                  prompt_len="uniform:16:300", output_len="uniform:1:300",
                                  seed=2)
    blind, blind_result = _run(requests, True, router=RoundRobin())
    asked, asked_result = _run(requests, True, router=Quiet())
    np.testing.assert_array_equal(blind.replica, asked.replica)
    np.testing.assert_array_equal(blind_result.finish_s, asked_result.finish_s)
    np.testing.assert_array_equal(blind_result.steps.column("step_s"),
                                  asked_result.steps.column("step_s"))

    def leaped(cluster):  # (steps run inside leaps, leaps)
        return (sum(r.executor.leaper.num_leaped_steps for r in cluster.replicas),
                sum(r.executor.leaper.num_leaps for r in cluster.replicas))
    # A leap cut by an arrival goes on as the next leap: the same steps, in fewer leaps.
    assert leaped(blind)[0] == leaped(asked)[0]
    assert leaped(blind)[1] < leaped(asked)[1]


def test_srpt_leaps_only_over_its_plan_in_the_order_it_ranks_now():
    # Issue 51: srpt on 3 replicas (least outstanding routes 0, 3 to replica 0; 1, 4 to 1;
    # 2, 5 to 2). On each, a short request A (16 + 52 tokens) and a long prompt R (241 + 50)
    # share the first step (A's prompt and 240 of R's); the second computes A's decode and
    # R's last prompt token, after which R's work (49) ranks before A's (50), tied before
    # it (51 each, A first by index). A leap repeated the plan in the old order: the rows
    # listed the same requests the other way round from the second step on.
    requests = [Request(id=i, arrival_s=0.0, prompt_len=16, output_len=52) for i in range(3)]
    requests += [Request(id=i, arrival_s=0.0, prompt_len=241, output_len=50) for i in range(3, 6)]
    config = CONFIG.with_knobs(max_num_seqs=4, log_step_requests=True)
    runs = []
    for leap in (False, True):
        cluster = Cluster(requests, num_replicas=3, router="least_outstanding",
                          make_policy=lambda: policies.make_policy("srpt"), make_engine=_engine,
                          config=config.with_knobs(leap=leap))
        runs.append((cluster, cluster.run()))
    (_, single), (other, leaped) = runs
    assert sum(r.executor.leaper.num_leaps for r in other.replicas) > 0
    assert single.replica.tolist() == [0, 1, 2, 0, 1, 2]
    rows = [s.tolist() for s in single.step_requests]
    assert [0, 3] in rows and [3, 0] in rows and [5, 2] in rows  # the turn, step by step
    assert len(leaped.step_requests) == len(single.step_requests)
    for a, b in zip(leaped.step_requests, single.step_requests):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(leaped.finish_s, single.finish_s)
