"""The two pictures every explanation of continuous batching draws, as exact numbers.

(a) Four requests needing 100, 200, 300 and 1,000 output tokens, all at t=0,
    5 ms per step. Static batching returns every answer when the longest is
    done, at 5.0 s; continuous (iteration-level) batching returns each as soon
    as it is done: 0.5, 1.0, 1.5 and 5.0 s.
(b) Four slots and twelve requests of mixed lengths, all at t=0: static
    batching runs three batches, each as long as its longest member (17 + 20 +
    19 = 56 steps); continuous batching refills a slot the step after it
    frees, so it needs 40 steps and requests wait less to start. The slot
    timeline of (b) is drawn to OUT_DIR/seed_timeline.png, or to --figure
    (static above, continuous below; the docs show docs/figures/seed_timeline.png).

    python -m experiments.reproduce.seed_examples [--out_dir=DIR] [--figure=PNG]
"""

from __future__ import annotations

import os
from typing import Sequence

import numpy as np
from absl import flags

import policies
from experiments.cli_errors import clean_errors, run_command
from experiments.reproduce.common import figure_path
from orca_jax import KVConfig, LoopFeatures, Request, Scheduler, SchedulerConfig, StepLimits
from orca_jax.core.requests.run_result import RunResult
from orca_jax.results.metrics import format_table
from orca_jax.results.plots import SlotTimeline, plot_slot_timelines, slot_timeline
from orca_jax.sim.cost_model import CostModelConfig
from orca_jax.sim.engine import SimEngine

STEP_S = 0.005
EXAMPLE_A_OUTPUTS = (100, 200, 300, 1000)
# Twelve requests for four slots, long and short ones interleaved: the seed's toy server,
# 56 steps static, 40 continuous.
EXAMPLE_B_OUTPUTS = (7, 9, 5, 17, 20, 3, 16, 1, 8, 4, 10, 19)
PROMPT_LEN = 4
TIMELINE = "seed_timeline.png"  # under --out_dir (docs/figures/ has the documented one)
OUT_DIR = "runs/reproduce/seed_examples"


def _run(policy: str, outputs: Sequence[int], slots: int) -> RunResult:
    requests = [Request(id=i, arrival_s=0.0, prompt_len=PROMPT_LEN, output_len=n)
                for i, n in enumerate(outputs)]
    config = SchedulerConfig(limits=StepLimits(max_num_seqs=slots, max_num_tokens=64,
                                               max_model_len=2048),
                             kv=KVConfig(num_kv_pages=4 * 2048 // 16, page_size=16),
                             features=LoopFeatures(log_step_requests=True))
    engine = SimEngine(CostModelConfig(mode="fixed", model="tiny", step_time_s=STEP_S))
    return Scheduler(requests, policies.make_policy(policy), engine, config).run()


def example_a() -> dict[str, list[float]]:
    """Seconds at which each answer of example (a) returns, per policy."""
    return {policy: [round(float(t), 9) for t in _run(policy, EXAMPLE_A_OUTPUTS, 4).finish_s]
            for policy in ("static", "orca")}


def example_b() -> list[dict[str, object]]:
    """Steps and mean waiting of example (b), per policy."""
    rows = []
    for policy in ("static", "orca"):
        result = _run(policy, EXAMPLE_B_OUTPUTS, 4)
        waiting_steps = (result.first_scheduled_s - result.arrival_s) / STEP_S
        latency_steps = (result.finish_s - result.arrival_s) / STEP_S
        rows.append({"policy": policy, "num_steps": result.num_steps,
                     "mean_wait_steps": round(float(np.mean(waiting_steps)), 6),
                     "mean_latency_steps": round(float(np.mean(latency_steps)), 6),
                     "mean_batch_size": round(float(np.mean(
                         result.step_array("num_seqs"))), 6)})
    return rows


def write_timeline(path: str) -> tuple[dict[str, SlotTimeline], bool]:
    """Slot timelines of example (b), static above continuous, drawn to `path`.

    Returns:
      The timelines by policy, and whether the figure was written (False
      without matplotlib).
    """
    timelines = {policy: slot_timeline(_run(policy, EXAMPLE_B_OUTPUTS, 4), num_slots=4)
                 for policy in ("static", "orca")}
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    drawn = plot_slot_timelines(
        [timelines["static"], timelines["orca"]], path,
        ["static batching (request-level)", "continuous batching (orca, iteration-level)"])
    return timelines, drawn


def define_flags() -> None:
    """The command's flags (defined only when it runs, so importing it defines none)."""
    for name, default, text in (
            ("out_dir", OUT_DIR, "where the slot timeline goes"),
            ("figure", None, f"the PNG to write (default: OUT_DIR/{TIMELINE}; the docs show "
                             f"docs/figures/{TIMELINE})")):
        if name not in flags.FLAGS:
            flags.DEFINE_string(name, default, text)


@clean_errors()
def main(argv: list[str]) -> None:
    del argv
    answers = example_a()
    print(f"(a) outputs {EXAMPLE_A_OUTPUTS} tokens at {STEP_S * 1e3:g} ms per step; "
          "answers return at (s):")
    for policy, times in answers.items():
        print(f"  {policy:7s} {', '.join(f'{t:.1f}' for t in times)}")
    print(f"\n(b) 4 slots, 12 requests with outputs {EXAMPLE_B_OUTPUTS} tokens:")
    print(format_table(example_b(), ["policy", "num_steps", "mean_wait_steps",
                                     "mean_latency_steps", "mean_batch_size"]))
    path = figure_path(flags.FLAGS.figure, flags.FLAGS.out_dir or OUT_DIR, TIMELINE)
    _, drawn = write_timeline(path)
    print(f"\nslot timeline: {path}" if drawn
          else "\nmatplotlib is not installed: no slot timeline figure")


if __name__ == "__main__":
    define_flags()
    run_command(main)
