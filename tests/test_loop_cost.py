"""The shape of the loop's hot path: what keeps an iteration as cheap as before issue 24.

The figures behind these rules are in benchmarks/results/loop_cost_vs_631e0d7.txt.
"""

from __future__ import annotations

import numpy as np

import policies
from orca_jax import KVConfig, Request, Scheduler, SchedulerConfig, StepLimits
from orca_jax.core.loop.executor import Executor
from orca_jax.core.loop.scheduler_loop import MAX_SCHEDULER_ATTRIBUTES
from orca_jax.sim.cost_model import CostModelConfig
from orca_jax.sim.engine import SimEngine

CONFIG = SchedulerConfig(limits=StepLimits(max_num_seqs=8, max_model_len=128),
                         kv=KVConfig(num_kv_pages=64, prefix_caching="off"))


def _scheduler(policy: str = "orca") -> Scheduler:
    requests = [Request(id=i, arrival_s=0.0, prompt_len=8, output_len=4) for i in range(4)]
    return Scheduler(requests, policies.make_policy(policy, {}),
                     SimEngine(CostModelConfig(mode="fixed", step_time_s=0.01)), CONFIG)


def test_a_scheduler_keeps_its_attributes_in_the_shared_key_table():
    # One attribute over the limit and every `self.method()` call on the scheduler stops
    # being specialized (scheduler_loop.MAX_SCHEDULER_ATTRIBUTES says why).
    for policy in ("orca", "vllm"):
        scheduler = _scheduler(policy)
        scheduler.step()
        assert len(vars(scheduler)) <= MAX_SCHEDULER_ATTRIBUTES, sorted(vars(scheduler))


def test_step_goes_to_the_executor_set_last_and_busy_is_its_queue():
    scheduler = _scheduler()
    first = scheduler.executor
    scheduler.executor = Executor(scheduler, depth=1)
    assert scheduler.step.__self__ is scheduler.executor is not first
    assert scheduler.step() and scheduler.num_steps == 1
    assert scheduler.busy is scheduler.executor.in_flight.busy
    assert isinstance(scheduler.busy, np.ndarray) and scheduler.busy.size == 0
