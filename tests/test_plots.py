"""Slot timelines (exact cells of the 4-slot, 12-request example) and the figures."""

import numpy as np
import pytest

import policies
from experiments.reproduce.seed_examples import EXAMPLE_B_OUTPUTS
from orca_jax import KVConfig, LoopFeatures, Request, Scheduler, SchedulerConfig, StepLimits
from orca_jax.results.plots import EMPTY, plot_slot_timeline, plot_sweep, slot_timeline
from orca_jax.results.sweep_store import aggregate, grid
from orca_jax.sim.cost_model import CostModelConfig
from orca_jax.sim.engine import SimEngine
from orca_jax.workloads.synthetic import synthetic_workload

OUTPUTS = EXAMPLE_B_OUTPUTS  # the seed example (b), whose exact cells these tests check
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _scheduler(policy, requests, slots=4, num_kv_pages=512, log_step_requests=True,
               **options):
    config = SchedulerConfig(limits=StepLimits(max_num_seqs=slots, max_num_tokens=64,
                                               max_model_len=2048),
                             kv=KVConfig(num_kv_pages=num_kv_pages, page_size=16),
                             features=LoopFeatures(log_step_requests=log_step_requests))
    engine = SimEngine(CostModelConfig(mode="fixed", model="tiny", step_time_s=0.005))
    return Scheduler(requests, policies.make_policy(policy, options), engine, config)


def _example(policy):
    # Ids 100.. so a mix-up of request index and request id shows.
    requests = [Request(id=100 + i, arrival_s=0.0, prompt_len=4, output_len=n)
                for i, n in enumerate(OUTPUTS)]
    return slot_timeline(_scheduler(policy, requests).run())


def test_static_batches_hold_their_slots_until_the_longest_member_is_done():
    timeline = _example("static")
    assert timeline.num_steps == 56 and timeline.num_slots == 4
    assert [timeline.request_id_at(0, s) for s in range(4)] == [100, 101, 102, 103]
    # Request 2 (5 tokens) is done after step 4 but keeps slot 2, idle, until step 16.
    assert timeline.request_id_at(16, 2) == 102 and not timeline.computing[16, 2]
    assert timeline.computing[4, 2]
    # The second batch (requests 4..7) starts at step 17, the third (8..11) at 37.
    assert [timeline.request_id_at(17, s) for s in range(4)] == [104, 105, 106, 107]
    assert [timeline.request_id_at(37, s) for s in range(4)] == [108, 109, 110, 111]
    assert timeline.request_id_at(55, 3) == 111 and timeline.computing[55, 3]
    assert timeline.request_id_at(55, 0) == 108 and not timeline.computing[55, 0]


def test_continuous_batching_refills_a_slot_the_step_after_it_frees():
    timeline = _example("orca")
    assert timeline.num_steps == 40
    assert timeline.request_id_at(4, 2) == 102
    assert timeline.request_id_at(5, 2) == 104  # 102 finished at step 4
    assert timeline.request_id_at(7, 0) == 105  # 100 finished at step 6
    assert timeline.request_id_at(10, 0) == 107  # a one-token request: one step
    assert timeline.request_id_at(11, 0) == 108
    assert timeline.request_id_at(17, 3) == 109  # 103 finished at step 16
    assert timeline.request_id_at(39, 3) == 111
    assert timeline.request_id_at(39, 0) is None
    assert timeline.computing[timeline.holder != EMPTY].all()  # nobody holds a slot idle


def test_timeline_matches_the_step_log_under_preemption():
    requests = synthetic_workload(num_requests=24, arrival="poisson", rate=200.0,
                                  prompt_len="uniform:8:40", output_len="uniform:4:40", seed=1)
    result = _scheduler("vllm", requests, slots=8, num_kv_pages=12).run()
    timeline = slot_timeline(result)
    assert result.total_preemptions > 0
    np.testing.assert_array_equal(timeline.computing.sum(axis=1), result.step_array("num_seqs"))
    for step in range(timeline.num_steps):
        held = timeline.holder[step][timeline.holder[step] != EMPTY]
        assert len(set(held.tolist())) == held.size  # no request in two slots


def test_timeline_needs_the_steps_requests_logged():
    requests = [Request(id=0, arrival_s=0.0, prompt_len=4, output_len=2)]
    result = _scheduler("orca", requests, log_step_requests=False).run()
    with pytest.raises(ValueError, match="needs a run with SchedulerConfig.features"):
        slot_timeline(result)


def test_figures_are_written(tmp_path):
    pytest.importorskip("matplotlib")
    requests = [Request(id=i, arrival_s=0.0, prompt_len=4, output_len=n)
                for i, n in enumerate(OUTPUTS)]
    timeline = plot_slot_timeline(_scheduler("orca", requests).run(), str(tmp_path / "t.png"),
                                  "orca")
    assert timeline is not None and timeline.num_steps == 40
    assert (tmp_path / "t.png").read_bytes()[:8] == PNG_MAGIC
    points = [{"policy": p, "rate": r, "seed": 0,
               "summary": {"throughput_req_s": r * 0.9, "ttft_p99_s": r / 10}}
              for p in ("static", "orca") for r in (2.0, 4.0)]
    curves = aggregate(points, grid(["static", "orca"], [2.0, 4.0], [0]),
                       "throughput_req_s", "ttft_p99_s")
    assert plot_sweep(curves, str(tmp_path / "s.png"), x_field="throughput_req_s",
                      y_field="ttft_p99_s")
    assert (tmp_path / "s.png").read_bytes()[:8] == PNG_MAGIC


def _curves(seeds):
    points = [{"policy": p, "rate": r, "seed": s,
               "summary": {"throughput_req_s": r * 0.9 + s, "ttft_p99_s": r / 10 + s}}
              for p in ("static", "orca") for r in (2.0, 4.0) for s in seeds]
    return aggregate(points, grid(["static", "orca"], [2.0, 4.0], list(seeds)),
                     "throughput_req_s", "ttft_p99_s")


def _legend_title_and_bands(fig):
    from matplotlib.collections import PolyCollection

    ax = fig.axes[0]
    bands = [c for c in ax.collections if isinstance(c, PolyCollection)]
    return ax.get_legend().get_title().get_text(), len(bands)


def test_a_sweep_figure_has_a_band_and_its_legend_only_over_several_seeds(tmp_path):
    pytest.importorskip("matplotlib")
    one = plot_sweep(_curves([0]), str(tmp_path / "one.png"), x_field="throughput_req_s",
                     y_field="ttft_p99_s", caption="what ran")
    assert _legend_title_and_bands(one) == ("", 0)
    two = plot_sweep(_curves([0, 1]), str(tmp_path / "two.png"), x_field="throughput_req_s",
                     y_field="ttft_p99_s", caption="what ran")
    assert _legend_title_and_bands(two) == ("mean; band: min–max over seeds", 2)
    assert [text.get_text() for text in two.texts] == ["what ran"]
    assert (tmp_path / "two.png").read_bytes()[:8] == PNG_MAGIC


def test_a_sweep_over_another_unit_labels_its_x_axis_so(tmp_path):
    pytest.importorskip("matplotlib")
    usual = plot_sweep(_curves([0]), str(tmp_path / "a.png"), x_field="offered_rate_req_s",
                       y_field="ttft_p99_s")
    assert usual.axes[0].get_xlabel() == "offered load (requests/s)"
    # cached_attention sweeps conversations/s, each of several turns
    turns = plot_sweep(_curves([0]), str(tmp_path / "b.png"), x_field="offered_rate_req_s",
                       y_field="ttft_p99_s", x_label="offered load (conversations/s)")
    assert turns.axes[0].get_xlabel() == "offered load (conversations/s)"


def test_the_caption_says_workload_engine_model_hardware_rate_and_runs():
    from orca_jax.runner.figure_caption import figure_caption
    from orca_jax.runner.spec import ClusterSpec, RunSpec, SimEngineSpec, WorkloadSpec

    spec = RunSpec(workload=WorkloadSpec(num_requests=20, rate=3.0),
                   engine=SimEngineSpec(model="llama2-7b", hardware="h100"))
    assert figure_caption(spec) == (
        "poisson (20 requests, prompts uniform:32:512, outputs uniform:1:128); engine sim, "
        "model llama2-7b, h100; rate 3 req/s; seed 0")
    sweep = figure_caption(spec, rates=[2, 8.5], seeds=[0, 1], repeats=3)
    assert sweep.endswith("; rates 2, 8.5 req/s; 2 seeds (0, 1), 3 repeats")
    trace = RunSpec(workload=WorkloadSpec(arrival="trace", trace="/x/azure_code.csv",
                                          num_requests=None),
                    cluster=ClusterSpec(num_replicas=3, router="cache_aware"))
    assert figure_caption(trace).startswith(
        "trace azure_code.csv (all requests); engine sim, model llama3-8b, a100; 3 replicas, "
        "router cache_aware; the trace's arrival times")


def test_the_comparison_figure_carries_a_title_and_the_caption(tmp_path):
    pytest.importorskip("matplotlib")
    from experiments import compare

    rows = [{"policy": name, "output_tok_s": 10.0, "latency_p50_s": 1.0,
             "normalized_latency_mean_s": 0.1, "ttft_p99_s": 0.2, "num_repeats": 3,
             "spread": {"output_tok_s": {"min": 9.0, "max": 11.0}}}
            for name in ("vllm", "orca")]
    fig = compare._plot(rows, str(tmp_path / "comparison.png"), "poisson; engine sim")
    assert fig.get_suptitle() == "compare: vllm, orca (median of 3 repeats; whiskers min–max)"
    assert [text.get_text() for text in fig.texts] == [fig.get_suptitle(),
                                                       "poisson; engine sim"]
    assert (tmp_path / "comparison.png").read_bytes()[:8] == PNG_MAGIC
