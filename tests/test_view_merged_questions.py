"""The view's merged questions answer what their parts answer: `uncomputed_and_pages` is
`requests.num_uncomputed` and `pages_needed` of those tokens, and `admission_needs` is
`num_uncomputed - cached_tokens` and `pages_needed` of those as lists, on every capacity
(plain, counts only, reserving, a page size that is no power of two, prefix hits)."""

import numpy as np
import pytest

from orca_jax import KVConfig, Request, Scheduler, SchedulerConfig, StepLimits, make_policy
from orca_jax.sim.cost_model import CostModelConfig
from orca_jax.sim.engine import SimEngine


def _requests(with_tokens: bool) -> list[Request]:
    """Twelve requests, some sharing a prefix, arriving together."""
    rng = np.random.default_rng(0)
    shared = rng.integers(0, 1000, 24).astype(np.int32)
    requests = []
    for i in range(12):
        prompt_len = int(rng.integers(5, 40))
        tokens = None
        if with_tokens:
            own = rng.integers(0, 1000, prompt_len).astype(np.int32)
            tokens = np.concatenate([shared, own])[:prompt_len] if i % 2 else own
        requests.append(Request(id=i, arrival_s=0.0, prompt_len=prompt_len, output_len=6,
                                prompt_tokens=tokens))
    return requests


@pytest.mark.parametrize("policy,page_size,counts_only,tokens", [
    ("vllm", 4, False, False), ("vllm", 4, True, False), ("vllm", 3, True, False),
    ("orca", 4, False, False), ("vllm", 4, False, True)])
def test_the_merged_questions_answer_what_their_parts_answer(policy, page_size, counts_only,
                                                             tokens):
    config = SchedulerConfig(
        limits=StepLimits(max_num_seqs=4, max_num_tokens=32, max_model_len=64),
        kv=KVConfig(num_kv_pages=200, page_size=page_size, watermark_pages=1))
    engine = SimEngine(CostModelConfig(mode="fixed", step_time_s=0.01))
    scheduler = Scheduler(_requests(tokens), make_policy(policy), engine, config,
                          kv_counts_only=counts_only)
    view = scheduler.view
    for _ in range(12):  # each step: running (some mid-prompt) and waiting ones asked
        for ids in (view.running, view.waiting):
            uncomputed, pages = view.uncomputed_and_pages(ids)
            np.testing.assert_array_equal(uncomputed, view.requests.num_uncomputed(ids))
            np.testing.assert_array_equal(pages, view.pages_needed(ids, uncomputed))
        waiting = view.waiting[:5]
        uncached = view.requests.num_uncomputed(waiting)
        if view.prefix_caching:
            uncached = uncached - view.cached_tokens(waiting)
        assert view.admission_needs(waiting.tolist()) == (
            uncached.tolist(), view.pages_needed(waiting, uncached).tolist())
        if not scheduler.step():
            break
