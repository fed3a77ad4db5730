"""The counts-only KV pool: chosen only where nothing reads pages, and the same results.

A run the runner builds on the simulator keeps page counts only (`CountedPool`); every
feature that reads which pages a request holds (a prefix cache, KV tiers, the buddy
layout, an engine that reads the descriptor, pipeline stages, a cluster's migration or
prefill-to-decode handoff) gets the full pool, and either pool writes the same
steps.jsonl and requests.jsonl. A colocated cluster without migration keeps counts only
on every replica.
"""

import dataclasses
import json

import numpy as np
import pytest

import policies  # noqa: F401  (registers the built-in policies)
from orca_jax.core.api.policy import make_policy
from orca_jax.core.kv.counted_pool import CountedPool
from orca_jax.core.kv.pool import PagedPool
from orca_jax.core.loop.scheduler import Scheduler
from orca_jax.core.step.engine_api import EngineWrapper
from orca_jax.runner.build import build_cluster, build_engine, build_workload, scheduler_config
from orca_jax.runner.disaggregated import run_disaggregated
from orca_jax.runner.experiment import run_policy
from orca_jax.runner.spec import ClusterSpec, LimitsSpec, RunSpec, WorkloadSpec

PLAIN = RunSpec(workload=WorkloadSpec(num_requests=40, rate=10))
# 160 pages of 16 tokens: vllm preempts, and pages are freed and taken again all run long.
KV_TIGHT = RunSpec(workload=WorkloadSpec(num_requests=80, rate=20),
                   limits=LimitsSpec(num_kv_pages=160, max_model_len=1024))


class PassThrough(EngineWrapper):
    """An engine whose steps go through `step` (and so may read the descriptor's pages)."""

    def step(self, inputs):
        return self.engine.step(inputs)


def scheduler_of(spec: RunSpec, policy: str = "vllm", *, wrap: bool = False,
                 **kwargs) -> Scheduler:
    config = scheduler_config(spec)
    engine = build_engine(spec, config)
    return Scheduler(build_workload(spec), make_policy(policy), PassThrough(engine) if wrap
                     else engine, config, **kwargs)


def test_a_plain_simulator_run_keeps_page_counts_only():
    scheduler = scheduler_of(PLAIN, kv_counts_only=True)
    assert type(scheduler.kv) is CountedPool
    scheduler.run()
    scheduler.kv.check_consistency()
    # A page reader fails with one line, never with pages the pool did not keep.
    for read in (lambda: scheduler.kv.pages_of(0), lambda: scheduler.kv.page_table,
                 lambda: scheduler.kv.row_of):
        with pytest.raises(RuntimeError, match="counts-only pool"):
            read()


def limits(**knobs) -> RunSpec:
    return dataclasses.replace(PLAIN, limits=dataclasses.replace(PLAIN.limits, **knobs))


SHARED_PREFIX = RunSpec(workload=WorkloadSpec(arrival="shared_prefix", num_requests=40,
                                              rate=10, prefix_len="fixed:256"),
                        limits=LimitsSpec(prefix_caching="on"))


@pytest.mark.parametrize("case", ["not_asked", "engine_reads_pages", "prefix_cache",
                                  "buddy", "host_tier", "replica_not_asked"])
def test_every_reader_of_pages_gets_the_full_pool(case):
    spec, policy, kwargs = PLAIN, "vllm", dict(kv_counts_only=True)
    if case == "not_asked":
        kwargs = {}
    elif case == "engine_reads_pages":
        kwargs["wrap"] = True
    elif case == "prefix_cache":
        spec = SHARED_PREFIX
    elif case == "buddy":
        spec, policy = limits(kv_layout="buddy"), "orca"
    elif case == "host_tier":
        spec = limits(kv_host_pages=64)
    else:  # a replica whose cluster does not give its word (`share_table`'s default)
        kwargs = dict(submitted_only=True)
    scheduler = scheduler_of(spec, policy, **kwargs)
    assert isinstance(scheduler.kv, PagedPool) is (case != "buddy")
    assert not isinstance(scheduler.kv, CountedPool)
    assert scheduler.kv.pages_of(0).size == 0  # the full pool answers: no pages yet


def test_the_pipelined_simulator_reads_pages():
    config = scheduler_config(PLAIN)
    assert not build_engine(PLAIN, config).reads_kv_pages
    pipelined = dataclasses.replace(PLAIN, engine=dataclasses.replace(PLAIN.engine, pp=2))
    assert build_engine(pipelined, scheduler_config(pipelined)).reads_kv_pages


def rows(folder, name: str) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if k != "host_s"}
            for line in (folder / name).read_text().splitlines()]


@pytest.mark.parametrize("policy", ["vllm", "orca", "sarathi"])
@pytest.mark.parametrize("leap", [True, False])
def test_either_pool_writes_the_same_results(policy, leap, tmp_path):
    spec = dataclasses.replace(KV_TIGHT, engine=dataclasses.replace(KV_TIGHT.engine, leap=leap))
    for counts_only in (True, False):
        run_policy(spec, policy, out_dir=str(tmp_path / str(counts_only)), progress=False,
                   kv_counts_only=counts_only)
    for name in ("steps.jsonl", "requests.jsonl"):
        counted, full = rows(tmp_path / "True", name), rows(tmp_path / "False", name)
        assert counted == full and len(counted) > 0
    if policy == "vllm":  # the tight pool preempts: pages freed and taken again
        assert any(r["num_preemptions"] for r in rows(tmp_path / "True", "requests.jsonl"))


def test_the_counts_follow_the_paged_pool_step_by_step():
    shape = dict(num_kv_pages=30, page_size=4, max_pages_per_seq=8, num_requests=6)
    full, counted = PagedPool(**shape), CountedPool(**shape)
    rng = np.random.default_rng(0)
    refused = set()
    for _ in range(400):
        ids = np.sort(rng.choice(6, size=int(rng.integers(1, 4)), replace=False))
        what = int(rng.integers(0, 4))
        if what == 3:  # a leap's steps: of requests holding pages (and so a row)
            ids = ids[full.num_held[ids] > 0]
        targets = rng.integers(0, 41, ids.size, dtype=np.int64)
        need = rng.integers(0, 2, (3, ids.size), dtype=np.int64)
        outcomes = []
        for pool in (full, counted):
            try:
                if what == 0:
                    pool.allocate(ids, targets)
                elif what == 1:
                    pool.free(ids)
                elif what == 2:
                    outcomes.append(pool.trim(ids, targets // 4))
                else:
                    pool.allocate_steps(ids, need)
            except RuntimeError as error:  # overcommitted, or past max_pages_per_seq
                outcomes.append(str(error))
                refused.add(str(error).split(':')[0])
        assert len(outcomes) != 1 and outcomes[:1] == outcomes[1:]
        np.testing.assert_array_equal(counted.num_held, full.num_held)
        assert counted.num_free == full.num_free
        counted.check_consistency()
    full.check_consistency()
    assert refused == {"KV pool overcommitted", "a request would exceed max_pages_per_seq"}


def clustered(spec: RunSpec, **cluster) -> RunSpec:
    return dataclasses.replace(spec, cluster=ClusterSpec(**cluster))


def replica_pools(spec: RunSpec, **kwargs) -> list:
    config = scheduler_config(spec)
    cluster = build_cluster(spec, "vllm", None, config, build_workload(spec), **kwargs)
    return [replica.kv for replica in cluster.replicas]


@pytest.mark.parametrize("router", ["round_robin", "least_outstanding"])
def test_a_plain_clusters_replicas_keep_page_counts_only(router):
    spec = clustered(PLAIN, num_replicas=3, router=router)
    assert [type(kv) for kv in replica_pools(spec, kv_counts_only=True)] == [CountedPool] * 3
    # Not asked (the default), or a real engine's or pipeline's pages: the full pools.
    assert not any(isinstance(kv, CountedPool) for kv in replica_pools(spec))


def test_an_elastic_clusters_replicas_keep_page_counts_only():
    # A planner starts and drains whole replicas: no request moves with its KV.
    spec = clustered(PLAIN, num_replicas=2, planner="threshold", max_replicas=4)
    pools = replica_pools(spec, kv_counts_only=True)
    assert len(pools) == 4 and all(type(kv) is CountedPool for kv in pools)


def test_a_migrating_or_disaggregated_clusters_replicas_keep_the_full_pool():
    migrating = clustered(PLAIN, num_replicas=3, router="round_robin",
                          rebalancer="load_balance")
    pools = replica_pools(migrating, kv_counts_only=True)
    assert len(pools) == 3 and not any(isinstance(kv, CountedPool) for kv in pools)
    assert all(kv.pages_of(0).size == 0 for kv in pools)
    split = clustered(PLAIN, num_prefill_replicas=2, num_decode_replicas=2)
    cluster = run_disaggregated(split, "vllm", None, scheduler_config(split),
                                build_workload(split))[3]
    pools = [replica.kv for replica in cluster.prefill + cluster.decode]
    assert len(pools) == 4 and not any(isinstance(kv, CountedPool) for kv in pools)


@pytest.mark.parametrize("router", ["round_robin", "least_outstanding"])
def test_either_pool_writes_the_same_cluster_results(router, tmp_path):
    spec = clustered(KV_TIGHT, num_replicas=3, router=router)
    for counts_only in (True, False):
        run_policy(spec, "vllm", out_dir=str(tmp_path / str(counts_only)), progress=False,
                   kv_counts_only=counts_only)
    for name in ("steps.jsonl", "requests.jsonl"):
        counted, full = rows(tmp_path / "True", name), rows(tmp_path / "False", name)
        assert counted == full and len(counted) > 0
    steps = rows(tmp_path / "True", "steps.jsonl")
    assert {r["replica"] for r in steps} == {0, 1, 2}
    assert any(r["num_preemptions"] for r in rows(tmp_path / "True", "requests.jsonl"))
