"""Does a compiled step cost its bucket or its real tokens? Measured on the real engine.

    JAX_PLATFORMS=cpu python -m benchmarks.sim_padding > benchmarks/results/sim_padding.txt

The simulator prices a step as compiled by default (`CostModelConfig.step_padding=
"bucket"`: token-wise kernels on the bucket's T rows, the LM head on its S rows,
attention on the real lengths). This is the measurement that choice rests on: the
real JAX engine (`tiny` and `small`) runs one and the same content — a few decode
sequences at one context, or one short prefill chunk — in buckets of growing T, and
each bucket full of real tokens beside it. If the step's time followed its real
tokens, the same content would take the same time in every bucket; it follows T.

Each row is one content in one bucket: its real tokens, the step's median wall time
(and process CPU time, which a busy neighbour moves less), and the wall time as a
multiple of the same content's in the smallest bucket: 1 throughout would mean padded
rows cost nothing (`ragged` pricing); growth with T means they are paid (`bucket`).
The last columns say what the simulator's default (llama3-8b on an A100, per_op)
prices the same step at under each pricing: the GPU's absolute times, not the CPU's,
to show that `ragged` does not move with the bucket and `bucket` does (little while a
step's weights, not its rows, bound it).
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import jax
import numpy as np

from benchmarks.engine_step import PAGE_SIZE, _median_wall_and_cpu_s
from orca_jax.core.step.engine_api import Bucket
from orca_jax.core.step.packing import build_step_inputs
from orca_jax.model import weights
from orca_jax.model.engine import JaxEngine
from orca_jax.sim import cost_model
from orca_jax.specs.model_config import get_model_config

TOKEN_SIZES = (16, 64, 128, 256, 512)
NUM_SEQS = 16
CONTEXT = 256  # every sequence's context after the step (a longer chunk's: the chunk)


def contents(bucket_tokens: int) -> dict[str, np.ndarray]:
    """The steps timed in a bucket of `bucket_tokens`: `[num_seqs]` new tokens each."""
    return {"4 decodes": np.ones(4, np.int64),
            "16-token prefill": np.array([16], np.int64),
            "bucket full": np.array([bucket_tokens - (NUM_SEQS - 1)]
                                    + [1] * (NUM_SEQS - 1), np.int64)}


def context(q_lens: np.ndarray) -> np.ndarray:  # [num_seqs] -> [num_seqs]
    """Each sequence's context after the step: `CONTEXT`, or its chunk if that is longer."""
    return np.maximum(q_lens, CONTEXT)


def sim_ms(q_lens: np.ndarray,  # [num_seqs]
           bucket: Bucket, padding: str) -> float:
    """The simulator's default cost model's step milliseconds for these lengths."""
    config = cost_model.CostModelConfig(step_padding=padding)
    kv_lens = context(q_lens)
    padded_to = (bucket.num_tokens, bucket.num_seqs) if padding == "bucket" else None
    return 1e3 * cost_model.roofline_seconds(config, q_lens, kv_lens, padded_to)


def run_model(name: str, repeats: int) -> None:
    """Times each content in each bucket on `name`'s real engine and prints the table."""
    config = get_model_config(name)
    pages_per_seq = max(CONTEXT, TOKEN_SIZES[-1]) // PAGE_SIZE
    num_pages = NUM_SEQS * pages_per_seq + 1
    engine = JaxEngine(config, weights.init_params(config, seed=0), num_cache_pages=num_pages,
                       page_size=PAGE_SIZE, pages_per_seq=pages_per_seq)
    buckets = [Bucket(num_tokens=t, num_seqs=NUM_SEQS) for t in TOKEN_SIZES]
    engine.warmup(buckets)
    rows = np.arange(1, num_pages, dtype=np.int32).reshape(NUM_SEQS, pages_per_seq)
    rng = np.random.default_rng(0)
    print(f"\nmodel={name}: {NUM_SEQS} sequence slots, context {CONTEXT}, page size "
          f"{PAGE_SIZE}, {repeats} timed runs per step (load {os.getloadavg()[0]:.1f})")
    print(f"  {'content':>16} {'bucket T':>8} {'real':>5} {'wall ms':>8} {'cpu ms':>8} "
          f"{'x T=' + str(TOKEN_SIZES[0]):>7}   {'sim bucket ms':>13} {'sim ragged ms':>13}")
    for label in contents(TOKEN_SIZES[0]):
        first_wall = None
        for bucket in buckets:
            q_lens = contents(bucket.num_tokens)[label]
            ids = rng.integers(0, config.vocab_size, int(q_lens.sum())).astype(np.int32)
            inputs = build_step_inputs(bucket, num_tokens=q_lens,
                                       num_computed=context(q_lens) - q_lens,
                                       page_rows=rows[:q_lens.size], page_size=PAGE_SIZE,
                                       token_ids=ids)
            wall, cpu = _median_wall_and_cpu_s(lambda: engine.step(inputs), repeats)
            first_wall = first_wall or wall
            print(f"  {label:>16} {bucket.num_tokens:>8} {int(q_lens.sum()):>5} "
                  f"{wall * 1e3:8.2f} {cpu * 1e3:8.2f} {wall / first_wall:7.2f}   "
                  f"{sim_ms(q_lens, bucket, 'bucket'):13.3f} "
                  f"{sim_ms(q_lens, bucket, 'ragged'):13.3f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["tiny", "small"])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    print(f"# {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"jax {jax.__version__} on {jax.default_backend()}")
    for name in args.models:
        run_model(name, args.repeats)


if __name__ == "__main__":
    main()
