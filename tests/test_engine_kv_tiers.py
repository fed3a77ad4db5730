"""The jax engine's host KV tier: real copies between the device cache and host memory.

On `tiny` (fp32, greedy), a KV-tight workload that preempts gives the same tokens
with swap (the victims' pages copied to host memory and back, at depth 1 and with
overlap at depth 2) as with recompute and as a pool roomy enough never to
preempt; and a shared-prefix workload whose device pool is too small to keep the
prefix gives the same tokens with its hits served from the host tier (write-back
and write-through) as without tiers. Each run that copies is checked to be able to
fail: with the copy back into the device skipped, the tokens differ.
"""

import numpy as np
import pytest

import policies
from orca_jax import KVConfig, LoopFeatures, Request, Scheduler, SchedulerConfig, StepLimits
from orca_jax.core.kv.config import TierConfig
from orca_jax.model import host_kv
from orca_jax.model.engine import JaxEngine
from orca_jax.model.weights import init_params
from orca_jax.specs.model_config import get_model_config

# Whole runs of the real engine, compiled: `pytest -m "not slow"` skips the module. Steps
# another real-engine module compiled are loaded (conftest.py).
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("session_compile_cache")]
CONFIG = get_model_config("tiny")
PAGE_SIZE = 4
MAX_LEN = 64
BUCKETS = (8, 32)  # two compiled steps per engine: compile time stays a few seconds
ROOMY_PAGES = 128


def _engine(feed_tokens=False, host_kv_memory="numpy"):
    return JaxEngine(CONFIG, init_params(CONFIG, seed=1), num_cache_pages=ROOMY_PAGES + 1,
                     page_size=PAGE_SIZE, pages_per_seq=MAX_LEN // PAGE_SIZE,
                     attention="reference", feed_tokens=feed_tokens,
                     host_kv_memory=host_kv_memory)


@pytest.fixture(scope="module")
def engine():
    return _engine()


def _host(num_pages):
    return TierConfig(name="host", num_pages=num_pages, page_bytes=1024, link="pcie4",
                      link_latency_s=1e-5, link_bytes_per_s=3.15e10)


def _run(engine, requests, *, num_kv_pages, options, tiers=(), overlap=False, **kv):
    config = SchedulerConfig(
        limits=StepLimits(max_num_seqs=4, max_num_tokens=BUCKETS[-1], max_model_len=MAX_LEN,
                          token_buckets=BUCKETS),
        kv=KVConfig(num_kv_pages=num_kv_pages, page_size=PAGE_SIZE, tiers=tiers, **kv),
        features=LoopFeatures(overlap=overlap))
    scheduler = Scheduler(requests, policies.make_policy("vllm", options), engine, config)
    result = scheduler.run()
    return [tokens.tolist() for tokens in result.output_tokens], result, scheduler


def _tight_workload():
    """Six requests at once, prompts 14-26 tokens, answers 12-20: four running need up
    to 46 tokens (12 pages) each, far more than a 24-page pool."""
    rng = np.random.default_rng(7)
    requests = []
    for i in range(6):
        prompt = rng.integers(1, CONFIG.vocab_size, size=int(rng.integers(14, 27)))
        requests.append(Request(id=i, arrival_s=0.0, prompt_len=prompt.size,
                                output_len=int(rng.integers(12, 21)),
                                prompt_tokens=prompt.astype(np.int32)))
    return requests


NO_CACHE = {"enable_prefix_caching": "false"}
SWAP = {**NO_CACHE, "preemption_mode": "swap"}


@pytest.fixture(scope="module")
def roomy_tokens(engine):
    tokens, result, _ = _run(engine, _tight_workload(), num_kv_pages=ROOMY_PAGES,
                             options=NO_CACHE)
    assert int(result.num_preemptions.sum()) == 0
    return tokens


def test_swap_and_recompute_give_the_roomy_pools_tokens(engine, roomy_tokens):
    recompute, result, _ = _run(engine, _tight_workload(), num_kv_pages=24, options=NO_CACHE)
    assert int(result.num_preemptions.sum()) > 0
    assert recompute == roomy_tokens
    swap, result, scheduler = _run(engine, _tight_workload(), num_kv_pages=24, options=SWAP,
                                   tiers=(_host(200),))
    host = result.kv_tiers["host"]
    assert int(result.num_preemptions.sum()) > 0 and host["swapped_out_pages"] > 0
    assert host["swapped_in_pages"] == host["swapped_out_pages"]
    assert result.total_recomputed_tokens == 0  # every victim came back over the link
    assert swap == roomy_tokens
    store = scheduler.kv_memory.linked.contents
    assert store.stats["pages_in"] == store.stats["pages_out"] == host["swapped_out_pages"]
    assert store.num_pages == 0  # every swapped page was forgotten once back
    assert engine.facts()["host_kv_memory"] == "numpy"
    # The engine's measured clock has the copies: no modelled link stall moves it.
    assert host["stall_s"] == 0.0 and not result.kv_stall_s


def test_swap_with_overlap_gives_the_same_tokens(roomy_tokens):
    fed = _engine(feed_tokens=True)
    tokens, result, scheduler = _run(fed, _tight_workload(), num_kv_pages=24, options=SWAP,
                                     tiers=(_host(200),), overlap=True)
    assert scheduler.executor.depth == 2
    assert result.kv_tiers["host"]["swapped_out_pages"] > 0
    assert tokens == roomy_tokens


def test_swap_without_the_copy_back_changes_tokens(engine, roomy_tokens, monkeypatch):
    monkeypatch.setattr(host_kv.HostKVStore, "put", lambda self, taken, pages: None)
    tokens, result, _ = _run(engine, _tight_workload(), num_kv_pages=24, options=SWAP,
                             tiers=(_host(200),))
    assert result.kv_tiers["host"]["swapped_out_pages"] > 0
    assert tokens != roomy_tokens


def _shared_prefix_workload():
    """A 28-token system prompt (7 pages) asked three times, 2 s apart, each time after
    two unrelated requests at once whose pages push it out of an 18-page device pool."""
    rng = np.random.default_rng(3)
    prefix = rng.integers(1, CONFIG.vocab_size, size=28)
    requests = []
    for turn in range(3):
        for k in range(2):
            other = rng.integers(1, CONFIG.vocab_size, size=30)
            requests.append((2.0 * turn, other, 6))
        question = rng.integers(1, CONFIG.vocab_size, size=5)
        requests.append((2.0 * turn + 1.0, np.concatenate([prefix, question]), 6))
    return [Request(id=i, arrival_s=a, prompt_len=p.size, output_len=n,
                    prompt_tokens=p.astype(np.int32)) for i, (a, p, n) in enumerate(requests)]


@pytest.fixture(scope="module")
def uncached_tokens(engine):
    tokens, _, _ = _run(engine, _shared_prefix_workload(), num_kv_pages=18, options=NO_CACHE)
    return tokens


@pytest.mark.parametrize("memory,placement", [
    ("numpy", "write_back"), ("numpy", "write_through"), ("pinned_host", "write_back")])
def test_prefix_hits_from_the_host_tier_keep_tokens(engine, uncached_tokens, memory,
                                                    placement):
    if memory == "pinned_host":
        offered = {m.kind for m in __import__("jax").devices()[0].addressable_memories()}
        if "pinned_host" not in offered:
            pytest.skip("this jax backend offers no pinned host memory")
        engine = _engine(host_kv_memory="pinned_host")
    device_only, result, _ = _run(engine, _shared_prefix_workload(), num_kv_pages=18,
                                  options={})
    assert device_only == uncached_tokens
    assert result.num_cached_tokens[[2, 5, 8]].tolist() == [0, 0, 0]  # evicted each time
    tokens, result, scheduler = _run(
        engine, _shared_prefix_workload(), num_kv_pages=18, options={}, tiers=(_host(64),),
        cache_policy_opts=(("placement", placement),))
    host = result.kv_tiers["host"]
    assert host["hit_tokens"] >= 2 * 28  # the 2nd and 3rd asks found the prefix there
    assert result.num_cached_tokens[[5, 8]].tolist() == [28, 28]
    assert tokens == uncached_tokens
    assert scheduler.kv_memory.linked.contents.memory_kind == memory


def test_host_hits_without_the_copy_back_change_tokens(engine, uncached_tokens, monkeypatch):
    monkeypatch.setattr(host_kv.HostKVStore, "put", lambda self, taken, pages: None)
    tokens, result, _ = _run(engine, _shared_prefix_workload(), num_kv_pages=18, options={},
                             tiers=(_host(64),))
    assert result.kv_tiers["host"]["hit_tokens"] > 0
    assert tokens != uncached_tokens


def test_host_memory_kind_is_chosen_and_checked():
    import jax

    cpu = jax.devices("cpu")[0]
    assert host_kv.host_memory_kind(cpu) == "numpy"  # a CPU's host memory is its own
    with pytest.raises(ValueError, match="host KV memory 'disk' is not one of"):
        host_kv.host_memory_kind(cpu, "disk")
    with pytest.raises(ValueError, match="host_kv_memory='disk' is not one of"):
        _engine(host_kv_memory="disk")


def test_a_jax_run_spec_takes_a_host_tier_of_its_dtype_and_refuses_a_disk_tier():
    from orca_jax.runner.build import scheduler_config
    from orca_jax.runner.spec import JaxEngineSpec, LimitsSpec, RunSpec, WorkloadSpec

    def jax_spec(dtype, **limits):
        return RunSpec(workload=WorkloadSpec(),
                       engine=JaxEngineSpec(model="tiny", dtype=dtype),
                       limits=LimitsSpec(page_size=PAGE_SIZE, **limits))

    fp32 = scheduler_config(jax_spec("float32", kv_host_pages=50)).kv.tiers
    bf16 = scheduler_config(jax_spec("bfloat16", kv_host_pages=50)).kv.tiers
    assert [t.name for t in fp32] == ["host"] and fp32[0].num_pages == 50
    page_bytes = 2 * CONFIG.num_layers * CONFIG.num_kv_heads * CONFIG.head_dim * PAGE_SIZE
    assert (fp32[0].page_bytes, bf16[0].page_bytes) == (4 * page_bytes, 2 * page_bytes)
    with pytest.raises(ValueError, match=r"^--kv_disk_gb/--kv_disk_pages: the jax engine holds "
                                         r"a host KV tier only"):
        jax_spec("float32", kv_host_pages=50, kv_disk_pages=100)


def test_the_copy_bandwidth_probe_runs_dry_on_the_cpu(capsys):
    from benchmarks import host_kv_copy

    assert host_kv_copy.main(["--dry_run"]) == 0
    out = capsys.readouterr().out
    for row in ("raw numpy out", "store numpy save", "store numpy take+put", "pcie5"):
        assert row in out
    assert "auto host memory here: numpy" in out
