"""The worked example of docs/writing_a_policy.md, loaded by path as a user would."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from orca_jax import (
    KVConfig,
    PolicyLoadError,
    Request,
    RequestState,
    Scheduler,
    SchedulerConfig,
    StepLimits,
    make_policy,
)
from orca_jax.sim.cost_model import CostModelConfig
from orca_jax.sim.engine import SimEngine

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "least_attained_service.py"


def test_the_docs_show_the_example_as_it_is_with_its_line_count():
    text, doc = EXAMPLE.read_text(), (REPO / "docs" / "writing_a_policy.md").read_text()
    assert f"```python\n{text}```" in doc
    lines = len(text.splitlines())
    assert lines < 40 and re.search(rf"least_attained_service\.py` \({lines} lines\)", doc)


def test_a_request_that_does_not_fit_takes_no_seat_from_one_that_does(tmp_path):
    # The issue-25 command: a batch cap of 1, and a pool of 16 pages that one request's
    # reservation (its 256-token context) fills. The waiting request ranks first (it has
    # generated nothing) but does not fit; the ranking once was cut to the cap before the
    # fit was checked, so nothing ran and the run ended in `no_progress`.
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "-m", "experiments.run", "--engine=sim",
         f"--policy={EXAMPLE}:LeastAttainedService", "--max_num_seqs=1", "--max_model_len=256",
         "--num_kv_pages=16", "--workload=burst", "--num_requests=2", "--prompt_len=fixed:10",
         "--output_len=fixed:10", "--log_step_requests", f"--out_dir={out}"],
        cwd=REPO, env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True,
        timeout=120)
    assert done.returncode == 0, done.stderr
    steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    # One after the other, each whole: 10 prompt tokens, then 9 decodes.
    assert [step["request_ids"] for step in steps] == [[0]] * 10 + [[1]] * 10


def test_it_never_preempts_so_it_refuses_pages_on_demand():
    with pytest.raises(PolicyLoadError, match="kv_reservation 'none'"):
        make_policy(f"{EXAMPLE}:LeastAttainedService", {"kv_reservation": "none"})


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
