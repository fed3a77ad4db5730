"""Where a real engine step's time goes on this CPU: the step vs its parts, vs a roofline.

For each model (`tiny`, `small`) and bucket (16 decode sequences; 128 and 256
tokens of prefill beside decodes), at each context length, one run times:

- the whole step (`JaxEngine.step`, wall clock: transfer in, compiled step,
  sampled tokens back) with the old attention (`reference`, the ragged jnp loop)
  and the new (`--new`: `bucketed` on a CPU, the Pallas kernel on a GPU), and
  checks both sample the same greedy tokens;
- its parts, each jitted alone on the same shapes: embedding; projections and
  MLP (every layer with attention stubbed out); KV write + attention (every
  layer, old and new op); LM head + sampling; host-side packing
  (`build_step_inputs`; the engine hands the host arrays to the compiled step,
  so their transfer is inside the step's time);
- a roofline for each part: max(FLOPs / measured matmul GFLOP/s, bytes /
  measured copy bandwidth), both measured here first.

With `--old_rev REV` (a git revision of this repository), the whole step of the
engine as it was at REV (its `reference` attention: the path an issue measured
on that day) is timed too, in a child process on the same shapes and pages, and
its greedy tokens are compared with the new step's.

Medians of `--repeats` timed runs after one warm run. The load average is
printed beside the figures: the machine may be shared, so each whole step also
gets its process CPU time (median over the same runs; XLA's threads included),
which a busy neighbour inflates far less than the wall clock.

    python -m benchmarks.engine_step [--models tiny small] [--kv_lens 128 1024] [--new auto]
        [--old_rev 8729958]  # the engine issue 18 measured
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks.old_revision import revision_tree, tree_env
from orca_jax.core.step.engine_api import Bucket
from orca_jax.core.step.packing import build_step_inputs
from orca_jax.model import llama as model_lib
from orca_jax.model import sampling, weights
from orca_jax.model.engine import JaxEngine
from orca_jax.specs.model_config import get_model_config

PAGE_SIZE = 16
BUCKETS = (Bucket(num_tokens=16, num_seqs=16), Bucket(num_tokens=128, num_seqs=16),
           Bucket(num_tokens=256, num_seqs=16))


def _median_s(fn: Callable[[], object], repeats: int) -> float:
    """Median wall seconds of `fn()` (which blocks on its result) after one warm call."""
    return _median_wall_and_cpu_s(fn, repeats)[0]


def _median_wall_and_cpu_s(fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    """Median wall and median process CPU seconds of `fn()`, after one warm call."""
    fn()
    walls, cpus = [], []
    for _ in range(repeats):
        start, cpu_start = time.perf_counter(), time.process_time()
        fn()
        walls.append(time.perf_counter() - start)
        cpus.append(time.process_time() - cpu_start)
    return statistics.median(walls), statistics.median(cpus)


def measure_machine(repeats: int) -> tuple[float, float]:
    """This CPU's fp32 matmul GFLOP/s (1024^2 jitted matmul) and copy GB/s (64 MiB)."""
    n = 1024
    a = jnp.ones((n, n), jnp.float32)
    matmul = jax.jit(lambda x: x @ x)
    gflops = 2 * n ** 3 / _median_s(lambda: matmul(a).block_until_ready(), repeats) / 1e9
    # Donated, so each pass reads and writes one resident buffer: a fresh 64 MiB output
    # every call measured the kernel's page faults instead (2.6 GB/s where numpy copies
    # at ~30 GB/s), and made every memory roofline below 10x too slow.
    held = {"x": jnp.ones((16 << 20,), jnp.float32)}
    nbytes = held["x"].nbytes
    scale = jax.jit(lambda x: x * 1.0001, donate_argnums=0)

    def copy() -> None:
        held["x"] = scale(held["x"])
        held["x"].block_until_ready()

    gbs = 2 * nbytes / _median_s(copy, repeats) / 1e9
    return gflops, gbs


def _step_shape(bucket: Bucket, kv_len: int) -> tuple[np.ndarray, np.ndarray]:
    """New and cached tokens per sequence: all decodes, or one prefill chunk beside
    `num_seqs - 1` decodes, every sequence ending at `kv_len`."""
    s = bucket.num_seqs
    q_lens = np.ones(s, np.int64)
    q_lens[0] = min(bucket.num_tokens - (s - 1), kv_len)
    return q_lens, kv_len - q_lens


def _parts(config, graphdef, params, held, inputs, attention_ops):
    """Jitted part functions on `inputs`' shapes: name -> zero-argument blocking call."""
    model = nnx.merge(graphdef, params)
    inv_freq = model_lib.rope_inv_freq(config)
    scale = config.head_dim ** -0.5
    x0 = model.embed_tokens(inputs.token_ids)

    embed = jax.jit(lambda ids: model.embed_tokens(ids))

    @jax.jit
    def dense(x, positions):  # every layer's projections and MLP; attention out := q
        for layer in model.layers:
            q, _, _ = layer.qkv(x, positions, inv_freq)
            x = layer.finish(x, q)
        return x

    qkv = [layer.qkv(x0, inputs.positions, inv_freq) for layer in model.layers]

    def attend_all(op, kv_cache, step):  # every layer's KV write and attention
        outs, new_k, new_v = [], [], []
        for (q, k, v), k_pages, v_pages in zip(qkv, kv_cache.k, kv_cache.v):
            k_pages = model_lib.write_kv(k_pages, k, step.slot_mapping)
            v_pages = model_lib.write_kv(v_pages, v, step.slot_mapping)
            outs.append(op(q, k_pages, v_pages, step.kv_lens, step.page_indices,
                           step.cu_q_lens, step.num_seqs, sm_scale=scale))
            new_k.append(k_pages)
            new_v.append(v_pages)
        return model_lib.KVCache(tuple(new_k), tuple(new_v)), outs

    def run_attention(fn):
        held["cache"], outs = fn(held["cache"], inputs)
        return jax.block_until_ready(outs)

    @jax.jit
    def head(x, step):
        logits = model.logits(x[step.sample_indices])
        return sampling.sample_tokens(logits, step.positions[step.sample_indices] + 1,
                                      step.temperature, step.top_k, step.top_p, step.rng_seeds)

    parts = {"embedding": lambda: embed(inputs.token_ids).block_until_ready(),
             "projections+MLP": lambda: dense(x0, inputs.positions).block_until_ready()}
    for name, op in attention_ops.items():
        fn = jax.jit(functools.partial(attend_all, model_lib.attention_op(op)),
                     donate_argnums=0)
        parts[f"KV write+attention ({name})"] = lambda fn=fn: run_attention(fn)
    parts["LM head+sampling"] = lambda: head(x0, inputs).block_until_ready()
    return parts


def _roofline(config, bucket: Bucket, kv_len: int, gflops: float, gbs: float
              ) -> dict[str, float]:
    """Seconds each part needs at best on this machine: max(compute, memory)."""
    d, hd, t, s = config.d_model, config.head_dim, bucket.num_tokens, bucket.num_seqs
    hq, hkv, layers = config.num_q_heads, config.num_kv_heads, config.num_layers
    layer_weights = d * hq * hd * 2 + 2 * d * hkv * hd + 3 * d * config.ffn_dim
    cached = s * kv_len  # KV positions read per layer (each sequence ends at kv_len)
    parts = {
        "embedding": (0.0, 2 * t * d * 4),
        "projections+MLP": (2 * t * layer_weights * layers, layer_weights * layers * 4),
        "KV write+attention": (4 * t * kv_len * hq * hd * layers,
                               2 * cached * hkv * hd * 4 * layers),
        "LM head+sampling": (2 * s * d * config.vocab_size, config.vocab_size * d * 4),
    }
    return {name: max(flops / (gflops * 1e9), nbytes / (gbs * 1e9))
            for name, (flops, nbytes) in parts.items()}


# Run in a child process against the code of another revision: the same shapes, pages
# and token ids as `run_model` (both draw them from `_step_cases` with the same seed),
# timed the same way; prints {"T,kv": [median seconds, tokens]} as JSON.
_OLD_STEP_TIMER = """
import json, statistics, sys, time
import numpy as np
from orca_jax.core.step.engine_api import Bucket
from orca_jax.core.step.packing import build_step_inputs
from orca_jax.model import weights
from orca_jax.model.engine import JaxEngine
from orca_jax.specs.model_config import get_model_config
name, page_size, pages_per_seq, repeats, cases = json.loads(sys.argv[1])
config = get_model_config(name)
engine = JaxEngine(config, weights.init_params(config, seed=0), attention="reference",
                   num_cache_pages=16 * pages_per_seq + 1, page_size=page_size,
                   pages_per_seq=pages_per_seq)
buckets = sorted({(c["T"], c["S"]) for c in cases})
engine.warmup([Bucket(num_tokens=t, num_seqs=s) for t, s in buckets])
out = {}
for c in cases:
    inputs = build_step_inputs(Bucket(num_tokens=c["T"], num_seqs=c["S"]),
                               num_tokens=np.array(c["q_lens"]),
                               num_computed=np.array(c["computed"]),
                               page_rows=np.array(c["rows"], np.int32), page_size=page_size,
                               token_ids=np.array(c["ids"], np.int32))
    engine.step(inputs)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        tokens = engine.step(inputs).sampled_tokens
        times.append(time.perf_counter() - start)
    out[f"{c['T']},{c['kv']}"] = [statistics.median(times), np.asarray(tokens).tolist()]
print(json.dumps(out))
"""


def _step_cases(config, kv_lens: list[int], num_pages: int, pages_per_seq: int):
    """(bucket, kv_len, q_lens, cached, page rows, token ids) of every timed step, drawn
    from one seeded generator in a fixed order (the old revision's child gets the same)."""
    rng = np.random.default_rng(0)
    for kv_len in kv_lens:
        for bucket in BUCKETS:
            q_lens, computed = _step_shape(bucket, kv_len)
            rows = rng.permutation(np.arange(1, num_pages))[:16 * pages_per_seq]
            rows = rows.reshape(16, pages_per_seq)[:bucket.num_seqs].astype(np.int32)
            ids = rng.integers(0, config.vocab_size, int(q_lens.sum())).astype(np.int32)
            yield bucket, kv_len, q_lens, computed, rows, ids


def time_old_revision(rev: str, name: str, kv_lens: list[int], repeats: int
                      ) -> dict[str, tuple[float, list[int]]]:
    """Whole-step medians and sampled tokens of the engine at git revision `rev`
    (reference attention), by "T,kv_len", from a child process on that code."""
    config = get_model_config(name)
    pages_per_seq = max(kv_lens) // PAGE_SIZE
    cases = [{"T": b.num_tokens, "S": b.num_seqs, "kv": kv, "q_lens": q.tolist(),
              "computed": c.tolist(), "rows": r.tolist(), "ids": i.tolist()}
             for b, kv, q, c, r, i in _step_cases(config, kv_lens, 16 * pages_per_seq + 1,
                                                  pages_per_seq)]
    with revision_tree(rev, ("orca_jax", "pallas_kernels")) as folder:
        result = subprocess.run(
            [sys.executable, "-c", _OLD_STEP_TIMER,
             json.dumps([name, PAGE_SIZE, pages_per_seq, repeats, cases])],
            cwd=folder, env=tree_env(folder), capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"--old_rev {rev}: the old engine failed:\n{result.stderr[-2000:]}")
    return {key: (seconds, tokens) for key, (seconds, tokens) in
            json.loads(result.stdout.strip().splitlines()[-1]).items()}


def run_model(name: str, kv_lens: list[int], repeats: int, gflops: float, gbs: float,
              new_op: str, old_rev: Optional[str] = None) -> None:
    """Times `name`'s buckets at each context: the reference beside `new_op`, and the parts."""
    config = get_model_config(name)
    params = weights.init_params(config, seed=0)
    graphdef, _ = model_lib.abstract_model(config)
    pages_per_seq = max(kv_lens) // PAGE_SIZE
    num_pages = 16 * pages_per_seq + 1
    old = time_old_revision(old_rev, name, kv_lens, repeats) if old_rev else {}
    engines = {op: JaxEngine(config, params, num_cache_pages=num_pages, page_size=PAGE_SIZE,
                             pages_per_seq=pages_per_seq, attention=op)
               for op in ("reference", new_op)}
    for engine in engines.values():
        engine.warmup(list(BUCKETS))
    # Donated like the engine's cache (so writes update it in place): the part calls swap it.
    held = {"cache": model_lib.init_kv_cache(config, num_pages=num_pages, page_size=PAGE_SIZE)}
    for bucket, kv_len, q_lens, computed, rows, ids in _step_cases(config, kv_lens, num_pages,
                                                                    pages_per_seq):
        pack = functools.partial(build_step_inputs, bucket, num_tokens=q_lens,
                                 num_computed=computed, page_rows=rows,
                                 page_size=PAGE_SIZE, token_ids=ids)
        inputs = pack()
        timed = {op: _median_wall_and_cpu_s(lambda e=e: e.step(inputs), repeats)
                 for op, e in engines.items()}
        steps = {op: wall for op, (wall, _) in timed.items()}
        cpu = {op: cpu_s for op, (_, cpu_s) in timed.items()}
        tokens = {op: e.step(inputs).sampled_tokens for op, e in engines.items()}
        same = np.array_equal(tokens["reference"], tokens[new_op])
        host = _median_s(pack, repeats)
        parts = {part: _median_s(fn, repeats) for part, fn in
                 _parts(config, graphdef, params, held, jax.device_put(inputs),
                        {"old": "reference", "new": new_op}).items()}
        roof = _roofline(config, bucket, kv_len, gflops, gbs)
        load = os.getloadavg()[0]
        print(f"\n{name} bucket T={bucket.num_tokens} S={bucket.num_seqs}, every sequence "
              f"at context {kv_len} (load {load:.1f})")
        if old:
            old_s, old_tokens = old[f"{bucket.num_tokens},{kv_len}"]
            old_same = np.array_equal(old_tokens, tokens[new_op])
            print(f"  step at {old_rev:<14s} {old_s * 1e3:8.2f} ms   (the engine at that "
                  f"revision, reference attention)   {old_s / steps[new_op]:.2f}x slower than "
                  f"new; greedy tokens {'identical' if old_same else 'DIFFER'}")
        print(f"  step old (reference)   {steps['reference'] * 1e3:8.2f} ms   "
              f"(cpu {cpu['reference'] * 1e3:.2f} ms)")
        print(f"  step new ({new_op}){' ' * (12 - len(new_op))}"
              f"{steps[new_op] * 1e3:8.2f} ms   (cpu {cpu[new_op] * 1e3:.2f} ms)   "
              f"{steps['reference'] / steps[new_op]:.2f}x faster "
              f"(cpu {cpu['reference'] / cpu[new_op]:.2f}x); "
              f"greedy tokens {'identical' if same else 'DIFFER'}")
        print(f"  {'part':32s} {'measured ms':>12s} {'roofline ms':>12s}")
        for part, seconds in parts.items():
            best = roof.get(part.split(" (")[0])
            roof_text = f"{best * 1e3:12.3f}" if best is not None else f"{'':12s}"
            print(f"  {part:32s} {seconds * 1e3:12.3f} {roof_text}")
        print(f"  {'host packing':32s} {host * 1e3:12.3f}")
        new_sum = sum(v for k, v in parts.items() if "(old)" not in k) + host
        print(f"  sum of new parts {new_sum * 1e3:.2f} ms vs new step "
              f"{steps[new_op] * 1e3:.2f} ms (+ packing, which the step excludes)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["tiny", "small"])
    parser.add_argument("--kv_lens", type=int, nargs="+", default=[128, 1024],
                        help="context lengths every sequence of a step ends at (multiples of "
                             f"{PAGE_SIZE}; the largest sets the page table)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--old_rev", default=None,
                        help="also time the whole step of the engine at this git revision "
                             "(e.g. the commit an issue measured), in a child process")
    parser.add_argument("--new", default="auto", choices=("auto", "bucketed", "pallas"),
                        help="the op timed beside the reference (auto: pallas on a GPU, "
                             "bucketed elsewhere, as the engine's --attention=auto)")
    args = parser.parse_args()
    new_op = args.new if args.new != "auto" else (
        "pallas" if jax.default_backend() == "gpu" else "bucketed")
    print(f"engine step on {jax.devices()[0].device_kind} ({jax.default_backend()}, "
          f"{os.cpu_count()} cpus), jax {jax.__version__}, python {platform.python_version()}, "
          f"fp32, page size {PAGE_SIZE}; medians of {args.repeats}")
    gflops, gbs = measure_machine(args.repeats)
    print(f"this machine: matmul {gflops:.1f} GFLOP/s, copy {gbs:.1f} GB/s "
          f"(load {os.getloadavg()[0]:.1f})")
    for name in args.models:
        run_model(name, sorted(args.kv_lens), args.repeats, gflops, gbs, new_op, args.old_rev)


if __name__ == "__main__":
    main()
