"""JaxEngine: compiles exactly the warmed buckets, batching invariance, fingerprints."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from orca_jax.core.step.engine_api import Bucket, EngineConfigError, StepInputs
from orca_jax.model import engine as jax_engine
from orca_jax.model import llama as model_lib
from orca_jax.model import weights
from orca_jax.specs.model_config import get_model_config

PAGE_SIZE, PAGES_PER_SEQ, NUM_PAGES = 4, 8, 40
SMALL, LARGE = Bucket(num_tokens=16, num_seqs=2), Bucket(num_tokens=32, num_seqs=4)


def pack_by_hand(chunks: list[tuple[list[int], int, list[int]]], bucket: Bucket) -> StepInputs:
    """StepInputs for sequences given as (new token ids, first position, pages)."""
    t, s = bucket.num_tokens, bucket.num_seqs
    ids, pos, slots = (np.zeros(t, np.int32) for _ in range(3))
    cu, kv, samples = np.zeros(s + 1, np.int32), np.zeros(s, np.int32), np.zeros(s, np.int32)
    table = np.zeros((s, PAGES_PER_SEQ), np.int32)
    for i, (tokens, start, pages) in enumerate(chunks):
        lo, n = cu[i], len(tokens)
        p = np.arange(start, start + n)
        ids[lo:lo + n], pos[lo:lo + n] = tokens, p
        slots[lo:lo + n] = np.asarray(pages)[p // PAGE_SIZE] * PAGE_SIZE + p % PAGE_SIZE
        cu[i + 1], kv[i], samples[i] = lo + n, start + n, lo + n - 1
        table[i, :len(pages)] = pages
    cu[len(chunks) + 1:] = cu[len(chunks)]
    return StepInputs(bucket=bucket, token_ids=ids, positions=pos, cu_q_lens=cu, kv_lens=kv,
                      page_indices=table, slot_mapping=slots, sample_indices=samples,
                      num_seqs=np.array([len(chunks)], np.int32),
                      temperature=np.zeros(s, np.float32), top_k=np.zeros(s, np.int32),
                      top_p=np.ones(s, np.float32), rng_seeds=np.zeros(s, np.uint32))


def generate(engine, requests, plans, bucket):
    """Runs `plans` (per step: list of (request, num_new_tokens)); returns generated tokens."""
    known = {r: list(tokens) for r, (tokens, _) in requests.items()}
    done = {r: 0 for r in requests}
    prompt_len = {r: len(tokens) for r, (tokens, _) in requests.items()}
    for plan in plans:
        chunks = [(known[r][done[r]:done[r] + n], done[r], requests[r][1]) for r, n in plan]
        out = engine.step(pack_by_hand(chunks, bucket))
        for slot, (r, n) in enumerate(plan):
            done[r] += n
            if done[r] == len(known[r]):
                known[r].append(int(out.sampled_tokens[slot]))
    return {r: known[r][prompt_len[r]:] for r in requests}


@pytest.fixture(scope="module")
def engine_parts():
    config = get_model_config("tiny")
    return config, weights.init_params(config, seed=3)


@pytest.fixture(scope="module")
def engine(engine_parts):
    config, params = engine_parts
    engine = jax_engine.JaxEngine(config, params, num_cache_pages=NUM_PAGES, page_size=PAGE_SIZE,
                                  pages_per_seq=PAGES_PER_SEQ)
    engine.warmup([SMALL, LARGE])
    return engine


def test_warmup_compiles_exactly_the_buckets_and_steps_compile_nothing(engine):
    assert engine.name == "jax" and engine.needs_token_ids
    assert engine.num_compiles == 2
    assert set(engine.fingerprints()) == {SMALL, LARGE}
    assert engine.fingerprints()[SMALL] != engine.fingerprints()[LARGE]
    before = jax_engine.backend_compiles()
    engine.warmup([LARGE])  # already compiled: nothing to do
    for bucket in (SMALL, LARGE, SMALL):
        engine.step(pack_by_hand([([1, 2, 3], 0, [5])], bucket))
    assert engine.num_compiles == 2
    assert jax_engine.backend_compiles() == before  # no XLA compile anywhere in the process
    with pytest.raises(ValueError, match=r"Bucket\(num_tokens=64, num_seqs=4\) was not warmed"):
        engine.step(pack_by_hand([([1], 0, [5])], Bucket(num_tokens=64, num_seqs=4)))


def test_a_single_device_step_hands_its_numpy_descriptor_to_the_compiled_program(
        engine, monkeypatch):
    # jax.device_put's Python path cost ~0.3 ms a step; the compiled call copies the arrays.
    expected = engine.step(pack_by_hand([([4, 5, 6], 0, [7])], SMALL)).sampled_tokens
    calls = []
    monkeypatch.setattr(jax_engine.jax, "device_put",
                        lambda *args, **kwargs: calls.append(args) or args[0])
    again = engine.step(pack_by_hand([([4, 5, 6], 0, [11])], SMALL)).sampled_tokens
    assert calls == []
    np.testing.assert_array_equal(again, expected)  # same prompt, other page: same token


def test_greedy_tokens_do_not_depend_on_the_batch(engine, engine_parts):
    config, params = engine_parts
    rng = np.random.default_rng(5)
    prompts = {r: list(rng.integers(0, config.vocab_size, n)) for r, n in
               (("a", 9), ("b", 14), ("c", 5))}
    pages = {"a": [11, 3, 20, 7, 1, 30, 12, 2], "b": [4, 25, 6, 19, 8, 9], "c": [33, 10, 13]}
    num_decodes = 6
    alone = generate(engine, {"a": (prompts["a"], pages["a"])},
                     [[("a", 9)]] + [[("a", 1)]] * num_decodes, SMALL)["a"]
    # Batched: a prefills in chunks 4 + 5 beside b's and c's prefills, then all decode.
    batched = generate(
        engine, {r: (prompts[r], pages[r]) for r in prompts},
        [[("b", 14), ("a", 4)], [("c", 5), ("a", 5), ("b", 1)]]
        + [[("a", 1), ("b", 1), ("c", 1)]] * num_decodes, LARGE)
    assert batched["a"][:num_decodes + 1] == alone
    # And both follow a plain dense greedy decode of the same model.
    graphdef, _ = model_lib.abstract_model(config)
    model = nnx.merge(graphdef, params)
    dense = nnx.jit(model_lib.dense_forward)
    tokens = list(prompts["a"])
    for _ in range(num_decodes + 1):
        logits = dense(model, jnp.asarray(tokens + [0] * (16 - len(tokens)), jnp.int32))
        tokens.append(int(jnp.argmax(logits[len(tokens) - 1])))
    assert tokens[9:] == alone


def test_fingerprints_match_across_engines_with_the_same_config(engine, engine_parts):
    config, _ = engine_parts
    other = jax_engine.JaxEngine(config, weights.init_params(config, seed=4),
                                 num_cache_pages=NUM_PAGES, page_size=PAGE_SIZE,
                                 pages_per_seq=PAGES_PER_SEQ)
    other.warmup([SMALL])
    assert other.num_compiles == 1
    assert other.fingerprints()[SMALL] == engine.fingerprints()[SMALL]


def test_bad_construction_and_inputs_name_the_problem(engine, engine_parts):
    config, params = engine_parts
    with pytest.raises(ValueError, match="unknown attention op 'flash'"):
        jax_engine.JaxEngine(config, params, num_cache_pages=8, page_size=4, pages_per_seq=2,
                             attention="flash")
    small = weights.init_params(get_model_config("small"))
    with pytest.raises(ValueError, match=r"embed_tokens.*expected \(512, 128\)"):
        jax_engine.JaxEngine(config, small, num_cache_pages=8, page_size=4, pages_per_seq=2)
    inputs = pack_by_hand([([1], 0, [5])], SMALL)
    wide = dataclasses.replace(inputs, page_indices=np.zeros((2, PAGES_PER_SEQ + 1), np.int32))
    with pytest.raises(ValueError, match="pages_per_seq=8"):
        engine.step(wide)
    plain_mlp = dataclasses.replace(config, name="tiny-opt", gated_mlp=False)
    with pytest.raises(EngineConfigError, match="'tiny-opt'.*gated_mlp=False.*simulator"):
        weights.init_params(plain_mlp)


def test_bucketed_attention_gives_the_reference_tokens_and_compiles_only_its_buckets(
        engine, engine_parts):
    # The op's KV chunks over long contexts are tested in test_bucketed_attention.py; here
    # the engine: the same greedy tokens as the reference op, and no compile past warm-up.
    config, params = engine_parts
    bucketed = jax_engine.JaxEngine(config, params, num_cache_pages=NUM_PAGES,
                                    page_size=PAGE_SIZE, pages_per_seq=PAGES_PER_SEQ,
                                    attention="bucketed")
    bucketed.warmup([SMALL, LARGE])
    assert bucketed.num_compiles == 2
    before = jax_engine.backend_compiles()
    rng = np.random.default_rng(8)
    prompts = {r: list(rng.integers(0, config.vocab_size, n)) for r, n in
               (("a", 9), ("b", 14), ("c", 5))}
    pages = {"a": [11, 3, 20, 7, 1, 30, 12, 2], "b": [4, 25, 6, 19, 8, 9], "c": [33, 10, 13]}
    plans = ([[("b", 14), ("a", 4)], [("c", 5), ("a", 5), ("b", 1)]]
             + [[("a", 1), ("b", 1), ("c", 1)]] * 6)
    requests = {r: (prompts[r], pages[r]) for r in prompts}
    got = generate(bucketed, requests, plans, LARGE)
    assert got == generate(engine, requests, plans, LARGE)
    assert [len(got[r]) for r in "abc"] == [7, 8, 7]
    alone = generate(bucketed, {"a": requests["a"]}, [[("a", 9)]] + [[("a", 1)]] * 6, SMALL)
    assert alone["a"] == got["a"]  # batching invariance holds on the bucketed op too
    assert jax_engine.backend_compiles() == before and bucketed.num_compiles == 2
    facts = bucketed.facts()
    assert facts["attention"] == "bucketed" and facts["attention_kv_chunk_tokens"] == 128
