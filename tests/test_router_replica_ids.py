"""Replica ids under a planner: a router's view renumbers the ready replicas as they start
and stop, `ClusterView.replica_ids` names each by its pool index, and the routers that
remember replicas (`program_affinity`'s homes, `prefix_hash`'s ring) keep ids."""

import dataclasses
from types import SimpleNamespace

import numpy as np
from test_planners import RandomCount, _cluster, _workload

from orca_jax.cluster.routing import ClusterView
from orca_jax.core.requests.request import RequestState
from policies.program_routers import ProgramAffinity
from policies.routers import HashRing, LeastOutstanding, PrefixHash


@dataclasses.dataclass
class RecordingLeastOutstanding(LeastOutstanding):
    """least_outstanding that records, per arrival, the view's replica ids and its choice."""

    seen: dict = dataclasses.field(default_factory=dict)

    def route(self, view, request):
        choice = super().route(view, request)
        self.seen[request] = (view.replica_ids, choice)
        return choice


def test_a_position_is_named_by_the_replica_that_serves_the_request():
    router = RecordingLeastOutstanding()
    cluster = _cluster(_workload(4, n=200, rate=80.0), RandomCount(seed=4), num_replicas=2,
                       router=router, interval_s=0.2, startup_s=0.1)
    result = cluster.run()
    assert (result.state == RequestState.FINISHED).all()
    renumbered = [ids for ids, _ in router.seen.values() if ids != tuple(range(len(ids)))]
    assert renumbered  # some arrival saw a replica missing below a ready one
    for request, (ids, choice) in router.seen.items():
        assert result.replica[request] == ids[choice]


class _State:
    """A cluster state of replicas with no load, for routers that read ids and tokens."""

    def __init__(self, replica_ids, specs):
        requests = SimpleNamespace(spec=specs.__getitem__)
        self.replica_ids = replica_ids
        self.replica_views = [SimpleNamespace(requests=requests, seed=0, ttft_slo_s=None,
                                              tpot_slo_s=None, page_size=4)
                              for _ in replica_ids]
        self.now_s = 0.0

    def outstanding(self):
        return np.zeros(len(self.replica_ids), dtype=np.int64)


def _spec(program=None, tokens=None):
    return SimpleNamespace(program_id=program, prompt_tokens=tokens)


def test_a_program_s_calls_follow_its_replica_through_a_renumbering():
    router = ProgramAffinity(max_excess=0)
    specs = [_spec(program=7), _spec(program=7), _spec(program=7)]
    first = ClusterView(_State((0, 1, 2, 3), specs))
    home = router.route(first, 0)
    assert home == 0  # all equal: the lowest position, replica 0
    # Replica 0 stops: position 0 is now replica 1; the program's home is gone.
    after_stop = ClusterView(_State((1, 2, 3), specs))
    assert after_stop.position_of(0) is None
    moved = router.route(after_stop, 1)
    assert after_stop.replica_ids[moved] == 1
    # Replica 0 is back in front of it: the home, replica 1, is now position 1.
    back = ClusterView(_State((0, 1, 2, 3), specs))
    assert router.route(back, 2) == back.position_of(1) == 1


def test_a_stopped_replica_hands_on_only_its_own_prefixes():
    rng = np.random.default_rng(0)
    specs = [_spec(tokens=rng.integers(0, 50_000, size=8)) for _ in range(400)]
    router = PrefixHash(prefix_tokens=4, epsilon=1e9)  # no load bound: the ring alone
    before = ClusterView(_State((0, 1, 2, 3), specs))
    owner = [before.replica_ids[router.route(before, i)] for i in range(len(specs))]
    after = ClusterView(_State((0, 1, 3), specs))  # replica 2 stopped
    again = [after.replica_ids[router.route(after, i)] for i in range(len(specs))]
    kept = [a == b for a, b in zip(owner, again) if a != 2]
    assert all(kept) and len(kept) > 250
    assert all(b != 2 for b in again)
    # The ring over ids (0, 1, 3) is the one a 4-replica ring would be without replica 2.
    ring = HashRing((0, 1, 3), 160)
    key = np.asarray(specs[0].prompt_tokens[:4], dtype=np.int64).tobytes()
    full = HashRing(4, 160).replicas_from(key)
    np.testing.assert_array_equal(ring.replicas_from(key), full[full != 2])
