"""A step loaded from the executable cache computes exactly what a fresh compile does.

For each model, one engine compiles its buckets with the compile cache on (and
stores them in `executable_cache`), a second loads them whole (checked: every
bucket loaded, same HLO fingerprints), and a third compiles with the cache off.
The three then run the same sequence of steps (random mixed prefill/decode
descriptors, each step's sampled tokens fed back as the next step's decode
tokens) and every step's sampled tokens must be identical across the three.
Runs on any backend; on a GPU it checks that serialized executables holding the
Pallas kernel load and run.

    python -m benchmarks.executable_cache_check [--models tiny small] [--steps 40]
"""

from __future__ import annotations

import argparse
import sys
import tempfile

import jax
import numpy as np

from orca_jax.core.step.engine_api import Bucket
from orca_jax.core.step.packing import build_step_inputs
from orca_jax.model import compile_cache, weights
from orca_jax.model.engine import JaxEngine
from orca_jax.specs.model_config import get_model_config

PAGE_SIZE, PAGES_PER_SEQ, SLOTS = 16, 16, 8
BUCKETS = [Bucket(num_tokens=8, num_seqs=SLOTS), Bucket(num_tokens=64, num_seqs=SLOTS)]


def _engine(name: str) -> JaxEngine:
    config = get_model_config(name)
    attention = "pallas" if jax.default_backend() == "gpu" else "bucketed"
    return JaxEngine(config, weights.init_params(config, seed=0),
                     num_cache_pages=SLOTS * PAGES_PER_SEQ + 1, page_size=PAGE_SIZE,
                     pages_per_seq=PAGES_PER_SEQ, attention=attention)


def _steps(vocab: int, count: int, seed: int):
    """`count` step shapes: each slot's new tokens and cached tokens, growing like a run's."""
    rng = np.random.default_rng(seed)
    computed = np.zeros(SLOTS, np.int64)
    for _ in range(count):
        prefill = rng.random(SLOTS) < 0.15
        new = np.where(prefill, rng.integers(2, 7, SLOTS), 1)
        if computed.max() + new.max() > PAGES_PER_SEQ * PAGE_SIZE:
            computed[:] = 0
        bucket = BUCKETS[0] if new.sum() <= BUCKETS[0].num_tokens else BUCKETS[1]
        yield bucket, new, computed.copy(), rng.integers(0, vocab, int(new.sum()))
        computed += new


def check(name: str, count: int) -> bool:
    before = compile_cache.current_dir()
    with tempfile.TemporaryDirectory() as folder:
        try:
            compile_cache.enable(folder)
            stored, loaded = _engine(name), _engine(name)
            stored.warmup(BUCKETS)
            loaded.warmup(BUCKETS)
            compile_cache.enable(compile_cache.DISABLED)
            fresh = _engine(name)
            fresh.warmup(BUCKETS)
        finally:
            compile_cache.enable(before or compile_cache.DISABLED)
    engines = {"stored": stored, "loaded": loaded, "fresh": fresh}
    facts = {key: engine.facts() for key, engine in engines.items()}
    ok = (facts["loaded"]["executables_loaded"] == len(BUCKETS)
          and facts["stored"]["executables_loaded"] == 0
          and stored.fingerprints() == loaded.fingerprints() == fresh.fingerprints())
    rows = np.arange(1, SLOTS * PAGES_PER_SEQ + 1, dtype=np.int32).reshape(SLOTS, -1)
    differ = 0
    for bucket, new, computed, ids in _steps(stored.vocab_size, count, seed=1):
        inputs = build_step_inputs(bucket, num_tokens=new, num_computed=computed,
                                   page_rows=rows, page_size=PAGE_SIZE,
                                   token_ids=ids.astype(np.int32))
        tokens = [engine.step(inputs).sampled_tokens for engine in engines.values()]
        differ += not all(np.array_equal(tokens[0], t) for t in tokens[1:])
    print(f"{name} on {jax.default_backend()} ({stored.attention}): loaded "
          f"{facts['loaded']['executables_loaded']}/{len(BUCKETS)} buckets, fingerprints "
          f"{'equal' if stored.fingerprints() == loaded.fingerprints() else 'DIFFER'}, "
          f"{count} steps, {differ} with different tokens "
          f"(stored vs loaded vs compiled without the cache)")
    return ok and differ == 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["tiny", "small"])
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    results = [check(name, args.steps) for name in args.models]
    print("executable cache check:", "passed" if all(results) else "FAILED")
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
