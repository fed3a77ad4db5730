"""A colocated cluster's replicas leap over steady decode steps up to the loop's next
event of another kind (through their own finishes and after their prefills too): the
same results, bit for bit, as one step at a time."""

import numpy as np
import pytest

import policies
from orca_jax import KVConfig, SchedulerConfig, StepLimits
from orca_jax.cluster.elastic import ScalingSpec
from orca_jax.cluster.migration import MigrationSpec
from orca_jax.cluster.replicas import Cluster
from orca_jax.cluster.transfers import KVTransferCost
from orca_jax.sim.cost_model import CostModelConfig
from orca_jax.sim.engine import SimEngine
from orca_jax.specs.hardware import KVLinkSpec
from orca_jax.workloads.synthetic import synthetic_workload

CONFIG = SchedulerConfig(limits=StepLimits(max_num_seqs=16, max_num_tokens=256,
                                           max_model_len=1024),
                         kv=KVConfig(num_kv_pages=200, page_size=16))
COST = KVTransferCost(link=KVLinkSpec(name="test", latency_s=0.001, bytes_per_s=5e6),
                      bytes_per_token=1000)


def _engine():
    # The roofline: steps grow with their context, so a leap prices each step's own.
    return SimEngine(CostModelConfig(model="llama3-8b", hardware="a100"))


def _run(requests, leap, **extra):
    cluster = Cluster(requests, num_replicas=3, router="least_outstanding",
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
