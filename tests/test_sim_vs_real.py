"""`benchmarks/sim_vs_real.py`: the stages it reads from a run and from the real set.

The replay itself needs `../shared/sim2real` and minutes of simulation; these check the
arithmetic a wrong figure would come from, on small files written here.
"""

import json

import pytest

from benchmarks import sim_vs_real

SPEC = {"stages": [[2, 10], [4, 10]], "sp": {"out": 11}}


def test_stages_split_by_arrival_and_tpot_is_the_sets_definition(tmp_path):
    rows = [  # arrival, first token, finish: two in stage 0, one in stage 1, one rejected
        {"arrival_s": 1.0, "first_token_s": 1.1, "finish_s": 2.1, "status": "finished"},
        {"arrival_s": 5.0, "first_token_s": 5.3, "finish_s": 7.3, "status": "finished"},
        {"arrival_s": 12.0, "first_token_s": 12.2, "finish_s": 13.2, "status": "finished"},
        {"arrival_s": 13.0, "first_token_s": None, "finish_s": None, "status": "rejected"},
    ]
    (tmp_path / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    first, second = sim_vs_real.simulated_stages(str(tmp_path), SPEC)
    assert first["ttft_mean"] == pytest.approx(0.2) and first["e2e_mean"] == pytest.approx(1.7)
    # (E2E mean - TTFT mean) / (output - 1): (1.7 - 0.2) / 10.
    assert first["tpot"] == pytest.approx(0.15)
    assert first["throughput"] == pytest.approx(0.2)  # 2 requests over 10 s
    assert second["e2e_mean"] == pytest.approx(1.2) and second["throughput"] == pytest.approx(0.1)


def test_a_stage_without_tier_a_truth_reads_the_s2r_records_in_milliseconds():
    records = [{"exp": "X", "stage": "1", "metric": "e2e_mean", "actual": "2100", "simulator": "v"},
               {"exp": "X", "stage": "1", "metric": "ttft_mean", "actual": "100", "simulator": "v"}]
    real = sim_vs_real.real_stage("X", SPEC, 1, {}, records)
    assert real["e2e_mean"] == pytest.approx(2.1) and real["tpot"] == pytest.approx(0.2)
    assert sim_vs_real.real_stage("X", SPEC, 0, {}, records) is None  # no truth: not scored


def test_without_the_set_it_says_where_the_data_come_from(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        sim_vs_real.load_set(str(tmp_path / "nowhere"))
    assert stop.value.code == 2
    assert "shared/sim2real" in capsys.readouterr().err
