"""Disaggregated prefill and decode on the simulator: priced transfers, exactly-once service."""

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import policies
from orca_jax import KVConfig, Request, SchedulerConfig, StepLimits
from orca_jax.cluster.disaggregated import DisaggregatedCluster, PoolSpec
from orca_jax.cluster.transfers import KVTransferCost, kv_transfer_cost
from orca_jax.core.requests.request import RequestState
from orca_jax.sim.cost_model import CostModelConfig
from orca_jax.sim.engine import SimEngine
from orca_jax.specs.hardware import KVLinkSpec, get_kv_link
from orca_jax.specs.model_config import get_model_config

STEP_S = 0.01
CONFIG = SchedulerConfig(limits=StepLimits(max_num_seqs=8, max_num_tokens=256, max_model_len=512),
                         kv=KVConfig(num_kv_pages=64, page_size=16))
# 1,000 bytes per token over 1 MB/s after 1 ms: a 100-token prompt takes 0.101 s.
SLOW_LINK = KVLinkSpec(name="slow", latency_s=1e-3, bytes_per_s=1e6)


def _engine():
    return SimEngine(CostModelConfig(mode="fixed", model="tiny", step_time_s=STEP_S))


def _pool(num_replicas, policy="vllm", config=CONFIG, router="round_robin"):
    return PoolSpec(num_replicas=num_replicas, make_policy=lambda: policies.make_policy(policy),
                    make_engine=_engine, config=config, router=router)


def _run(requests, prefill=1, decode=1, *, link=SLOW_LINK, bytes_per_token=1000,
         prefill_policy="vllm", decode_policy="vllm", decode_config=CONFIG):
    cluster = DisaggregatedCluster(
        requests, prefill=_pool(prefill, prefill_policy),
        decode=_pool(decode, decode_policy, decode_config),
        transfer_cost=KVTransferCost(link=link, bytes_per_token=bytes_per_token))
    return cluster, cluster.run()


def _request(i, arrival_s, prompt_len, output_len):
    return Request(id=i, arrival_s=arrival_s, prompt_len=prompt_len, output_len=output_len)


def test_transfer_bytes_and_time_by_hand():
    llama = get_model_config("llama3-8b")  # 32 layers, 8 KV heads of 128
    ib200 = get_kv_link("ib200")
    cost = kv_transfer_cost(llama, ib200)
    assert cost.bytes_per_token == 32 * 8 * 128 * 2 * 2 == 131_072
    # 1,000 tokens: 131,072,000 bytes at 25 GB/s, after 20 us.
    assert cost.num_bytes(1000) == 131_072_000
    assert cost.seconds(1000) == pytest.approx(20e-6 + 131_072_000 / 25e9)
    assert cost.seconds(1000) == pytest.approx(0.00526288)
    # TP 2: each shard holds 4 heads and sends half, at the same time.
    assert kv_transfer_cost(llama, ib200, tp=2).num_bytes(1000) == 65_536_000
    # More shards than KV heads: each holds (a copy of) one head.
    assert kv_transfer_cost(llama, ib200, tp=16).bytes_per_token == 32 * 1 * 128 * 2 * 2
    assert kv_transfer_cost(llama, get_kv_link("nvlink"), dtype_bytes=4).seconds(1) == (
        pytest.approx(10e-6 + 262_144 / 300e9))
    assert get_kv_link("ib400").bytes_per_s == 50e9
    assert get_kv_link("ib400", max_concurrent=3).max_concurrent == 3
    with pytest.raises(ValueError, match="unknown KV link preset 'ib100'.*ib200"):
        get_kv_link("ib100")


def test_one_request_takes_its_prefill_then_the_priced_transfer_then_decodes():
    _, result = _run([_request(0, 0.0, 100, 4)])
    (transfer,) = result.transfers
    # The prompt in one step (0.01 s), its first token sampled at its end.
    assert result.first_token_s[0] == pytest.approx(STEP_S)
    assert transfer.ready_s == transfer.start_s == pytest.approx(STEP_S)
    assert transfer.num_bytes == 100 * 1000
    assert transfer.end_s - transfer.start_s == pytest.approx(1e-3 + 100_000 / 1e6)
    # Three decode steps on the decode replica, the first as the transfer ends.
    assert result.finish_s[0] == pytest.approx(transfer.end_s + 3 * STEP_S)
    assert (transfer.from_replica, transfer.to_replica) == (0, 1)
    assert result.prefill_replica.tolist() == [0] and result.replica.tolist() == [1]
    assert result.num_generated.tolist() == [4]
    np.testing.assert_allclose(result.token_time_s,
                               [STEP_S, *(transfer.end_s + STEP_S * k for k in (1, 2, 3))])


def test_a_burst_queues_on_the_link_one_transfer_at_a_time():
    requests = [_request(i, 0.0, 100, 3) for i in range(4)]
    _, result = _run(requests)
    transfers = sorted(result.transfers, key=lambda t: t.start_s)
    assert [t.request for t in transfers] == [0, 1, 2, 3]
    for earlier, later in zip(transfers, transfers[1:]):
        assert later.start_s == pytest.approx(max(earlier.end_s, later.ready_s))
    assert transfers[-1].start_s - transfers[-1].ready_s > 0.2  # it queued behind three


def test_two_slots_per_link_let_two_transfers_overlap():
    requests = [_request(i, 0.0, 100, 3) for i in range(4)]
    link = dataclasses.replace(SLOW_LINK, max_concurrent=2)
    _, result = _run(requests, link=link)
    starts = np.array(sorted(t.start_s for t in result.transfers))
    ends = np.array(sorted(t.end_s for t in result.transfers))
    in_flight = [int(np.sum((starts <= s) & (ends > s))) for s in starts]
    assert max(in_flight) == 2


def test_a_transfer_waits_for_room_in_the_decode_pool():
    # The decode pool holds one request's KV (8 pages of 16: 100 + 20 tokens need 8).
    small = CONFIG.with_knobs(num_kv_pages=8)
    requests = [_request(i, 0.0, 100, 20) for i in range(3)]
    cluster, result = _run(requests, link=get_kv_link("nvlink"), bytes_per_token=1,
                           decode_config=small)
    transfers = sorted(result.transfers, key=lambda t: t.start_s)
    assert [t.request for t in transfers] == [0, 1, 2]
    for earlier, later in zip(transfers, transfers[1:]):
        # The next starts only when the previous request has finished and freed its pages.
        assert later.start_s >= result.finish_s[earlier.request] - 1e-12
    assert (result.state == RequestState.FINISHED).all()
    assert cluster.decode[0].kv.num_free == 8


def test_a_one_token_answer_never_leaves_the_prefill_replica():
    cluster, result = _run([_request(0, 0.0, 40, 1), _request(1, 0.0, 40, 2)])
    assert [t.request for t in result.transfers] == [1]
    assert result.state.tolist() == [RequestState.FINISHED] * 2
    assert result.replica.tolist() == [-1, 1]
    assert cluster.prefill[0].kv.num_free == CONFIG.kv.num_kv_pages


def test_requests_too_long_for_the_decode_pool_are_rejected_before_their_prefill():
    small = CONFIG.with_knobs(num_kv_pages=4)  # 64 tokens
    cluster, result = _run([_request(0, 0.0, 40, 2), _request(1, 0.0, 40, 40)],
                           decode_config=small)
    assert result.state.tolist() == [RequestState.FINISHED, RequestState.REJECTED]
    assert "KV pages" in result.reject_reason[1]
    assert np.isnan(result.first_scheduled_s[1])  # its prompt never ran
    assert result.replica.tolist() == [1, -1] and result.prefill_replica.tolist() == [0, -1]


def test_the_decode_pool_may_run_another_policy():
    requests = [_request(i, 0.01 * i, 60, 10) for i in range(6)]
    _, result = _run(requests, 2, 1, prefill_policy="sarathi", decode_policy="orca")
    assert result.policy == "orca"
    assert (result.state == RequestState.FINISHED).all()
    assert sorted(set(result.prefill_replica.tolist())) == [0, 1]


@st.composite
def _workloads(draw):
    n = draw(st.integers(1, 14))
    gaps = draw(st.lists(st.sampled_from([0.0, 0.001, 0.02, 0.2]), min_size=n, max_size=n))
    prompts = draw(st.lists(st.integers(1, 90), min_size=n, max_size=n))
    outputs = draw(st.lists(st.integers(1, 30), min_size=n, max_size=n))
    arrivals = np.cumsum(gaps)
    return [_request(i, float(a), p, o) for i, (a, p, o) in
            enumerate(zip(arrivals, prompts, outputs))]


@settings(max_examples=40, deadline=None, derandomize=True)
@given(requests=_workloads(), num_prefill=st.integers(1, 3), num_decode=st.integers(1, 3),
       decode_pages=st.integers(3, 16), prefill_pages=st.integers(6, 32),
       max_concurrent=st.integers(1, 3),
       prefill_policy=st.sampled_from(["vllm", "sarathi", "orca"]),
       decode_policy=st.sampled_from(["vllm", "orca", "sarathi"]))
def test_every_request_is_served_exactly_once(requests, num_prefill, num_decode, decode_pages,
                                              prefill_pages, max_concurrent, prefill_policy,
                                              decode_policy):
    link = dataclasses.replace(SLOW_LINK, latency_s=0.002, bytes_per_s=2e5,
                               max_concurrent=max_concurrent)
    prefill_config = CONFIG.with_knobs(num_kv_pages=prefill_pages, max_num_seqs=4)
    decode_config = CONFIG.with_knobs(num_kv_pages=decode_pages, max_num_seqs=3)
    cluster = DisaggregatedCluster(
        requests, prefill=_pool(num_prefill, prefill_policy, prefill_config, "least_outstanding"),
        decode=_pool(num_decode, decode_policy, decode_config, "least_outstanding"),
        transfer_cost=KVTransferCost(link=link, bytes_per_token=10))
    result = cluster.run()
    finished = result.state == RequestState.FINISHED
    rejected = result.state == RequestState.REJECTED
    assert (finished | rejected).all()
    out = np.array([r.output_len for r in requests])
    np.testing.assert_array_equal(result.num_generated[finished], out[finished])
    # Each token once, in the log; the first before the rest, none before the arrival.
    np.testing.assert_array_equal(np.bincount(result.token_req, minlength=len(requests)),
                                  result.num_generated)
    assert (result.first_token_s[finished] > result.arrival_s[finished]).all()
    assert (result.finish_s[finished] >= result.first_token_s[finished]).all()
    # A transfer for every finished request of more than one token, and for no other.
    moved = sorted(t.request for t in result.transfers)
    assert moved == np.flatnonzero(finished & (out > 1)).tolist()
    for t in result.transfers:
        assert t.ready_s <= t.start_s < t.end_s
        assert t.ready_s == pytest.approx(result.first_token_s[t.request])
        assert t.from_replica == result.prefill_replica[t.request]
        assert t.to_replica == result.replica[t.request] >= num_prefill
    for source in range(num_prefill):  # never more than max_concurrent on one link at once
        for target in range(num_prefill, num_prefill + num_decode):
            on_link = [t for t in result.transfers
                       if (t.from_replica, t.to_replica) == (source, target)]
            for t in on_link:
                overlapping = sum(o.start_s <= t.start_s < o.end_s for o in on_link)
                assert overlapping <= max_concurrent
    # Every page back in its pool, no transfer left holding any.
    for scheduler in (*cluster.prefill, *cluster.decode):
        assert scheduler.kv.num_free == scheduler.kv.num_kv_pages
        assert scheduler.in_transfer.size == 0


def test_received_requests_that_stall_the_decode_pool_give_their_pages_back():
    # Three pages of decode pool: the long request outgrows its two and is preempted while
    # the short ones hold the third; FCFS puts it first, so only a received request giving
    # its pages back (and recomputing) lets the pool move on (without that: no_progress).
    prefill_config = CONFIG.with_knobs(num_kv_pages=6, max_num_seqs=4)
    decode_config = CONFIG.with_knobs(num_kv_pages=3, max_num_seqs=3)
    requests = [_request(0, 0.0, 1, 1), _request(1, 0.0, 20, 14),
                *(_request(i, 0.0, 1, 1) for i in range(2, 8)),
                _request(8, 0.0, 1, 10), _request(9, 0.0, 1, 2)]
    link = dataclasses.replace(SLOW_LINK, latency_s=0.002, bytes_per_s=2e5)
    cluster = DisaggregatedCluster(
        requests, prefill=_pool(1, "vllm", prefill_config), decode=_pool(1, "vllm", decode_config),
        transfer_cost=KVTransferCost(link=link, bytes_per_token=10))
    result = cluster.run()
    assert (result.state == RequestState.FINISHED).all()
    np.testing.assert_array_equal(result.num_generated, [r.output_len for r in requests])
    assert result.num_preemptions[[8, 9]].sum() > 0  # a received request recomputed
    assert cluster.decode[0].kv.num_free == 3


def test_a_disaggregated_run_writes_transfers_and_per_gpu_goodput(tmp_path):
    import json

    from orca_jax.runner.experiment import run_policy
    from orca_jax.runner.spec import ClusterSpec, LimitsSpec, RunSpec, SimEngineSpec, WorkloadSpec

    spec = RunSpec(workload=WorkloadSpec(num_requests=30, rate=20.0, prompt_len="uniform:32:256",
                                         output_len="uniform:2:32"),
                   engine=SimEngineSpec(model="llama3-8b", tp=2),
                   limits=LimitsSpec(max_num_seqs=16, num_kv_pages=2000),
                   cluster=ClusterSpec(num_prefill_replicas=2, num_decode_replicas=1,
                                       decode_policy="orca", kv_link="ib400"),
                   ttft_slo_s=10.0, tpot_slo_s=10.0)
    summary, result = run_policy(spec, "sarathi", out_dir=str(tmp_path))
    assert (summary["prefill_policy"], summary["decode_policy"]) == ("sarathi", "orca")
    assert summary["num_finished"] == 30 and summary["num_transfers"] == 30
    assert summary["num_gpus"] == 6  # three replicas of TP 2
    assert summary["goodput_req_s_per_gpu"] == pytest.approx(summary["goodput_req_s"] / 6)
    rows = [json.loads(line) for line in (tmp_path / "transfers.jsonl").read_text().splitlines()]
    assert len(rows) == 30 and {r["to"] for r in rows} == {2}
    llama = get_model_config("llama3-8b")
    by_id = {r["id"]: r for r in map(json.loads,
                                      (tmp_path / "requests.jsonl").read_text().splitlines())}
    for row in rows:  # one TP shard's KV (4 of 8 heads, bf16) of the prompt, over 50 GB/s
        prompt = by_id[row["request"]]["prompt_len"]
        assert row["bytes"] == llama.num_layers * 4 * llama.head_dim * 2 * 2 * prompt
        assert row["end_s"] - row["start_s"] == pytest.approx(20e-6 + row["bytes"] / 50e9)
        assert by_id[row["request"]]["prefill_replica"] == row["from"]
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["pools"]["kv_link"]["name"] == "ib400"


def test_a_half_disaggregated_cluster_is_refused_by_name():
    from orca_jax.runner.spec import ClusterSpec

    with pytest.raises(ValueError, match="num_prefill_replicas=2, num_decode_replicas=0"):
        ClusterSpec(num_prefill_replicas=2)
    with pytest.raises(ValueError, match="unknown KV link preset 'infiniband'"):
        ClusterSpec(num_prefill_replicas=1, num_decode_replicas=1, kv_link="infiniband")
    with pytest.raises(ValueError, match="num_replicas=2 .* both set"):
        ClusterSpec(num_replicas=2, num_prefill_replicas=1, num_decode_replicas=1)
