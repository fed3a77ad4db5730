"""The real engine at model scale: llama3-8b steps against their roofline, and whole runs.

One process, one engine (issue 33, parts 1 and 2):

1. ceilings: HBM read and copy bandwidth of a 2 GiB bf16 array (`attention_gpu.ceilings`)
   and a bf16 matmul's rate; the dense bf16 peak is the hardware preset's datasheet
   figure (`h200`, `h100`, ... by the device's name);
2. random bf16 weights drawn on the device (`device_init.init_params_on_device`: one
   jitted program, no host copy), the KV cache sized from the device's free memory
   after them (`KV_FREE_FRACTION` of `bytes_limit - bytes_in_use`; `--kv_gb` on a CPU)
   and capped at what the cases need;
3. one compile per bucket, each timed (and counted against the persistent compile
   cache, `--compile_cache`);
4. the cases: decode at each batch x context, a mixed step (a `--mixed_prefill`-token
   chunk beside `batch - 1` decodes at the first context) and a prefill-only step of
   `--prefill` tokens. Each is timed two ways: `step` (dispatch to tokens on the host,
   median) and `pipelined` (`--repeats` steps dispatched back to back, one wait: the
   device's time per step once dispatch is hidden). Each is printed against its
   roofline: bytes (weights read once + KV read + KV written) over the measured read
   ceiling, and FLOPs over the dense bf16 peak, as fractions of the pipelined time.
   Where the cache cannot hold every sequence's context apart (256 x 4k of llama3-8b is
   128 GiB), page rows repeat the pool's pages (`aliased`); the kernel still reads
   every row's bytes, and the pool is far larger than the L2;
5. `vllm` and `orca` on one Poisson workload through the same compiled steps, wall
   clock: output tokens per wall second of each whole run.

    python -m benchmarks.model_scale                 # on a GPU: llama3-8b, bf16
    python -m benchmarks.model_scale --dry_run       # a CPU: tiny shapes, seconds
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.attention_gpu import ceilings
from orca_jax.core.step.engine_api import Bucket, StepInputs
from orca_jax.core.step.packing import build_step_inputs
from orca_jax.model import compile_cache, device_init
from orca_jax.model.engine import JaxEngine
from orca_jax.specs.hardware import HARDWARE_ALIASES, HARDWARE_PRESETS
from orca_jax.specs.model_config import ModelConfig, get_model_config

PAGE_SIZE = 16
DRY_RUN = dict(model="tiny", dtype="bfloat16", batches=[4], contexts=[64, 128],
               mixed_prefill=32, prefill=64, repeats=2, ceiling_bytes=1 << 22,
               matmul=256, kv_gb=0.01, poisson_requests=12)


@dataclasses.dataclass
class Case:
    name: str
    bucket: Bucket
    q_lens: np.ndarray  # [n] new tokens of each sequence
    kv_lens: np.ndarray  # [n] context after the step


def hardware_for(device_kind: str) -> Optional[str]:
    """The hardware preset named in the device's kind ("NVIDIA H200" -> h200), or None."""
    kind = device_kind.lower().replace(" ", "").replace("-", "")
    names = {**{name: name for name in HARDWARE_PRESETS}, **HARDWARE_ALIASES}
    for alias in sorted(names, key=len, reverse=True):
        if alias.replace("-", "") in kind:
            return names[alias]
    return None


def cases(batches: list[int], contexts: list[int], mixed_prefill: int, prefill: int
          ) -> list[Case]:
    """Decode at every batch x context; mixed (one chunk beside decodes); prefill only."""
    out = [Case(f"decode {b} x {c}", Bucket(b, b), np.ones(b, np.int64),
                np.full(b, c, np.int64)) for c in contexts for b in batches]
    b, c = max(batches), contexts[0]
    q = np.ones(b, np.int64)
    q[0] = mixed_prefill
    kv = np.full(b, c, np.int64)  # the chunk is the last of a prompt ending at `c`
    out.append(Case(f"mixed {b - 1} x {c} + {mixed_prefill}", Bucket(int(q.sum()), b), q, kv))
    out.append(Case(f"prefill {prefill}", Bucket(prefill, 1), np.array([prefill]),
                    np.array([prefill])))
    return out


def priority(all_cases: list[Case], batches: list[int], contexts: list[int]) -> list[Case]:
    """The issue's two targets first (decode at the batch nearest 64 at the first context;
    the prefill-only step), then the rest by bucket, so that compiles are few early."""
    target_batch = min(batches, key=lambda b: abs(b - 64))
    first = [f"decode {target_batch} x {contexts[0]}", all_cases[-1].name]
    head = [c for name in first for c in all_cases if c.name == name]
    rest = sorted((c for c in all_cases if all(c is not h for h in head)),
                  key=lambda c: (c.bucket.num_seqs != target_batch, c.bucket.num_tokens))
    return head + rest


def roofline(config: ModelConfig, case: Case, dtype_bytes: int) -> tuple[int, int]:
    """(bytes, FLOPs) a step must move and do: weights read once, every sequence's KV read
    and its new KV written; matmuls over every token, the LM head over the sampled rows,
    attention causal within each chunk."""
    kv_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim * dtype_bytes
    tokens, seqs = int(case.q_lens.sum()), len(case.q_lens)
    nbytes = (config.step_weight_bytes(dtype_bytes)
              + int((case.kv_lens - case.q_lens).sum()) * kv_token + tokens * kv_token)
    cached = case.kv_lens - case.q_lens
    # Each new token attends to the cached tokens and to the chunk's tokens up to itself.
    pairs = int((case.q_lens * cached + case.q_lens * (case.q_lens + 1) // 2).sum())
    flops = (2 * tokens * config.non_embedding_params
             + 2 * seqs * config.vocab_size * config.d_model
             + 4 * pairs * config.num_q_heads * config.head_dim * config.num_layers)
    return nbytes, flops


def step_inputs(case: Case, num_pages: int, pages_per_seq: int, seed: int = 0
                ) -> tuple[StepInputs, bool]:
    """The case's descriptor, distinct pages per sequence where the pool holds them
    (else the pool's pages repeat: `aliased`)."""
    needed = -(-case.kv_lens // PAGE_SIZE)  # [n]
    usable = num_pages - 1  # page 0 is the null page
    aliased = int(needed.sum()) > usable
    rows = np.zeros((len(case.q_lens), pages_per_seq), np.int32)
    next_page = 0
    for i, n in enumerate(needed):
        rows[i, :n] = 1 + (next_page + np.arange(n)) % usable
        next_page += int(n)
    ids = np.random.default_rng(seed).integers(0, 100, int(case.q_lens.sum())).astype(np.int32)
    return build_step_inputs(case.bucket, num_tokens=case.q_lens,
                             num_computed=case.kv_lens - case.q_lens, page_rows=rows,
                             page_size=PAGE_SIZE, token_ids=ids), aliased


def time_case(engine: JaxEngine, inputs: StepInputs, repeats: int) -> tuple[float, float]:
    """(median step seconds, dispatch to tokens; pipelined seconds per step)."""
    engine.step(inputs)
    steps = []
    for _ in range(repeats):
        start = time.perf_counter()
        engine.step(inputs)
        steps.append(time.perf_counter() - start)
    start = time.perf_counter()
    pending = [engine.step_async(inputs) for _ in range(repeats)]
    pending[-1].output()
    return statistics.median(steps), (time.perf_counter() - start) / repeats


def matmul_tflops(n: int) -> float:
    """Measured bf16 n x n x n matmul rate, TFLOP/s (random data: zeros run faster)."""
    a = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    fn = jax.jit(lambda x: x @ x)
    fn(a).block_until_ready()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        fn(a).block_until_ready()
        times.append(time.perf_counter() - start)
    return 2 * n ** 3 / statistics.median(times) / 1e12


def poisson_runs(engine: JaxEngine, config: ModelConfig, args: argparse.Namespace,
                 num_pages: int, max_model_len: int, log) -> dict[str, Any]:
    """vllm and orca on one Poisson workload through `engine`, wall clock."""
    from orca_jax.runner.build import build_workload
    from orca_jax.runner.experiment import run_policy
    from orca_jax.runner.spec import JaxEngineSpec, LimitsSpec, RunSpec, WorkloadSpec

    # The decode bucket of the largest batch and the mixed step's: compiled already.
    seqs = max(args.batches)
    top = args.mixed_prefill + seqs - 1
    spec = RunSpec(
        workload=WorkloadSpec(arrival="poisson", num_requests=args.poisson_requests,
                              rate=args.poisson_rate, prompt_len=args.prompt_len,
                              output_len=args.output_len),
        engine=JaxEngineSpec(model=config.name, clock="wall", dtype=args.dtype, overlap=False),
        limits=LimitsSpec(max_num_seqs=seqs, max_num_tokens=top, num_kv_pages=num_pages - 1,
                          page_size=PAGE_SIZE, max_model_len=max_model_len,
                          token_buckets=(seqs, top)),
        seed=0)
    requests = build_workload(spec)
    out = {}
    for policy in ("vllm", "orca"):
        start = time.perf_counter()
        summary, result = run_policy(spec, policy, requests=requests, engine=engine,
                                     progress=False)
        wall = time.perf_counter() - start
        tokens = sum(len(t) for t in result.output_tokens)
        out[policy] = {"wall_s": round(wall, 3), "output_tokens": tokens,
                       "wall_tok_s": round(tokens / wall, 1),
                       "clock_tok_s": round(summary["throughput_tok_s"], 1)}
        log(f"  {policy:5s} {tokens} output tokens in {wall:.2f} s wall: "
            f"{tokens / wall:,.0f} tok/s (virtual clock {summary['throughput_tok_s']:,.0f})")
    return out


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry_run", action="store_true",
                        help=f"tiny shapes on any backend: {DRY_RUN}")
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--mixed_prefill", type=int, default=512)
    parser.add_argument("--prefill", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--kv_fraction", type=float, default=device_init.KV_FREE_FRACTION)
    parser.add_argument("--kv_gb", type=float, default=1.0,
                        help="KV cache GB where the device reports no free memory (CPU)")
    parser.add_argument("--ceiling_bytes", type=int, default=1 << 31)
    parser.add_argument("--matmul", type=int, default=8192)
    parser.add_argument("--poisson_requests", type=int, default=200)
    parser.add_argument("--poisson_rate", type=float, default=50.0)
    parser.add_argument("--prompt_len", default="uniform:64:1024")
    parser.add_argument("--output_len", default="uniform:32:256")
    parser.add_argument("--compile_cache", default=None,
                        help="persistent compile cache folder (default: the user cache)")
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    if args.dry_run:
        for key, value in DRY_RUN.items():
            setattr(args, key, value)
        args.prompt_len, args.output_len = "uniform:8:48", "uniform:4:16"
    if args.kv_fraction <= 0 or args.kv_fraction > 1:
        print(f"--kv_fraction={args.kv_fraction}: must be in (0, 1]", file=sys.stderr)
        return 2

    def log(line: str = "") -> None:
        print(line, flush=True)

    figures: dict[str, Any] = {"args": vars(args)}
    config, dtype = get_model_config(args.model), jnp.dtype(args.dtype)
    device = jax.devices()[0]
    preset = hardware_for(device.device_kind)
    peak = HARDWARE_PRESETS[preset].peak_flops if preset else None
    cache_dir = compile_cache.enable(args.compile_cache)
    log(f"model_scale: {config.name} {dtype.name} on {device.device_kind} "
        f"({jax.default_backend()}), jax {jax.__version__}; hardware preset {preset}; "
        f"compile cache {cache_dir}")
    read_gbs, copy_gbs = ceilings(args.ceiling_bytes)
    tflops = matmul_tflops(args.matmul)
    log(f"ceilings: read {read_gbs:,.0f} GB/s, copy {copy_gbs:,.0f} GB/s (read + write) over "
        f"{args.ceiling_bytes / 2 ** 30:.3g} GiB; bf16 matmul {args.matmul}^3 {tflops:,.1f} "
        f"TFLOP/s; dense bf16 peak {peak / 1e12 if peak else float('nan'):,.0f} TFLOP/s "
        f"(datasheet)")
    figures["ceilings"] = {"read_gbs": read_gbs, "copy_gbs": copy_gbs, "matmul_tflops": tflops,
                           "peak_tflops": peak / 1e12 if peak else None}

    start = time.perf_counter()
    params = jax.block_until_ready(device_init.init_params_on_device(config, dtype=dtype))
    init_s = time.perf_counter() - start
    weight_bytes = device_init.param_bytes(params)
    free = device_init.free_device_bytes(device)
    all_cases = cases(args.batches, args.contexts, args.mixed_prefill, args.prefill)
    max_len = max(max(args.contexts), args.prefill)
    pages_per_seq = -(-max_len // PAGE_SIZE)
    wanted = 1 + max(int((-(-c.kv_lens // PAGE_SIZE)).sum()) for c in all_cases)
    num_pages = device_init.kv_pages_for_free_memory(
        config, page_size=PAGE_SIZE, dtype=dtype, free_bytes=free,
        fallback_bytes=int(args.kv_gb * 1e9), fraction=args.kv_fraction, max_pages=wanted)
    page_bytes = device_init.kv_page_bytes(config, PAGE_SIZE, dtype)
    log(f"weights: {weight_bytes / 1e9:.2f} GB drawn on the device in {init_s:.1f} s (one jitted "
        f"program, compile included); free after them "
        f"{'n/a (no memory stats)' if free is None else f'{free / 1e9:.1f} GB'}; KV cache "
        f"{num_pages} pages x {page_bytes / 1e6:.2f} MB = {num_pages * page_bytes / 1e9:.2f} GB "
        f"({args.kv_fraction:.0%} of free, at most the {wanted} the cases need)")
    figures.update(init_s=init_s, weight_bytes=weight_bytes, free_bytes=free,
                   num_pages=num_pages)
    attention = "pallas" if jax.default_backend() == "gpu" else "bucketed"
    engine = JaxEngine(config, params, num_cache_pages=num_pages, page_size=PAGE_SIZE,
                       pages_per_seq=pages_per_seq, dtype=dtype, attention=attention)
    del params  # the engine holds them (the same buffers)

    # Each bucket compiles just before its first case, and the cases run in the order of
    # what the issue needs first: a run cut short by its time limit keeps those.
    log(f"\n{attention} attention; a bucket's compile (+ first run) is timed before its "
        f"first case")
    log(f"{'case':28s} {'step ms':>8s} {'pipe ms':>8s} {'GB':>7s} {'HBM %':>6s} "
        f"{'TFLOP':>7s} {'peak %':>7s}  notes")
    dtype_bytes = dtype.itemsize
    compiles: dict[str, Any] = {}
    rows: dict[str, Any] = {}
    figures.update(compile=compiles, cases=rows)
    for case in priority(all_cases, args.batches, args.contexts):
        key = f"{case.bucket.num_tokens}x{case.bucket.num_seqs}"
        if key not in compiles:
            hits_before = engine.facts()["compile_cache_hits"]
            start = time.perf_counter()
            engine.warmup([case.bucket])
            seconds = time.perf_counter() - start
            hits = engine.facts()["compile_cache_hits"] - hits_before
            compiles[key] = {"s": round(seconds, 2), "cache_hits": hits}
            log(f"  compile T={case.bucket.num_tokens} S={case.bucket.num_seqs}: "
                f"{seconds:.2f} s ({hits} program(s) from the compile cache)")
        inputs, aliased = step_inputs(case, num_pages, pages_per_seq)
        step_s, pipe_s = time_case(engine, inputs, args.repeats)
        nbytes, flops = roofline(config, case, dtype_bytes)
        hbm = nbytes / (read_gbs * 1e9) / pipe_s
        of_peak = flops / peak / pipe_s if peak else float("nan")
        rows[case.name] = {"step_ms": step_s * 1e3, "pipelined_ms": pipe_s * 1e3,
                           "bytes": nbytes, "flops": flops, "hbm_fraction": hbm,
                           "peak_fraction": of_peak, "aliased": aliased}
        log(f"{case.name:28s} {step_s * 1e3:8.2f} {pipe_s * 1e3:8.2f} {nbytes / 1e9:7.2f} "
            f"{100 * hbm:5.1f}% {flops / 1e12:7.2f} {100 * of_peak:6.1f}%  "
            f"{'aliased pages' if aliased else ''}")
    log("HBM %: (weights + KV bytes) / read ceiling / pipelined time; peak %: FLOPs / dense "
        "bf16 peak / pipelined time.")

    if args.poisson_requests > 0:
        log(f"\nwhole runs, wall clock: {args.poisson_requests} requests, poisson "
            f"{args.poisson_rate}/s, prompt {args.prompt_len}, output {args.output_len}, "
            f"batch cap {max(args.batches)}, buckets {max(args.batches)} and "
            f"{args.mixed_prefill + max(args.batches) - 1} tokens (compiled above)")
        start = time.perf_counter()
        figures["poisson"] = poisson_runs(engine, config, args, num_pages, max_len, log)
        log(f"  (both runs: {time.perf_counter() - start:.1f} s)")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(figures, f, indent=1, default=float)
    return 0


if __name__ == "__main__":
    sys.exit(main())
