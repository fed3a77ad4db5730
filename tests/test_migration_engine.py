"""Live migration on the real engine: two `tiny` JaxEngine replicas of one cluster.

A request migrated between two replicas in one process (each its own KV cache)
must give the greedy tokens it gives unmigrated: the target decodes on from the
pages copied out of the source engine's cache, round by round (live) or at once
(stop-and-copy), with no recompute. Without the copy the tokens differ, so the
test sees it. Every page comes back to its pool once. The runs in other processes (the command line,
replicas on two devices) are in test_migration_engine_processes.py, so the two files can
run on two test workers at once.
"""

import dataclasses

import numpy as np
import pytest

import policies
from orca_jax import KVConfig, Request, Scheduler, SchedulerConfig, StepLimits
from orca_jax.cluster.migration import MigrationSpec
from orca_jax.cluster.rebalancing import Migration, Rebalancer
from orca_jax.cluster.replicas import Cluster
from orca_jax.cluster.transfers import KVTransferCost
from orca_jax.core.requests.request import RequestState
from orca_jax.model.engine import JaxEngine
from orca_jax.model.weights import init_params
from orca_jax.specs.hardware import KVLinkSpec
from orca_jax.specs.model_config import get_model_config

# Steps another real-engine module compiled are loaded (conftest.py).
pytestmark = pytest.mark.usefixtures("session_compile_cache")

MODEL = get_model_config("tiny")
PAGE_SIZE = 4
MAX_LEN = 64
NUM_PAGES = 48
CONFIG = SchedulerConfig(limits=StepLimits(max_num_seqs=2, max_num_tokens=32,
                                           max_model_len=MAX_LEN, token_buckets=(8, 32)),
                         kv=KVConfig(num_kv_pages=NUM_PAGES, page_size=PAGE_SIZE),
                         ).with_knobs(prefix_caching="off")  # migrated pages are their own
# A slow link (1 ms + 10 us a token): a live copy takes several rounds while the source decodes.
COST = KVTransferCost(link=KVLinkSpec(name="test", latency_s=1e-3, bytes_per_s=1e8),
                      bytes_per_token=1000)


@pytest.fixture(scope="module")
def params():
    return init_params(MODEL, seed=5)


def _engine(params, overlap=False, device=None):
    return JaxEngine(MODEL, params, num_cache_pages=NUM_PAGES + 1, page_size=PAGE_SIZE,
                     pages_per_seq=MAX_LEN // PAGE_SIZE, attention="reference",
                     feed_tokens=overlap, device=device)


def _requests():
    # Round robin: 0, 2, 4 on replica 0 (two run, one waits), 1, 3 on replica 1.
    rng = np.random.default_rng(7)
    lengths = [(9, 12), (17, 10), (3, 30), (25, 5), (6, 10)]
    return [Request(id=i, arrival_s=0.0, prompt_len=p, output_len=o,
                    prompt_tokens=rng.integers(1, MODEL.vocab_size, p).astype(np.int32))
            for i, (p, o) in enumerate(lengths)]


def _tokens(result):
    return {rid: result.output_tokens[i].tolist() for i, rid in enumerate(result.request_ids)}


@dataclasses.dataclass
class MoveAfter(Rebalancer):
    """Moves each request of `after` ({request: tokens}) to the other replica once it has
    sampled that many tokens (0: while it waits, before it is admitted); records the
    tokens it had and the state it was in."""

    after: dict = dataclasses.field(default_factory=dict)
    seen: dict = dataclasses.field(default_factory=dict)

    def rebalance(self, view):
        generated = view.requests.num_generated
        moves = []
        for request, tokens in self.after.items():
            for source, replica in enumerate(view.replicas):
                waiting = tokens == 0 and request in replica.waiting
                running = (tokens > 0 and request in replica.running
                           and generated[request] >= tokens)
                if request not in self.seen and (waiting or running):
                    self.seen[request] = (int(generated[request]),
                                          "waiting" if waiting else "running")
                    moves.append(Migration(request, source, 1 - source))
        return moves


def _cluster(params, rebalancer=None, mode="live", stop_pages=1, overlap=False, devices=None,
             max_rounds=8, requests=_requests, config=CONFIG):
    # The copy's measured wall time on the clock only for stop-and-copy (its one round
    # cannot abort): a live copy's rounds, priced alone, stay far shorter than a step,
    # however busy the machine, so the request never finishes while it moves.
    migration = None if rebalancer is None else MigrationSpec(
        cost=COST, mode=mode, interval_s=1e-4, stop_pages=stop_pages, max_rounds=max_rounds,
        measure_copy=mode == "stop_and_copy")
    # overlap: each replica plans step N+1 while step N runs (its tokens come back late).
    # devices: replica i's engine on devices[i] (None: both on the default device).
    placed = iter(devices or [None, None])
    return Cluster(requests(), num_replicas=2, router="round_robin",
                   make_policy=lambda: policies.make_policy("vllm"),
                   make_engine=lambda: _engine(params, overlap, next(placed)),
                   config=config.with_knobs(overlap=overlap),
                   rebalancer=rebalancer, migration=migration)


@pytest.fixture(scope="module")
def unmigrated(params):
    return _tokens(Scheduler(_requests(), policies.make_policy("vllm"), _engine(params),
                             CONFIG).run())


def _check_pages_back(cluster):
    for replica in cluster.replicas:  # every page back to its pool, none freed twice
        assert replica.kv.num_free == NUM_PAGES
        assert not replica.in_transfer.size and not replica.kv.num_held.any()


@pytest.mark.slow
@pytest.mark.parametrize("mode, overlap", [("live", False), ("stop_and_copy", False),
                                           ("live", True)])
def test_requests_migrated_mid_decode_and_waiting_keep_their_greedy_tokens(
        params, unmigrated, mode, overlap):
    # 0 moves after 3 tokens, 1 (on replica 1) after 2, 4 while it waits on replica 0.
    rebalancer = MoveAfter(after={0: 3, 1: 2, 4: 0})
    cluster = _cluster(params, rebalancer, mode, overlap=overlap)
    result = cluster.run()
    assert _tokens(result) == unmigrated
    assert {r: s for r, (_, s) in rebalancer.seen.items()} == {
        0: "running", 1: "running", 4: "waiting"}
    log = {m.request: m for m in cluster.migrator.log}
    assert sorted(log) == [0, 1, 4] and cluster.migrator.num_aborted == 0
    assert [(log[r].from_replica, log[r].to_replica) for r in (0, 1, 4)] == [(0, 1), (1, 0),
                                                                             (0, 1)]
    assert result.replica.tolist() == [1, 0, 0, 1, 1]
    for request in (0, 1):  # mid-decode: pages of the prompt and the tokens so far moved
        moved = log[request]
        assert 0 < rebalancer.seen[request][0] < _requests()[request].output_len
        assert moved.num_pages >= -(-(_requests()[request].prompt_len
                                      + rebalancer.seen[request][0] - 1) // PAGE_SIZE)
        assert moved.copy_wall_s > 0 and moved.downtime_s > COST.seconds(0)
        if mode == "stop_and_copy":  # one round, all downtime: the link's price + the copy
            assert moved.num_rounds == 1 and moved.start_s == moved.stop_s
            assert moved.downtime_s == pytest.approx(
                COST.seconds(moved.num_pages * PAGE_SIZE) + moved.copy_wall_s)
        else:  # the last round's price alone: at most the pages filled since the last round
            assert moved.downtime_s < COST.seconds(moved.num_pages * PAGE_SIZE)
    assert log[4].num_pages == 0 and log[4].copy_wall_s == 0.0  # waiting: no KV yet
    assert result.state.tolist() == [int(RequestState.FINISHED)] * 5
    _check_pages_back(cluster)


@pytest.mark.slow
def test_a_live_copy_sends_pages_filled_while_it_ran(params, unmigrated):
    # A long request: rounds go on while it decodes, then it stops.
    rebalancer = MoveAfter(after={2: 2})
    cluster = _cluster(params, rebalancer, "live", stop_pages=0, max_rounds=3)  # 3, then stop
    result = cluster.run()
    assert _tokens(result) == unmigrated
    (moved,) = cluster.migrator.log
    assert moved.num_rounds >= 2 and moved.stop_s > moved.start_s
    at_start = -(-(3 + rebalancer.seen[2][0] - 1) // PAGE_SIZE)  # pages of its computed tokens
    assert moved.num_pages > at_start  # and those filled (or partly filled) meanwhile
    assert result.replica[2] == 1
    _check_pages_back(cluster)


@pytest.mark.slow
def test_without_the_page_copy_the_migrated_tokens_differ(params, unmigrated, monkeypatch):
    monkeypatch.setattr(JaxEngine, "write_kv_pages", lambda self, pages, kv: None)
    cluster = _cluster(params, MoveAfter(after={0: 3}), "stop_and_copy")
    tokens = _tokens(cluster.run())
    assert tokens[0][:3] == unmigrated[0][:3] and tokens[0] != unmigrated[0]
    assert all(tokens[i] == unmigrated[i] for i in (1, 2, 3, 4))


def _sharing_requests():
    # Request 2 comes last (index 4 in arrival order, on replica 0 as 0 and 3 are) and
    # shares request 0's first two pages (8 tokens) from the prefix cache.
    prefix = _requests()[0].prompt_tokens[:8]
    requests = _requests()
    own = np.arange(3, dtype=np.int32) + 100
    requests[2] = dataclasses.replace(requests[2], arrival_s=1e-9, prompt_len=11,
                                      prompt_tokens=np.concatenate([prefix, own]))
    return requests


@pytest.mark.slow
def test_a_request_sharing_cached_pages_migrates_to_a_caching_replica(params):
    caching = CONFIG.with_knobs(prefix_caching="on")
    expected = _tokens(Scheduler(_sharing_requests(), policies.make_policy("vllm"),
                                 _engine(params), caching).run())
    rebalancer = MoveAfter(after={4: 2})
    cluster = _cluster(params, rebalancer, "stop_and_copy", requests=_sharing_requests,
                       config=caching)
    result = cluster.run()
    (moved,) = cluster.migrator.log
    assert (moved.request, moved.to_replica) == (4, 1) and rebalancer.seen[4][1] == "running"
    assert cluster.replicas[1].table.num_cached_tokens[4] == 8  # its hit on replica 0
    assert _tokens(result) == expected
    for replica in cluster.replicas:
        replica.kv.check_consistency()
        assert not replica.in_transfer.size and not replica.kv.num_held.any()
