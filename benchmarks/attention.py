"""Ragged paged attention against dense padded XLA attention, on a mixed and a decode batch.

Cases (LLaMA-3-8B heads: 32 query heads, 8 KV heads, head_dim 128; pages of 16):
  * mixed: 63 decodes at contexts uniform in [256, 4096] plus one 512-token
    prefill chunk — a continuous-batching step;
  * decode: 64 decodes at a 4,096-token context.
Implementations:
  * pallas: the Pallas kernel (GPU; `--interpret` runs it on a CPU, slowly);
  * reference: the jnp ragged reference (what the engine uses off a GPU);
  * dense: what a padded engine does — every sequence's queries padded to the
    longest chunk and its KV gathered to the longest context, then masked
    attention over [S, max_q, max_kv].
Printed per case and implementation: median seconds over `--iters` runs after a
warm-up, real (ragged) FLOPs and the dense one's padded FLOPs, KV bytes read,
the achieved KV bandwidth, and the speed-up over dense. On a CPU, `--scale`
shrinks the contexts (default 1/8) so the run takes seconds.

    python benchmarks/attention.py                  # CPU: reference vs dense, 1/8 contexts
    python benchmarks/attention.py --scale 1        # GPU: full contexts, pallas included

The H200 check (correctness against float64, every kernel config, bandwidth against a
measured ceiling) is `python3 -m benchmarks.attention_gpu`; docs/attention_kernel.md.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import ragged_paged_attention as rpa

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE = 32, 8, 128, 16


def make_case(name: str, scale: float, dtype: jnp.dtype, seed: int = 0) -> dict:
    """The step's arrays: flat queries, a page pool, and the ragged layout."""
    rng = np.random.default_rng(seed)
    if name == "mixed":
        kv = rng.integers(256, 4097, size=63)
        q_lens = np.append(np.ones(63, np.int64), 512)
        kv = np.append(kv, 2048)  # the chunk continues a prompt: 1,536 cached + 512 new
    else:
        kv = np.full(64, 4096)
        q_lens = np.ones(64, np.int64)
    kv = np.maximum((kv * scale).astype(np.int64), q_lens)
    q_lens = np.minimum(q_lens, kv)
    pages_per_seq = int(-(-kv.max() // PAGE_SIZE))
    num_pages = int(sum(-(-k // PAGE_SIZE) for k in kv)) + 1
    perm = rng.permutation(np.arange(1, num_pages))  # scattered pages, page 0 unused
    page_indices = np.zeros((kv.size, pages_per_seq), np.int32)
    start = 0
    for i, k in enumerate(kv):
        n = int(-(-k // PAGE_SIZE))
        page_indices[i, :n] = perm[start:start + n]
        start += n
    total = int(q_lens.sum())
    keys = jax.random.split(jax.random.key(seed), 3)
    return dict(
        q=jax.random.normal(keys[0], (total, NUM_Q_HEADS, HEAD_DIM), dtype),
        k_pages=jax.random.normal(keys[1], (num_pages, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM), dtype),
        v_pages=jax.random.normal(keys[2], (num_pages, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM), dtype),
        kv_lens=jnp.asarray(kv, jnp.int32), page_indices=jnp.asarray(page_indices),
        cu_q_lens=jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32),
        num_seqs=jnp.asarray([kv.size], jnp.int32), q_lens_np=q_lens, kv_np=kv)


def dense_padded_attention(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *,
                           sm_scale: float, max_q: int):
    """Pads every sequence to [max_q, max_kv] and runs masked dense attention (the baseline)."""
    del num_seqs
    num_seq, pages_per_seq = page_indices.shape
    max_kv = pages_per_seq * PAGE_SIZE
    k = k_pages[page_indices].reshape(num_seq, max_kv, NUM_KV_HEADS, HEAD_DIM)  # [S, K, Hkv, D]
    v = v_pages[page_indices].reshape(num_seq, max_kv, NUM_KV_HEADS, HEAD_DIM)
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    rows = cu_q_lens[:-1, None] + jnp.arange(max_q)[None, :]  # [S, max_q]
    q_valid = jnp.arange(max_q)[None, :] < q_lens[:, None]
    qd = jnp.where(q_valid[..., None, None], q[jnp.minimum(rows, q.shape[0] - 1)], 0)
    group = NUM_Q_HEADS // NUM_KV_HEADS
    qd = qd.reshape(num_seq, max_q, NUM_KV_HEADS, group, HEAD_DIM)
    scores = jnp.einsum("sqhgd,skhd->shgqk", qd, k, preferred_element_type=jnp.float32)
    pos = (kv_lens - q_lens)[:, None] + jnp.arange(max_q)[None, :]  # [S, max_q]
    mask = jnp.arange(max_kv)[None, None, :] <= pos[:, :, None]  # [S, max_q, K]
    scores = jnp.where(mask[:, None, None], scores * sm_scale, -1e30)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("shgqk,skhd->sqhgd", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(num_seq, max_q, NUM_Q_HEADS, HEAD_DIM)


def time_it(fn: Callable[[], jax.Array], iters: int) -> float:
    jax.block_until_ready(fn())  # compile and warm up
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    on_gpu = jax.default_backend() == "gpu"
    parser.add_argument("--scale", type=float, default=1.0 if on_gpu else 0.125,
                        help="multiplies every context length")
    parser.add_argument("--iters", type=int, default=20 if on_gpu else 3)
    parser.add_argument("--dtype", default="bfloat16" if on_gpu else "float32")
    parser.add_argument("--interpret", action="store_true",
                        help="also time the Pallas kernel in interpret mode off a GPU")
    args = parser.parse_args()
    dtype = jnp.dtype(args.dtype)
    sm_scale = HEAD_DIM ** -0.5
    print(f"ragged paged attention on {jax.devices()[0].device_kind} ({jax.default_backend()}), "
          f"jax {jax.__version__}, {args.dtype}, context scale {args.scale}, "
          f"median of {args.iters}")
    for name in ("mixed", "decode"):
        case = make_case(name, args.scale, dtype)
        q_lens, kv = case.pop("q_lens_np"), case.pop("kv_np")
        max_q = int(q_lens.max())
        width = case["page_indices"].shape[1] * PAGE_SIZE
        real_flops = int(4 * NUM_Q_HEADS * HEAD_DIM * np.sum(q_lens * (kv - (q_lens - 1) / 2)))
        dense_flops = int(4 * NUM_Q_HEADS * HEAD_DIM * kv.size * max_q * width)
        kv_bytes = int(2 * kv.sum() * NUM_KV_HEADS * HEAD_DIM * dtype.itemsize)
        # The arrays are arguments, not closed-over constants, so XLA cannot fold them away.
        impls: dict[str, Callable[..., jax.Array]] = {
            "reference": jax.jit(functools.partial(rpa.ragged_paged_attention_reference,
                                                   sm_scale=sm_scale)),
            "dense": jax.jit(functools.partial(dense_padded_attention, sm_scale=sm_scale,
                                               max_q=max_q)),
        }
        if on_gpu or args.interpret:
            impls["pallas"] = jax.jit(functools.partial(
                rpa.ragged_paged_attention, sm_scale=sm_scale, interpret=not on_gpu))
        print(f"\n{name}: {kv.size} sequences, {int(q_lens.sum())} query tokens, contexts "
              f"{int(kv.min())}-{int(kv.max())}; ragged {real_flops / 1e9:.2f} GFLOP, dense "
              f"padded {dense_flops / 1e9:.2f} GFLOP ({dense_flops / real_flops:.0f}x), KV "
              f"{kv_bytes / 1e6:.1f} MB (dense reads {width * kv.size / kv.sum():.1f}x)")
        times = {impl: time_it(functools.partial(fn, **case), args.iters)
                 for impl, fn in impls.items()}
        print(f"{'impl':>10} {'median ms':>10} {'TFLOP/s':>9} {'KV GB/s':>9} {'vs dense':>9}")
        for impl, seconds in times.items():
            print(f"{impl:>10} {seconds * 1e3:>10.3f} {real_flops / seconds / 1e12:>9.3f} "
                  f"{kv_bytes / seconds / 1e9:>9.1f} {times['dense'] / seconds:>8.2f}x")


if __name__ == "__main__":
    main()
