"""Speculative decoding at temperature > 0 on the real engine (tiny, fp32): the tokens a
speculating run keeps are distributed as a run without speculation's (chi-square over many
requests of one fixed context), seed for seed the same tokens, with drafts both accepted
and rejected, for both drafters; a run repeats."""

import numpy as np
import pytest
from speculating_policy import Speculating

from orca_jax import KVConfig, Request, Scheduler, SchedulerConfig, StepLimits
from orca_jax.core.step.sampling import SamplingConfig
from orca_jax.model.engine import JaxEngine
from orca_jax.model.speculative import SpeculativeEngine, draft_params
from orca_jax.model.weights import init_params
from orca_jax.specs.model_config import get_model_config

# Whole runs of the real engine: `pytest -m "not slow"` skips them. The second verifying
# engine loads the first one's steps, and steps another real-engine module compiled are
# loaded (conftest.py); a loaded step counts as compiled, so the compile-set check holds.
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("session_compile_cache")]

CONFIG = get_model_config("tiny")
DRAFT = get_model_config("tiny-draft")
PAGE_SIZE, MAX_LEN, MAX_SEQS = 4, 32, 32
BUCKETS = (64, 128)
NUM_PAGES = MAX_SEQS * MAX_LEN // PAGE_SIZE
# One fixed context for every request; its second "5 9 2 7 5 9" gives prompt lookup an
# earlier occurrence to propose from.
PROMPT = [5, 9, 2, 7, 5, 9, 454, 492, 220, 45, 220, 497, 5, 9, 2, 7, 5, 9]
OUTPUT_LEN = 4  # token 0 comes from the prefill; tokens 1..3 from verifying steps
K = 3
SAMPLING = dict(temperature=1.0, top_k=8)
# Sample size and significance. Each request is an independent draw of its 4 tokens
# (its own seed). Per arm N = 400 requests; a position's tokens are pooled into the 5
# commonest of both arms and "other" (6 categories, df = 5; `_chi2` asserts every
# expected count is at least 5, where the chi-square law holds). The homogeneity statistic is
# compared with chi2.isf(1e-4, df=5) = 25.745 (the textbook quantile; scipy is no
# dependency): with 2 drafters x 3 positions a correct sampler would fail one of the six
# under a fresh seed about 6 times in 10,000, and with the fixed seeds here it is
# deterministic, so it cannot flake. The test has power: the draft model's own tokens
# (what a verifier keeping every draft would emit) fail it by far
# (`test_the_chi_square_tells_the_draft_from_the_target`). Not fewer: at N = 200 the
# statistics would still hold (the draft's tokens score 170, 51, 44 and 49), but the ngram
# drafter's seed-A run keeps none of its 25 drafts, so its run no longer covers a kept draft.
NUM_REQUESTS = 400
CHI2_5DF_1E4 = 25.745
SEED_A, SEED_B = 1, 2


def _engine(config, params, verify=False):
    return JaxEngine(config, params, num_cache_pages=NUM_PAGES + 1, page_size=PAGE_SIZE,
                     pages_per_seq=MAX_LEN // PAGE_SIZE, attention="bucketed",
                     verify_rows=verify)


def _run(engine, k, seed, num_requests=NUM_REQUESTS):
    """[num_requests, OUTPUT_LEN] the tokens of a run of `num_requests` copies of PROMPT."""
    config = SchedulerConfig(
        limits=StepLimits(max_num_seqs=MAX_SEQS, max_num_tokens=BUCKETS[-1],
                          max_model_len=MAX_LEN, token_buckets=BUCKETS),
        kv=KVConfig(num_kv_pages=NUM_PAGES, page_size=PAGE_SIZE),
        sampling=SamplingConfig(seed=seed, **SAMPLING))
    requests = [Request(id=i, arrival_s=0.0, prompt_len=len(PROMPT), output_len=OUTPUT_LEN,
                        prompt_tokens=np.asarray(PROMPT, np.int32))
                for i in range(num_requests)]
    policy = Speculating(ks=(k,), budget=BUCKETS[-1], max_seqs=MAX_SEQS)
    result = Scheduler(requests, policy, engine, config).run()
    return np.stack(result.output_tokens)


def _chi2(a, b, categories=5):  # [N], [M] tokens of two samples
    """The 2 x (categories + 1) homogeneity statistic: the commonest tokens of both
    samples together, the rest pooled."""
    values, counts = np.unique(np.concatenate([a, b]), return_counts=True)
    top = values[np.argsort(-counts, kind="stable")[:categories]]
    table = np.array([[*(np.sum(s == t) for t in top), np.sum(~np.isin(s, top))]
                      for s in (a, b)], np.float64)  # [2, C]
    expected = table.sum(1, keepdims=True) * table.sum(0, keepdims=True) / table.sum()
    assert expected.min() >= 5, expected  # else the chi-square approximation is off
    return float(((table - expected) ** 2 / expected).sum())


@pytest.fixture(scope="module")
def params():
    return init_params(CONFIG, seed=3)


@pytest.fixture(scope="module")
def plain(params):
    """Runs without speculation, seeds A and B."""
    engine = _engine(CONFIG, params)
    return {seed: _run(engine, 0, seed) for seed in (SEED_A, SEED_B)}


@pytest.fixture(scope="module")
def speculative(params):
    """One speculating engine per drafter and its seed-A run (k = 3), with the drafts it
    made and kept in that run."""
    out = {}
    for drafter in ("ngram", "model"):
        draft = (_engine(DRAFT, draft_params(CONFIG, params, DRAFT, seed=3))
                 if drafter == "model" else None)
        engine = SpeculativeEngine(_engine(CONFIG, params, verify=True), drafter=drafter,
                                   draft=draft)
        tokens = _run(engine, K, SEED_A)
        facts = engine.facts()
        out[drafter] = (engine, tokens, facts["drafted_tokens"],
                        facts["accepted_draft_tokens"])
    return out


@pytest.mark.parametrize("drafter", ["ngram", "model"])
def test_sampled_tokens_with_speculation_are_distributed_as_without(plain, speculative,
                                                                    drafter):
    _, tokens, drafted, accepted = speculative[drafter]
    assert 0 < accepted < drafted  # the test covers kept drafts and rejections both
    for position in range(1, OUTPUT_LEN):  # the tokens verifying steps produced
        # Seed A with speculation against seed B without: independent samples.
        statistic = _chi2(tokens[:, position], plain[SEED_B][:, position])
        assert statistic < CHI2_5DF_1E4, (position, statistic)


@pytest.mark.parametrize("drafter", ["ngram", "model"])
def test_sampled_tokens_are_the_plain_runs_seed_for_seed(plain, speculative, drafter):
    """Each verified row draws with the key its position has without speculation: the
    run keeps exactly the plain run's tokens, and repeats itself."""
    engine, tokens, _, _ = speculative[drafter]
    assert np.array_equal(tokens, plain[SEED_A])
    assert np.array_equal(_run(engine, K, SEED_A, num_requests=40), plain[SEED_A][:40])
    # The compile set: one program per bucket and model, as at greedy.
    assert engine.target.num_compiles == len(BUCKETS)


def test_the_chi_square_tells_the_draft_from_the_target(params, plain, speculative):
    """Power: the draft model's own tokens (what keeping every draft would emit) are past
    the threshold at every position (327, 95, 76 and 80 at tokens 0-3 when written), so passing
    the test above is no accident."""
    draft_engine = speculative["model"][0].draft
    drafted = _run(draft_engine, 0, SEED_B)
    for position in range(OUTPUT_LEN):
        assert _chi2(drafted[:, position], plain[SEED_A][:, position]) > CHI2_5DF_1E4
