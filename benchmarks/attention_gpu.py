"""The attention kernel on a GPU: correctness against float64, then timings and bandwidth.

One command, from the repository root, with whatever jax the machine has (nothing is
installed; the module finds `pallas_kernels` and `benchmarks` from the current folder):

    python3 -m benchmarks.attention_gpu --out benchmarks/results/attention_h200.txt
    python -m benchmarks.attention_gpu --tiny      # CPU, interpret mode, seconds

Steps (llama3-8b heads: 32 query heads, 8 KV heads, head_dim 128, pages of 16, bf16):
  1. Ceilings: a read-only pass (max over 2 GiB) and a copy (read + write counted)
     give the measured HBM bandwidth that "% of ceiling" is taken against.
  2. Correctness: every kernel config and the jnp reference against a float64
     oracle on a ragged mixed batch, by ||out - ref|| / ||ref||: bf16 must land
     under 2e-2; fp32 under 5e-3 (on a GPU Triton's fp32 dots run as TF32, about
     3e-4, not fp32's 1e-6). The cache outside every sequence holds NaN, so a read
     past a sequence shows; padding rows must be exactly zero.
  3. Timings (median of batches of asynchronously dispatched calls, after a
     warm-up; each case's KV is far larger than the 60 MB L2): (a) a mixed step,
     63 decodes at contexts 2k-8k plus one 512-token chunk at 4k; (b) decode-only
     64 x {2k, 4k, 8k}; (c) 8 x 8k decodes, where split-KV matters. For each: the
     kernel configs, the jnp reference and dense padded XLA attention; achieved KV
     GB/s (each sequence's K and V read once: the fewest bytes) and its share of
     the measured ceiling, and the speed-up over dense.
Targets (issue 15): decode >= 70% of the read ceiling at 64 x 4k; mixed >= 5x dense.
Every config runs inside its own try, so one that fails to compile is reported and
the rest still run. The last lines are a summary table.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import statistics
import sys
import time
import traceback
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.attention import dense_padded_attention
from pallas_kernels import ragged_paged_attention as rpa
from pallas_kernels.ragged_paged_attention import RaggedAttentionConfig
from pallas_kernels.tiling import PassPlan, plan_passes

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE = 32, 8, 128, 16  # as benchmarks/attention.py
SM_SCALE = HEAD_DIM ** -0.5
TOLERANCE = {"bfloat16": 2e-2, "float32": 5e-3}  # relative Frobenius error; fp32 means TF32
KERNEL_CONFIGS = {
    "tables": None,
    "one_pass": RaggedAttentionConfig(decode_pass=False),
    "no_split": RaggedAttentionConfig(num_kv_splits=1),
    "kv128": RaggedAttentionConfig(block_kv=128),
    "stages4": RaggedAttentionConfig(num_stages=4),
    "warps8": RaggedAttentionConfig(num_warps=8),
}


@dataclasses.dataclass
class Case:
    """One step's arrays (on the device) and its sizes."""

    name: str
    args: dict  # the op's arguments
    q_lens: np.ndarray  # [S]
    kv_lens: np.ndarray  # [S]

    @property
    def kv_bytes(self) -> int:
        itemsize = self.args["k_pages"].dtype.itemsize
        return int(2 * self.kv_lens.sum() * NUM_KV_HEADS * HEAD_DIM * itemsize)

    @property
    def flops(self) -> int:
        q, kv = self.q_lens, self.kv_lens
        return int(4 * NUM_Q_HEADS * HEAD_DIM * np.sum(q * (kv - (q - 1) / 2)))


def make_case(name: str, q_lens, kv_lens, dtype, *, seed: int = 0, poison: bool = False) -> Case:
    """Scattered pages holding random K/V (NaN beyond each sequence when `poison`)."""
    rng = np.random.default_rng(seed)
    q_lens, kv_lens = np.asarray(q_lens, np.int64), np.asarray(kv_lens, np.int64)
    pages_needed = -(-kv_lens // PAGE_SIZE)
    num_pages = int(pages_needed.sum()) + 1  # page 0 is the null page
    perm = rng.permutation(np.arange(1, num_pages))
    page_indices = np.zeros((kv_lens.size, int(pages_needed.max())), np.int32)
    starts = np.concatenate([[0], np.cumsum(pages_needed)])
    for i, n in enumerate(pages_needed):
        page_indices[i, :n] = perm[starts[i]:starts[i] + n]
    keys = jax.random.split(jax.random.key(seed), 3)
    shape = (num_pages, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_pages = jax.random.normal(keys[1], shape, dtype)
    v_pages = jax.random.normal(keys[2], shape, dtype)
    if poison:  # every slot no sequence owns: the null page and each last page's tail
        owned = np.zeros((num_pages, PAGE_SIZE), bool)
        for i, kv in enumerate(kv_lens):
            pos = np.arange(kv)
            owned[page_indices[i, pos // PAGE_SIZE], pos % PAGE_SIZE] = True
        stale = jnp.asarray(~owned)[:, :, None, None]
        k_pages, v_pages = (jnp.where(stale, jnp.nan, a).astype(dtype) for a in (k_pages,
                                                                                 v_pages))
    total = int(q_lens.sum())
    args = dict(q=jax.random.normal(keys[0], (total, NUM_Q_HEADS, HEAD_DIM), dtype),
                k_pages=k_pages, v_pages=v_pages, kv_lens=jnp.asarray(kv_lens, jnp.int32),
                page_indices=jnp.asarray(page_indices),
                cu_q_lens=jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32),
                num_seqs=jnp.asarray([kv_lens.size], jnp.int32))
    return Case(name, args, q_lens, kv_lens)


def oracle(case: Case) -> np.ndarray:
    """Per-sequence causal attention in float64 on the host."""
    a = {k: np.asarray(v) for k, v in case.args.items()}
    q = a["q"].astype(np.float64)
    out = np.zeros_like(q)
    group = NUM_Q_HEADS // NUM_KV_HEADS
    for i, (start, q_len, kv_len) in enumerate(zip(a["cu_q_lens"][:-1], case.q_lens,
                                                   case.kv_lens)):
        pos = np.arange(kv_len)
        pages = a["page_indices"][i, pos // PAGE_SIZE]
        k = a["k_pages"][pages, pos % PAGE_SIZE].astype(np.float64)  # [kv, Hkv, D]
        v = a["v_pages"][pages, pos % PAGE_SIZE].astype(np.float64)
        q_pos = kv_len - q_len + np.arange(q_len)
        for h in range(NUM_Q_HEADS):
            s = q[start:start + q_len, h] @ k[:, h // group].T * SM_SCALE
            s = np.where(pos[None, :] <= q_pos[:, None], s, -np.inf)
            p = np.exp(s - s.max(axis=-1, keepdims=True))
            out[start:start + q_len, h] = (p / p.sum(axis=-1, keepdims=True)) @ v[:, h // group]
    return out


def kernel_plan(case: Case, config: RaggedAttentionConfig | None) -> PassPlan:
    q, k_pages, pages = case.args["q"], case.args["k_pages"], case.args["page_indices"]
    return plan_passes(num_tokens=q.shape[0], num_slots=pages.shape[0],
                       num_q_heads=NUM_Q_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM,
                       page_size=PAGE_SIZE, pages_per_seq=pages.shape[1],
                       itemsize=k_pages.dtype.itemsize, config=config)


def implementations(case: Case, interpret: bool,
                    configs: list[str]) -> dict[str, Callable[[], jax.Array]]:
    """Each implementation as a no-argument call on the case's arrays (jitted, not folded).

    A kernel config whose plan for this case equals an earlier one's is left out.
    """
    fns, plans = {}, []
    for name in configs:
        config = KERNEL_CONFIGS[name]
        plan = kernel_plan(case, config)
        if plan not in plans:
            plans.append(plan)
            fns[f"kernel:{name}"] = jax.jit(functools.partial(
                rpa.ragged_paged_attention, sm_scale=SM_SCALE, config=config,
                interpret=interpret))
    fns["reference"] = jax.jit(functools.partial(rpa.ragged_paged_attention_reference,
                                                 sm_scale=SM_SCALE))
    fns["dense"] = jax.jit(functools.partial(dense_padded_attention, sm_scale=SM_SCALE,
                                             max_q=int(case.q_lens.max())))
    return {name: functools.partial(fn, **case.args) for name, fn in fns.items()}


def time_call(fn: Callable[[], jax.Array], budget_s: float) -> tuple[float, int]:
    """Median seconds per call: batches of back-to-back dispatches, each batch synced once."""
    jax.block_until_ready(fn())  # compile and warm up
    start = time.perf_counter()
    jax.block_until_ready(fn())
    once = max(time.perf_counter() - start, 1e-6)
    per_batch = max(1, min(20, int(0.05 / once)))
    batches = max(3, min(15, int(budget_s / (once * per_batch))))
    times = []
    for _ in range(batches):
        start = time.perf_counter()
        outs = [fn() for _ in range(per_batch)]
        jax.block_until_ready(outs)
        times.append((time.perf_counter() - start) / per_batch)
    return statistics.median(times), batches * per_batch


def ceilings(num_bytes: int) -> tuple[float, float]:
    """(read GB/s, copy GB/s) over a `num_bytes` bf16 array, copy counting read + write."""
    x = jax.random.normal(jax.random.key(7), (num_bytes // 2,), jnp.bfloat16)
    read, _ = time_call(functools.partial(jax.jit(jnp.max), x), 1.0)
    copy, _ = time_call(functools.partial(jax.jit(lambda a: a * 2 + 1), x), 1.0)
    del x
    return num_bytes / read / 1e9, 2 * num_bytes / copy / 1e9


def check(case: Case, interpret: bool, configs: list[str], log) -> list[str]:
    """Compares every implementation with the float64 oracle; returns the failures."""
    expected = oracle(case)
    dtype = str(case.args["q"].dtype)
    failures = []
    for name, fn in implementations(case, interpret, configs).items():
        if name == "dense":
            continue
        try:
            out = np.asarray(jax.block_until_ready(fn()), np.float64)
        except Exception as error:  # noqa: BLE001 - report and go on with the rest
            failures.append(f"{name}: {type(error).__name__}: {str(error)[:200]}")
            log(traceback.format_exc())
            continue
        n = int(case.q_lens.sum())
        err = np.linalg.norm(out[:n] - expected[:n]) / np.linalg.norm(expected[:n])
        ok = bool(np.isfinite(err) and err < TOLERANCE[dtype] and np.all(out[n:] == 0))
        log(f"  {dtype:>8} {name:<16} rel err {err:.2e} (limit {TOLERANCE[dtype]:.0e})"
            f"{'' if ok else '  FAIL'}")
        if not ok:
            failures.append(f"{name} {dtype}: rel err {err:.2e}")
    return failures


def timing_cases(tiny: bool, dtype) -> list[tuple[str, list[int], list[int]]]:
    """(name, q_lens, kv_lens) of the timed steps."""
    rng = np.random.default_rng(1)
    if tiny:
        return [("mixed", [1] * 3 + [16], [40, 70, 100, 48])]
    mixed_kv = list(rng.integers(2048, 8193, size=63)) + [4096]
    cases = [("mixed 63x2k-8k+512", [1] * 63 + [512], mixed_kv)]
    cases += [(f"decode 64x{k // 1024}k", [1] * 64, [k] * 64) for k in (2048, 4096, 8192)]
    cases.append(("decode 8x8k split", [1] * 8, [8192] * 8))
    return cases


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true",
                        help="tiny shapes in interpret mode (CPU smoke run)")
    parser.add_argument("--out", default=None, help="also write the raw output here")
    parser.add_argument("--budget", type=float, default=0.5,
                        help="seconds of timed calls per implementation and case")
    parser.add_argument("--configs", default=None,
                        help=f"comma-separated kernel configs of {sorted(KERNEL_CONFIGS)}; "
                             "default: all (--tiny: tables)")
    args = parser.parse_args(argv)
    configs = (args.configs or ("tables" if args.tiny else ",".join(KERNEL_CONFIGS))).split(",")
    unknown = sorted(set(configs) - set(KERNEL_CONFIGS))
    if unknown:
        parser.error(f"--configs: unknown {unknown}; choose from {sorted(KERNEL_CONFIGS)}")
    # Dense padded attention of the mixed step holds ~50 GB of scores: let XLA have the card.
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    on_gpu = jax.default_backend() == "gpu"
    interpret = args.tiny or not on_gpu
    lines: list[str] = []

    def log(line: str = "") -> None:
        print(line, flush=True)
        lines.append(line)

    device = jax.devices()[0]
    log(f"# {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} attention_gpu "
        f"{' '.join(sys.argv[1:])}")
    log(f"device {device.device_kind} ({jax.default_backend()}), jax {jax.__version__}, "
        f"interpret={interpret}")
    read_gbs, copy_gbs = ceilings(2 ** 24 if args.tiny else 2 ** 31)
    ceiling = max(read_gbs, copy_gbs)
    log(f"ceilings: read {read_gbs:.0f} GB/s, copy {copy_gbs:.0f} GB/s (read + write)")

    log("\ncorrectness vs float64 (cache poisoned with NaN outside every sequence):")
    q_lens, kv_lens = ([1] * 3 + [9], [17, 40, 64, 30]) if args.tiny else (
        [1] * 14 + [3, 128], list(np.random.default_rng(2).integers(100, 2049, size=15)) + [700])
    failures = []
    for dtype in (jnp.bfloat16, jnp.float32):
        case = make_case("check", q_lens, kv_lens, dtype, seed=3, poison=True)
        failures += check(case, interpret, configs, log)

    rows = []
    for name, case_q, case_kv in timing_cases(args.tiny, jnp.bfloat16):
        case = make_case(name, case_q, case_kv, jnp.bfloat16)
        log(f"\n{name}: {len(case_q)} sequences, {sum(case_q)} query tokens, KV "
            f"{case.kv_bytes / 1e6:.0f} MB, {case.flops / 1e9:.1f} GFLOP")
        times = {}
        for impl, fn in implementations(case, interpret, configs).items():
            try:
                times[impl], calls = time_call(fn, args.budget)
            except Exception as error:  # noqa: BLE001 - e.g. dense padded running out of memory
                log(f"  {impl:<16} failed: {type(error).__name__}: {str(error)[:160]}")
                continue
            gbs = case.kv_bytes / times[impl] / 1e9
            log(f"  {impl:<16} {times[impl] * 1e6:10.1f} us  {gbs:7.0f} GB/s "
                f"{100 * gbs / ceiling:5.1f}% of ceiling  {case.flops / times[impl] / 1e12:6.1f} "
                f"TFLOP/s  ({calls} calls)")
        dense = times.get("dense")
        for impl, seconds in times.items():
            rows.append((name, impl, seconds, case.kv_bytes / seconds / 1e9 / ceiling,
                         dense / seconds if dense else float("nan")))
        del case
    log("\nsummary (KV share of the measured ceiling; speed-up over dense padded):")
    log(f"{'case':<22} {'impl':<16} {'us':>10} {'%ceil':>6} {'vs dense':>9}")
    for name, impl, seconds, share, speedup in rows:
        log(f"{name:<22} {impl:<16} {seconds * 1e6:10.1f} {100 * share:6.1f} {speedup:8.2f}x")
    log(f"\ncorrectness: {'all passed' if not failures else 'FAILED: ' + '; '.join(failures)}")
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
