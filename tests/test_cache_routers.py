"""Cache-aware routers: `cache_aware` (SGLang's rule) and `prefix_hash` (bounded consistent
hashing), through a simulated cluster, and the hash ring itself."""

import dataclasses

import numpy as np
import pytest

import policies
from orca_jax import KVConfig, Request, SchedulerConfig, StepLimits
from orca_jax.cluster.replicas import Cluster
from orca_jax.cluster.routing import ClusterView, make_router
from orca_jax.sim.cost_model import CostModelConfig
from orca_jax.sim.engine import SimEngine
from orca_jax.workloads.prefix_workloads import shared_prefix_workload
from policies.routers import HashRing, PrefixHash

PAGE = 4
CONFIG = SchedulerConfig(limits=StepLimits(max_num_seqs=8, max_num_tokens=128, max_model_len=128),
                         kv=KVConfig(num_kv_pages=64, page_size=PAGE))


def request(i, prefix, arrival_s, output_len=2, suffix=3):
    tokens = np.concatenate([np.full(16, 100 + prefix), np.arange(suffix) + 1000 * (i + 1)])
    return Request(id=i, arrival_s=arrival_s, prompt_len=tokens.size, output_len=output_len,
                   prompt_tokens=tokens.astype(np.int32))


def cluster(requests, num_replicas, router, policy="vllm", **options):
    engine = lambda: SimEngine(CostModelConfig(mode="fixed", step_time_s=0.01))  # noqa: E731
    built = Cluster(requests, num_replicas=num_replicas, router=router,
                    make_policy=lambda: policies.make_policy(policy), make_engine=engine,
                    config=CONFIG, router_options={k: str(v) for k, v in options.items()})
    return built.run()


# ------------------------------------------------------------------ cache_aware
def test_cache_aware_follows_the_replica_that_holds_the_prefix():
    # 0 (prefix 0) and 1 (prefix 1) arrive together: a tie, then the least loaded. Both are
    # done by 1 s; 2 (prefix 1) then finds prefix 1 on replica 1 and 3 prefix 0 on replica 0,
    # where least_outstanding breaks the idle ties round robin.
    requests = [request(0, 0, 0.0), request(1, 1, 0.0), request(2, 1, 1.0),
                request(3, 0, 2.0)]
    routed = cluster(requests, 2, "cache_aware")
    assert routed.replica.tolist() == [0, 1, 1, 0]
    assert routed.num_cached_tokens.tolist() == [0, 0, 16, 16]
    assert cluster(requests, 2, "least_outstanding").replica.tolist() == [0, 1, 0, 1]


def test_cache_aware_goes_to_the_least_loaded_when_load_is_imbalanced():
    # 0 (prefix 0) runs long on replica 0; 1 is done on replica 1 by 0.5 s. 2 (prefix 0) finds
    # its prefix on replica 0, one request busy against none: SGLang's default thresholds
    # call that balanced, thresholds of 0 and 1 call it imbalanced.
    requests = [request(0, 0, 0.0, output_len=100), request(1, 1, 0.0), request(2, 0, 0.5)]
    assert cluster(requests, 2, "cache_aware").replica.tolist() == [0, 1, 0]
    strict = cluster(requests, 2, "cache_aware", balance_abs_threshold=0,
                     balance_rel_threshold=1.0)
    assert strict.replica.tolist() == [0, 1, 1]
    # Below `cache_threshold` of the prompt cached, the cache is not worth following.
    assert cluster(requests, 2, "cache_aware", cache_threshold=0.9).replica.tolist() == [0, 1, 1]


def test_cache_aware_knobs_are_checked():
    with pytest.raises(ValueError, match="balance_rel_threshold"):
        make_router("cache_aware", {"balance_rel_threshold": "0.5"})


# ------------------------------------------------------------------ prefix_hash
def test_the_ring_moves_only_the_new_replicas_share_when_one_is_added():
    keys = [np.arange(k, k + 8, dtype=np.int64).tobytes() for k in range(2000)]
    before, after = HashRing(4, 160), HashRing(5, 160)
    owner_before = np.array([before.replicas_from(key)[0] for key in keys])
    owner_after = np.array([after.replicas_from(key)[0] for key in keys])
    moved = owner_before != owner_after
    assert (owner_after[moved] == 4).all()  # a key moves only to the new replica
    assert 0.12 < moved.mean() < 0.28  # about 1/5 of them
    assert np.bincount(owner_after, minlength=5).min() > 0.12 * len(keys)  # spread evenly
    # Every replica once, clockwise; the same walk in another ring object.
    walk = after.replicas_from(keys[0])
    assert sorted(walk.tolist()) == [0, 1, 2, 3, 4]
    np.testing.assert_array_equal(HashRing(5, 160).replicas_from(keys[0]), walk)


def test_prefix_hash_sends_a_first_block_to_one_replica():
    requests = shared_prefix_workload(num_requests=60, rate=50.0, num_prefixes=6,
                                      prefix_len="uniform:8:40", prefix_zipf=0.0,
                                      suffix_len="uniform:1:20", output_len="uniform:1:20",
                                      seed=1, vocab_size=1000)
    routed = cluster(requests, 3, "prefix_hash", epsilon=100.0)  # no load bound in the way
    ring = HashRing(3, 160)
    by_id = {request_id: i for i, request_id in enumerate(routed.request_ids)}
    blocks = {}
    for r in requests:
        key = r.prompt_tokens[:PAGE].astype(np.int64).tobytes()
        replica = int(routed.replica[by_id[r.id]])
        assert replica == ring.replicas_from(key)[0]
        blocks.setdefault(key, set()).add(replica)
    assert all(len(replicas) == 1 for replicas in blocks.values()) and len(blocks) == 6
    assert len(set().union(*blocks.values())) > 1


@dataclasses.dataclass
class RecordingPrefixHash(PrefixHash):
    """prefix_hash that records each decision's loads, capacity and choice."""

    seen: list = dataclasses.field(default_factory=list)

    def route(self, view: ClusterView, request: int) -> int:
        choice = super().route(view, request)
        load = view.outstanding().copy()
        self.seen.append((load, self.capacity(load), choice))
        return choice


def test_prefix_hash_bounds_every_replicas_load():
    # One hot prefix in a burst: its home replica fills to its bound, then the ring spills
    # the rest clockwise, and no replica ever holds more than ceil(1.25 * mean).
    requests = [request(i, 0, 0.001 * i, output_len=50) for i in range(40)]
    router = RecordingPrefixHash(epsilon=0.25)
    routed = cluster(requests, 4, router)
    for load, capacity, choice in router.seen:
        assert load[choice] + 1 <= capacity
        assert capacity == int(np.ceil(1.25 * (load.sum() + 1) / 4))
    counts = np.bincount(routed.replica, minlength=4)
    home = int(HashRing(4, 160).replicas_from(requests[0].prompt_tokens[:PAGE]
                                              .astype(np.int64).tobytes())[0])
    assert counts[home] == counts.max() and (counts > 0).all()
    assert routed.num_generated.tolist() == [50] * 40


def test_prefix_hash_knobs():
    assert make_router("prefix_hash", {"prefix_tokens": "none"}).prefix_tokens is None
    with pytest.raises(ValueError, match="epsilon"):
        make_router("prefix_hash", {"epsilon": "0"})
