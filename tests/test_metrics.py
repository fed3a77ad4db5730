"""Metrics on small hand-computed runs: per-request values, summaries, goodput, fairness, tables."""

import json
import math

import numpy as np
import pytest

from orca_jax.results import metrics

NAN = math.nan


def five_request_run():
    """Req 0 (3 tokens), 1 (1 token), 2 (4 tokens) finish; 3 is rejected; 4 is unfinished."""
    log = [(0, 1.0), (0, 1.5), (1, 2.0), (2, 2.5), (0, 3.0), (2, 3.0), (2, 3.5), (2, 4.0),
           (4, 4.0)]
    return dict(
        arrival_s=np.array([0.0, 1.0, 2.0, 2.0, 3.0]),
        first_scheduled_s=np.array([0.5, 1.0, 2.5, NAN, 3.5]),
        first_token_s=np.array([1.0, 2.0, 2.5, NAN, 4.0]),
        finish_s=np.array([3.0, 2.0, 4.0, NAN, NAN]),
        output_len=np.array([3, 1, 4, 5, 3]),
        token_req=np.array([r for r, _ in log]),
        token_time_s=np.array([t for _, t in log]),
    )


def test_request_metrics_hand_computed():
    m = metrics.request_metrics(**five_request_run())
    np.testing.assert_allclose(m["queueing_delay_s"], [0.5, 0.0, 0.5, NAN, 0.5])
    np.testing.assert_allclose(m["ttft_s"], [1.0, 1.0, 0.5, NAN, 1.0])
    np.testing.assert_allclose(m["latency_s"], [3.0, 1.0, 2.0, NAN, NAN])
    # (last - first token) / (output_len - 1); one-token and unfinished requests have none.
    np.testing.assert_allclose(m["tpot_s"], [1.0, NAN, 0.5, NAN, NAN])
    np.testing.assert_allclose(m["normalized_latency_s"], [1.0, 1.0, 0.5, NAN, NAN])
    np.testing.assert_allclose(m["max_itl_s"], [1.5, NAN, 0.5, NAN, NAN])
    np.testing.assert_array_equal(m["num_tokens"], [3, 1, 4, 0, 1])


def test_inter_token_gaps_group_interleaved_tokens_by_request():
    run = five_request_run()
    np.testing.assert_allclose(metrics.inter_token_gaps(run["token_req"], run["token_time_s"]),
                               [0.5, 1.5, 0.5, 0.5, 0.5])
    owners, gaps = metrics.inter_token_gaps_by_request(run["token_req"], run["token_time_s"])
    np.testing.assert_array_equal(owners, [0, 0, 2, 2, 2])
    assert metrics.inter_token_gaps(np.array([], np.int64), np.array([])).size == 0


def test_bad_token_logs_are_rejected_with_the_reason():
    with pytest.raises(ValueError, match="time order; token 2"):
        metrics.inter_token_gaps(np.array([0, 1, 0]), np.array([1.0, 2.0, 1.5]))
    with pytest.raises(ValueError, match="same length"):
        metrics.inter_token_gaps(np.array([0, 1]), np.array([1.0]))
    run = five_request_run()
    run["token_req"] = run["token_req"].copy()
    run["token_req"][0] = 5
    with pytest.raises(ValueError, match=r"outside \[0, 5\)"):
        metrics.request_metrics(**run)
    run = five_request_run()
    run["finish_s"] = run["finish_s"][:4]
    with pytest.raises(ValueError, match=r"finish_s has shape \(4,\), expected \(5,\)"):
        metrics.request_metrics(**run)


def test_run_summary_hand_computed():
    s = metrics.run_summary(**five_request_run(), rejected=np.array([0, 0, 0, 1, 0], bool))
    assert (s["num_requests"], s["num_finished"], s["num_rejected"], s["num_unfinished"]) == (
        5, 3, 1, 1)
    assert s["duration_s"] == 4.0  # first arrival 0.0 to last finish 4.0
    assert s["throughput_req_s"] == 0.75
    assert s["output_tok_s"] == 2.0  # 3 + 1 + 4 output tokens of the finished requests
    assert s["throughput_tok_s"] == s["output_tok_s"]  # its old name, kept one release
    assert s["total_tok_s"] is None  # no prompt lengths given
    prompts = np.array([10, 20, 30, 40, 50])
    with_prompts = metrics.run_summary(**five_request_run(), prompt_len=prompts)
    # (10 + 20 + 30 prompt + 8 output tokens of the finished requests) / 4 s
    assert with_prompts["total_tok_s"] == 68 / 4.0
    assert s["latency_p50_s"] == pytest.approx(2.0)
    assert s["latency_p90_s"] == pytest.approx(2.8)
    assert s["latency_p99_s"] == pytest.approx(2.98)
    assert s["tpot_p50_s"] == pytest.approx(0.75)
    assert s["tpot_p90_s"] == pytest.approx(0.95)
    assert s["ttft_p50_s"] == pytest.approx(1.0)
    assert s["normalized_latency_mean_s"] == pytest.approx(2.5 / 3)
    assert s["queueing_delay_mean_s"] == pytest.approx(1.0 / 3)
    assert s["itl_p99_s"] == pytest.approx(1.46)  # gaps 0.5, 0.5, 0.5, 0.5, 1.5
    assert s["max_itl_p99_s"] == pytest.approx(1.49)  # per-request maxima 0.5, 1.5
    assert "goodput_req_s" not in s and "tenants" not in s
    json.dumps(s, allow_nan=False)
    assert all(type(v) in (int, float, type(None)) for v in s.values())


@pytest.mark.parametrize("ttft_slo, tpot_slo, goodput", [
    (0.9, None, 0.25),  # only request 2 has TTFT under 0.9 s
    (None, 0.6, 0.5),  # request 1 has no TPOT and meets it; request 2 does
    (1.0, 0.6, 0.5),
    (0.1, 0.1, 0.0),
])
def test_goodput_counts_finished_requests_meeting_every_slo(ttft_slo, tpot_slo, goodput):
    s = metrics.run_summary(**five_request_run(), ttft_slo_s=ttft_slo, tpot_slo_s=tpot_slo)
    assert s["goodput_req_s"] == pytest.approx(goodput)
    assert s["slo_attainment"] == pytest.approx(goodput * 4.0 / 5)


def test_tenant_service_and_jain_indices():
    s = metrics.run_summary(**five_request_run(), tenants=["a", "b", "a", "b", "b"])
    assert s["tenants"]["a"] == {"num_requests": 2, "num_finished": 2, "tokens_served": 7,
                                 "normalized_latency_mean_s": 0.75}
    assert s["tenants"]["b"]["tokens_served"] == 2  # the unfinished request's token counts
    assert s["fairness_jain_tokens"] == pytest.approx(81 / 106)
    assert s["fairness_jain_normalized_latency"] == pytest.approx(1.75**2 / (2 * (0.75**2 + 1)))
    json.dumps(s, allow_nan=False)


def test_jain_index_bounds():
    assert metrics.jain_index([3, 3, 3]) == 1.0
    assert metrics.jain_index([1, 0, 0, 0]) == 0.25
    assert metrics.jain_index([0, 0]) is None


def test_percentiles_on_known_data():
    n = 100
    finish = np.arange(1, n + 1, dtype=float)
    s = metrics.run_summary(arrival_s=np.zeros(n), first_scheduled_s=np.zeros(n),
                            first_token_s=finish, finish_s=finish, output_len=np.ones(n),
                            token_req=np.arange(n), token_time_s=finish)
    assert (s["latency_p50_s"], s["latency_p90_s"]) == pytest.approx((50.5, 90.1))
    assert s["latency_p99_s"] == pytest.approx(99.01)
    assert s["tpot_p50_s"] is None and s["itl_p99_s"] is None  # one-token outputs only


def test_a_run_where_nothing_finished_is_all_none():
    s = metrics.run_summary(arrival_s=np.array([0.0, 1.0]), first_scheduled_s=np.array([0.0, NAN]),
                            first_token_s=np.array([0.5, NAN]), finish_s=np.array([NAN, NAN]),
                            output_len=np.array([4, 4]), token_req=np.array([0]),
                            token_time_s=np.array([0.5]), ttft_slo_s=1.0)
    assert s["num_finished"] == 0 and s["num_unfinished"] == 2
    assert s["throughput_req_s"] is None and s["ttft_p50_s"] is None
    assert s["goodput_req_s"] is None and s["slo_attainment"] == 0.0
    json.dumps(s, allow_nan=False)


def test_format_table_aligns_text_left_and_numbers_right():
    rows = [{"policy": "fcfs", "ttft_p50_s": 0.123456, "num_finished": 10},
            {"policy": "sjf-long", "ttft_p50_s": None, "num_finished": 9}]
    assert metrics.format_table(rows, ["policy", "ttft_p50_s", "num_finished"]) == "\n".join([
        "policy    ttft_p50_s  num_finished",
        "--------  ----------  ------------",
        "fcfs          0.1235            10",
        "sjf-long           -             9",
    ])


def test_static_batching_ceiling_counts_each_batch_at_its_longest_member():
    # Batches of 2 in arrival order: (1, 4) runs 4 steps, (3, 2) runs 3; packed
    # continuous batching needs 10 / 2 = 5 steps.
    assert metrics.static_batching_ceiling([1, 4, 3, 2], 2) == pytest.approx(7 / 5)
    # A short last batch still runs for its longest member: (5, 1) 5, (2,) 2 -> 7 / (8 / 2).
    assert metrics.static_batching_ceiling([5, 1, 2], 2) == pytest.approx(7 / 4)
    assert metrics.static_batching_ceiling([7, 7, 7, 7], 4) == 1.0
    assert metrics.static_batching_ceiling([3, 9], 1) == 1.0


def test_static_batching_ceiling_of_uniform_lengths_is_under_two():
    lens = np.random.default_rng(0).integers(1, 257, size=16 * 4000)
    # 2B / (B + 1) for B = 16, up to the discreteness of [1, 256].
    assert metrics.static_batching_ceiling(lens, 16) == pytest.approx(32 / 17, rel=0.01)


@pytest.mark.parametrize("lens, batch", [([], 2), ([3, 0], 2), ([[1, 2]], 2), ([1, 2], 0)])
def test_static_batching_ceiling_rejects_bad_input(lens, batch):
    with pytest.raises(ValueError, match="output_len|batch_size"):
        metrics.static_batching_ceiling(lens, batch)
