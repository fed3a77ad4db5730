"""Speculative decoding on the real engine (tiny, fp32): the verifying step's row tokens
are the dense model's greedy tokens, and a greedy run's outputs are identical with and
without speculation, for several k, batches mixing k = 0, k > 0 and prefills, with the
prompt-lookup drafter and a draft model; the compile set stays the buckets'."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from speculating_policy import Speculating

from orca_jax import KVConfig, Request, Scheduler, SchedulerConfig, StepLimits
from orca_jax.core.step.engine_api import Bucket, EngineConfigError
from orca_jax.core.step.packing import build_step_inputs
from orca_jax.model.engine import JaxEngine
from orca_jax.model.llama import dense_forward, init_model
from orca_jax.model.speculative import SpeculativeEngine, draft_params
from orca_jax.model.weights import init_params
from orca_jax.specs.model_config import get_model_config

# Steps another real-engine module compiled are loaded (conftest.py).
pytestmark = pytest.mark.usefixtures("session_compile_cache")

CONFIG = get_model_config("tiny")
DRAFT = get_model_config("tiny-draft")
PAGE_SIZE, MAX_LEN = 4, 64
BUCKETS = (16, 32, 64)
NUM_PAGES = 4 * MAX_LEN // PAGE_SIZE
# Repeats in the prompts give prompt lookup something to find.
PROMPTS = [[5, 9, 2, 7, 5, 9, 2, 7, 5, 9], [11, 4, 6, 2, 9, 13, 21, 30, 7, 5, 1, 17, 2],
           [3, 3, 8], [40, 2, 19, 6, 6, 1, 22, 9, 14, 2, 40, 2, 19]]
OUTPUTS = [14, 9, 12, 10]
CHUNK = 5  # prompt tokens a step gives a request: prefills span steps beside decodes


@pytest.fixture(scope="module")
def params():
    return init_params(CONFIG, seed=3)


def _engine(params, verify=False):
    return JaxEngine(CONFIG, params, num_cache_pages=NUM_PAGES + 1, page_size=PAGE_SIZE,
                     pages_per_seq=MAX_LEN // PAGE_SIZE, attention="reference",
                     verify_rows=verify)


def _speculative(params, drafter):
    draft = None
    if drafter == "model":
        draft = JaxEngine(DRAFT, draft_params(CONFIG, params, DRAFT, seed=3),
                          num_cache_pages=NUM_PAGES + 1, page_size=PAGE_SIZE,
                          pages_per_seq=MAX_LEN // PAGE_SIZE, attention="reference")
    return SpeculativeEngine(_engine(params, verify=True), drafter=drafter, draft=draft)


def _run(engine, policy):
    config = SchedulerConfig(limits=StepLimits(max_num_seqs=4, max_num_tokens=BUCKETS[-1],
                                               max_model_len=MAX_LEN, token_buckets=BUCKETS),
                             kv=KVConfig(num_kv_pages=NUM_PAGES, page_size=PAGE_SIZE))
    requests = [Request(id=i, arrival_s=0.0, prompt_len=len(p), output_len=n,
                        prompt_tokens=np.asarray(p, np.int32))
                for i, (p, n) in enumerate(zip(PROMPTS, OUTPUTS))]
    result = Scheduler(requests, policy, engine, config).run()
    return [tokens.tolist() for tokens in result.output_tokens], result


@pytest.fixture(scope="module")
def speculative_engines(params):
    """One speculative engine per drafter, shared by the runs (as a server's would be)."""
    return {drafter: _speculative(params, drafter) for drafter in ("ngram", "model")}


@pytest.fixture(scope="module")
def plain_outputs(params):
    outputs, _ = _run(_engine(params), Speculating(ks=(0,), chunk=CHUNK, budget=BUCKETS[-1]))
    return outputs


def test_verifying_step_rows_are_the_dense_greedy_tokens(params):
    engine = _engine(params, verify=True)
    bucket = Bucket(32, 4)
    engine.warmup([bucket])
    assert engine.num_compiles == 1  # one program per bucket, as the plain step
    sequences = [PROMPTS[1], PROMPTS[3]]
    inputs = build_step_inputs(
        bucket, num_tokens=np.array([len(s) for s in sequences]),
        num_computed=np.zeros(2, np.int64),
        page_rows=np.arange(1, 1 + 2 * 4, dtype=np.int32).reshape(2, 4), page_size=PAGE_SIZE,
        token_ids=np.concatenate(sequences).astype(np.int32),
        pages_per_seq=MAX_LEN // PAGE_SIZE)
    out = engine.step(inputs)
    model = init_model(CONFIG, seed=3)
    start = 0
    for i, sequence in enumerate(sequences):
        dense = np.asarray(jnp.argmax(dense_forward(model, jnp.asarray(sequence)), axis=-1))
        rows = out.row_tokens[start:start + len(sequence)]
        assert rows.tolist() == dense.tolist(), i
        assert out.sampled_tokens[i] == dense[-1]  # the sequence's sampled token is its last row
        start += len(sequence)
    assert engine.num_compiles == 1


@pytest.mark.slow  # whole runs of the real engine: `pytest -m "not slow"` skips them
@pytest.mark.parametrize("drafter", ["ngram", "model"])
@pytest.mark.parametrize("ks", [(1,), (3,), (0, 2, 4)], ids=["k1", "k3", "k0-2-4"])
def test_greedy_outputs_identical_with_and_without_speculation(speculative_engines,
                                                               plain_outputs, drafter, ks):
    engine = speculative_engines[drafter]
    before = engine.facts()
    outputs, _ = _run(engine, Speculating(ks=ks, chunk=CHUNK, budget=BUCKETS[-1]))
    assert outputs == plain_outputs
    if drafter == "ngram":  # its context is every token but the last (never computed)
        for i, prompt in enumerate(PROMPTS):
            assert engine.request_tokens(i).tolist() == prompt + outputs[i][:-1], i
    facts = engine.facts()
    drafted = facts["drafted_tokens"] - before["drafted_tokens"]
    accepted = facts["accepted_draft_tokens"] - before["accepted_draft_tokens"]
    assert 0 < accepted < drafted  # both paths taken: drafts kept and drafts rejected
    # The compile set: the buckets, once for the target and once for the draft model,
    # however many runs and whatever k.
    per_model = len(BUCKETS)
    assert engine.target.num_compiles == per_model
    assert facts["num_compiles"] == per_model * (2 if drafter == "model" else 1)
    if drafter == "model":
        assert facts["draft_num_compiles"] == per_model
        assert facts["draft_s"] > before["draft_s"] and facts["draft_steps"] > 0


@pytest.mark.slow
def test_drafts_that_disagree_keep_the_outputs(params, plain_outputs):
    """A draft model of random weights (not the target's first layer) is rejected almost
    always: the run still gives the target's greedy tokens."""
    draft = JaxEngine(DRAFT, init_params(DRAFT, seed=11), num_cache_pages=NUM_PAGES + 1,
                      page_size=PAGE_SIZE, pages_per_seq=MAX_LEN // PAGE_SIZE,
                      attention="reference")
    engine = SpeculativeEngine(_engine(params, verify=True), drafter="model", draft=draft)
    outputs, _ = _run(engine, Speculating(ks=(3,), chunk=CHUNK, budget=BUCKETS[-1]))
    assert outputs == plain_outputs
    assert engine.facts()["accepted_draft_tokens"] < engine.facts()["drafted_tokens"]


def test_bad_drafter_settings_are_one_line(params):
    small = get_model_config("small")
    with pytest.raises(EngineConfigError, match="vocab_size 512.*target 'small' has 2048"):
        draft_params(small, init_params(small, seed=0), DRAFT, seed=0)
    with pytest.raises(EngineConfigError, match="needs a draft model"):
        SpeculativeEngine(_engine(params, verify=True), drafter="model")
    with pytest.raises(EngineConfigError, match="is not one of ngram, model"):
        SpeculativeEngine(_engine(params, verify=True), drafter="eagle")
    with pytest.raises(EngineConfigError, match="verify_rows=True"):
        SpeculativeEngine(_engine(params), drafter="ngram")


def test_self_draft_shares_the_targets_first_layer(params):
    shared = draft_params(CONFIG, params, DRAFT, seed=5)
    leaves = {jax.tree_util.keystr(p): leaf
              for p, leaf in jax.tree_util.tree_leaves_with_path(params)}
    for path, leaf in jax.tree_util.tree_leaves_with_path(shared):
        assert np.array_equal(leaf, leaves[jax.tree_util.keystr(path)])
    assert len(jax.tree_util.tree_leaves(shared)) < len(leaves)


@pytest.mark.parametrize("knobs,message", [
    (dict(drafter="model"), "engine.drafter model needs engine.draft_model"),
    (dict(drafter="ngram", draft_model="tiny-draft"), "is the model drafter's"),
    (dict(model="small", drafter="model", draft_model="tiny-draft"),
     "vocabulary of 512 tokens, the target 'small' 2048.*presets that share it: small-draft"),
    (dict(drafter="ngram", clock="profiled"), "use engine.clock wall"),
    (dict(drafter="eagle"), "drafter"),
])
def test_engine_spec_refuses_bad_drafter_settings_in_one_line(knobs, message):
    from orca_jax.runner.spec import JaxEngineSpec
    settings = {"model": "tiny", "clock": "wall", **knobs}
    with pytest.raises(ValueError, match=message) as error:
        JaxEngineSpec(**settings)
    assert "\n" not in str(error.value)
    JaxEngineSpec(model="tiny", clock="wall", drafter="model", draft_model="tiny-draft")
    JaxEngineSpec(model="tiny", clock="wall", drafter="ngram", sampling="temperature:0.8:40")
