"""The CachedAttention reproduction on a tiny configuration: its setups differ where they
should, its hits are counted where they were served, and its command refuses bad flags."""

import json

import pytest

from experiments.reproduce import cached_attention as ca
from tests.cli_runner import run_module

# 60 turns at one rate; a device pool of 512 pages (8k tokens) holds a few turns' prompts
# and little of the histories between turns.
TINY = ca.CachedAttentionSetup(num_requests=60, rates=(0.5,), device_pages=512)


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    rows, curves = ca.run(TINY, str(tmp_path_factory.mktemp("cached_attention")))
    assert [c.variant for c in curves] == list(ca.SETUPS)
    return {row["setup"]: row for row in rows}


def test_every_setup_runs_every_turn_on_the_same_requests(rows):
    assert list(rows) == list(ca.SETUPS)
    finished = {row["num_finished"] for row in rows.values()}
    assert len(finished) == 1 and 0 < finished.pop() <= TINY.num_requests


def test_the_device_pool_is_too_small_for_the_history(rows):
    assert TINY.history_pages() > TINY.device_pages
    # The device alone loses hits that a host tier of every history keeps, and that host
    # tier hits as often as a pool that never evicts.
    assert rows["device cache"]["prefix_hit_rate"] < rows["host"]["prefix_hit_rate"]
    assert rows["host"]["prefix_hit_rate"] == pytest.approx(
        rows["unbounded device"]["prefix_hit_rate"], abs=0.01)


def test_recompute_hits_nothing_and_host_hits_are_counted_on_the_host(rows):
    recompute, host = rows[ca.BASELINE], rows["host"]
    assert recompute["prefix_hit_rate"] == 0 and recompute["host_hit_tokens"] == 0
    assert host["host_hit_tokens"] > 0 and host["disk_hit_tokens"] == 0
    assert host["stall_s"] > 0  # a hit on the host is a transfer the step waits for
    assert rows["device cache"]["host_hit_tokens"] == 0 == rows["device cache"]["stall_s"]
    assert rows["unbounded device"]["host_hit_tokens"] == 0


def test_a_small_host_spills_to_the_disk_and_its_hits_are_counted_there(rows):
    small, disk = rows["small host"], rows["small host + disk"]
    assert disk["disk_hit_tokens"] > 0 and small["disk_hit_tokens"] == 0
    # The disk keeps what the small host evicts: more hits than the small host alone.
    assert disk["prefix_hit_rate"] > small["prefix_hit_rate"]


def test_a_host_tier_cuts_ttft_and_raises_prefill_throughput_over_recompute(rows):
    recompute, host = rows[ca.BASELINE], rows["host"]
    assert host[ca.TTFT_MEAN] < recompute[ca.TTFT_MEAN]
    assert host["ttft_p50_s"] < recompute["ttft_p50_s"]
    assert host[ca.PREFILL] > recompute[ca.PREFILL]


def test_paper_rows_compare_each_setup_with_recompute_at_its_rate(rows):
    table = {row["setup"]: row for row in ca.paper_rows(list(rows.values()))}
    assert ca.BASELINE not in table
    base, host = rows[ca.BASELINE], rows["host"]
    assert table["host"]["ttft_mean_cut"] == round(1 - host[ca.TTFT_MEAN] / base[ca.TTFT_MEAN],
                                                   3)
    assert table["host"]["prefill_speedup"] == round(host[ca.PREFILL] / base[ca.PREFILL], 2)
    assert 0 < table["host"]["ttft_mean_cut"] < 1 and table["host"]["prefill_speedup"] > 1


def test_the_command_prints_paper_beside_ours_and_resumes(tmp_path, capsys):
    args = [f"--out_dir={tmp_path}", "--num_requests=20", "--rates=0.5", "--device_pages=512"]
    ca.main(args)
    printed = capsys.readouterr().out
    assert "paper: TTFT down up to 87%, prefill throughput up to 7.8x; ours" in printed
    assert "What differs:" in printed
    setups = json.loads((tmp_path / "setups.json").read_text())["rows"]
    assert [r["setup"] for r in setups] == list(ca.SETUPS)
    points = (tmp_path / "points.jsonl").read_text().splitlines()
    assert len(points) == len(setups)
    ca.main(args)  # a rerun finds every point done
    assert (tmp_path / "points.jsonl").read_text().splitlines() == points


@pytest.mark.parametrize("flag", ["--device_pages=abc", "--device_pages=0", "--rates=1,x"])
def test_a_bad_flag_is_one_line_and_exit_2(flag):
    result = run_module("experiments.reproduce.cached_attention", flag, check=False)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and flag.split("=")[0] in lines[0]
    assert result.stdout == ""
