"""A request moved between schedulers by `export_request` / `import_request`: a running
request migrates between two colocated replicas mid-run and finishes with its tokens."""

import dataclasses
from typing import ClassVar

import numpy as np
import pytest

import policies
from orca_jax import KVConfig, LoopFeatures, Request, Scheduler, SchedulerConfig, StepLimits
from orca_jax.cluster.event_loop import Event, EventLoop
from orca_jax.cluster.replicas import Cluster
from orca_jax.core.loop.request_export import RequestExport
from orca_jax.core.requests.request import RequestState
from orca_jax.core.requests.run_result import RunResult
from orca_jax.sim.cost_model import CostModelConfig
from orca_jax.sim.engine import SimEngine

CONFIG = SchedulerConfig(limits=StepLimits(max_num_seqs=8, max_num_tokens=256, max_model_len=512),
                         kv=KVConfig(num_kv_pages=64, page_size=16),
                         features=LoopFeatures(log_step_requests=True))
STEP_S = 0.01
COPY_S = 0.005  # the test's price of moving the KV (a transfer model would price its bytes)


def _engine():
    return SimEngine(CostModelConfig(mode="fixed", model="tiny", step_time_s=STEP_S))


def _workload():
    return [Request(id=i, arrival_s=0.002 * i, prompt_len=40 + 10 * i, output_len=30)
            for i in range(4)]


def _replicas(policy):
    """Replica A holds the whole workload; replica B holds nothing until the import."""
    a = Scheduler(_workload(), policies.make_policy(policy), _engine(), CONFIG)
    b = Scheduler(_workload(), policies.make_policy(policy), _engine(), CONFIG,
                  submitted_only=True)
    return a, b


@pytest.mark.parametrize("policy", ["vllm", "orca", "sarathi"])
def test_a_running_request_migrates_mid_run_and_finishes_with_its_tokens(policy):
    a, b = _replicas(policy)
    moved = 1
    while a.table.num_generated[moved] < 5:
        a.step()
    assert a.table.state[moved] == RequestState.RUNNING
    export = a.export_request(moved)
    assert isinstance(export, RequestExport) and export.state == RequestState.RUNNING
    assert export.num_computed == 50 + 4 and export.num_generated == 5  # prompt + decodes
    a.release_request(moved, a.now_s)
    b.import_request(export, a.now_s + COPY_S)
    assert b.now_s == pytest.approx(a.now_s + COPY_S)
    assert b.kv.num_held[moved] == 4  # 54 computed tokens' KV, taken on import
    assert a.table.state[moved] == RequestState.ROUTED_AWAY and moved not in a.running
    result_a, result_b = a.run(), b.run()

    assert result_b.state[moved] == RequestState.FINISHED
    assert result_b.num_generated[moved] == 30
    # B computed only the tokens A had not: each of its steps of the request one decode.
    b_tokens = [int(t[r == moved][0]) for r, t in zip(result_b.step_requests,
                                                       result_b.step_tokens) if moved in r]
    assert b_tokens == [1] * (30 - 5)
    assert result_b.first_token_s[moved] == result_a.first_token_s[moved]
    assert a.kv.num_free == b.kv.num_free == CONFIG.kv.num_kv_pages  # nothing held on
    joined = RunResult.concat([result_a, result_b], router="migration")
    assert joined.replica.tolist() == [0, 1, 0, 0]
    assert (joined.state == RequestState.FINISHED).all()
    assert joined.num_generated.tolist() == [30] * 4
    assert int(np.count_nonzero(joined.token_req == moved)) == 30  # 5 on A, 25 on B
    assert (np.diff(joined.token_time_s[joined.token_req == moved]) > 0).all()


def test_a_migration_lands_on_its_arrival_order_in_the_waiting_queue():
    a, b = _replicas("vllm")
    b.submit([0, 3])
    b.step()
    while a.table.num_generated[2] < 2:
        a.step()
    export = a.export_request(2)
    a.release_request(2, a.now_s)
    b.import_request(export, a.now_s)
    assert list(b.waiting) == sorted(b.waiting) and 2 in b.waiting


def test_moves_refuse_a_request_in_the_wrong_place():
    a, b = _replicas("vllm")
    with pytest.raises(ValueError, match="export_request: request 0 is PENDING here"):
        a.export_request(0)
    a.step()
    export = a.export_request(0)
    with pytest.raises(ValueError, match="import_request: request 0 is RUNNING here"):
        a.import_request(export, a.now_s)
    with pytest.raises(ValueError, match="release_request: request 0 is ROUTED_AWAY here"):
        b.release_request(0, 0.0)
    full = dataclasses.replace(export, num_computed=10 * 512)
    before = (b.kv.num_free, b.num_done)
    with pytest.raises(ValueError, match="import_request: request 0 needs 320 KV pages; 64 "
                                         "are free"):
        b.import_request(full, 0.0)
    assert (b.kv.num_free, b.num_done) == before


def test_a_caching_replica_imports_a_request_holding_its_own_pages():
    # Both prompts start with the same page: on B, request 1's first page is cached when
    # request 0 arrives there, but request 0 holds its own copy and takes no hit.
    prefix = np.arange(16, dtype=np.int32) + 100
    requests = [Request(id=i, arrival_s=0.0, prompt_len=40, output_len=8,
                        prompt_tokens=np.concatenate([prefix, np.arange(24, dtype=np.int32)
                                                      + 50 * i])) for i in range(2)]
    a = Scheduler(requests, policies.make_policy("vllm"), _engine(), CONFIG)
    b = Scheduler(requests, policies.make_policy("vllm"), _engine(), CONFIG,
                  submitted_only=True)
    b.submit([1])
    b.step()
    a.step()
    a.step()
    export = a.export_request(0)
    assert export.output_tokens == (40, 41)  # the simulator samples kv_len % vocab
    a.release_request(0, a.now_s)
    b.import_request(export, a.now_s)
    assert b.kv.num_held[0] == 3 and b.table.num_computed[0] == 41
    b.step()  # admitted with its pages: it decodes on, no recompute
    assert b.table.num_computed[0] == 42 and b.kv.num_held[0] == 3
    b.run()
    assert b.table.state[0] == RequestState.FINISHED and b.table.num_generated[0] == 8
    assert b.table.num_cached_tokens[0] == 0  # its first admission's, on A: nothing cached
    b.kv.check_consistency()
    assert not b.kv.num_held.any()


def test_a_caching_replica_refuses_an_import_without_token_ids():
    requests = [Request(id=0, arrival_s=0.0, prompt_len=40, output_len=8,
                        prompt_tokens=np.arange(40, dtype=np.int32))]
    a = Scheduler(requests, policies.make_policy("vllm"), _engine(), CONFIG)
    b = Scheduler(requests, policies.make_policy("vllm"), _engine(), CONFIG,
                  submitted_only=True)
    a.step()
    export = dataclasses.replace(a.export_request(0), output_tokens=None)
    with pytest.raises(ValueError, match="import_request: request 0: prefix caching is "
                                         "active here, and its export has no generated"):
        b.import_request(export, a.now_s)
    assert b.table.state[0] == RequestState.ROUTED_AWAY and b.kv.num_free == 64


@dataclasses.dataclass(frozen=True)
class Migrate(Event):
    """A test's own event kind on the cluster's loop: a request moves between replicas."""

    priority: ClassVar[int] = 50
    request: int
    source: int
    target: int
    import_first: bool = False  # the receiver takes it before the sender lets it go

    def fire(self, loop: EventLoop, when: float) -> None:
        source, target = loop.pools[0].replicas[self.source], loop.pools[0].replicas[self.target]
        # A step runs whole: one in progress at `when` ends before the request leaves.
        leaves_s = max(when, source.now_s)
        export = source.export_request(self.request)
        if self.import_first:  # the replicas share one table: the row is the receiver's
            target.import_request(export, leaves_s + COPY_S)
            source.release_request(self.request, leaves_s)
        else:
            source.release_request(self.request, leaves_s)
            target.import_request(export, leaves_s + COPY_S)
        loop.wake(0, self.source)
        loop.wake(0, self.target)


@pytest.mark.parametrize("import_first", [False, True])
def test_a_migration_event_moves_a_running_request_on_the_cluster_loop(import_first):
    requests = [Request(id=0, arrival_s=0.0, prompt_len=30, output_len=100),
                *[Request(id=i, arrival_s=0.05 * i, prompt_len=20, output_len=10)
                  for i in range(1, 6)]]
    cluster = Cluster(requests, num_replicas=2, router="round_robin",
                      make_policy=lambda: policies.make_policy("vllm"), make_engine=_engine,
                      config=CONFIG)
    cluster.push(Migrate(request=0, source=0, target=1, import_first=import_first), 0.305)
    result = cluster.run()
    assert cluster.replicas[0].table.holder[0] == 1  # the shared row moved its holder
    assert result.replica[0] == 1 and result.num_generated[0] == 100
    assert (result.state == RequestState.FINISHED).all()
    tokens_at = result.token_time_s[result.token_req == 0]
    assert tokens_at.size == 100 and (np.diff(tokens_at) > 0).all()
    # Replica 0's step in progress at 0.305 s ends at 0.31 s with the 31st token; replica 1
    # runs the request no sooner than the copy's end.
    on_source = tokens_at <= 0.31 + 1e-9
    assert on_source.sum() == 31
    assert tokens_at[~on_source].min() >= 0.31 + COPY_S + STEP_S - 1e-9
    assert all(r.kv.num_free == CONFIG.kv.num_kv_pages for r in cluster.replicas)
