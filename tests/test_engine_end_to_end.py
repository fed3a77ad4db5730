"""The real engine through the real scheduler: batching invariance and compiled steps.

Every request's greedy tokens (fp32) must be the same whether it runs alone or
batched, under `static` and `orca`, with its prompt in one step or in chunks,
and after a recompute preemption — and equal to a plain dense step-by-step
decode of the same model. A whole run compiles exactly the configured buckets,
none after warm-up, and every policy runs the same compiled steps.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import policies
from orca_jax import KVConfig, Request, Scheduler, SchedulerConfig, StepLimits, StepPlan
from orca_jax.core.api.policy import Policy
from orca_jax.model.engine import JaxEngine
from orca_jax.model.llama import dense_forward, init_model
from orca_jax.model.weights import init_params
from orca_jax.specs.model_config import get_model_config

# Whole runs of the real engine, compiled: `pytest -m "not slow"` skips the module.
pytestmark = pytest.mark.slow
CONFIG = get_model_config("tiny")
PAGE_SIZE = 4
MAX_LEN = 64
BUCKETS = (16, 32, 64)
PROMPTS = [[5, 9, 2, 7, 1, 3, 8], [11, 4, 6, 2, 9, 13, 21, 30, 7, 5, 1, 17, 2], [3, 3, 8],
           [40, 2, 19, 6, 6, 1, 22, 9, 14, 2]]
OUTPUTS = [6, 4, 7, 5]


@dataclasses.dataclass(kw_only=True)
class ChunkedPreempting(Policy):
    """FCFS, prompts chunked to `chunk` tokens, pages on demand; at step `preempt_at` the
    newest running request is preempted by recompute (tests only)."""

    chunk: int = 4
    preempt_at: int = -1
    kv_reservation: str = "none"

    def schedule(self, view):
        preempt = []
        running = view.running.tolist()
        if view.step_index == self.preempt_at and running:
            preempt = [running.pop()]
        ids, tokens = [], []
        for request in running + [w for w in view.waiting.tolist()]:
            ids.append(request)
            tokens.append(min(int(view.requests.num_uncomputed([request])[0]), self.chunk))
        return StepPlan(ids, tokens, preempt=preempt)


ChunkedPreempting.name = "chunked-preempting"


@pytest.fixture(scope="module")
def engine():
    params = init_params(CONFIG, seed=3)
    engine = JaxEngine(CONFIG, params, num_cache_pages=4 * MAX_LEN // PAGE_SIZE + 1,
                       page_size=PAGE_SIZE, pages_per_seq=MAX_LEN // PAGE_SIZE,
                       attention="reference")
    return engine


@pytest.fixture(scope="module")
def dense_tokens():
    """Greedy continuation of every prompt by the plain dense model, one token at a time."""
    model = init_model(CONFIG, seed=3)
    forward = jax.jit(lambda tokens: dense_forward(model, tokens))
    out = []
    for prompt, length in zip(PROMPTS, OUTPUTS):
        sequence = list(prompt)
        for _ in range(length):
            sequence.append(int(jnp.argmax(forward(jnp.asarray(sequence, jnp.int32))[-1])))
        out.append(sequence[len(prompt):])
    return out


def _requests(indices):
    return [Request(id=i, arrival_s=0.0, prompt_len=len(PROMPTS[i]), output_len=OUTPUTS[i],
                    prompt_tokens=np.asarray(PROMPTS[i], np.int32)) for i in indices]


def _run(engine, policy, indices, max_num_seqs=4):
    config = SchedulerConfig(limits=StepLimits(max_num_seqs=max_num_seqs,
                                               max_num_tokens=BUCKETS[-1], max_model_len=MAX_LEN,
                                               token_buckets=BUCKETS),
                             kv=KVConfig(num_kv_pages=4 * MAX_LEN // PAGE_SIZE,
                                         page_size=PAGE_SIZE))
    result = Scheduler(_requests(indices), policy, engine, config).run()
    by_id = {request_id: result.output_tokens[i].tolist()
             for i, request_id in enumerate(result.request_ids)}
    return by_id, result


@pytest.mark.parametrize("policy_name", ["static", "orca"])
def test_batched_tokens_equal_alone_and_dense(engine, dense_tokens, policy_name):
    batched, _ = _run(engine, policies.make_policy(policy_name), range(4))
    for i in range(4):
        alone, _ = _run(engine, policies.make_policy(policy_name), [i])
        assert alone[i] == dense_tokens[i], (policy_name, i)
        assert batched[i] == dense_tokens[i], (policy_name, i)


def test_chunked_prefill_and_recompute_preemption_keep_tokens(engine, dense_tokens):
    chunked, result = _run(engine, ChunkedPreempting(chunk=3), range(4))
    assert max(s.num_tokens for s in result.steps) <= 3 * 4
    assert chunked == {i: dense_tokens[i] for i in range(4)}
    # Preempt the newest running request mid-decode: it recomputes prompt + output so far.
    preempted, result = _run(engine, ChunkedPreempting(chunk=5, preempt_at=6), range(4))
    assert result.total_preemptions == 1
    assert int(result.num_preemptions.sum()) == 1
    assert preempted == {i: dense_tokens[i] for i in range(4)}


def test_runs_compile_exactly_the_buckets_and_share_them(engine):
    fresh = JaxEngine(CONFIG, init_params(CONFIG, seed=3),
                      num_cache_pages=4 * MAX_LEN // PAGE_SIZE + 1, page_size=PAGE_SIZE,
                      pages_per_seq=MAX_LEN // PAGE_SIZE, attention="reference")
    _, static_run = _run(fresh, policies.make_policy("static"), range(4))
    assert fresh.num_compiles == len(BUCKETS)
    static_prints = fresh.fingerprints()
    _, orca_run = _run(fresh, policies.make_policy("orca"), range(4))
    assert fresh.num_compiles == len(BUCKETS)  # none after warm-up, for either policy
    assert fresh.fingerprints() == static_prints
    assert sorted(b.num_tokens for b in static_prints) == list(BUCKETS)
    # A separately built engine compiles the very same programs.
    assert engine.fingerprints() == static_prints
    used = {s.bucket for s in static_run.steps} | {s.bucket for s in orca_run.steps}
    assert used <= set(BUCKETS)


def test_prefix_caching_keeps_greedy_tokens(engine, dense_tokens):
    # Request 1 repeats 0's prompt (13 tokens: 3 cached pages, 1 token computed); 2 shares
    # its first two pages and is admitted in the same step as 1; 3 is unrelated and, in the
    # small pool, evicts cached pages that 4 (0's prompt again) then recomputes.
    shared = PROMPTS[1]
    prompts = [shared, shared, shared[:8] + [3, 3, 8, 1], PROMPTS[3] + PROMPTS[0] + PROMPTS[2],
               shared]
    arrivals, outputs = [0.0, 100.0, 100.0, 200.0, 300.0], [4, 5, 4, 5, 3]
    requests = [Request(id=i, arrival_s=a, prompt_len=len(p), output_len=n,
                        prompt_tokens=np.asarray(p, np.int32))
                for i, (p, a, n) in enumerate(zip(prompts, arrivals, outputs))]

    def run(num_kv_pages, caching):
        config = SchedulerConfig(limits=StepLimits(max_num_seqs=4, max_num_tokens=BUCKETS[-1],
                                                   max_model_len=MAX_LEN, token_buckets=BUCKETS),
                                 kv=KVConfig(num_kv_pages=num_kv_pages, page_size=PAGE_SIZE,
                                             prefix_caching="policy" if caching else "off"))
        result = Scheduler(requests, policies.make_policy("vllm"), engine, config).run()
        return [tokens.tolist() for tokens in result.output_tokens], result

    off, _ = run(64, caching=False)
    assert off[0] == dense_tokens[1][:4]
    for num_kv_pages in (64, 8):
        on, result = run(num_kv_pages, caching=True)
        assert on == off, num_kv_pages
        assert result.num_cached_tokens[:3].tolist() == [0, 12, 8]
        if num_kv_pages == 64:  # 1 and 2 were admitted together, on the same pages
            assert 12 + 8 in [step.num_cached_tokens for step in result.steps]
    # The small pool evicted 0's pages: 4 found fewer of them than 1 did.
    assert result.num_evictions > 0 and result.num_cached_tokens[4] < 12
