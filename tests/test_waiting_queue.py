"""The waiting queue as a slice of the table's indices (`scheduler_loop.appended`): the
same values as a copied queue, never changed under a policy that keeps an old one."""

from __future__ import annotations

import numpy as np
import pytest

import policies
from orca_jax import Request, Scheduler, SchedulerConfig, StepLimits
from orca_jax.core.kv import KVConfig
from orca_jax.core.loop.scheduler_loop import NO_REQUESTS, appended
from orca_jax.core.requests.request import RequestState
from orca_jax.sim.cost_model import CostModelConfig
from orca_jax.sim.engine import SimEngine


def _indices(n: int) -> np.ndarray:
    indices = np.arange(n, dtype=np.int64)
    indices.setflags(write=False)
    return indices


def test_arrivals_end_to_end_widen_a_slice_and_anything_else_is_copied():
    indices = _indices(10)
    queue = appended(NO_REQUESTS, indices[2:4], indices)
    assert queue.tolist() == [2, 3] and np.shares_memory(queue, indices)
    queue = appended(queue, indices[4:6], indices)
    assert queue.tolist() == [2, 3, 4, 5] and np.shares_memory(queue, indices)
    head_admitted = queue[1:]  # what `Scheduler._admit` keeps when the head is admitted
    gap = appended(head_admitted, indices[7:8], indices)  # 6 went elsewhere: not adjacent
    assert gap.tolist() == [3, 4, 5, 7] and not np.shares_memory(gap, indices)
    assert not gap.flags.writeable
    filtered = appended(head_admitted, np.array([6, 8]), indices)  # not a slice
    assert filtered.tolist() == [3, 4, 5, 6, 8] and not filtered.flags.writeable
    assert appended(gap, indices[8:8], indices) is gap  # nobody arrived


@pytest.mark.parametrize("policy", ["vllm", "orca", "sjf"])
def test_the_queue_holds_exactly_the_waiting_requests_and_old_queues_never_change(policy):
    # Arrivals over time into a pool too small for all: admissions of the head, of
    # others (sjf), and preemptions (vllm) that sort a victim back into the queue.
    rng = np.random.default_rng(3)
    arrivals = np.cumsum(rng.exponential(0.004, size=60))
    requests = [Request(id=i, arrival_s=float(t), prompt_len=int(rng.integers(4, 40)),
                        output_len=int(rng.integers(20, 80))) for i, t in enumerate(arrivals)]
    config = SchedulerConfig(limits=StepLimits(max_num_seqs=6, max_model_len=128),
                             kv=KVConfig(num_kv_pages=16, prefix_caching="off"))
    scheduler = Scheduler(requests, policies.make_policy(policy, {}),
                          SimEngine(CostModelConfig(mode="fixed", step_time_s=0.01)), config)
    kept = []  # (a queue a policy saw, its values then)
    while scheduler.step():
        waiting = scheduler.waiting
        kept.append((waiting, waiting.copy()))
        state = scheduler.table.state
        assert waiting.tolist() == np.flatnonzero(state == RequestState.WAITING).tolist()
        assert not waiting.flags.writeable
    assert all(np.array_equal(queue, then) for queue, then in kept)
    # The slices ran too (not only the copies), the case this test is about.
    assert any(np.shares_memory(queue, scheduler.table.indices) for queue, _ in kept)
    assert scheduler.done
    if policy == "vllm":
        assert scheduler.record.num_preemptions > 0  # the copied path ran too
