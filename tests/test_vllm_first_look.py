"""vllm's admission looks at a head of the queue whose size is a guess (twice the last
step's admissions and one): any head decides the same, so a run's plans do not depend
on the guess, whether it is short (several looks), exact, or longer than the queue."""

import numpy as np
import pytest

import policies
from orca_jax import KVConfig, Request, Scheduler, SchedulerConfig, StepLimits
from orca_jax.sim.cost_model import CostModelConfig
from orca_jax.sim.engine import SimEngine

CONFIG = SchedulerConfig(limits=StepLimits(max_num_seqs=32, max_num_tokens=512,
                                           max_model_len=256),
                         kv=KVConfig(num_kv_pages=160, page_size=8))


def _plans(guess, chunked=True):
    """Every step's plan of a run in which the first look's guess is always `guess`
    (None: the policy's own)."""
    rng = np.random.default_rng(7)
    requests = [Request(id=i, arrival_s=float(t), prompt_len=int(p), output_len=int(o))
                for i, (t, p, o) in enumerate(zip(np.sort(rng.uniform(0, 0.5, 120)),
                                                  rng.integers(5, 120, 120),
                                                  rng.integers(1, 40, 120)))]
    policy = policies.make_policy("vllm", {"max_num_tokens": 512,
                                           "enable_chunked_prefill": str(chunked).lower()})
    plans = []
    schedule = policy.schedule

    def planned(view):
        if guess is not None:
            policy._last_admitted = guess
        plan = schedule(view)
        plans.append((plan.request_ids.tolist(), plan.num_tokens.tolist(),
                      plan.preempt.tolist()))
        return plan

    policy.schedule = planned
    scheduler = Scheduler(requests, policy, SimEngine(CostModelConfig()), CONFIG)
    result = scheduler.run()
    return plans, int(np.sum(result.num_preemptions))


@pytest.mark.parametrize("chunked", [True, False])
def test_the_first_looks_size_changes_no_plan(chunked):
    own, preemptions = _plans(None, chunked)
    assert max(len(ids) for ids, _, _ in own) > 8  # admissions beyond a short head happen
    assert preemptions > 0  # and the pool runs out: the preempting pass is taken too
    for guess in (0, 1, 3, 1000):
        assert _plans(guess, chunked) == (own, preemptions)
