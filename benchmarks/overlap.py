"""Overlap scheduling on the real engine, on this machine's CPU: wall time per step.

For each model (`tiny`, `small`) the same burst workload (every request there at
once, so the plans cannot depend on timing) is served by `orca` twice per
repeat, through the same compiled step buckets:

* in step (`overlap=False`): plan and pack, run the step and wait for its
  tokens, update. Its mean host time per step (`host_s`, plan + pack +
  update) and its measured device time per step (the engine's wall time from
  dispatch to tokens on the host) are the two parts; their sum is what a step
  costs when they do not overlap.
* overlapped (`overlap=True`): step N+1 is planned and packed while step N
  runs, its decodes fed N's tokens on the device.

Printed per model and repeat: host, device, host + device, max(host, device),
the wall time per step in step and overlapped, and overlapped / max(host,
device) (1.0 is perfect hiding of the host work); then the medians over the
repeats. Both runs must produce the same tokens (checked). The machine's load
average is printed: host and device share the CPU's cores here.

    python -m benchmarks.overlap [--models tiny small] [--repeats 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import statistics
import time

import jax
import numpy as np

from orca_jax import KVConfig, LoopFeatures, StepLimits
from orca_jax.core.api.policy import make_policy
from orca_jax.core.loop.scheduler import Scheduler, SchedulerConfig
from orca_jax.core.step.engine_api import Engine
from orca_jax.core.step.packing import bucket_config_for
from orca_jax.model import weights
from orca_jax.model.engine import JaxEngine
from orca_jax.sim.profiled_clock import ProfiledClock
from orca_jax.specs.model_config import get_model_config
from orca_jax.workloads.synthetic import synthetic_workload


def _engine(model, config: SchedulerConfig, *, feed: bool) -> Engine:
    # The in-step engine measures each step (its step_s is the device time); the
    # overlapped one is priced at dispatch by the profiled clock, as a run's is (a
    # measured time would make the scheduler wait for the step it overlaps).
    # The attention a run gets by default (--attention=auto).
    attention = "pallas" if jax.default_backend() == "gpu" else "bucketed"
    limits, kv = config.limits, config.kv
    pages_per_seq = -(-limits.max_model_len // kv.page_size)
    engine: Engine = JaxEngine(model, weights.init_params(model, seed=0),
                               num_cache_pages=kv.num_kv_pages + 1,
                               page_size=kv.page_size, pages_per_seq=pages_per_seq,
                               feed_tokens=feed, attention=attention)
    if feed:
        engine = ProfiledClock(engine, max_model_len=limits.max_model_len,
                               page_size=kv.page_size, pages_per_seq=pages_per_seq,
                               num_pages=kv.num_kv_pages + 1)
    engine.warmup(bucket_config_for(max_num_tokens=limits.max_num_tokens,
                                    max_num_seqs=limits.max_num_seqs,
                                    max_model_len=limits.max_model_len,
                                    page_size=kv.page_size).buckets())
    return engine


def _serve(requests, engine: Engine, config: SchedulerConfig) -> dict[str, object]:
    scheduler = Scheduler(requests, make_policy("orca"), engine, config)
    start = time.perf_counter()
    result = scheduler.run()  # the buckets are warm: run() compiles nothing
    wall = time.perf_counter() - start
    steps = scheduler.record.steps
    return {"steps": len(steps), "wall_ms": 1e3 * wall / len(steps),
            "host_ms": 1e3 * statistics.fmean(s.host_s for s in steps),
            "device_ms": 1e3 * statistics.fmean(s.step_s for s in steps),
            "tokens": [list(t) for t in result.output_tokens],
            "overlapped": scheduler.executor.depth > 1}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["tiny", "small"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num_requests", type=int, default=64)
    parser.add_argument("--max_num_seqs", type=int, default=32)
    parser.add_argument("--max_num_tokens", type=int, default=256)
    parser.add_argument("--prompt_len", default="uniform:8:32")
    parser.add_argument("--output_len", default="uniform:32:96")
    args = parser.parse_args()
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"jax {jax.__version__} on {jax.default_backend()}; load average at start "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"# attention {'pallas' if jax.default_backend() == 'gpu' else 'bucketed'}; "
          f"orca, burst of {args.num_requests} requests, prompt {args.prompt_len}, output "
          f"{args.output_len}, max_num_seqs={args.max_num_seqs}, "
          f"max_num_tokens={args.max_num_tokens}; ms per step")
    header = (f"{'model':6} {'rep':>3} {'steps':>5} {'host':>7} {'device':>7} {'sum':>7} "
              f"{'max':>7} {'wall_in_step':>12} {'wall_overlap':>12} {'overlap/max':>11}")
    for name in args.models:
        model = get_model_config(name)
        config = SchedulerConfig(limits=StepLimits(max_num_seqs=args.max_num_seqs,
                                                   max_num_tokens=args.max_num_tokens,
                                                   max_model_len=256),
                                 kv=KVConfig(page_size=16, num_kv_pages=args.max_num_seqs * 16))
        requests = synthetic_workload(num_requests=args.num_requests, arrival="burst",
                                      rate=None, prompt_len=args.prompt_len,
                                      output_len=args.output_len, seed=0,
                                      vocab_size=model.vocab_size)
        in_step = _engine(model, config, feed=False)
        overlapped = _engine(model, config, feed=True)
        print(header)
        rows = []
        for repeat in range(args.repeats):
            plain = _serve(requests, in_step, dataclasses.replace(
                config, features=LoopFeatures(overlap=False)))
            fed = _serve(requests, overlapped, dataclasses.replace(
                config, features=LoopFeatures(overlap=True)))
            assert fed["overlapped"] and not plain["overlapped"]
            assert fed["tokens"] == plain["tokens"], "overlap changed the tokens"
            assert fed["steps"] == plain["steps"]
            host, device = plain["host_ms"], plain["device_ms"]
            row = (host, device, host + device, max(host, device), plain["wall_ms"],
                   fed["wall_ms"], fed["wall_ms"] / max(host, device))
            rows.append(row)
            print(f"{name:6} {repeat:>3} {plain['steps']:>5} " + " ".join(
                f"{v:>{w}.3f}" for v, w in zip(row, (7, 7, 7, 7, 12, 12, 11))))
        medians = np.median(np.asarray(rows), axis=0)
        print(f"{name:6} {'med':>3} {plain['steps']:>5} " + " ".join(
            f"{v:>{w}.3f}" for v, w in zip(medians, (7, 7, 7, 7, 12, 12, 11))))
    print(f"# load average at end {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
