"""The paper reproductions on tiny configurations: structure and the papers' orderings."""

import dataclasses
import json

import numpy as np
import pytest
from absl import app

from experiments.reproduce import common, orca, prefix_caching, sarathi, vllm_memory
from orca_jax.results.sweep_store import Curve
from orca_jax.specs.hardware import get_hardware
from orca_jax.specs.memory import num_kv_pages_for_memory
from orca_jax.specs.model_config import get_model_config


def _curve(x, y):
    n = len(x)
    return Curve(policy="p", rates=np.arange(1.0, n + 1), x_mean=np.asarray(x, float),
                 y_mean=np.asarray(y, float), y_low=np.asarray(y, float),
                 y_high=np.asarray(y, float), num_seeds=np.ones(n, np.int64))


def test_throughput_at_bound_interpolates_the_crossing():
    curve = _curve([1.0, 2.0, 3.0], [0.1, 0.2, 0.4])
    assert common.throughput_at_bound(curve, 0.3) == pytest.approx(2.5)
    assert common.throughput_at_bound(curve, 0.2) == pytest.approx(2.0)
    assert common.throughput_at_bound(curve, 0.05) is None  # never that fast
    assert common.throughput_at_bound(curve, 1.0) == pytest.approx(3.0)  # never crossed: last x


def test_clipped_drops_points_above_the_cap():
    (curve,) = common.clipped([_curve([1.0, 2.0, 3.0], [0.1, 0.5, 0.2])], 0.3)
    assert curve.x_mean.tolist() == [1.0, 3.0]
    assert curve.num_seeds.tolist() == [1, 1]
    # A variant's curve keeps its variant, so its legend entry (cached_attention's setups).
    (curve,) = common.clipped([dataclasses.replace(_curve([1.0], [0.1]), variant="host")], 1.0)
    assert curve.label == "p@host"


def test_orca_beats_static_at_equal_latency(tmp_path):
    # Rates and bounds for the per-op roofline: tp=16 spans two nodes, whose 193
    # all-reduces a step take ~90 ms, so 1 req/s is near capacity and a token ~0.1 s.
    setup = orca.OrcaSetup(num_requests=40, rates=(0.25, 1.0), static_batch_sizes=(8,),
                           orca_batch_sizes=(8,), latency_bounds_s=(0.15, 0.3))
    result = orca.run(setup, str(tmp_path))
    latency = {(r["policy"], r["rate"]): r[orca.LATENCY] for r in result.rows}
    assert sorted(latency) == [("orca bs=8", 0.25), ("orca bs=8", 1.0),
                               ("static bs=8", 0.25), ("static bs=8", 1.0)]
    # A static batch returns its answers when its longest member is done.
    assert latency["orca bs=8", 1.0] < latency["static bs=8", 1.0]
    assert [r["latency_bound_s"] for r in result.ratios] == [0.15, 0.3]
    for row in result.ratios:
        assert row["best_orca"] == "orca bs=8"
        assert row["static_req_s"] is None or row["orca_req_s"] > row["static_req_s"]
    assert any(row["ratio"] is not None and row["ratio"] > 1 for row in result.ratios)


def test_orca_command_writes_figure_and_tables_and_resumes(tmp_path, capsys):
    args = [f"--out_dir={tmp_path / 'out'}", "--num_requests=12", "--rates=2"]
    orca.main(args)
    printed = capsys.readouterr().out
    assert "throughput (req/s) at equal median normalized latency" in printed
    ratios = json.loads((tmp_path / "out" / "ratios.json").read_text())
    assert len(ratios["rows"]) == len(orca.OrcaSetup().latency_bounds_s)
    points = (tmp_path / "out" / "points.jsonl").read_text().splitlines()
    assert len(points) == 7  # 4 static and 3 orca batch sizes at one rate
    # No --figure: the figure goes under --out_dir, not into the tracked docs/figures/.
    figure = tmp_path / "out" / orca.FIGURE
    assert f"figure: {figure}" in printed and figure.read_bytes()[:4] == b"\x89PNG"
    orca.main(args)  # a rerun finds every point done
    assert (tmp_path / "out" / "points.jsonl").read_text().splitlines() == points


def test_orca_layouts_run_side_by_side_and_a_bad_layout_is_one_line(tmp_path, capsys):
    args = [f"--out_dir={tmp_path / 'out'}", "--num_requests=8", "--rates=2",
            "--layouts=tp16,tp8pp2"]
    orca.main(args)
    printed = capsys.readouterr().out
    assert "== layout tp8pp2: tp 8 x pp 2 (balanced micro-batches)" in printed
    rows = json.loads((tmp_path / "out" / "layouts.json").read_text())["rows"]
    assert [row["latency_bound_s"] for row in rows] == list(orca.OrcaSetup().latency_bounds_s)
    assert {"tp16", "tp8pp2", "paper_ratio"} <= set(rows[0])
    # The pipeline layout runs its four curves, each point through two stages.
    points = [json.loads(line) for line in
              (tmp_path / "out" / "tp8pp2" / "points.jsonl").read_text().splitlines()]
    assert sorted(p["policy"] for p in points) == ["orca bs=32", "static bs=16",
                                                   "static bs=32", "static bs=8"]
    assert all(p["summary"]["pipeline.stages"] == 2 for p in points)
    with pytest.raises(app.UsageError, match=r"^--layouts: tp4; choose from tp16, tp8pp2"):
        orca.main([f"--out_dir={tmp_path / 'bad'}", "--layouts=tp4"])


def test_vllm_batches_more_than_orca_max(tmp_path):
    # 80 ShareGPT-like requests in 8 s: every policy's batch is as large as its KV allows.
    setup = vllm_memory.VLLMSetup(num_requests=80, rates=(10.0,), batch_rate=10.0)
    result = vllm_memory.run(setup, str(tmp_path))
    batch = {row["policy"]: row["batch_at_rate"] for row in result.summary}
    assert list(batch) == ["Orca (Max)", "Orca (Pow2)", "Orca (Oracle)", "vLLM"]
    # Orca (Max) reserves the 2,048-token context per request: the pool holds only that many.
    pages = num_kv_pages_for_memory(get_model_config("opt-13b"), get_hardware("a100-40gb"), 1, 16)
    assert batch["Orca (Max)"] <= pages * 16 // 2048
    assert batch["vLLM"] > batch["Orca (Oracle)"] > batch["Orca (Pow2)"] > batch["Orca (Max)"]
    assert batch["vLLM"] > 2 * batch["Orca (Max)"]
    # The buddy layout's rounding and fragmentation never let Orca batch more.
    buddy = {row["policy"]: row["batch_at_rate"] for row in result.buddy_summary}
    assert list(buddy) == ["Orca (Max), buddy", "Orca (Pow2), buddy", "Orca (Oracle), buddy"]
    for label, value in buddy.items():
        assert value <= batch[label.split(",")[0]] + 1e-9


def test_sarathi_arxiv_workload_reads_the_lengths_file(tmp_path):
    lengths = tmp_path / "lengths.csv"
    lengths.write_text("num_prefill_tokens,num_decode_tokens\n30,4\n")
    setup = sarathi.SarathiSetup().for_workload("arxiv", str(lengths))
    assert setup.prompt_len == f"empirical:{lengths}:num_prefill_tokens"
    assert setup.output_len == f"empirical:{lengths}:num_decode_tokens"
    assert setup.rates == sarathi.ARXIV_RATES
    assert sarathi.SarathiSetup().for_workload("synthetic") == sarathi.SarathiSetup()
    with pytest.raises(ValueError, match="workload"):
        sarathi.SarathiSetup().for_workload("sharegpt")


def test_sarathi_tail_tbt_is_lower_than_vllm_at_the_same_load(tmp_path):
    setup = sarathi.SarathiSetup(num_requests=40, rates=(4.0,), budgets=(512,))
    result = sarathi.run(setup, str(tmp_path))
    tbt = {row["policy"]: row[sarathi.TBT] for row in result.rows}
    assert list(tbt) == ["vLLM (no chunking)", "Sarathi 512"]
    # A whole prompt of ~1,500 tokens stalls every decode for ~0.1 s; a 512-token step less.
    assert tbt["Sarathi 512"] < 0.6 * tbt["vLLM (no chunking)"]
    assert [(r["tbt_slo_s"], r["policy"]) for r in result.capacity] == [
        (0.1, "vLLM (no chunking)"), (0.1, "Sarathi 512"),
        (0.5, "vLLM (no chunking)"), (0.5, "Sarathi 512")]


def test_prefix_caching_shared_prefix_hits_only_with_the_cache(tmp_path):
    setup = prefix_caching.PrefixCachingSetup(num_requests=30, rates=(8.0,), num_prefixes=2,
                                              prefix_len="fixed:256", max_num_seqs=8)
    rows, curves = prefix_caching.sglang_rows(setup, str(tmp_path))
    by_policy = {row["policy"]: row for row in rows}
    assert set(by_policy) == {"FCFS, no cache", "FCFS (vllm)", "LPM (sglang)"}
    assert by_policy["FCFS, no cache"]["prefix_hit_rate"] == 0.0
    assert by_policy["FCFS (vllm)"]["prefix_hit_rate"] > 0.5
    assert by_policy["LPM (sglang)"]["prefix_hit_rate"] > 0.5
    assert len(curves) == 3


def test_prefix_caching_unbounded_pool_reaches_the_ceiling(tmp_path):
    # Mooncake's format: each turn's blocks extend the previous turn's, arrivals far apart.
    # Whole blocks: the ceiling counts a seen block whole, where an earlier prompt may
    # have held only its start.
    trace = tmp_path / "mooncake.jsonl"
    turns = [[0, 1], [0, 1, 2], [0, 1, 2, 3], [5, 6]]
    trace.write_text("".join(
        json.dumps({"timestamp": 60_000 * k, "input_length": 512 * len(ids),
                    "output_length": 4, "hash_ids": ids}) + "\n"
        for k, ids in enumerate(turns)))
    setup = prefix_caching.PrefixCachingSetup(trace=str(trace), trace_requests=4,
                                              pool_pages=(10_000_000,), trace_time_scale=1.0)
    (row,) = prefix_caching.trace_pool_rows(setup)
    assert row["ceiling"] > 0.3
    assert row["prefix_hit_rate"] == pytest.approx(row["ceiling"])


def test_a_reproduction_refuses_ray_settings_without_the_ray_executor(tmp_path):
    with pytest.raises(app.UsageError, match=r"^--ray_address and --ray_num_cpus need "
                                             r"--executor=ray$"):
        orca.main([f"--out_dir={tmp_path / 'out'}", "--ray_num_cpus=2"])
    assert not (tmp_path / "out").exists()  # refused before anything was written


@pytest.mark.parametrize("module", [orca, prefix_caching, sarathi, vllm_memory])
def test_a_reproduction_s_figure_defaults_under_its_out_dir(module):
    assert module.FLAGS["figure"].default is None
    assert not module.FIGURE.startswith("docs")
    assert common.figure_path(None, "runs/x", module.FIGURE) == f"runs/x/{module.FIGURE}"
    assert common.figure_path("a/b.png", "runs/x", module.FIGURE) == "a/b.png"
    assert sarathi.figure_name("arxiv") == "sarathi_mistral7b_tbt_arxiv.png"
