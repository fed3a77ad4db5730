"""Speculative decoding on the real engine at small scale: latency against request rate.

The SmartSpec comparison (`experiments/reproduce/smartspec.py` runs it on the simulator
at paper scale) on this machine's jax engine: the target `tiny` (or `small`), a handful
of Poisson requests per rate, served by `orca` with no speculation, a fixed k (`spec_k`)
of 1, 3 and 5, and `smartspec` where it is registered, each with the prompt-lookup
drafter (`ngram`) and the one-layer self-draft (`model`, `<target>-draft`). The clock is
each step's measured wall time, drafting included. Per run: mean and p90 latency (arrival
to last token), mean time per output token, steps, draft tokens accepted / drafted, the
share of step time spent drafting, and the compiles (target + draft). Every run's
outputs must equal the no-speculation run's (checked, printed): greedy, or with
`--sampling=T[:TOP_K]` sampled, where each verified row draws with the key its position
has without speculation, so the tokens are the same seed for seed.

    python -m benchmarks.spec_engine [--model tiny] [--rates 10 40 160] [--requests 12]
        [--sampling 0.8:20]
"""

from __future__ import annotations

import argparse
import os
import platform

import jax
import numpy as np

from orca_jax import KVConfig, LoopFeatures, StepLimits
from orca_jax.core.api.policy import make_policy
from orca_jax.core.loop.scheduler import Scheduler, SchedulerConfig
from orca_jax.core.step.engine_api import Engine
from orca_jax.core.step.packing import pages_per_seq_for
from orca_jax.core.step.sampling import SamplingConfig
from orca_jax.model import weights
from orca_jax.model.engine import JaxEngine
from orca_jax.model.speculative import SpeculativeEngine, draft_params
from orca_jax.specs.model_config import get_model_config
from orca_jax.workloads.synthetic import synthetic_workload

PAGE_SIZE, MAX_LEN, MAX_SEQS = 16, 256, 8
BUCKETS = (16, 32, 64, 128)


def _config(spec_k: int, sampling: SamplingConfig) -> SchedulerConfig:
    return SchedulerConfig(
        sampling=sampling,
        limits=StepLimits(max_num_seqs=MAX_SEQS, max_num_tokens=BUCKETS[-1],
                          max_model_len=MAX_LEN, token_buckets=BUCKETS),
        kv=KVConfig(num_kv_pages=MAX_SEQS * MAX_LEN // PAGE_SIZE, page_size=PAGE_SIZE),
        features=LoopFeatures(spec_k=spec_k))


def _engines(model_name: str) -> dict[str, Engine]:
    """The plain target, and the verifying target with each drafter (built once: a run
    after the first compiles nothing)."""
    model = get_model_config(model_name)
    params = weights.init_params(model, seed=0)
    attention = "pallas" if jax.default_backend() == "gpu" else "bucketed"
    geometry = dict(num_cache_pages=MAX_SEQS * MAX_LEN // PAGE_SIZE + 1, page_size=PAGE_SIZE,
                    pages_per_seq=pages_per_seq_for(MAX_LEN, PAGE_SIZE), attention=attention)
    draft_model = get_model_config(f"{model_name}-draft")
    draft = JaxEngine(draft_model, draft_params(model, params, draft_model, seed=0), **geometry)
    return {
        "none": JaxEngine(model, params, **geometry),
        "ngram": SpeculativeEngine(JaxEngine(model, params, verify_rows=True, **geometry),
                                   drafter="ngram"),
        "model": SpeculativeEngine(JaxEngine(model, params, verify_rows=True, **geometry),
                                   drafter="model", draft=draft)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", choices=("tiny", "small"))
    parser.add_argument("--rates", type=float, nargs="+", default=[10.0, 40.0, 160.0])
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 3, 5])
    parser.add_argument("--sampling", default="greedy",
                        help="greedy, or T[:TOP_K]: temperature T, the TOP_K likeliest tokens")
    args = parser.parse_args()
    sampling = SamplingConfig()
    if args.sampling != "greedy":
        temperature, _, top_k = args.sampling.partition(":")
        sampling = SamplingConfig(temperature=float(temperature), top_k=int(top_k or 0))
    print(f"# {platform.node()} {jax.default_backend()} jax {jax.__version__}, "
          f"load average {os.getloadavg()[0]:.2f}; target {args.model}, draft "
          f"{args.model}-draft (self-draft: the target's first layer), page {PAGE_SIZE}, "
          f"buckets {BUCKETS}, {args.requests} requests per rate, orca, {args.sampling}, "
          "wall clock")
    engines = _engines(args.model)
    vocab = get_model_config(args.model).vocab_size
    try:
        make_policy("smartspec")
        smartspec = True
    except ValueError:
        smartspec = False
    variants = [("none", "orca", 0)]
    for drafter in ("ngram", "model"):
        variants += [(drafter, "orca", k) for k in args.ks]
        if smartspec:
            variants.append((drafter, "smartspec", 0))
    header = (f"{'rate':>6} {'drafter':>7} {'policy':>9} {'k':>2} {'mean_lat_s':>10} "
              f"{'p90_lat_s':>9} {'tpot_ms':>7} {'steps':>5} {'acc/drafted':>11} "
              f"{'draft%':>6} {'compiles':>8} same")
    print(header)
    for rate in args.rates:
        requests = synthetic_workload(num_requests=args.requests, arrival="poisson", rate=rate,
                                      prompt_len="uniform:16:48", output_len="uniform:16:32",
                                      seed=0, vocab_size=vocab, max_total_len=MAX_LEN)
        reference = None
        for drafter, policy, k in variants:
            engine = engines[drafter]
            facts = engine.facts()
            result = Scheduler(requests, make_policy(policy), engine, _config(k, sampling)).run()
            after = engine.facts()
            outputs = [tokens.tolist() for tokens in result.output_tokens]
            if reference is None:
                reference = outputs
            latency = result.last_token_s - result.arrival_s
            decode = np.maximum(result.num_generated - 1, 1)
            tpot = (result.last_token_s - result.first_token_s) / decode
            drafted = after.get("drafted_tokens", 0) - facts.get("drafted_tokens", 0)
            accepted = (after.get("accepted_draft_tokens", 0)
                        - facts.get("accepted_draft_tokens", 0))
            draft_s = after.get("draft_s", 0.0) - facts.get("draft_s", 0.0)
            busy_s = float(np.sum(result.steps.column("step_s"))) if len(result.steps) else 0.0
            print(f"{rate:6.1f} {drafter:>7} {policy:>9} {k:2d} {latency.mean():10.4f} "
                  f"{np.percentile(latency, 90):9.4f} {1e3 * tpot.mean():7.2f} "
                  f"{len(result.steps):5d} {accepted:5d}/{drafted:<5d} "
                  f"{100 * draft_s / max(busy_s, 1e-12):6.1f} {after['num_compiles']:8d} "
                  f"{'yes' if outputs == reference else 'NO'}", flush=True)


if __name__ == "__main__":
    main()
