"""How often greedy tokens depend on the batch, and which reduction makes them (issue 33.5).

1. Tokens: the same burst of requests served by `orca` twice through one engine,
   once with a batch cap of 1 (every request alone in its steps) and once with a cap
   of `--batch` (decodes beside other decodes and prefill chunks); per model and
   dtype: the requests whose greedy tokens differ, the tokens that differ, and the
   mean output position of the first difference.
2. Which reduction: the same rows computed alone and inside a larger batch,
   compared bit for bit (max |difference|):
   * a bf16/fp32 projection `x @ W` (d_model x ffn), one row alone vs 1 of `--batch`:
     the matmul library picks tiles (and split-K) by the batch's size;
   * the attention op on one decode sequence alone vs beside `--batch - 1` others:
     the kernel's decode pass splits a sequence's KV by occupancy (few sequences:
     more splits, merged in another order; `docs/attention_kernel.md`), so its
     sum order follows the batch; with `num_kv_splits=1` forced it should not.
   On a CPU the attention rows use the kernel in interpret mode (`--dry_run`: tiny).

    python -m benchmarks.batch_invariance [--models tiny small] [--dtypes float32 bfloat16]
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from orca_jax import KVConfig, LoopFeatures, StepLimits
from orca_jax.core.api.policy import make_policy
from orca_jax.core.loop.scheduler import Scheduler, SchedulerConfig
from orca_jax.core.step.packing import bucket_config_for
from orca_jax.model import weights
from orca_jax.model.engine import JaxEngine
from orca_jax.specs.model_config import get_model_config
from orca_jax.workloads.synthetic import synthetic_workload

PAGE_SIZE = 16


def token_rates(name: str, dtype: str, args: argparse.Namespace) -> dict[str, Any]:
    """Part 1: alone vs batched greedy tokens of the same requests."""
    model = get_model_config(name)
    max_len = args.max_model_len
    attention = "pallas" if jax.default_backend() == "gpu" else "bucketed"
    engine = JaxEngine(model, weights.init_params(model, seed=0, dtype=jnp.dtype(dtype)),
                       num_cache_pages=args.batch * (max_len // PAGE_SIZE) + 1,
                       page_size=PAGE_SIZE, pages_per_seq=max_len // PAGE_SIZE,
                       dtype=jnp.dtype(dtype), attention=attention)
    requests = synthetic_workload(num_requests=args.num_requests, arrival="burst", rate=None,
                                  prompt_len=args.prompt_len, output_len=args.output_len,
                                  seed=0, vocab_size=model.vocab_size)
    outputs = {}
    for cap in (1, args.batch):
        config = SchedulerConfig(
            limits=StepLimits(max_num_seqs=cap, max_num_tokens=args.max_num_tokens,
                              max_model_len=max_len),
            kv=KVConfig(page_size=PAGE_SIZE, num_kv_pages=engine.num_cache_pages - 1),
            features=LoopFeatures(overlap=False))
        engine.warmup(bucket_config_for(max_num_tokens=args.max_num_tokens, max_num_seqs=cap,
                                        max_model_len=max_len, page_size=PAGE_SIZE).buckets())
        result = Scheduler(requests, make_policy("orca"), engine, config).run()
        outputs[cap] = [np.asarray(t) for t in result.output_tokens]
    alone, batched = outputs[1], outputs[args.batch]
    differ = [i for i, (a, b) in enumerate(zip(alone, batched)) if not np.array_equal(a, b)]
    first = [int(np.flatnonzero(alone[i] != batched[i])[0]) for i in differ]
    total = sum(len(a) for a in alone)
    tokens_differ = sum(int((a != b).sum()) for a, b in zip(alone, batched))
    return {"requests": len(alone), "requests_differ": len(differ), "tokens": total,
            "tokens_differ": tokens_differ,
            "mean_first_difference": float(np.mean(first)) if first else None}


def matmul_rows(dtype: str, d: int, f: int, batch: int) -> float:
    """max |x[:1] @ W - (x @ W)[:1]|: one row alone vs inside `batch` rows."""
    kx, kw = jax.random.split(jax.random.key(3))
    x = jax.random.normal(kx, (batch, d), jnp.dtype(dtype))
    w = jax.random.normal(kw, (d, f), jnp.dtype(dtype)) * d ** -0.5
    mm = jax.jit(lambda a, b: a @ b)
    alone = mm(x[:1], w).astype(jnp.float32)
    inside = mm(x, w)[:1].astype(jnp.float32)
    return float(jnp.max(jnp.abs(alone - inside)))


def attention_rows(dtype: str, batch: int, context: int, heads: tuple[int, int, int],
                   splits: Optional[int]) -> float:
    """max |out[0]| difference of one decode sequence alone vs beside `batch - 1` others
    (the same context each), through the kernel with `num_kv_splits=splits`."""
    from pallas_kernels.ragged_paged_attention import ragged_paged_attention
    from pallas_kernels.tiling import RaggedAttentionConfig

    hq, hkv, hd = heads
    pages_per_seq = context // PAGE_SIZE
    num_pages = batch * pages_per_seq + 1
    keys = jax.random.split(jax.random.key(5), 3)
    dt = jnp.dtype(dtype)
    k_pages = jax.random.normal(keys[0], (num_pages, PAGE_SIZE, hkv, hd), dt)
    v_pages = jax.random.normal(keys[1], (num_pages, PAGE_SIZE, hkv, hd), dt)
    q = jax.random.normal(keys[2], (batch, hq, hd), dt)
    table = jnp.arange(1, num_pages, dtype=jnp.int32).reshape(batch, pages_per_seq)
    config = None if splits is None else RaggedAttentionConfig(num_kv_splits=splits)
    interpret = jax.default_backend() != "gpu"

    def run(n: int) -> jax.Array:
        return ragged_paged_attention(
            q[:n], k_pages, v_pages, jnp.full((n,), context, jnp.int32), table[:n],
            jnp.arange(n + 1, dtype=jnp.int32), jnp.array([n], jnp.int32),
            sm_scale=hd ** -0.5, config=config, interpret=interpret)

    return float(jnp.max(jnp.abs(run(1)[0].astype(jnp.float32)
                                 - run(batch)[0].astype(jnp.float32))))


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["tiny", "small"])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--num_requests", type=int, default=64)
    parser.add_argument("--prompt_len", default="uniform:8:64")
    parser.add_argument("--output_len", default="uniform:32:96")
    parser.add_argument("--max_num_tokens", type=int, default=256)
    parser.add_argument("--max_model_len", type=int, default=256)
    parser.add_argument("--attention_context", type=int, default=4096)
    parser.add_argument("--dry_run", action="store_true",
                        help="tiny in float32, 8 requests, short outputs, small op shapes (any "
                        "backend)")
    args = parser.parse_args(argv)
    op_shape = dict(d=4096, f=14336, heads=(32, 8, 128))  # llama3-8b's
    if args.dry_run:
        # float32 only: the dry run checks the script runs end to end (a CI test); bf16's
        # second pass through the interpreted kernel would double its time for nothing new.
        args.models, args.dtypes, args.batch, args.num_requests = ["tiny"], ["float32"], 4, 8
        args.prompt_len, args.output_len, args.max_num_tokens = "uniform:4:12", "uniform:4:8", 16
        args.max_model_len, args.attention_context = 64, 64
        op_shape = dict(d=128, f=256, heads=(4, 2, 32))

    def log(line: str = "") -> None:
        print(line, flush=True)

    log(f"batch invariance on {jax.devices()[0].device_kind} ({jax.default_backend()}), "
        f"jax {jax.__version__}; orca, burst of {args.num_requests}, alone (cap 1) vs cap "
        f"{args.batch}; greedy")
    log(f"{'model':8s} {'dtype':9s} {'requests differ':>16s} {'tokens differ':>14s} "
        f"{'first diff at':>13s}")
    for name in args.models:
        for dtype in args.dtypes:
            r = token_rates(name, dtype, args)
            first = ("-" if r["mean_first_difference"] is None
                     else f"{r['mean_first_difference']:.1f}")
            log(f"{name:8s} {dtype:9s} {r['requests_differ']:>7d} of {r['requests']:<6d} "
                f"{r['tokens_differ']:>6d} of {r['tokens']:<6d} {first:>13s}")
    log(f"\none row alone vs inside {args.batch} (max |difference|; 0 = batch-invariant):")
    for dtype in args.dtypes:
        mm = matmul_rows(dtype, op_shape["d"], op_shape["f"], args.batch)
        att = attention_rows(dtype, args.batch, args.attention_context, op_shape["heads"], None)
        one = attention_rows(dtype, args.batch, args.attention_context, op_shape["heads"], 1)
        log(f"  {dtype:9s} projection {op_shape['d']}x{op_shape['f']}: {mm:.3g}; attention "
            f"at {args.attention_context}: splits by occupancy {att:.3g}, one split {one:.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
