"""Where an overlapped step's time goes: host, dispatch, device, token readback (issue 33.3).

On the H200 overlap made `tiny` and `small` steps 11-19% slower than in step
(`benchmarks/results/overlap_h200.txt`). This probe splits a step's life into what
the host spends and what it waits for, two ways:

A. The engine alone, one decode bucket (`--seqs` sequences at context `--context`),
   every step the same descriptor:
   * `in step`: dispatch, wait, read back, `--steps` times (the plain step);
   * `depth 2`: the feeding step (`feed_tokens`), step N dispatched and then N-1's
     tokens waited for and read back, with `--host_ms` of busy host work (a stand-in
     for planning) after each: wall per step against max(host, device);
   * `pipelined`: `--steps` dispatched back to back, one wait: the device's own time
     per step (if it equals the dispatch time, the step is launch-bound and overlap
     cannot hide the host: the host *is* the device's feeder);
   * `lag`: how long after N's dispatch N-1's tokens were ready, against N's own
     readiness: if N-1 is only ready when N is, the readback waits for the step
     after it (a sync that serialises).
B. The scheduler (`orca`, a burst, as `benchmarks/overlap.py`) at depth 1 and 2,
   through a wrapper that records each step's dispatch, wait and readback: the
   mean of each, beside the scheduler's own host time (plan + pack + update).
   `--clock wall` passes the engine's measured time through, as a `--clock=wall`
   run does: the executor then reads it right after dispatch (a wait), which is
   what a wall-clock overlapped run does (see docs/gpu.md).

All figures are medians (A) or means (B) in ms; tokens are checked equal.

    python -m benchmarks.overlap_probe [--models tiny small] [--dry_run]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from typing import Any, Optional

import jax
import numpy as np

from orca_jax import KVConfig, LoopFeatures, StepLimits
from orca_jax.core.api.policy import make_policy
from orca_jax.core.loop.scheduler import Scheduler, SchedulerConfig
from orca_jax.core.step.engine_api import (
    Bucket,
    EngineWrapper,
    PendingStep,
    StepInputs,
    StepOutput,
)
from orca_jax.core.step.packing import bucket_config_for, build_step_inputs
from orca_jax.model import weights
from orca_jax.model.engine import JaxEngine
from orca_jax.specs.model_config import get_model_config
from orca_jax.workloads.synthetic import synthetic_workload

PAGE_SIZE = 16


def _spin(seconds: float) -> None:
    """Busy host work (planning holds the GIL too; a sleep would not)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _engine(name: str, *, feed: bool, pages_per_seq: int, num_pages: int) -> JaxEngine:
    config = get_model_config(name)
    attention = "pallas" if jax.default_backend() == "gpu" else "bucketed"
    return JaxEngine(config, weights.init_params(config, seed=0), num_cache_pages=num_pages,
                     page_size=PAGE_SIZE, pages_per_seq=pages_per_seq, attention=attention,
                     feed_tokens=feed)


def engine_probe(plain: JaxEngine, fed: JaxEngine, seqs: int, context: int, steps: int,
                 host_ms: list[float], log) -> dict[str, Any]:
    """Part A: one decode bucket on the plain and the feeding engine."""
    pages_per_seq = plain.pages_per_seq
    bucket = Bucket(seqs, seqs)
    rows = np.arange(1, seqs * pages_per_seq + 1, dtype=np.int32).reshape(seqs, pages_per_seq)
    inputs = build_step_inputs(bucket, num_tokens=np.ones(seqs, np.int64),
                               num_computed=np.full(seqs, context - 1, np.int64),
                               page_rows=rows, page_size=PAGE_SIZE,
                               token_ids=np.arange(seqs, dtype=np.int32))
    for engine in (plain, fed):
        engine.warmup([bucket])
    out: dict[str, Any] = {}
    # In step: each step waited for before the next.
    for label, engine in (("in step (plain)", plain), ("in step (feeding)", fed)):
        engine.step(inputs)
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            pending = engine.step_async(inputs)
            pending.wait()
            times.append((time.perf_counter() - start, pending.timings()))
        row = {"wall": statistics.median(t for t, _ in times),
               **{key: statistics.median(t[key] for _, t in times)
                  for key in ("dispatch_s", "ready_s", "readback_s")}}
        out[label] = row
        log(f"  {label:22s} wall {row['wall'] * 1e3:7.3f}  dispatch "
            f"{row['dispatch_s'] * 1e3:7.3f}  ready {row['ready_s'] * 1e3:7.3f}  readback "
            f"{row['readback_s'] * 1e3:7.3f}")
    # Pipelined: the device's time per step once the host is out of the way.
    for label, engine in (("pipelined (plain)", plain), ("pipelined (feeding)", fed)):
        start = time.perf_counter()
        pending = [engine.step_async(inputs) for _ in range(steps)]
        pending[-1].wait()
        per_step = (time.perf_counter() - start) / steps
        dispatch = statistics.median(p.timings()["dispatch_s"] for p in pending)
        out[label] = {"per_step": per_step, "dispatch_s": dispatch}
        bound = "launch-bound" if dispatch > 0.8 * per_step else "device-bound"
        log(f"  {label:22s} per step {per_step * 1e3:7.3f}  (dispatch alone "
            f"{dispatch * 1e3:7.3f}: {bound})")
    # Depth 2: dispatch N (its decodes fed N-1's tokens on the device), then land N-1.
    source = np.arange(seqs, dtype=np.int32)
    for host in host_ms:
        previous: Optional[Any] = None
        walls, lags, ready_gaps = [], [], []
        fed.step_async(inputs).wait()
        for _ in range(steps):
            start = time.perf_counter()
            pending = fed.step_async(inputs, source)
            if previous is not None:
                previous.wait()
                lags.append(previous.ready_at - pending.dispatched_at)
                ready_gaps.append(previous)
            _spin(host / 1e3)
            walls.append(time.perf_counter() - start)
            previous = pending
        previous.wait()
        # N-1 ready vs N ready: both known once every step has landed.
        gaps = [later.ready_at - earlier.ready_at
                for earlier, later in zip(ready_gaps, ready_gaps[1:])]
        row = {"host_ms": host, "wall": statistics.median(walls),
               "lag": statistics.median(lags), "ready_gap": statistics.median(gaps)}
        out[f"depth 2, host {host} ms"] = row
        device = out["pipelined (feeding)"]["per_step"]
        log(f"  depth 2, host {host:5.2f} ms   wall {row['wall'] * 1e3:7.3f}  max(host, device) "
            f"{max(host / 1e3, device) * 1e3:7.3f}  N-1 ready {row['lag'] * 1e3:+7.3f} after "
            f"N's dispatch; consecutive readies {row['ready_gap'] * 1e3:7.3f} apart")
    return out


class _Timing(EngineWrapper):
    """Records each step's dispatch, wait and readback; `clock` priced: a fixed price at
    dispatch (as the profiled clock), wall: the inner step's measured time."""

    def __init__(self, engine: JaxEngine, clock: str) -> None:
        super().__init__(engine)
        self.clock = clock
        self.records: list[dict[str, float]] = []

    @property
    def feeds_tokens(self) -> bool:
        return self.engine.feeds_tokens

    def step(self, inputs: StepInputs) -> StepOutput:
        return self.step_async(inputs).output()

    def step_async(self, inputs: StepInputs, token_source=None) -> PendingStep:
        return _TimedPending(self, self.engine.step_async(inputs, token_source))


class _TimedPending(PendingStep):
    def __init__(self, owner: _Timing, pending: Any) -> None:
        self._owner, self._pending, self._output = owner, pending, None

    @property
    def step_s(self) -> float:
        return 1e-3 if self._owner.clock == "priced" else self._pending.step_s

    def output(self) -> StepOutput:
        if self._output is None:
            start = time.perf_counter()
            tokens, _ = self._pending.wait()
            record = self._pending.timings()
            record["wait_s"] = time.perf_counter() - start
            self._owner.records.append(record)
            self._output = StepOutput(sampled_tokens=tokens, step_s=self.step_s)
        return self._output


def scheduler_probe(plain: JaxEngine, fed: JaxEngine, args: argparse.Namespace, log
                    ) -> dict[str, Any]:
    """Part B: orca on a burst at depth 1 and 2 (priced clock), and depth 2 on the wall."""
    model = plain.model_config
    config = SchedulerConfig(limits=StepLimits(max_num_seqs=args.max_num_seqs,
                                               max_num_tokens=args.max_num_tokens,
                                               max_model_len=args.context),
                             kv=KVConfig(page_size=PAGE_SIZE,
                                         num_kv_pages=plain.num_cache_pages - 1))
    requests = synthetic_workload(num_requests=args.num_requests, arrival="burst", rate=None,
                                  prompt_len=args.prompt_len, output_len=args.output_len,
                                  seed=0, vocab_size=model.vocab_size)
    buckets = bucket_config_for(max_num_tokens=args.max_num_tokens,
                                max_num_seqs=args.max_num_seqs, max_model_len=args.context,
                                page_size=PAGE_SIZE).buckets()
    out, tokens = {}, {}
    for label, feed, clock in (("depth 1", False, "priced"), ("depth 2", True, "priced"),
                               ("depth 2, wall clock", True, "wall")):
        engine = _Timing(fed if feed else plain, clock)
        engine.warmup(buckets)
        engine.records.clear()
        scheduler = Scheduler(requests, make_policy("orca"), engine, dataclasses.replace(
            config, features=LoopFeatures(overlap=feed)))
        start = time.perf_counter()
        result = scheduler.run()
        wall = time.perf_counter() - start
        steps = scheduler.record.steps
        tokens[label] = [list(t) for t in result.output_tokens]
        mean = lambda key: 1e3 * statistics.fmean(r[key] for r in engine.records)  # noqa: E731
        row = {"steps": len(steps), "depth": scheduler.executor.depth,
               "wall_ms": 1e3 * wall / len(steps),
               "host_ms": 1e3 * statistics.fmean(s.host_s for s in steps),
               **{key: mean(key) for key in ("dispatch_s", "ready_s", "readback_s", "wait_s")}}
        out[label] = row
        log(f"  {label:20s} depth {row['depth']} {row['steps']:4d} steps  wall/step "
            f"{row['wall_ms']:7.3f}  host {row['host_ms']:6.3f}  dispatch "
            f"{row['dispatch_s']:6.3f}  ready {row['ready_s']:6.3f}  readback "
            f"{row['readback_s']:6.3f}  host blocked in wait {row['wait_s']:6.3f}")
    same = all(t == tokens["depth 1"] for t in tokens.values())
    log(f"  tokens identical at every depth and clock: {same}")
    out["tokens_identical"] = same
    return out


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["tiny", "small"])
    parser.add_argument("--seqs", type=int, default=32)
    parser.add_argument("--context", type=int, default=256,
                        help="A's context, B's max_model_len")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--host_ms", type=float, nargs="+", default=[0.0, 0.3, 1.0])
    parser.add_argument("--num_requests", type=int, default=64)
    parser.add_argument("--max_num_seqs", type=int, default=32)
    parser.add_argument("--max_num_tokens", type=int, default=256)
    parser.add_argument("--prompt_len", default="uniform:8:32")
    parser.add_argument("--output_len", default="uniform:32:96")
    parser.add_argument("--dry_run", action="store_true",
                        help="tiny only, 8 sequences, few steps (any backend, seconds)")
    args = parser.parse_args(argv)
    if args.dry_run:
        # B's one bucket (8 tokens, 8 sequences: prompts chunked) is A's decode bucket, so
        # each engine compiles one step program, not two (compiling is the dry run's time).
        args.models, args.seqs, args.context, args.steps = ["tiny"], 8, 64, 6
        args.host_ms, args.num_requests, args.max_num_seqs = [0.0, 1.0], 8, 8
        args.max_num_tokens, args.prompt_len, args.output_len = 8, "uniform:4:8", "uniform:4:12"

    def log(line: str = "") -> None:
        print(line, flush=True)

    log(f"overlap probe on {jax.devices()[0].device_kind} ({jax.default_backend()}), "
        f"jax {jax.__version__}; ms")
    ok = True
    for name in args.models:
        log(f"\n{name}: A. engine alone, decode {args.seqs} x {args.context}, "
            f"{args.steps} steps")
        # One plain and one feeding engine serve both parts (their buckets compile once).
        pages_per_seq = -(-args.context // PAGE_SIZE)
        num_pages = max(args.seqs, args.max_num_seqs) * pages_per_seq + 1
        plain, fed = (_engine(name, feed=feed, pages_per_seq=pages_per_seq, num_pages=num_pages)
                      for feed in (False, True))
        buckets = bucket_config_for(max_num_tokens=args.max_num_tokens,
                                    max_num_seqs=args.max_num_seqs, max_model_len=args.context,
                                    page_size=PAGE_SIZE).buckets()
        fed.warmup(buckets + [Bucket(args.seqs, args.seqs)])
        engine_probe(plain, fed, args.seqs, args.context, args.steps, args.host_ms, log)
        log(f"{name}: B. orca, burst of {args.num_requests}, max_num_seqs={args.max_num_seqs}")
        ok &= scheduler_probe(plain, fed, args, log)["tokens_identical"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
