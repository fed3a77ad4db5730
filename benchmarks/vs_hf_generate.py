"""Our engine (orca, batch cap 16, wall clock) vs HF transformers `generate` in static
batches of 16, on the same random LLaMA saved as safetensors and the same burst.

One run: writes the `small` preset (4 layers, d=256, vocab 2,048) with random
weights to a LLaMA-format folder (config.json + model.safetensors); draws a burst
of requests (all arrive at t=0); HF `generate` (greedy, fp32) serves them in
arrival order in static batches of 16, left-padded, each batch generating its
longest member's output (shorter members' extra tokens are not counted); then
our engine loads the same folder and serves the same requests with `orca`.
Printed: useful output tokens/s of each (end-to-end wall clock of the serving
loop, after both have loaded and, for ours, compiled), our busy time (sum of
step_s + host_s) as the issue counts it, the ratio, and how many requests got
the very same greedy tokens from both. Each side's process CPU seconds (all its
threads) are printed too: on a shared machine a neighbour stretches the wall
clock of both, and the CPU seconds say how much work each side did.

Needs `torch` and `transformers` (not dependencies of orca_jax); without them it
says so and exits 0.

    python benchmarks/vs_hf_generate.py [--num_requests 64] [--output_len uniform:16:128]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import tempfile
import time

import numpy as np

from orca_jax.model import weights
from orca_jax.runner.build import build_engine, build_workload, scheduler_config
from orca_jax.runner.experiment import run_policy
from orca_jax.runner.spec import JaxEngineSpec, LimitsSpec, RunSpec, WorkloadSpec
from orca_jax.specs.model_config import get_model_config, to_hf_config

BATCH = 16


def write_model(folder: str, seed: int) -> None:
    """The `small` preset with random weights, as a LLaMA-format folder."""
    from safetensors.numpy import save_file

    config = get_model_config("small")
    params = weights.init_params(config, seed=seed)
    with open(os.path.join(folder, "config.json"), "w", encoding="utf-8") as f:
        json.dump(to_hf_config(config), f)
    save_file(weights.hf_state_dict(config, params), os.path.join(folder, "model.safetensors"))


def run_hf(folder: str, requests: list, threads: int
           ) -> tuple[float, float, list[list[int]]]:
    """Wall and process CPU seconds HF `generate` takes for all static batches on
    `threads` torch threads, and each request's tokens."""
    import torch
    from transformers import LlamaForCausalLM

    torch.set_num_threads(threads)
    model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    batches = [requests[i:i + BATCH] for i in range(0, len(requests), BATCH)]

    def generate(batch):
        width = max(r.prompt_len for r in batch)
        ids = np.zeros((len(batch), width), np.int64)
        mask = np.zeros((len(batch), width), np.int64)
        for row, r in enumerate(batch):  # left padding: every prompt ends at the last column
            ids[row, width - r.prompt_len:] = r.prompt_tokens
            mask[row, width - r.prompt_len:] = 1
        new = max(r.output_len for r in batch)
        with torch.inference_mode():
            out = model.generate(torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                                 max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                 pad_token_id=0, eos_token_id=None)
        return [out[row, width:width + r.output_len].tolist() for row, r in enumerate(batch)]

    generate(batches[0][:2])  # one small warm-up call: first-call allocations are not serving
    start, cpu_start = time.perf_counter(), time.process_time()
    tokens = [t for batch in batches for t in generate(batch)]
    return time.perf_counter() - start, time.process_time() - cpu_start, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num_requests", type=int, default=64)
    parser.add_argument("--prompt_len", default="uniform:16:128")
    parser.add_argument("--output_len", default="uniform:16:128")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hf_threads", type=int, nargs="+", default=None,
                        help="torch thread counts to try (default: 1 and all cpus); the "
                             "ratio is taken against HF's best (torch's spinning threads "
                             "collapse on a shared machine)")
    args = parser.parse_args()
    try:
        import torch
        import transformers
    except ImportError as e:
        print(f"vs_hf_generate: skipped, {e.name} is not installed "
              "(pip install torch transformers)")
        return
    threads = os.cpu_count() or 1
    print(f"vs HF generate: python {platform.python_version()}, torch {torch.__version__}, "
          f"transformers {transformers.__version__}, {threads} cpus, "
          f"load {os.getloadavg()[0]:.1f}")
    spec = RunSpec(
        workload=WorkloadSpec(num_requests=args.num_requests, rate=1000.0,
                              prompt_len=args.prompt_len, output_len=args.output_len),
        engine=JaxEngineSpec(model="small", clock="wall"),  # checkpoint set below
        limits=LimitsSpec(max_num_seqs=BATCH, max_num_tokens=256), seed=args.seed)
    with tempfile.TemporaryDirectory() as folder:
        write_model(folder, args.seed)
        spec = dataclasses.replace(spec, engine=dataclasses.replace(spec.engine,
                                                                    checkpoint=folder))
        # A burst: every request is there at t=0, as HF's static batches assume.
        requests = [dataclasses.replace(r, arrival_s=0.0) for r in build_workload(spec)]
        useful = sum(r.output_len for r in requests)
        print(f"workload: {len(requests)} requests at t=0, prompt {args.prompt_len}, output "
              f"{args.output_len} ({useful} output tokens); model small (random, fp32, "
              "safetensors); greedy")
        hf_runs = {}
        for count in args.hf_threads or sorted({1, threads}):
            hf_runs[count] = run_hf(folder, requests, count)
            print(f"HF generate, static batches of {BATCH}, {count} torch threads: "
                  f"{hf_runs[count][0]:.2f} s, {useful / hf_runs[count][0]:.1f} output tok/s; "
                  f"cpu {hf_runs[count][1]:.2f} s (load {os.getloadavg()[0]:.1f})")
        hf_s, hf_cpu_s, hf_tokens = min(hf_runs.values(), key=lambda run: run[0])
        engine = build_engine(spec, scheduler_config(spec))
        # The first run compiles the buckets; the timed one is the serving loop alone.
        run_policy(spec, "orca", requests=requests, engine=engine, progress=False)
        start, cpu_start = time.perf_counter(), time.process_time()
        summary, result = run_policy(spec, "orca", requests=requests, engine=engine,
                                     progress=False)
        ours_s, ours_cpu_s = time.perf_counter() - start, time.process_time() - cpu_start
        busy_s = sum(s.step_s + s.host_s for s in result.steps)
        print(f"orca_jax orca, batch cap {BATCH}, --clock=wall: {ours_s:.2f} s end to end, "
              f"{useful / ours_s:.1f} output tok/s; busy (sum step_s + host_s) {busy_s:.2f} s, "
              f"{useful / busy_s:.1f} tok/s; cpu {ours_cpu_s:.2f} s; "
              f"{summary['num_steps']} steps, "
              f"compiles {engine.facts()['num_compiles']} (load {os.getloadavg()[0]:.1f})")
        print(f"ratio ours / HF's best: {hf_s / ours_s:.2f}x end to end, "
              f"{hf_s / busy_s:.2f}x busy, {hf_cpu_s / ours_cpu_s:.2f}x in cpu seconds")
        ours = dict(zip(result.request_ids, (t.tolist() for t in result.output_tokens)))
        same = sum(ours[r.id] == hf for r, hf in zip(requests, hf_tokens))
        print(f"identical greedy tokens: {same}/{len(requests)} requests")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
