"""The worked example of docs/writing_a_policy.md, loaded by path as a user would."""

from pathlib import Path

import numpy as np

from orca_jax import (
    KVConfig,
    Request,
    RequestState,
    Scheduler,
    SchedulerConfig,
    StepLimits,
    make_policy,
)
from orca_jax.sim.cost_model import CostModelConfig
from orca_jax.sim.engine import SimEngine

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "least_attained_service.py"


def test_example_fits_the_documented_size():
    assert len(EXAMPLE.read_text().splitlines()) < 40


def test_least_attained_service_round_robins_the_batch():
    policy = make_policy(f"{EXAMPLE}:LeastAttainedService", {"max_running": "4"})
    assert policy.name == "las" and policy.max_running == 4
    requests = [Request(id=i, arrival_s=0.0, prompt_len=4, output_len=n)
                for i, n in enumerate([6, 3, 5, 4])]
    config = SchedulerConfig(limits=StepLimits(max_num_seqs=2, max_num_tokens=16, max_model_len=32),
                             kv=KVConfig(num_kv_pages=64, page_size=4))
    engine = SimEngine(CostModelConfig(mode="fixed", model="tiny", step_time_s=0.01))
    scheduler = Scheduler(requests, policy, engine, config)
    scheduler.run()
    assert (scheduler.table.state == RequestState.FINISHED).all()
    token_req, token_time = scheduler.record.token_log()
    # Two slots, least attained first: every request has its first token (step 2 at the
    # latest) before any request gets its third.
    first = np.array([token_time[token_req == i][0] for i in range(4)])
    third = np.array([token_time[token_req == i][2] for i in range(4)])
    assert first.max() < third.min()
    assert first.tolist() == [0.01, 0.01, 0.02, 0.02]
