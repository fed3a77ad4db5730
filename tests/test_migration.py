"""Live migration between a cluster's replicas: priced downtime, page accounting, refusals."""

import dataclasses
import json
import math

import numpy as np
import pytest

import policies
from orca_jax import KVConfig, Request, SchedulerConfig, StepLimits
from orca_jax.cluster.migration import MigrationSpec
from orca_jax.cluster.rebalancing import Migration, Rebalancer
from orca_jax.cluster.replicas import Cluster
from orca_jax.cluster.transfers import KVTransferCost
from orca_jax.core.api.policy import PolicyLoadError
from orca_jax.core.plans.plan import PlanError
from orca_jax.core.requests.request import RequestState
from orca_jax.sim.cost_model import CostModelConfig
from orca_jax.sim.engine import SimEngine
from orca_jax.specs.hardware import KVLinkSpec
from orca_jax.workloads.synthetic import synthetic_workload

STEP_S = 0.01
PAGE = 16
CONFIG = SchedulerConfig(limits=StepLimits(max_num_seqs=8, max_num_tokens=256, max_model_len=512),
                         kv=KVConfig(num_kv_pages=120, page_size=PAGE))
LATENCY_S, BYTES_PER_TOKEN, BYTES_PER_S = 0.001, 1000, 4.8e6
COST = KVTransferCost(link=KVLinkSpec(name="test", latency_s=LATENCY_S, bytes_per_s=BYTES_PER_S),
                      bytes_per_token=BYTES_PER_TOKEN)


def _engine():
    return SimEngine(CostModelConfig(mode="fixed", model="tiny", step_time_s=STEP_S))


def _cluster(requests, rebalancer, *, num_replicas=2, policy="vllm", mode="live",
             interval_s=0.05, config=CONFIG):
    return Cluster(requests, num_replicas=num_replicas, router="round_robin",
                   make_policy=lambda: policies.make_policy(policy), make_engine=_engine,
                   config=config, rebalancer=rebalancer,
                   migration=MigrationSpec(cost=COST, mode=mode, interval_s=interval_s))


@dataclasses.dataclass
class Scripted(Rebalancer):
    """Asks for `moves` at its first call (recording what each request had computed)."""

    moves: tuple = ()
    seen: dict = dataclasses.field(default_factory=dict)
    calls: int = 0

    def rebalance(self, view):
        self.calls += 1
        if self.calls > 1:
            return []
        for request, _, _ in self.moves:
            if request < len(view.requests.num_computed):
                self.seen[request] = int(view.requests.num_computed[request])
        return [Migration(*m) for m in self.moves]


@dataclasses.dataclass
class RandomMoves(Rebalancer):
    """Moves up to two random waiting or running requests to random replicas with room."""

    seed: int = 0

    def __post_init__(self):
        self.rng = np.random.default_rng(self.seed)

    def rebalance(self, view):
        moving = set(view.migrating().tolist())
        moves = []
        for _ in range(2):
            source = int(self.rng.integers(view.num_replicas))
            replica = view.replicas[source]
            held = [i for i in np.concatenate([replica.waiting, replica.running]).tolist()
                    if i not in moving]
            if not held:
                continue
            request = int(self.rng.choice(held))
            target = int((source + 1 + self.rng.integers(view.num_replicas - 1))
                         % view.num_replicas)
            room = view.replicas[target].kv_room() - sum(
                view.pages_to_receive(m.request, target) for m in moves if m.target == target)
            if view.pages_to_receive(request, target) <= room:
                moves.append(Migration(request, source, target))
                moving.add(request)
        return moves


def _one_long_request():
    # Alone on replica 0 (round robin): a 40-token prompt, then decodes.
    return [Request(id=0, arrival_s=0.0, prompt_len=40, output_len=200)]


def _pages(tokens):
    return math.ceil(tokens / PAGE)


def _copy_s(pages):
    return LATENCY_S + pages * PAGE * BYTES_PER_TOKEN / BYTES_PER_S


def test_stop_and_copy_is_all_downtime_priced_over_the_link():
    rebalancer = Scripted(moves=((0, 0, 1),))
    cluster = _cluster(_one_long_request(), rebalancer, mode="stop_and_copy")
    result = cluster.run()
    (log,) = cluster.migrator.log
    # The tick at 0.05 s fires before the step due then: the prefill and 4 decodes ran.
    n0 = rebalancer.seen[0]
    assert n0 == 40 + 4
    assert (log.from_replica, log.to_replica, log.num_rounds) == (0, 1, 1)
    assert log.start_s == log.stop_s == pytest.approx(0.05)
    assert log.num_pages == _pages(n0) == 3
    assert log.downtime_s == pytest.approx(_copy_s(3))
    assert log.num_bytes == 3 * PAGE * BYTES_PER_TOKEN
    assert cluster.replica[0] == 1
    assert result.state[0] == RequestState.FINISHED
    assert np.count_nonzero(result.token_req == 0) == 200  # no token lost or repeated


def test_live_copy_copies_while_decoding_then_stops_for_the_last_page():
    rebalancer = Scripted(moves=((0, 0, 1),))
    cluster = _cluster(_one_long_request(), rebalancer, mode="live")
    result = cluster.run()
    (log,) = cluster.migrator.log
    n0 = rebalancer.seen[0]  # 44: 3 pages, the last partly filled
    round1_end = 0.05 + _copy_s(_pages(n0))  # 0.061 s: the steps at 0.05 and 0.06 ran
    n1 = n0 + 2  # 46 tokens: still 3 pages, 1 of them not wholly copied
    assert round1_end == pytest.approx(0.061)
    # The source ran its 0.06 s step to 0.07 s: it stops the request there.
    assert log.stop_s == pytest.approx(0.07)
    last = _pages(n1) - n0 // PAGE  # the partly filled page again
    assert last == 1
    assert log.downtime_s == pytest.approx(_copy_s(last))
    assert log.downtime_s < _copy_s(_pages(n1))  # shorter than stopping for all of it
    assert (log.num_rounds, log.num_pages) == (2, _pages(n0) + last)
    assert result.state[0] == RequestState.FINISHED
    assert np.count_nonzero(result.token_req == 0) == 200
    tokens = result.token_time_s[result.token_req == 0]
    assert (np.diff(tokens) >= 0).all()
    gap = tokens[1:][np.diff(tokens) > STEP_S + 1e-9]
    assert gap.size == 1 and gap[0] >= log.end_s  # the one pause: the downtime


@pytest.mark.parametrize("seed", range(6))
def test_random_migrations_lose_nothing_and_release_pages_once(seed):
    rng = np.random.default_rng(seed)
    num_replicas = int(rng.integers(2, 5))
    policy = ["vllm", "orca", "sarathi"][seed % 3]
    mode = ["live", "stop_and_copy"][seed % 2]
    config = CONFIG.with_knobs(num_kv_pages=int(rng.integers(40, 120)))
    requests = synthetic_workload(num_requests=70, arrival="poisson", rate=200.0,
                                  prompt_len="uniform:8:120", output_len="uniform:1:150",
                                  seed=seed)
    cluster = _cluster(requests, RandomMoves(seed=seed), num_replicas=num_replicas,
                       policy=policy, mode=mode, interval_s=float(rng.uniform(0.01, 0.05)),
                       config=config)
    releases = {}
    for index, replica in enumerate(cluster.replicas):
        def counted(request, at_s, index=index, release=replica.release_request):
            releases[index, request] = releases.get((index, request), 0) + 1
            release(request, at_s)
        replica.release_request = counted
    result = cluster.run()
    log = cluster.migrator.log
    assert len(log) > 5
    if mode == "live":  # some live copies were aborted (their request finished or was
        assert cluster.migrator.num_aborted > 0  # preempted): the invariants cover them too
    # Every request finished once, with its whole answer.
    assert (result.state == RequestState.FINISHED).all()
    output_len = np.array([r.output_len for r in requests])
    np.testing.assert_array_equal(np.bincount(result.token_req, minlength=len(requests)),
                                  output_len)
    # The source let each migrated request go once per migration away from it.
    moved_away = {}
    for m in log:
        moved_away[m.from_replica, m.request] = moved_away.get((m.from_replica, m.request), 0) + 1
    assert releases == moved_away
    # Each request's migrations chain from where it was to where it went; it ends there.
    last = {}
    for m in sorted(log, key=lambda m: m.end_s):
        assert last.get(m.request, m.from_replica) == m.from_replica
        last[m.request] = m.to_replica
        assert m.start_s <= m.stop_s < m.end_s
        assert m.downtime_s == pytest.approx(m.end_s - m.stop_s)
    for request, replica in last.items():
        assert cluster.replica[request] == replica
    # Page accounting balances on every replica.
    for replica in cluster.replicas:
        assert replica.kv.num_free == replica.kv.num_kv_pages
        assert not replica.kv.num_held.any()
        assert not replica.in_transfer.size
    assert not cluster.view.migrating().size


def test_load_balance_moves_from_the_most_to_the_least_loaded():
    # Every request to replica 0 (router: a file-less plugin would do; use round robin
    # over 2 with only even arrivals long): replica 0 fills, replica 1 idles.
    requests = [Request(id=i, arrival_s=0.001 * i, prompt_len=100,
                        output_len=150 if i % 2 == 0 else 1) for i in range(12)]
    cluster = _cluster(requests, "load_balance", policy="vllm")
    result = cluster.run()
    assert cluster.migrator.log
    assert all(m.from_replica == 0 and m.to_replica == 1 for m in cluster.migrator.log[:1])
    assert (result.state == RequestState.FINISHED).all()


def test_load_balance_never_turns_a_pair_around():
    # A lone request on replica 0 holds up to 15 of 40 pages: usage over the gap (0.2)
    # against an idle replica 1, but moving it would only swap the two, and the next call
    # would move it back (it went back and forth at every call, 0.05 s apart).
    cluster = _cluster(_one_long_request(), "load_balance",
                       config=CONFIG.with_knobs(num_kv_pages=40))
    result = cluster.run()
    assert _pages(240) / 40 > 0.2  # the gap is crossed: only the turn-around rule holds it
    assert cluster.migrator.log == []
    assert (result.state == RequestState.FINISHED).all()


def test_migration_needs_two_replicas():
    with pytest.raises(ValueError, match="migration needs 2 or more replicas"):
        _cluster(_one_long_request(), "load_balance", num_replicas=1)


def test_an_unknown_rebalancer_is_named():
    with pytest.raises(PolicyLoadError, match="unknown rebalancer 'nope'"):
        _cluster(_one_long_request(), "nope")


def _two_requests():
    return [Request(id=0, arrival_s=0.0, prompt_len=40, output_len=200),
            Request(id=1, arrival_s=0.0, prompt_len=40, output_len=200)]


@pytest.mark.parametrize("moves, rule", [
    (((0, 0, 1), (1, 0, 1)), "not_on_source"),  # request 1 is on replica 1
    (((0, 0, 1), (0, 0, 1)), "already_migrating"),
    (((0, 0, 1), (1, 1, 1)), "replica_out_of_range"),
    (((0, 0, 1), (7, 0, 1)), "unknown_request"),
])
def test_a_bad_migration_stops_the_run_with_nothing_half_run(moves, rule):
    cluster = _cluster(_two_requests(), Scripted(moves=moves))
    with pytest.raises(PlanError, match=f"rule '{rule}'") as error:
        cluster.run()
    assert "\n" not in str(error.value)
    # The first, valid, migration's reservation was given back: nothing moves.
    target = cluster.replicas[1]
    assert not target.in_transfer.size and not target.kv.num_held[0]
    assert cluster.replicas[0].table.holder[0] == 0
    assert not cluster.view.migrating().size


def test_a_target_without_room_is_refused():
    small = CONFIG.with_knobs(num_kv_pages=12)
    requests = [Request(id=0, arrival_s=0.0, prompt_len=100, output_len=50),
                Request(id=1, arrival_s=0.0, prompt_len=100, output_len=50)]
    cluster = _cluster(requests, Scripted(moves=((0, 0, 1),)), config=small)
    with pytest.raises(PlanError, match="rebalancer 'scripted' broke rule 'no_room': replica 1 "
                       "has no room for request 0's 7 KV pages"):
        cluster.run()
    assert not cluster.replicas[1].in_transfer.size


def test_the_command_line_logs_each_migration_and_counts_them(tmp_path):
    from cli_runner import run_module

    out = tmp_path / "run"
    run_module("experiments.run", "--engine=sim", "--model=llama3-8b", "--hardware=a100",
               "--num_requests=120", "--rate=20", "--num_replicas=3", "--policy=vllm",
               "--rebalancer=load_balance", "--rebalancer_opts=gap=0.1",
               "--rebalance_interval_s=0.25", "--migration=stop_and_copy",
               "--num_kv_pages=800", f"--out_dir={out}")
    rows = [json.loads(line) for line in (out / "migrations.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    assert rows and summary["num_migrations"] == len(rows)
    assert summary["rebalancer"] == "load_balance" and summary["migration"] == "stop_and_copy"
    assert summary["migration_pages_total"] == sum(r["num_pages"] for r in rows)
    assert all(r["num_rounds"] == 1 and r["start_s"] == r["stop_s"] for r in rows)
    assert summary["num_finished"] == 120


@pytest.mark.parametrize("flags, message", [
    (("--num_replicas=1", "--rebalancer=load_balance"),
     "error: cluster: rebalancer 'load_balance': migration needs num_replicas >= 2 "
     "(colocated), got num_replicas=1"),
    (("--num_replicas=2", "--rebalancer=nope"), "error: unknown rebalancer 'nope'"),
    (("--num_replicas=2", "--rebalancer=load_balance", "--rebalance_interval_s=0"),
     "error: cluster: rebalance_interval_s must be > 0 seconds, got 0.0"),
])
def test_bad_migration_flags_are_one_line_and_nothing_runs(tmp_path, flags, message):
    from cli_runner import run_module

    out = tmp_path / "run"
    result = run_module("experiments.run", "--engine=sim", "--num_requests=5", *flags,
                        f"--out_dir={out}", check=False)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith(message)
    assert not out.exists()


def test_priority_isolation_moves_normal_requests_away_from_an_urgent_one():
    # Round robin: even requests (one urgent, the others normal and long) fill replica 0;
    # odd ones are one token long, so replica 1 empties.
    requests = [Request(id=i, arrival_s=0.001 * i, prompt_len=100,
                        output_len=(150 if i % 2 == 0 else 1), priority=(0 if i == 0 else 1))
                for i in range(16)]
    cluster = _cluster(requests, "priority_isolation", policy="vllm",
                       config=CONFIG.with_knobs(num_kv_pages=80))
    cluster.migrator.rebalancer.headroom = 0.5
    result = cluster.run()
    log = cluster.migrator.log
    assert log and all(m.request != 0 for m in log)
    assert log[0].from_replica == 0 and log[0].to_replica == 1
    assert (result.state == RequestState.FINISHED).all()


@pytest.mark.parametrize("rebalancer, seed", [("load_balance", 0), ("load_balance", 1),
                                              ("priority_isolation", 2)])
def test_the_built_in_rebalancers_lose_nothing(rebalancer, seed):
    rng = np.random.default_rng(seed)
    requests = synthetic_workload(num_requests=80, arrival="poisson", rate=300.0,
                                  prompt_len="uniform:8:120", output_len="uniform:1:200",
                                  seed=seed)
    requests = [dataclasses.replace(r, priority=int(rng.integers(0, 3))) for r in requests]
    cluster = _cluster(requests, rebalancer, num_replicas=3, interval_s=0.02,
                       config=CONFIG.with_knobs(num_kv_pages=60))
    result = cluster.run()
    assert cluster.migrator.log
    assert (result.state == RequestState.FINISHED).all()
    np.testing.assert_array_equal(np.bincount(result.token_req, minlength=len(requests)),
                                  [r.output_len for r in requests])
    for replica in cluster.replicas:
        assert replica.kv.num_free == replica.kv.num_kv_pages


def test_the_llumnix_reproduction_runs_every_setup_on_the_same_requests():
    from experiments.reproduce import llumnix

    setup = llumnix.LlumnixSetup(num_requests=40, rates=(20.0,))
    rows = llumnix.run(setup)
    assert [r["setup"] for r in rows] == [label for label, _, _ in llumnix.SETUPS]
    finished = {r["finished"] for r in rows}
    assert len(finished) == 1  # the same requests: each setup finishes the same ones
    assert rows[0]["migrations"] == rows[1]["migrations"] == 0


def test_describe_policy_names_a_rebalancers_knobs():
    from experiments.run import describe

    text = describe("priority_isolation")
    assert text.startswith("rebalancer 'priority_isolation'")
    assert "--rebalancer_opts" in text and "headroom: float = 0.2" in text


def _conversation_on_replica_1(vocab):
    # Round robin: 0, 2, 4 on replica 0; 1, 3, 5 on replica 1. Request 2 (one page of
    # prompt, 100 tokens of answer) migrates to replica 1 while it decodes; request 5
    # comes to replica 1 after it finished, its prompt request 2's prompt and answer (the
    # simulator samples `kv_len % vocab`, so the answer is known).
    prompt = (np.arange(PAGE, dtype=np.int32) * 7 + 3) % vocab
    answer = (PAGE + np.arange(100, dtype=np.int32)) % vocab
    other = [(np.arange(24, dtype=np.int32) + 11 * i) % vocab for i in range(4)]
    return [Request(id=0, arrival_s=0.0, prompt_len=24, output_len=20, prompt_tokens=other[0]),
            Request(id=1, arrival_s=0.0, prompt_len=24, output_len=20, prompt_tokens=other[1]),
            Request(id=2, arrival_s=0.0, prompt_len=PAGE, output_len=100, prompt_tokens=prompt),
            Request(id=3, arrival_s=0.0, prompt_len=24, output_len=5, prompt_tokens=other[2]),
            Request(id=4, arrival_s=0.0, prompt_len=24, output_len=5, prompt_tokens=other[3]),
            Request(id=5, arrival_s=5.0, prompt_len=PAGE + 100, output_len=4,
                    prompt_tokens=np.concatenate([prompt, answer]))]


@pytest.mark.parametrize("mode", ["live", "stop_and_copy"])
def test_a_migrated_request_keeps_its_pages_and_names_them_on_a_caching_target(mode):
    vocab = _engine().vocab_size
    requests = _conversation_on_replica_1(vocab)
    rebalancer = Scripted(moves=((2, 0, 1),))
    cluster = _cluster(requests, rebalancer, mode=mode,
                       config=CONFIG.with_knobs(prefix_caching="on"))
    result = cluster.run()
    (log,) = cluster.migrator.log
    assert (log.request, log.to_replica) == (2, 1) and 0 < rebalancer.seen[2] < PAGE + 100
    assert (result.state == RequestState.FINISHED).all()
    np.testing.assert_array_equal(np.bincount(result.token_req, minlength=len(requests)),
                                  [r.output_len for r in requests])
    # Request 5 finds request 2's pages on replica 1, named there by the answer request 2
    # generated partly on replica 0: 7 full pages of its 115 computed tokens (the prompt's
    # one page alone, were the tokens sampled on replica 0 not carried over).
    assert cluster.replica[5] == 1
    assert cluster.replicas[1].table.num_cached_tokens[5] == 7 * PAGE
    for replica in cluster.replicas:
        replica.kv.check_consistency()
        assert not replica.kv.num_held.any() and not replica.in_transfer.size


@pytest.mark.parametrize("leap", [True, False])
def test_a_static_batch_member_migrates_and_the_batch_finishes_without_it(leap):
    # Round robin: 0, 2, 4 on replica 0 form its batch (max_num_seqs 4); 2 leaves it
    # mid-decode for replica 1 (which runs 1, 3, 5 as its batch, then 2 as a new one).
    requests = [Request(id=i, arrival_s=0.0, prompt_len=40, output_len=30 + 10 * i)
                for i in range(6)]
    config = CONFIG.with_knobs(max_num_seqs=4, num_kv_pages=200, leap=leap)  # 32 a member
    cluster = _cluster(requests, Scripted(moves=((2, 0, 1),)), policy="static", config=config)
    result = cluster.run()
    (log,) = cluster.migrator.log
    assert (log.request, log.to_replica) == (2, 1)
    assert (result.state == RequestState.FINISHED).all()
    np.testing.assert_array_equal(np.bincount(result.token_req, minlength=6),
                                  [r.output_len for r in requests])
    assert result.replica.tolist() == [0, 1, 1, 1, 0, 1]
    # Replica 0's batch (0 and 4 left) was released when its longest, 4, finished.
    assert result.finish_s[0] == result.finish_s[4]
    for replica in cluster.replicas:
        assert not replica.kv.num_held.any() and not replica.in_transfer.size
