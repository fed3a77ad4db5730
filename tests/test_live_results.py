"""A live run's streamed logs: every step in order, every request once, in finish order,
though rows go out in batches of iterations (`STREAM_EVERY_STEPS`)."""

import json

import numpy as np
import pytest

from orca_jax import KVConfig, Request, Scheduler, SchedulerConfig, StepLimits, make_policy
from orca_jax.results.row_lines import iter_step_lines
from orca_jax.results.run_folder import RunFolder
from orca_jax.results.summary import iter_request_rows
from orca_jax.runner import live_results
from orca_jax.runner.live_results import StreamResults
from orca_jax.sim.cost_model import CostModelConfig
from orca_jax.sim.engine import SimEngine


def _streamed_run(tmp_path, policy: str):
    requests = [Request(id=100 + i, arrival_s=0.013 * i, prompt_len=20 + 7 * (i % 5),
                        output_len=2 + (i * 7) % 23) for i in range(60)]
    config = SchedulerConfig(limits=StepLimits(max_num_seqs=4, max_num_tokens=128,
                                               max_model_len=256),
                             kv=KVConfig(num_kv_pages=128, page_size=8))
    engine = SimEngine(CostModelConfig(mode="fixed", step_time_s=0.01))
    scheduler = Scheduler(requests, make_policy(policy), engine, config)
    folder = RunFolder(tmp_path / "run")
    folder.begin({"policy": policy})
    stream = StreamResults(folder, scheduler)
    calls = []
    real_append = folder.append_lines
    folder.append_lines = lambda name, lines: (calls.append(name), real_append(name, lines))
    result = scheduler.run(progress=stream)
    stream.flush()
    folder.keep_streamed("steps.jsonl")
    folder.keep_streamed("requests.jsonl")
    steps = (folder.staging / "steps.jsonl").read_text().splitlines()
    finished = [json.loads(line) for line in
                (folder.staging / "requests.jsonl").read_text().splitlines()]
    folder.discard()
    return result, steps, finished, calls


@pytest.fixture(autouse=True)
def _short_batches(monkeypatch):
    """Batches of 32 iterations: the short runs here still write several."""
    monkeypatch.setattr(live_results, "STREAM_EVERY_STEPS", 32)


@pytest.mark.parametrize("policy", ["vllm", "static"])  # static defers release
@pytest.mark.parametrize("batch", [1, 1024])  # a write each STREAM_EVERY_STEPS, or at the end
def test_streamed_rows_are_the_run_s_rows_in_finish_order(tmp_path, monkeypatch, policy,
                                                          batch):
    monkeypatch.setattr(live_results, "STREAM_BATCH", batch)
    result, steps, finished, calls = _streamed_run(tmp_path, policy)
    assert result.num_steps > 3 * live_results.STREAM_EVERY_STEPS
    # Batched: about one write of each file per STREAM_EVERY_STEPS iterations, not one a step.
    assert calls.count("steps.jsonl") <= result.num_steps // live_results.STREAM_EVERY_STEPS + 1
    if batch == 1:
        assert calls.count("requests.jsonl") > 3
    assert steps == list(iter_step_lines(result))
    final = {row["id"]: row for row in iter_request_rows(result)}
    assert sorted(row["id"] for row in finished) == sorted(final)  # each once
    assert all(row == final[row["id"]] for row in finished)
    # Finish order; requests released together come by index (= id order here).
    keys = [(row["finish_s"], row["id"]) for row in finished]
    assert keys == sorted(keys)
    assert np.unique([row["finish_s"] for row in finished]).size > 1


def test_request_rows_wait_for_a_batch_or_for_the_file_to_be_due(tmp_path, monkeypatch):
    """Below `STREAM_BATCH` request rows none is written until the folder's streams are
    due to reach the file (`FLUSH_EVERY_S`), so a killed run loses no more than before;
    the steps go out every `STREAM_EVERY_STEPS` iterations all the same."""
    due = []
    monkeypatch.setattr(RunFolder, "flush_due", lambda self: bool(due))
    result, _, finished, calls = _streamed_run(tmp_path, "vllm")
    assert calls.count("requests.jsonl") == 1  # the end's flush only
    assert calls.count("steps.jsonl") == result.num_steps // live_results.STREAM_EVERY_STEPS + 1
    due.append(True)
    result, _, finished, calls = _streamed_run(tmp_path, "vllm")
    assert calls.count("requests.jsonl") > 3
    assert calls.index("requests.jsonl") < calls.index("steps.jsonl")  # first: sent at once
