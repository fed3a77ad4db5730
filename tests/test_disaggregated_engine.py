"""Disaggregated prefill and decode on the real engine: two JaxEngines, KV pages copied
(and a running request migrated between two of them the same way).

A 1+1 cluster of `tiny` fp32 engines in one process (each with its own KV cache,
compiled once per bucket) must give every request the greedy tokens a colocated
run gives it: the decode engine continues from the pages copied out of the
prefill engine's cache. Without the copy the tokens differ, so the test sees it.
"""


import numpy as np
import pytest

import policies
from orca_jax import KVConfig, Request, Scheduler, SchedulerConfig, StepLimits
from orca_jax.cluster.disaggregated import DisaggregatedCluster, PoolSpec
from orca_jax.cluster.transfers import KVTransferCost
from orca_jax.core.requests.run_result import RunResult
from orca_jax.model.engine import JaxEngine
from orca_jax.model.weights import init_params
from orca_jax.specs.hardware import get_kv_link
from orca_jax.specs.model_config import get_model_config

# Steps another real-engine module compiled are loaded (conftest.py).
pytestmark = pytest.mark.usefixtures("session_compile_cache")

MODEL = get_model_config("tiny")
PAGE_SIZE = 4
MAX_LEN = 64
CONFIG = SchedulerConfig(limits=StepLimits(max_num_seqs=4, max_num_tokens=32, max_model_len=MAX_LEN,
                                           token_buckets=(8, 32)),
                         kv=KVConfig(num_kv_pages=48, page_size=PAGE_SIZE))


@pytest.fixture(scope="module")
def params():
    return init_params(MODEL, seed=5)


def _engine(params):
    return JaxEngine(MODEL, params, num_cache_pages=CONFIG.kv.num_kv_pages + 1, page_size=PAGE_SIZE,
                     pages_per_seq=MAX_LEN // PAGE_SIZE, attention="reference")


def _requests():
    rng = np.random.default_rng(7)
    lengths = [(9, 6), (17, 4), (3, 8), (25, 5), (6, 1), (12, 7)]
    return [Request(id=i, arrival_s=0.002 * i, prompt_len=p, output_len=o,
                    prompt_tokens=rng.integers(1, MODEL.vocab_size, p).astype(np.int32))
            for i, (p, o) in enumerate(lengths)]


def _tokens(result):
    return {rid: result.output_tokens[i].tolist() for i, rid in enumerate(result.request_ids)}


def _disaggregated(params, prefill_policy="vllm"):
    engines = []

    def make_engine():
        engines.append(_engine(params))
        return engines[-1]

    def pool(policy):
        return PoolSpec(num_replicas=1, make_policy=lambda: policies.make_policy(policy),
                        make_engine=make_engine, config=CONFIG)

    cluster = DisaggregatedCluster(
        _requests(), prefill=pool(prefill_policy), decode=pool("vllm"),
        transfer_cost=KVTransferCost(link=get_kv_link("nvlink"), bytes_per_token=4096))
    return cluster


@pytest.fixture(scope="module")
def colocated(params):
    return _tokens(Scheduler(_requests(), policies.make_policy("vllm"), _engine(params),
                             CONFIG).run())


def test_page_copy_moves_exactly_those_pages(params):
    source, target = _engine(params), _engine(params)
    kv = source.read_kv_pages(np.array([0, 0], np.int32))  # the null pages: zeros
    assert kv[0] == 2
    source._cache = type(source._cache)(  # distinct values in pages 3 and 5
        k=tuple(k.at[3].set(1.0).at[5].set(2.0) for k in source._cache.k),
        v=tuple(v.at[3].set(-1.0).at[5].set(-2.0) for v in source._cache.v))
    target.write_kv_pages(np.array([7, 2], np.int32),
                          source.read_kv_pages(np.array([3, 5], np.int32)))
    for k, v in zip(target._cache.k, target._cache.v):
        assert float(k[7].min()) == float(k[7].max()) == 1.0
        assert float(v[2].min()) == float(v[2].max()) == -2.0
        assert float(abs(k[1]).max()) == float(abs(k[3]).max()) == 0.0  # nothing else moved
    with pytest.raises(ValueError, match="2 pages of KV for 1 pages"):
        target.write_kv_pages(np.array([1], np.int32), kv)


@pytest.mark.slow
@pytest.mark.parametrize("prefill_policy", ["vllm", "sarathi"])
def test_one_plus_one_gives_the_colocated_greedy_tokens(params, colocated, prefill_policy):
    cluster = _disaggregated(params, prefill_policy)
    result = cluster.run()
    assert _tokens(result) == colocated
    assert len(result.transfers) == 5  # every request but the one-token answer moved
    assert [r.engine.num_compiles for r in (*cluster.prefill, *cluster.decode)] == [2, 2]


@pytest.mark.slow
def test_without_the_page_copy_the_tokens_differ(params, colocated, monkeypatch):
    monkeypatch.setattr(JaxEngine, "write_kv_pages", lambda self, pages, kv: None)
    result = _disaggregated(params).run()
    tokens = _tokens(result)
    assert tokens[4] == colocated[4]  # the one-token answer never left the prefill engine
    assert any(tokens[i] != colocated[i] for i in tokens)


@pytest.mark.slow
def test_a_running_request_migrated_between_engines_keeps_its_greedy_tokens(params, colocated):
    config = CONFIG.with_knobs(prefix_caching="off")  # pages are their own
    a = Scheduler(_requests(), policies.make_policy("vllm"), _engine(params), config)
    b = Scheduler(_requests(), policies.make_policy("vllm"), _engine(params), config,
                  submitted_only=True)
    a.engine.warmup(a.bucket_config.buckets())
    moved = 0  # a 9-token prompt and 6 output tokens: 2 sampled on A, 4 on B
    while a.table.num_generated[moved] < 2:
        a.step()
    export = a.export_request(moved)
    assert export.output_tokens == tuple(colocated[0][:2]) and export.kv_contents is not None
    a.release_request(moved, a.now_s)
    b.import_request(export, a.now_s)
    result = RunResult.concat([a.run(), b.run()], router="migration")
    assert result.replica.tolist() == [1, 0, 0, 0, 0, 0]
    assert _tokens(result) == colocated  # B decoded on from A's KV pages
