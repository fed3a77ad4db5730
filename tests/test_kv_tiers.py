"""KV memory tiers (issue 27): host and disk tiers over links, swap or recompute per victim,
prefix hits found on a slower tier, and cache policies as plugins."""

import dataclasses

import numpy as np
import pytest

from orca_jax.core.api.plugins import PolicyLoadError, resolve_cache_policy
from orca_jax.core.api.policy import make_policy
from orca_jax.core.kv.cache_policies import ARC, LFU, LRU, CachePolicyError, make_cache_policy
from orca_jax.core.kv.links import LinkQueue
from orca_jax.core.kv.preemption import preemption_costs
from orca_jax.core.loop.scheduler import Scheduler
from orca_jax.core.requests.request import RequestState
from orca_jax.runner.build import build_engine, build_workload, check_policies, scheduler_config
from orca_jax.runner.spec import JaxEngineSpec, LimitsSpec, RunSpec, SimEngineSpec, WorkloadSpec
from orca_jax.specs.hardware import get_kv_link
from orca_jax.specs.model_config import get_model_config

PAGE_BYTES = 16 * 131072  # llama3-8b: 128 KiB of KV a token, 16-token pages


def spec(workload=None, **limits):
    workload = workload or WorkloadSpec(arrival="poisson", num_requests=120, rate=40.0,
                                        prompt_len="uniform:200:800", output_len="uniform:50:200")
    return RunSpec(workload=workload, engine=SimEngineSpec(),
                   limits=LimitsSpec(max_num_seqs=32, max_num_tokens=1024, **limits))


def run(run_spec, options=None):
    config = scheduler_config(run_spec)
    policy = make_policy("vllm", options)
    scheduler = Scheduler(build_workload(run_spec), policy, build_engine(run_spec, config),
                          config)
    result = scheduler.run()
    assert (scheduler.table.state == RequestState.FINISHED).all()
    np.testing.assert_array_equal(scheduler.table.num_generated, scheduler.table.output_len)
    return scheduler, result


def shared_prefixes(rate=20.0):
    return WorkloadSpec(arrival="shared_prefix", num_requests=200, rate=rate, num_prefixes=16,
                        prefix_len="fixed:1024", prefix_zipf=0.6, suffix_len="uniform:16:64",
                        output_len="uniform:8:32")


def test_a_link_direction_queues_its_transfers_one_after_another():
    link = LinkQueue(latency_s=1e-3, bytes_per_s=1e9)
    assert link.enqueue(0.0, 1_000_000) == pytest.approx(2e-3)  # 1 ms latency + 1 ms
    assert link.enqueue(0.0, 1_000_000) == pytest.approx(4e-3)  # behind the first
    assert link.enqueue(10.0, 0) == pytest.approx(10.001)  # an idle link starts at once
    assert link.num_transfers == 3 and link.num_bytes == 2_000_000


def test_link_presets_hold_the_tier_links():
    assert get_kv_link("pcie-gen5-x16").bytes_per_s == pytest.approx(63.0e9, rel=0.01)
    assert get_kv_link("nvlink-c2c").bytes_per_s == 450e9
    assert get_kv_link("nvme").bytes_per_s < get_kv_link("rdma").bytes_per_s
    with pytest.raises(ValueError, match="unknown KV link preset 'pcie9'"):
        LimitsSpec(kv_host_gb=1.0, kv_host_link="pcie9")


@pytest.mark.parametrize("limits, message", [
    (dict(kv_host_gb=1e-6), r"--kv_host_gb=1e-06 holds no KV page: one page of llama3-8b"),
    (dict(kv_disk_pages=100), r"a disk KV tier sits under a host tier"),
    (dict(kv_host_gb=1.0, kv_host_pages=10), r"both set"),
])
def test_bad_tiers_are_refused_by_name(limits, message):
    with pytest.raises(ValueError, match=message):
        spec(**limits)


def test_a_tier_beyond_any_machine_is_refused_and_one_at_the_cap_taken():
    cap = 2**31 - 2  # the device pool's: page ids are int32, page 0 the null page
    spec(kv_host_pages=cap, kv_disk_pages=cap)
    for limits, flag in [(dict(kv_host_pages=cap + 1), "kv_host_pages"),
                         (dict(kv_host_pages=8, kv_disk_pages=10**15), "kv_disk_pages"),
                         (dict(kv_host_gb=1e15), "kv_host_gb")]:
        with pytest.raises(ValueError, match=rf"^--{flag}=.* KV pages, above the cap of "
                                             rf"{cap:,} pages a tier holds"):
            spec(**limits)


def test_the_jax_engines_host_tier_is_capped_by_this_machines_memory():
    from orca_jax.runner.kv_tiers import check_host_tier_memory, tier_configs

    # tiny, float32: pages of 16 tokens, 16 KiB; 10^4 GB of them is no laptop's memory.
    tiers = tier_configs(LimitsSpec(kv_host_pages=1000), get_model_config("tiny"), 1, 4)
    page_bytes = tiers[0].page_bytes
    check_host_tier_memory(tiers, 1, memory=1000 * page_bytes)
    with pytest.raises(ValueError, match=rf"^--kv_host_gb/--kv_host_pages: 1,000 host KV "
                                         rf"pages of {page_bytes:,} B .* above the cap of 999 "
                                         r"pages: the jax engine copies them"):
        check_host_tier_memory(tiers, 1, memory=1000 * page_bytes - 1)
    with pytest.raises(ValueError, match=r"--kv_host_gb/--kv_host_pages: .* jax engine"):
        RunSpec(engine=JaxEngineSpec(model="tiny"), limits=LimitsSpec(kv_host_gb=1e4))


@pytest.mark.parametrize("limits", [dict(kv_cache_policy="arc"),
                                    dict(kv_cache_policy_opts="placement=write_through"),
                                    dict(kv_host_link="nvlink-c2c")])
def test_a_tier_setting_without_a_tier_is_refused(limits):
    name = next(iter(limits))
    with pytest.raises(ValueError, match=rf"^limits\.{name} .* is a setting of the slower KV "
                                         "tiers, and the run has none"):
        spec(**limits)
    spec(kv_host_gb=1.0, **limits)  # with a tier it is read


def test_pinning_without_programs_is_refused():
    with pytest.raises(ValueError, match=r"^limits\.kv_pin_s 5 pins an agent program's KV "
                                         r"between its calls; workload 'poisson' has no programs"):
        spec(kv_pin_s=5.0)
    spec(WorkloadSpec(arrival="programs", num_requests=20), kv_pin_s=5.0)


def test_swap_without_a_host_tier_is_refused():
    run_spec = spec(num_kv_pages=300)
    with pytest.raises(PolicyLoadError, match="preemption_mode=swap needs a host KV tier"):
        check_policies(run_spec, scheduler_config(run_spec),
                       [("vllm", {"preemption_mode": "swap"})])


def test_swapped_requests_come_back_over_the_link_and_compute_nothing_twice():
    _, recomputed = run(spec(num_kv_pages=300, kv_host_gb=50.0))
    scheduler, swapped = run(spec(num_kv_pages=300, kv_host_gb=50.0),
                             {"preemption_mode": "swap"})
    host = swapped.kv_tiers["host"]
    assert recomputed.total_preemptions > 0 and swapped.total_preemptions > 0
    assert recomputed.total_recomputed_tokens > 0 and swapped.total_recomputed_tokens == 0
    assert host["swapped_out_pages"] == host["swapped_in_pages"] > 0
    assert host["write_bytes"] == host["read_bytes"] == host["swapped_in_pages"] * PAGE_BYTES
    assert scheduler.kv_memory.linked.lower[0].num_swapped == 0  # every page came back
    # Each move stalls its step: the stalls are the link's time, queued, and logged.
    assert sum(swapped.kv_stall_s.values()) == pytest.approx(host["stall_s"])
    assert host["stall_s"] >= 2 * host["swapped_in_pages"] * PAGE_BYTES / get_kv_link(
        "pcie4").bytes_per_s
    steps = swapped.steps.column("start_s")
    for index, stall in swapped.kv_stall_s.items():  # a stalled step starts late
        previous_end = steps[index - 1] + swapped.steps.column("step_s")[index - 1]
        assert steps[index] == pytest.approx(previous_end + stall)


def test_the_view_prices_each_mode_per_request():
    scheduler, _ = run(spec(num_kv_pages=300, kv_host_gb=50.0))
    memory = scheduler.kv_memory
    ids = np.array([0, 1], dtype=np.int64)
    memory.pool.allocate(ids, np.array([160, 320]))  # 10 and 20 pages
    memory.table.num_computed[ids] = [160, 320]
    costs = preemption_costs(memory, ids)
    np.testing.assert_array_equal(costs.pages, [10, 20])
    np.testing.assert_array_equal(costs.recompute_tokens, [160, 320])
    link = get_kv_link("pcie4")
    np.testing.assert_allclose(costs.swap_s, [2 * (link.latency_s + n * PAGE_BYTES
                                                   / link.bytes_per_s) for n in (10, 20)])


def test_prefix_pages_the_device_evicts_are_hit_again_on_the_host_tier():
    _, device_only = run(spec(shared_prefixes(), num_kv_pages=160))
    _, tiered = run(spec(shared_prefixes(), num_kv_pages=160, kv_host_gb=20.0))
    host = tiered.kv_tiers["host"]
    rate = lambda r: (np.minimum(r.num_cached_tokens, r.prompt_len).sum()  # noqa: E731
                      / r.prompt_len.sum())
    assert device_only.num_evictions > 0 and host["hit_pages"] > 0
    assert rate(tiered) > rate(device_only) + 0.05
    assert host["read_bytes"] == host["hit_pages"] * PAGE_BYTES
    assert host["evictions"] == 0  # 20 GB holds every prefix


def test_write_through_overlaps_the_steps_and_write_back_stalls_them():
    _, back = run(spec(shared_prefixes(), num_kv_pages=160, kv_host_gb=20.0))
    _, through = run(spec(shared_prefixes(), num_kv_pages=160, kv_host_gb=20.0,
                          kv_cache_policy_opts="placement=write_through"))
    assert through.kv_tiers["host"]["write_bytes"] > back.kv_tiers["host"]["write_bytes"]
    # write-through's copies wait for no step; only its loads do (stalls = load time)
    assert through.kv_tiers["host"]["hit_pages"] > 0
    load_s = through.kv_tiers["host"]["read_bytes"] / get_kv_link("pcie4").bytes_per_s
    latency_s = get_kv_link("pcie4").latency_s * through.kv_tiers["host"]["hit_pages"]
    assert sum(through.kv_stall_s.values()) <= load_s + latency_s
    assert sum(back.kv_stall_s.values()) > back.kv_tiers["host"]["read_bytes"] / get_kv_link(
        "pcie4").bytes_per_s


def test_a_disk_tier_catches_what_the_host_evicts():
    _, host_only = run(spec(shared_prefixes(), num_kv_pages=160, kv_host_pages=200))
    _, with_disk = run(spec(shared_prefixes(), num_kv_pages=160, kv_host_pages=200,
                            kv_disk_gb=50.0))
    assert host_only.kv_tiers["host"]["evictions"] > 0
    disk = with_disk.kv_tiers["disk"]
    assert disk["hit_pages"] > 0 and disk["read_bytes"] == disk["hit_pages"] * PAGE_BYTES
    assert with_disk.num_cached_tokens.sum() > host_only.num_cached_tokens.sum()


def test_eviction_orders():
    lru, lfu = LRU(), LFU()
    for policy in (lru, lfu):
        for key in "abc":
            policy.inserted(key)
        policy.hit("a")
        policy.hit("a")
        policy.hit("b")
    assert lru.victim() == "c" and lru.victim() == "a"  # a was hit before b
    assert lfu.victim() == "c" and lfu.victim() == "b"  # a was hit twice
    arc = ARC()
    arc.bind(2)
    arc.inserted("a")
    arc.hit("a")  # a: used twice (T2)
    arc.inserted("b")  # b: once (T1)
    assert arc.victim() == "b"  # T1 over its target of 0
    arc.inserted("b")  # found in B1: recency was evicted too soon, T1's target grows
    assert arc._p == 1.0 and arc.victim() == "a"


def test_a_cache_policy_loads_by_path_and_runs():
    name = resolve_cache_policy("examples/kv_cache_mru.py:MRU")
    assert type(make_cache_policy(name)).__name__ == "MRU"
    _, result = run(spec(shared_prefixes(), num_kv_pages=160, kv_host_pages=200,
                         kv_cache_policy="examples/kv_cache_mru.py:MRU"))
    assert result.kv_tiers["host"]["cache_policy"] == "examples/kv_cache_mru.py:MRU"
    assert result.kv_tiers["host"]["evictions"] > 0


@pytest.mark.parametrize("plugin, returned", [("NamesAStranger", "'no-such-page'"),
                                              ("NamesNothing", "None")])
def test_a_victim_the_tier_does_not_hold_stops_the_run_naming_the_plugin(plugin, returned):
    path = f"tests/plugins/bad_cache_policies.py:{plugin}"
    with pytest.raises(CachePolicyError) as error:
        run(spec(shared_prefixes(), num_kv_pages=160, kv_host_pages=8, kv_cache_policy=path))
    assert str(error.value) == (
        f"cache policy '{path}' broke rule 'victim_not_held': victim() returned {returned}, "
        "which the host tier does not hold (it holds 8 cached pages; give one of them)")
    assert error.value.rule == "victim_not_held"


def test_prefetch_on_queue_moves_disk_pages_to_the_host_before_admission():
    kw = dict(num_kv_pages=160, kv_host_pages=200, kv_disk_gb=50.0)
    _, lru = run(spec(shared_prefixes(rate=200.0), **kw))
    _, prefetch = run(spec(shared_prefixes(rate=200.0), kv_cache_policy="prefetch-on-queue",
                           **kw))
    # The queue's head finds its pages on the host tier, moved there while it waited:
    # fewer admissions read the disk, and the steps wait less for their loads.
    assert prefetch.kv_tiers["disk"]["hit_pages"] < lru.kv_tiers["disk"]["hit_pages"] / 2
    assert prefetch.kv_tiers["host"]["hit_pages"] > lru.kv_tiers["host"]["hit_pages"] * 2
    assert sum(prefetch.kv_stall_s.values()) < sum(lru.kv_stall_s.values()) / 2
    assert prefetch.num_cached_tokens.sum() == lru.num_cached_tokens.sum()


def test_no_tiers_is_the_plain_run():
    scheduler, result = run(spec(num_kv_pages=300))
    assert result.kv_tiers is None and result.kv_stall_s == {}
    assert scheduler.kv_memory.linked is None and dataclasses.replace(
        scheduler.config.kv).tiers == ()
