"""A run's counts are capped by what this machine's memory holds, checked where a RunSpec is.

The machine's memory is pinned (`spec_caps.physical_memory`) so the caps are exact numbers
here; tests/test_cli_errors.py runs the issue's commands on the real machine.
"""

from __future__ import annotations

import pytest

from orca_jax.runner import spec_caps
from orca_jax.runner.spec import ClusterSpec, LimitsSpec, RunSpec, SimEngineSpec, WorkloadSpec

GIB = 2**30


@pytest.fixture
def sixteen_gib(monkeypatch):
    monkeypatch.setattr(spec_caps, "physical_memory", lambda: 16 * GIB)


def test_a_count_at_its_cap_is_accepted_and_one_above_refused_naming_value_and_cap(
        sixteen_gib):
    cap = 16 * GIB // 512  # requests: 512 B each at least
    RunSpec(workload=WorkloadSpec(num_requests=cap))
    with pytest.raises(ValueError, match=(
            rf"^workload\.num_requests={cap + 1} is above its cap of {cap:,}: requests take "
            r"at least 512 B each and this machine has 16\.0 GiB of memory$")):
        RunSpec(workload=WorkloadSpec(num_requests=cap + 1))


def test_kv_pages_are_capped_over_every_replica_of_the_run(sixteen_gib):
    pages = 16 * GIB // 16 // 4  # a quarter of what one replica's tables may hold
    RunSpec(limits=LimitsSpec(num_kv_pages=pages), cluster=ClusterSpec(num_replicas=4))
    with pytest.raises(ValueError, match=(
            rf"^limits\.num_kv_pages={pages} gives {pages:,} KV pages in each of 5 replicas, "
            rf"above the cap of {16 * GIB // 16 // 5:,} pages")):
        RunSpec(limits=LimitsSpec(num_kv_pages=pages), cluster=ClusterSpec(num_replicas=5))
    with pytest.raises(ValueError, match=r"in each of 5 replicas"):  # 2 + 3 pools
        RunSpec(limits=LimitsSpec(num_kv_pages=pages),
                cluster=ClusterSpec(num_prefill_replicas=2, num_decode_replicas=3))


def test_a_kv_memory_budget_is_capped_by_the_pages_it_gives(sixteen_gib):
    # llama3-8b keeps 128 KiB of KV per token: 2 MiB per page of 16 tokens.
    with pytest.raises(ValueError, match=(
            r"^limits\.kv_memory_gb=1e\+12 gives 476,837,158,203,125 KV pages \(of llama3-8b, "
            r"page_size 16\), above the cap of 1,073,741,824 pages")):
        RunSpec(limits=LimitsSpec(kv_memory_gb=1e12))


def test_the_page_table_caps_the_context_limit(sixteen_gib):
    # 64 rows of 8-byte entries (the pool's and a step's copy): 16 GiB / 512 B pages of 16.
    cap = 16 * GIB // (8 * 64) * 16
    RunSpec(limits=LimitsSpec(max_model_len=cap))
    with pytest.raises(ValueError, match=rf"^limits\.max_model_len={cap + 16} is above its cap "
                                         rf"of {cap:,}: page tables of max_num_seqs=64 rows"):
        RunSpec(limits=LimitsSpec(max_model_len=cap + 16))


def test_int32_ids_cap_counts_whatever_the_memory(monkeypatch):
    monkeypatch.setattr(spec_caps, "physical_memory", lambda: 2**50)  # a petabyte machine
    with pytest.raises(ValueError, match=r"^limits\.max_num_tokens=2147483648 is above its cap "
                                         r"of 2,147,483,647: token positions are int32$"):
        RunSpec(limits=LimitsSpec(max_num_tokens=2**31, max_num_seqs=1))
    with pytest.raises(ValueError, match=r"page ids are int32 and page 0 is the null page$"):
        RunSpec(limits=LimitsSpec(num_kv_pages=2**31 - 1))
    RunSpec(limits=LimitsSpec(num_kv_pages=2**31 - 2))


def test_a_page_larger_than_the_gpus_kv_memory_names_page_size_and_the_weights_the_model():
    with pytest.raises(ValueError, match=r"^limits\.page_size=1000000000: model llama3-8b on 1 "
                                         r"x a100-80gb: KV memory of .* holds no page"):
        RunSpec(limits=LimitsSpec(page_size=10**9))
    with pytest.raises(ValueError, match=r"^engine\.model=llama3-70b: model llama3-70b .* does "
                                         r"not fit on 1 x a100-80gb"):
        RunSpec(engine=SimEngineSpec(model="llama3-70b"))
    RunSpec(engine=SimEngineSpec(model="llama3-70b"), limits=LimitsSpec(num_kv_pages=100))


def test_physical_memory_is_this_machines():
    memory = spec_caps.physical_memory()
    assert memory is None or memory >= 2**28  # no machine runs this with under 256 MiB
