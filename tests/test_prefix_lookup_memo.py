"""A prefix lookup that goes on from its last run (`PrefixHits`'s memo) finds what a walk
from the first page finds, on the device and on the slower tiers, while pages are cached,
evicted, written back, moved up from the disk and evicted from host and disk."""

import numpy as np
import pytest

from orca_jax.core.api.policy import make_policy
from orca_jax.core.kv.prefix_hits import PrefixHits
from orca_jax.core.loop.scheduler import Scheduler
from orca_jax.runner.build import build_engine, build_workload, scheduler_config
from orca_jax.runner.spec import LimitsSpec, RunSpec, SimEngineSpec, WorkloadSpec


@pytest.mark.parametrize("tiers", [
    dict(),  # the device alone
    dict(kv_host_pages=200),  # a host tier that evicts
    dict(kv_host_pages=200, kv_disk_pages=600),  # ... onto a disk that evicts too
    dict(kv_host_pages=200, kv_disk_pages=600, kv_cache_policy="prefetch-on-queue"),
])
def test_memoized_lookups_equal_fresh_walks(monkeypatch, tiers):
    checked = []
    lookup = PrefixHits._lookup

    def checking(self, request):
        found = lookup(self, request)
        memo = self._memo.pop(request, None)  # walk again from the first page
        fresh = lookup(self, request)
        if memo is not None:
            self._memo[request] = memo
        assert found[0] == fresh[0] and tuple(found[1]) == tuple(fresh[1])
        checked.append(bool(found[1]))
        return found

    monkeypatch.setattr(PrefixHits, "_lookup", checking)
    workload = WorkloadSpec(arrival="shared_prefix", num_requests=200, rate=20.0,
                            num_prefixes=16, prefix_len="fixed:1024", prefix_zipf=0.6,
                            suffix_len="uniform:16:64", output_len="uniform:8:32")
    run_spec = RunSpec(workload=workload, engine=SimEngineSpec(),
                       limits=LimitsSpec(max_num_seqs=32, max_num_tokens=1024,
                                         num_kv_pages=160, **tiers))
    config = scheduler_config(run_spec)
    scheduler = Scheduler(build_workload(run_spec), make_policy("vllm"),
                          build_engine(run_spec, config), config)
    result = scheduler.run()
    assert len(checked) > 1000
    if tiers:
        assert any(checked)  # lookups found pages on a slower tier
        assert result.kv_tiers["host"]["evictions"] > 0
    if "kv_disk_pages" in tiers:
        assert result.kv_tiers["disk"]["evictions"] > 0
    np.testing.assert_array_equal(result.num_generated, result.output_len)
