"""The gateways' routers (`power_of_two`, `length_buckets`, `kv_aware`): properties of every
decision they make over random clusters, read back through recording subclasses."""

import dataclasses

import numpy as np
import pytest

import policies
from orca_jax import KVConfig, Request, SchedulerConfig, StepLimits
from orca_jax.cluster.disaggregated import DisaggregatedCluster, PoolSpec
from orca_jax.cluster.replicas import Cluster
from orca_jax.cluster.routing import ClusterView, make_router
from orca_jax.cluster.transfers import KVTransferCost
from orca_jax.core.api.policy import PolicyLoadError
from orca_jax.core.plans.plan import PlanError
from orca_jax.core.step.sampling import SamplingConfig
from orca_jax.runner.build import check_router
from orca_jax.runner.spec import ClusterSpec, RunSpec
from orca_jax.sim.cost_model import CostModelConfig
from orca_jax.sim.engine import SimEngine
from orca_jax.specs.hardware import get_kv_link
from orca_jax.workloads.prefix_workloads import shared_prefix_workload
from orca_jax.workloads.synthetic import synthetic_workload
from policies.gateway_routers import KVAware, PowerOfTwo

CONFIG = SchedulerConfig(limits=StepLimits(max_num_seqs=8, max_num_tokens=256, max_model_len=512),
                         kv=KVConfig(num_kv_pages=160, page_size=16))


def _engine():
    return SimEngine(CostModelConfig(mode="fixed", model="tiny", step_time_s=0.01))


def _workload(n=80, rate=200.0, seed=3, prompt_len="uniform:8:200"):
    return synthetic_workload(num_requests=n, arrival="poisson", rate=rate,
                              prompt_len=prompt_len, output_len="uniform:1:60", seed=seed)


def _run(requests, num_replicas, router, *, seed=0, config=CONFIG, **options):
    config = dataclasses.replace(config, sampling=SamplingConfig(seed=seed))
    cluster = Cluster(requests, num_replicas=num_replicas, router=router,
                      make_policy=lambda: policies.make_policy("vllm"), make_engine=_engine,
                      config=config, router_options={k: str(v) for k, v in options.items()})
    return cluster.run()


# ------------------------------------------------------------------ power_of_two
@dataclasses.dataclass
class RecordingPowerOfTwo(PowerOfTwo):
    """power_of_two that records each decision's two draws, the loads and the choice."""

    seen: list = dataclasses.field(default_factory=list)
    _pair: tuple = ()

    def sample(self, view: ClusterView) -> tuple[int, int]:
        self._pair = super().sample(view)
        return self._pair

    def route(self, view: ClusterView, request: int) -> int:
        choice = super().route(view, request)
        self.seen.append((self._pair, view.outstanding().copy(), choice))
        return choice


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_power_of_two_never_picks_the_more_loaded_of_its_two_draws(seed):
    router = RecordingPowerOfTwo()
    result = _run(_workload(seed=seed), 4, router, seed=seed)
    assert len(router.seen) == 80
    imbalanced = 0
    for (first, second), load, choice in router.seen:
        assert first != second and choice in (first, second)
        other = second if choice == first else first
        assert load[choice] <= load[other]
        if load[first] == load[second]:
            assert choice == first  # a tie goes to the first drawn, as sgl-router's
        imbalanced += load[first] != load[second]
    assert imbalanced > 10  # the loads differed often enough for the rule to matter
    assert set(result.replica.tolist()) == {0, 1, 2, 3}


def test_power_of_two_draws_from_the_run_seed():
    requests = _workload()
    first = _run(requests, 4, "power_of_two", seed=5).replica
    np.testing.assert_array_equal(_run(requests, 4, "power_of_two", seed=5).replica, first)
    assert (_run(requests, 4, "power_of_two", seed=6).replica != first).any()
    # One replica: no draw, no error.
    assert (_run(requests[:5], 1, "power_of_two").replica == 0).all()


def test_power_of_two_has_no_knobs():
    with pytest.raises(PolicyLoadError, match="router 'power_of_two' has no option 'k'"):
        make_router("power_of_two", {"k": "3"})


# ------------------------------------------------------------------ length_buckets
def _by_request(requests, result):
    """Each request's prompt length and the replica that served it, in workload order."""
    where = {request_id: i for i, request_id in enumerate(result.request_ids)}
    return [(r.prompt_len, int(result.replica[where[r.id]])) for r in requests]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_length_buckets_never_send_a_long_prompt_to_a_short_group(seed):
    requests = _workload(seed=seed, prompt_len="uniform:1:300")
    served = _by_request(requests, _run(requests, 4, "length_buckets", bounds=100,
                                        replicas="1+3"))
    short = [replica for length, replica in served if length <= 100]
    long = [replica for length, replica in served if length > 100]
    assert short and long
    assert set(short) == {0} and set(long) == {1, 2, 3}  # the long group shares its load
    # Three buckets over five replicas, split evenly: the longer buckets take the rest.
    served = _by_request(requests, _run(requests, 5, "length_buckets", bounds="50+150"))
    groups = {0: {0}, 1: {1, 2}, 2: {3, 4}}
    for length, replica in served:
        bucket = 0 if length <= 50 else 1 if length <= 150 else 2
        assert replica in groups[bucket], (length, replica)
    assert {replica for _, replica in served} == {0, 1, 2, 3, 4}


def test_a_prompt_of_a_bound_s_length_is_in_the_bucket_below_it():
    router = make_router("length_buckets", {"bounds": "64+256"})
    assert [router.bucket(n) for n in (1, 64, 65, 256, 257)] == [0, 0, 1, 1, 2]


def test_length_buckets_options_are_checked():
    for options, message in (({"bounds": "256+64"}, "not strictly ascending"),
                             ({"bounds": "64", "replicas": "1+1+1"}, "3 groups for 2 buckets"),
                             ({"bounds": "a"}, "'a' is not an int"),
                             ({"bounds": ""}, "bounds is empty")):
        with pytest.raises(PolicyLoadError, match=f"router 'length_buckets': .*{message}"):
            make_router("length_buckets", options)
    # Groups that do not fit the pool are refused at the first arrival, before any routing.
    requests = _workload(n=4)
    with pytest.raises(PlanError, match="router 'length_buckets' broke rule 'bucket_replicas': "
                                        "replicas '1\\+2' sums to 3, the pool has 2"):
        _run(requests, 2, "length_buckets", bounds=100, replicas="1+2")
    with pytest.raises(PlanError, match="3 buckets need >= 3 replicas, the pool has 2"):
        _run(requests, 2, "length_buckets", bounds="10+100")


def test_a_disaggregated_cluster_buckets_each_pool_by_its_own_bounds():
    # Prefill: prompts up to 100 tokens on replica 0, longer on 1-2. Decode (replicas 3-5 in
    # cluster numbering): up to 40 on 3-4, longer on 5.
    requests = _workload(n=60, seed=4, prompt_len="uniform:1:200")
    assert [r.id for r in requests] == list(range(60))  # request index = id
    pool = lambda count, **options: PoolSpec(  # noqa: E731
        num_replicas=count, make_policy=lambda: policies.make_policy("vllm"),
        make_engine=_engine, config=CONFIG, router="length_buckets", router_options=options)
    cluster = DisaggregatedCluster(
        requests, prefill=pool(3, bounds="100", replicas="1+2"),
        decode=pool(3, bounds="40", replicas="2+1"),
        transfer_cost=KVTransferCost(link=get_kv_link("ib200"), bytes_per_token=1000))
    transfers = cluster.run().transfers
    assert len(transfers) > 40  # those of one output token end at the prefill replica
    for t in transfers:
        length = requests[t.request].prompt_len
        assert t.from_replica in ({0} if length <= 100 else {1, 2}), (length, t)
        assert t.to_replica in ({3, 4} if length <= 40 else {5}), (length, t)
    assert {t.from_replica for t in transfers} == {0, 1, 2}
    assert {t.to_replica for t in transfers} == {3, 4, 5}


def test_each_pool_s_router_options_are_checked_before_the_run():
    spec = RunSpec(cluster=ClusterSpec(num_prefill_replicas=1, num_decode_replicas=1,
                                       decode_router="length_buckets",
                                       decode_router_opts="bounds=512+64"))
    with pytest.raises(PolicyLoadError, match="^decode pool: router 'length_buckets': bounds "
                                              "'512\\+64' are not strictly ascending$"):
        check_router(spec)
    check_router(dataclasses.replace(spec, cluster=dataclasses.replace(
        spec.cluster, decode_router_opts="bounds=64+512")))


# ------------------------------------------------------------------ kv_aware
PAGE = 4
PREFIX_CONFIG = SchedulerConfig(
    limits=StepLimits(max_num_seqs=8, max_num_tokens=128, max_model_len=512),
    kv=KVConfig(num_kv_pages=256, page_size=PAGE))


def _prefixed(i, prefix, arrival_s, output_len):
    """A 19-token prompt: 16 tokens of its prefix (4 pages), then 3 of its own."""
    tokens = np.concatenate([np.full(16, 100 + prefix), np.arange(3) + 1000 * (i + 1)])
    return Request(id=i, arrival_s=arrival_s, prompt_len=19, output_len=output_len,
                   prompt_tokens=tokens.astype(np.int32))


@dataclasses.dataclass
class RecordingKVAware(KVAware):
    """kv_aware that records each decision's costs and choice."""

    seen: list = dataclasses.field(default_factory=list)

    def route(self, view: ClusterView, request: int) -> int:
        costs = self.costs(view, request)
        choice = super().route(view, request)
        self.seen.append((costs, choice))
        return choice


@pytest.mark.parametrize("weight,expected", [(1.0, "idle"), (10.0, "cached")])
def test_kv_aware_costs_uncached_prompt_blocks_plus_active_blocks(weight, expected):
    # Request 0 (prefix 0) runs alone from 0 s: its prompt in the first 0.01 s step, then one
    # token a step, so at 0.505 s it knows 19 + 50 tokens: 18 pages. Request 1 (prefix 0)
    # arrives then: its replica caches 16 of its 19 tokens (0.75 pages left to prefill), the
    # idle one none (4.75 pages).
    router = RecordingKVAware(overlap_score_weight=weight)
    result = _run([_prefixed(0, 0, 0.0, 200), _prefixed(1, 0, 0.505, 5)], 2, router,
                  config=PREFIX_CONFIG)
    busy = int(result.replica[0])
    costs, choice = router.seen[1]
    assert costs[busy] == pytest.approx(weight * 0.75 + 18)
    assert costs[1 - busy] == pytest.approx(weight * 4.75)
    assert choice == (1 - busy if expected == "idle" else busy) == int(result.replica[1])
    assert result.num_cached_tokens[1] == (16 if expected == "cached" else 0)


@pytest.mark.parametrize("seed", [0, 1])
def test_kv_aware_at_temperature_0_takes_the_cheapest_and_above_it_spreads(seed):
    requests = shared_prefix_workload(num_requests=80, rate=100.0, num_prefixes=4,
                                      prefix_len="uniform:8:64", prefix_zipf=1.0,
                                      suffix_len="uniform:1:40", output_len="uniform:1:60",
                                      seed=seed, vocab_size=1000)
    cheapest = RecordingKVAware()
    _run(requests, 4, cheapest, seed=seed, config=PREFIX_CONFIG)
    assert all(costs[choice] == costs.min() for costs, choice in cheapest.seen)
    assert sum(np.ptp(costs) > 0 for costs, _ in cheapest.seen) > 40  # costs that differ
    hot = RecordingKVAware(temperature=1000.0)
    served = _run(requests, 4, hot, seed=seed, config=PREFIX_CONFIG).replica
    # Nearly uniform: most choices are not the cheapest, and every replica takes its share.
    assert sum(costs[choice] > costs.min() for costs, choice in hot.seen) > 40
    assert np.bincount(served, minlength=4).min() >= 10
    np.testing.assert_array_equal(
        _run(requests, 4, "kv_aware", seed=seed, config=PREFIX_CONFIG, temperature=1000.0
             ).replica, served)  # seeded: a rerun draws the same


def test_kv_aware_softmax_scales_the_costs_to_their_spread():
    router = make_router("kv_aware", {"temperature": "1"})
    # Costs 5 and 15: scaled to 0 and 1, so p is proportional to 1 and exp(-1).
    np.testing.assert_allclose(router.probabilities(np.array([5.0, 15.0])),
                               [1 / (1 + np.exp(-1)), np.exp(-1) / (1 + np.exp(-1))])
    # Any costs of the same order give the same chances (Dynamo's temperature has no unit).
    np.testing.assert_allclose(router.probabilities(np.array([500.0, 1000.0, 1500.0])),
                               router.probabilities(np.array([0.0, 0.5, 1.0])))
    np.testing.assert_allclose(router.probabilities(np.full(3, 7.0)), [1 / 3] * 3)
    for options, message in (({"temperature": "-1"}, "temperature must be >= 0"),
                             ({"overlap_score_weight": "nan"}, "overlap_score_weight must be")):
        with pytest.raises(PolicyLoadError, match=f"router 'kv_aware': {message}"):
            make_router("kv_aware", options)
