"""Requests that did not finish are counted in the terminal, with their reasons (issue 51: 10
of 50 requests over the context vanished from a compare table without a line)."""

from __future__ import annotations

import policies
from experiments.terminal_table import fit_table
from orca_jax import KVConfig, Request, Scheduler, SchedulerConfig, StepLimits
from orca_jax.results.comparison import left_out_line
from orca_jax.results.summary import summarize_run
from orca_jax.sim.cost_model import CostModelConfig
from orca_jax.sim.engine import SimEngine

CONFIG = SchedulerConfig(limits=StepLimits(max_num_seqs=4, max_num_tokens=64, max_model_len=64),
                         kv=KVConfig(num_kv_pages=64, page_size=4))


def _run(lengths: list[tuple[int, int]]):
    requests = [Request(id=i, arrival_s=0.01 * i, prompt_len=p, output_len=o)
                for i, (p, o) in enumerate(lengths)]
    return Scheduler(requests, policies.make_policy("vllm", {}),
                     SimEngine(CostModelConfig(mode="fixed", step_time_s=0.01)), CONFIG).run()


def test_rejected_requests_are_counted_by_kind_of_reason_with_an_example():
    # Context 64: 70 + 4 and 60 + 10 do not fit; 10 + 4 and 20 + 4 do.
    result = _run([(10, 4), (70, 4), (20, 4), (60, 10)])
    assert left_out_line("vllm", result) == (
        'vllm: 2 of 4 requests rejected (2 like "prompt 70 + output 4 tokens exceed the '
        'context of 64"), 0 unfinished')
    assert left_out_line("vllm", _run([(10, 4), (20, 4)])) is None


def test_the_terminal_table_shows_rejections_only_where_a_run_has_some():
    rows = []
    for lengths in ([(10, 4), (20, 4)], [(10, 4), (70, 4)]):
        summary, _ = summarize_run(_run(lengths))
        rows.append({**summary, "policy": f"run{len(rows)}"})
    header = fit_table(rows).splitlines()[0].split()
    assert header[:4] == ["policy", "num_finished", "num_rejected", "output_tok_s"]
    assert "num_unfinished" not in header
    assert "num_rejected" not in fit_table(rows[:1]).splitlines()[0]
