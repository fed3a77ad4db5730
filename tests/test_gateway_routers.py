"""The gateways' routers (`power_of_two`, `length_buckets`, `kv_aware`): properties of every
decision they make over random clusters, read back through recording subclasses."""

import dataclasses

import numpy as np
import pytest

import policies
from orca_jax import KVConfig, SchedulerConfig, StepLimits
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
from orca_jax.workloads.synthetic import synthetic_workload
from policies.gateway_routers import PowerOfTwo

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
