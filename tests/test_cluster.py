"""Replicas behind a router: routing decisions, and that co-simulation changes no replica."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import policies
from orca_jax import KVConfig, Request, Scheduler, SchedulerConfig, StepLimits
from orca_jax.cluster.replicas import Cluster
from orca_jax.core.api.policy import PolicyLoadError
from orca_jax.core.plans.plan import PlanError
from orca_jax.core.requests.request import RequestState
from orca_jax.core.requests.run_result import RunResult
from orca_jax.core.requests.token_stats import TokenStats
from orca_jax.results.summary import replica_rows, summarize
from orca_jax.runner.spec import ClusterSpec, JaxEngineSpec, RunSpec, SimEngineSpec
from orca_jax.sim.cost_model import CostModelConfig
from orca_jax.sim.engine import SimEngine
from orca_jax.workloads.synthetic import synthetic_workload

REPO = Path(__file__).resolve().parents[1]
CONFIG = SchedulerConfig(limits=StepLimits(max_num_seqs=8, max_num_tokens=256, max_model_len=512),
                         kv=KVConfig(num_kv_pages=120, page_size=16))


def _engine():
    return SimEngine(CostModelConfig(mode="fixed", model="tiny", step_time_s=0.01))


def _workload(n=60, rate=150.0, seed=3):
    return synthetic_workload(num_requests=n, arrival="poisson", rate=rate,
                              prompt_len="uniform:8:120", output_len="uniform:1:60", seed=seed)


def _cluster(requests, num_replicas, router, policy="orca", config=CONFIG):
    cluster = Cluster(requests, num_replicas=num_replicas, router=router,
                      make_policy=lambda: policies.make_policy(policy), make_engine=_engine,
                      config=config)
    return cluster.run()


def _alone(requests, policy="orca", config=CONFIG):
    return Scheduler(requests, policies.make_policy(policy), _engine(), config).run()


FIELDS = ("first_scheduled_s", "first_token_s", "finish_s", "num_preemptions")


@pytest.mark.parametrize("policy", ["orca", "static", "vllm"])
def test_a_one_replica_cluster_is_the_plain_scheduler(policy):
    requests = _workload()
    cluster, alone = _cluster(requests, 1, "least_outstanding", policy), _alone(requests, policy)
    for field in FIELDS:
        np.testing.assert_array_equal(getattr(cluster, field), getattr(alone, field), field)
    assert np.count_nonzero(cluster.step_replica == 0) == alone.num_steps


@pytest.mark.parametrize("router", ["round_robin", "least_outstanding"])
def test_each_replica_serves_its_share_as_if_alone(router):
    # Under KV pressure (vllm preempts), so stepping replicas up to each arrival
    # must not change what any of them does with the requests it was sent.
    tight = CONFIG.with_knobs(num_kv_pages=30)
    requests = _workload(n=90, rate=400.0)
    cluster = _cluster(requests, 3, router, "vllm", tight)
    by_id = {request_id: i for i, request_id in enumerate(cluster.request_ids)}
    for r in range(3):
        mine = [q for q in requests if cluster.replica[by_id[q.id]] == r]
        alone = _alone(mine, "vllm", tight)
        rows = [by_id[request_id] for request_id in alone.request_ids]
        for field in FIELDS:
            np.testing.assert_array_equal(getattr(cluster, field)[rows],
                                          getattr(alone, field), f"replica {r} {field}")
    assert cluster.total_preemptions > 0


def test_round_robin_deals_requests_in_arrival_order():
    cluster = _cluster(_workload(n=10), 3, "round_robin")
    np.testing.assert_array_equal(cluster.replica, np.arange(10) % 3)
    assert [row["num_requests"] for row in replica_rows(cluster)] == [4, 3, 3]
    assert summarize(cluster)["num_finished"] == 10


def test_least_outstanding_sends_work_to_the_replica_that_freed_up():
    # Replica 0 gets the long request, replica 1 the short one. At 0.5 s the short
    # one is done, so the third goes to replica 1, where round robin would send it
    # to replica 0 behind the long one.
    requests = [Request(id=0, arrival_s=0.0, prompt_len=4, output_len=100),
                Request(id=1, arrival_s=0.0, prompt_len=4, output_len=5),
                Request(id=2, arrival_s=0.5, prompt_len=4, output_len=5)]
    assert _cluster(requests, 2, "least_outstanding").replica.tolist() == [0, 1, 1]
    assert _cluster(requests, 2, "round_robin").replica.tolist() == [0, 1, 0]


def test_least_outstanding_counts_requests_not_yet_admitted():
    # A burst: nobody has stepped yet, so only the routed counts tell replicas apart.
    requests = [Request(id=i, arrival_s=0.0, prompt_len=4, output_len=10) for i in range(6)]
    assert _cluster(requests, 3, "least_outstanding").replica.tolist() == [0, 1, 2, 0, 1, 2]


def test_least_outstanding_breaks_ties_round_robin():
    # Each request is done long before the next arrives: every choice is a 3-way tie.
    requests = [Request(id=i, arrival_s=10.0 * i, prompt_len=4, output_len=2) for i in range(5)]
    assert _cluster(requests, 3, "least_outstanding").replica.tolist() == [0, 1, 2, 0, 1]


# Every built-in policy but ltr, which needs a trained ranker (test_scheduler_invariants
# trains one; on a cluster it decides as srpt does, with learned scores).
# smartspec needs an engine that speculates, on one replica (tests/test_smartspec.py).
POLICIES = sorted(name for name, cls in policies.registered_policies().items()
                  if cls.__module__.startswith("policies.") and name not in ("ltr", "smartspec"))


@pytest.mark.parametrize("policy", POLICIES)
def test_every_request_finishes_once_across_replicas(policy):
    requests = _workload(n=80, rate=300.0) + [
        Request(id=999, arrival_s=0.01, prompt_len=500, output_len=100)]  # over the context
    cluster = _cluster(requests, 4, "least_outstanding", policy)
    counts = np.bincount(cluster.token_req, minlength=len(requests))
    rejected = cluster.state == RequestState.REJECTED
    assert rejected.sum() == 1 and cluster.replica[rejected].tolist() == [-1]
    np.testing.assert_array_equal(counts[~rejected], cluster.output_len[~rejected])
    summary = summarize(cluster)
    assert summary["num_finished"] == 80 and summary["num_rejected"] == 1
    assert sum(row["num_requests"] for row in replica_rows(cluster)) == 80
    assert summary["load_imbalance"] >= 1.0


CLUSTER_KEYS = {"num_replicas", "router", "load_imbalance"}


def test_a_cluster_summary_has_every_key_of_a_single_run_and_its_own():
    # Two tenants, so the fairness keys (once missing from the cluster's summary) show.
    requests = [dataclasses.replace(q, tenant=f"t{q.id % 2}") for q in _workload(n=30)]
    single = summarize(_alone(requests))
    one_replica = summarize(_cluster(requests, 1, "round_robin"))
    two_replicas = summarize(_cluster(requests, 2, "round_robin"))
    assert "fairness_jain_tokens" in single and "mean_batch_size" in single
    assert CLUSTER_KEYS.isdisjoint(single) and one_replica.keys() == single.keys()
    assert two_replicas.keys() == single.keys() | CLUSTER_KEYS
    replicas = replica_rows(_cluster(requests, 2, "round_robin"))
    assert two_replicas["num_steps"] == sum(row["num_steps"] for row in replicas)
    assert [row["replica"] for row in replicas] == [0, 1]


def test_concat_needs_every_request_routed_to_one_replica():
    requests = _workload(n=4)
    fresh = [Scheduler(requests, policies.make_policy("orca"), _engine(), CONFIG).result()
             for _ in range(2)]
    with pytest.raises(ValueError, match="request 0 is on replicas \\[0, 1\\]"):
        RunResult.concat(fresh, router="round_robin")
    with pytest.raises(ValueError, match="result 1 is of another workload"):
        RunResult.concat([fresh[0], _alone(requests[:2])], router="round_robin")


def test_concat_merges_the_token_logs_as_a_stable_sort_and_joins_their_stats():
    # Every request at once and fixed 10 ms steps: the replicas' steps end at the same
    # instants, so tokens of different replicas tie, and the merge keeps replica order.
    requests = [dataclasses.replace(q, arrival_s=0.0) for q in _workload(n=80)]
    cluster = Cluster(requests, num_replicas=3, router="round_robin",
                      make_policy=lambda: policies.make_policy("vllm"), make_engine=_engine,
                      config=CONFIG)
    joined = cluster.run()
    parts = [replica.result() for replica in cluster.replicas]
    req = np.concatenate([part.token_req for part in parts])
    times = np.concatenate([part.token_time_s for part in parts])
    order = np.argsort(times, kind="stable")
    np.testing.assert_array_equal(joined.token_req, req[order])
    np.testing.assert_array_equal(joined.token_time_s, times[order])
    shared = np.intersect1d(parts[0].token_time_s, parts[1].token_time_s)
    assert shared.size > 10  # ties across replicas to order
    # Each request's tokens on one replica: the replicas' stats joined, as the merged
    # log's own pass gives them.
    merged = TokenStats.from_log(joined.token_req, joined.token_time_s,
                                 np.isfinite(joined.finish_s))
    for field in dataclasses.fields(TokenStats):
        got, want = getattr(joined.token_stats, field.name), getattr(merged, field.name)
        np.testing.assert_array_equal(got, want, err_msg=field.name)
        assert got.dtype == want.dtype
    assert merged.gap_counts.sum() > 1000


def test_submit_gives_a_replica_only_its_requests_and_refuses_one_it_holds():
    requests = [Request(id=i, arrival_s=float(i), prompt_len=4, output_len=3) for i in range(3)]
    scheduler = Scheduler(requests, policies.make_policy("orca"), _engine(), CONFIG,
                          submitted_only=True)
    assert scheduler.done and scheduler.next_arrival_s() is None  # holds nothing yet
    scheduler.submit([2])
    assert scheduler.num_done == 2 and scheduler.next_arrival_s() == 2.0
    before = (scheduler.table.state.copy(), scheduler.num_done)
    with pytest.raises(ValueError, match="submit: request 2 is PENDING here; only a request"):
        scheduler.submit([0, 2])
    np.testing.assert_array_equal(scheduler.table.state, before[0])
    assert scheduler.num_done == before[1]
    result = scheduler.run()
    np.testing.assert_array_equal(result.state, [RequestState.ROUTED_AWAY] * 2
                                  + [RequestState.FINISHED])
    assert result.first_scheduled_s[2] == 2.0 and result.num_generated[2] == 3


def test_cluster_progress_counts_each_request_once_as_it_is_done():
    requests = [*_workload(n=30), Request(id=99, arrival_s=0.05, prompt_len=600, output_len=2)]
    cluster = Cluster(requests, num_replicas=3, router="least_outstanding",
                      make_policy=lambda: policies.make_policy("orca"), make_engine=_engine,
                      config=CONFIG)
    seen = []
    result = cluster.run(progress=seen.append)
    assert seen[0] == 1  # the request too long for the context, rejected up front
    assert all(a <= b for a, b in zip(seen, seen[1:])) and seen[-1] == cluster.num_done == 31
    assert len(set(seen)) > 10  # counted as requests finish, not all at the end
    too_long = result.request_ids.index(99)
    assert result.replica[too_long] == -1 and np.count_nonzero(result.replica >= 0) == 30


def test_cluster_rejects_bad_settings():
    with pytest.raises(PolicyLoadError, match="unknown router 'random'; registered routers: "
                                              "cache_aware, chain, kv_aware, least_outstanding, "
                                              "least_work, length_buckets, power_of_two, "
                                              "prefix_hash, program_affinity, round_robin"):
        Cluster(_workload(n=2), num_replicas=2, router="random", make_policy=lambda: None,
                make_engine=_engine, config=CONFIG)
    with pytest.raises(PolicyLoadError, match="router 'round_robin' has no option 'x'"):
        Cluster(_workload(n=2), num_replicas=2, router="round_robin", router_options={"x": "1"},
                make_policy=lambda: None, make_engine=_engine, config=CONFIG)
    # The real engine serves a colocated cluster too (each replica its own KV cache);
    # pipeline stages still serve one replica.
    assert RunSpec(engine=JaxEngineSpec(), cluster=ClusterSpec(num_replicas=2)).cluster
    with pytest.raises(ValueError, match="engine.pp 2: pipeline stages serve one replica"):
        RunSpec(engine=SimEngineSpec(pp=2, model="llama3-8b"),
                cluster=ClusterSpec(num_replicas=2))


def test_run_cli_writes_each_request_s_replica(tmp_path):
    out = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "experiments.run", "--engine=sim", "--model=llama3-8b",
         "--policy=orca", "--num_requests=40", "--rate=40", "--num_replicas=2",
         "--router=least_outstanding", f"--out_dir={out}"],
        cwd=REPO, env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True,
        timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    rows = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    assert summary["num_replicas"] == 2 and summary["router"] == "least_outstanding"
    replicas = [json.loads(line) for line in (out / "replicas.jsonl").read_text().splitlines()]
    assert [sum(r["replica"] == k for r in rows) for k in (0, 1)] == [
        r["num_requests"] for r in replicas]
    assert json.loads((out / "status.json").read_text())["status"] == "finished"
    assert {s["replica"] for s in steps} == {0, 1}
    assert len(steps) == summary["num_steps"]
    assert all(r["status"] == "finished" for r in rows)


def test_least_work_weighs_tokens_left_not_requests():
    # After a long request on replica 0 and a short one on replica 1, both hold one
    # request: least_outstanding breaks the tie to replica 0, behind 200 tokens;
    # least_work sends the next two short ones to replica 1.
    requests = [Request(id=0, arrival_s=0.0, prompt_len=4, output_len=200),
                Request(id=1, arrival_s=0.0, prompt_len=4, output_len=20),
                Request(id=2, arrival_s=0.0, prompt_len=4, output_len=20),
                Request(id=3, arrival_s=0.05, prompt_len=4, output_len=5)]
    assert _cluster(requests, 2, "least_outstanding").replica.tolist() == [0, 1, 0, 1]
    assert _cluster(requests, 2, "least_work").replica.tolist() == [0, 1, 1, 1]


PLUGIN = """
import dataclasses
from orca_jax.cluster.routing import Router

@dataclasses.dataclass
class ToLast(Router):
    offset: int = 0

    def route(self, view, request):
        return view.num_replicas - 1 - self.offset
"""


def test_a_router_plugin_loads_from_a_file_with_options(tmp_path):
    path = tmp_path / "to_last.py"
    path.write_text(PLUGIN)
    requests = _workload(n=6)
    cluster = Cluster(requests, num_replicas=3, router=f"{path}:ToLast",
                      router_options={"offset": "1"}, make_engine=_engine, config=CONFIG,
                      make_policy=lambda: policies.make_policy("orca"))
    result = cluster.run()
    assert result.replica.tolist() == [1] * 6
    assert summarize(result)["router"] == "tolast"
    broken = Cluster(requests, num_replicas=3, router=f"{path}:ToLast",
                     router_options={"offset": "-1"}, make_engine=_engine, config=CONFIG,
                     make_policy=lambda: policies.make_policy("orca"))
    with pytest.raises(PlanError, match="tolast.*replica_out_of_range.*returned 3 for request 0"
                       ) as caught:
        broken.run()
    assert caught.value.kind == "router" and str(caught.value).startswith("router 'tolast'")


def test_replicas_share_one_request_table_and_each_writes_only_its_rows():
    requests = _workload(n=40)
    cluster = Cluster(requests, num_replicas=3, router="round_robin",
                      make_policy=lambda: policies.make_policy("vllm"), make_engine=_engine,
                      config=CONFIG)
    tables = [replica.table for replica in cluster.replicas]
    # One set of arrays for the pool, not one per replica.
    assert all(t.state is tables[0].state and t.num_computed is tables[0].num_computed
               for t in tables[1:])
    assert [t.replica for t in tables] == [0, 1, 2] and all(t.shared for t in tables)
    assert (tables[0].holder == -1).all()  # nothing routed before the run
    result = cluster.run()
    # Round robin: request i is held by replica i % 3, and each replica's own result
    # counts only its requests as its own.
    np.testing.assert_array_equal(tables[0].holder, np.arange(40) % 3)
    np.testing.assert_array_equal(result.replica, np.arange(40) % 3)
    for index, replica in enumerate(cluster.replicas):
        own = replica.result()
        served = own.state != RequestState.ROUTED_AWAY
        np.testing.assert_array_equal(np.flatnonzero(served), np.arange(index, 40, 3))


@dataclasses.dataclass(kw_only=True)
class _Poacher(policies.registered_policies()["vllm"]):
    """Plans, beside its own work, a request another replica holds."""

    def schedule(self, view):
        plan = super().schedule(view)
        requests = view.requests
        mine = np.concatenate([view.running, view.waiting])
        live = (requests.holder >= 0) & (requests.state == RequestState.WAITING)
        others = np.setdiff1d(np.flatnonzero(live), mine)
        if plan.request_ids.size and others.size:
            return type(plan)(np.append(plan.request_ids, others[0]),
                              np.append(plan.num_tokens, 1))
        return plan


def test_a_plan_naming_another_replicas_request_is_refused():
    cluster = Cluster(_workload(n=20), num_replicas=2, router="round_robin",
                      make_policy=_Poacher, make_engine=_engine, config=CONFIG)
    with pytest.raises(PlanError, match=r"broke rule 'not_held': request_ids: request \d+ "
                                        r"is held by replica \d, not this one \(\d\)"):
        cluster.run()


@pytest.mark.parametrize("policy", ["vllm", "sarathi"])
def test_a_cluster_that_counts_its_tokens_summarizes_as_one_that_logs_them(policy):
    # A tight pool: preemptions break requests' tokens into runs, which each replica's
    # tally closes and measures the gaps of.
    requests = _workload(n=150, rate=300.0, seed=5)
    config = CONFIG.with_knobs(num_kv_pages=40)
    runs = {}
    for log_tokens in (True, False):
        cluster = Cluster(requests, num_replicas=3, router="least_outstanding",
                          make_policy=lambda: policies.make_policy(policy),
                          make_engine=_engine, config=config, log_tokens=log_tokens)
        runs[log_tokens] = cluster.run()
    logged, counted = runs[True], runs[False]
    assert counted.token_req is None and counted.token_time_s is None
    assert logged.token_req.size == int(counted.token_stats.num_tokens.sum())
    assert counted.total_preemptions > 0
    for field in dataclasses.fields(TokenStats):
        np.testing.assert_array_equal(getattr(counted.token_stats, field.name),
                                      getattr(logged.token_stats, field.name), field.name)
    host = lambda summary: {k: v for k, v in summary.items()  # noqa: E731
                            if not k.startswith("host_")}  # wall time of the host
    assert host(summarize(counted)) == host(summarize(logged))


def test_a_cluster_that_moves_requests_keeps_its_token_log():
    from orca_jax.cluster.migration import MigrationSpec
    from orca_jax.cluster.transfers import KVTransferCost
    from orca_jax.specs.hardware import KVLinkSpec

    cost = KVTransferCost(link=KVLinkSpec(name="test", latency_s=1e-3, bytes_per_s=1e8),
                          bytes_per_token=1000)
    cluster = Cluster(_workload(), num_replicas=2, router="round_robin",
                      make_policy=lambda: policies.make_policy("vllm"), make_engine=_engine,
                      config=CONFIG, rebalancer="load_balance",
                      migration=MigrationSpec(cost=cost), log_tokens=False)
    result = cluster.run()  # a migrated request's gap across its move is in the log
    assert result.token_req is not None and result.token_req.size == sum(
        r.output_len for r in _workload())


def test_concat_refuses_counted_results_whose_request_spans_two():
    requests = _workload(n=4)
    parts = [Scheduler(requests, policies.make_policy("orca"), _engine(), CONFIG,
                       log_tokens=False).run() for _ in range(2)]
    with pytest.raises(ValueError, match="is on replicas"):
        RunResult.concat(parts, router="round_robin")
    logged = Scheduler(requests, policies.make_policy("orca"), _engine(), CONFIG).run()
    with pytest.raises(ValueError, match="result 1 has a token log and result 0 has none"):
        RunResult.concat([parts[0], logged], router="round_robin")
